"""Backend-free trainer pieces: batching, the per-micro-batch objective, metrics, train dumps.

Every backend (torch, megatron) trains on the same `MicroBatch`es with the same objective
and reports the same metrics; only the forward/backward machinery differs.

Per-token tensors are [b, T] and aligned by position: at position t the model predicts
`targets[t] = tokens[t + 1]`, and `mask[t]` says whether that is a trained response token
(so the last position is always masked). Aligning targets before any sequence split lets
context parallelism cut sequences anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax.algo import kl_estimate, masked_sum, policy_loss
from relax.files import atomic_save, fill
from relax.sample import Sample, group_size_of  # noqa: F401 (trainers use it from here)

FIRST_STEP_SAMPLES = 16  # per-token log-probs of these sample indices go to layout comparisons
STEP_KEYS = ("train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/kl_loss",
             "train/entropy_loss", "train/train_rollout_logprob_abs_diff")


@dataclass
class MicroBatch:
    indices: list[int]               # sample indices (positions in the rollout); -1 = padding row
    tokens: torch.Tensor             # [b, T] right-padded
    targets: torch.Tensor            # [b, T] tokens shifted left by one
    mask: torch.Tensor               # [b, T] 1 where targets[t] is a trained response token
    advantages: torch.Tensor         # [b]
    rollout_log_probs: torch.Tensor  # [b, T] the engine's, at the same positions
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def make_micro_batch(samples: list[Sample], advantages: torch.Tensor, pad_id: int,
                     length: int | None = None, rows: int | None = None) -> MicroBatch:
    """Right-pad to `length` tokens and `rows` rows (fixed shapes for pipeline schedules)."""
    T = length or max(len(s.tokens) for s in samples)
    B = rows or len(samples)
    tokens = torch.full((B, T + 1), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T)
    rollout_lp = torch.zeros(B, T)
    for b, s in enumerate(samples):
        tokens[b, :len(s.tokens)] = torch.tensor(s.tokens)
        start = s.prompt_length - 1  # position t predicts token t + 1
        mask[b, start:start + s.response_length] = torch.tensor(s.loss_mask, dtype=torch.float)
        rollout_lp[b, start:start + s.response_length] = torch.tensor(s.rollout_log_probs)
    adv = torch.zeros(B)
    adv[:len(samples)] = advantages[[s.index for s in samples]]
    indices = [s.index for s in samples] + [-1] * (B - len(samples))
    return MicroBatch(indices, tokens[:, :T], tokens[:, 1:], mask, adv, rollout_lp)


def shard_steps(samples: list[Sample], advantages: torch.Tensor, steps: int, dp: int, dp_rank: int,
                micro_batch_size: int, pad_id: int, fixed_shape: bool = False,
                length_multiple: int = 1) -> list[list[MicroBatch]]:
    """Per optimizer step, this rank's micro-batches: each step's mini-batch is split evenly
    over the DP ranks, then into micro-batches of `micro_batch_size` samples. With
    `fixed_shape`, every micro-batch has the same [rows, T] (padding rows are masked out)."""
    if len(samples) % (steps * dp):
        raise ValueError(f"{len(samples)} samples do not split into num_steps_per_rollout="
                         f"{steps} x dp={dp} equal parts")
    per_rank = len(samples) // (steps * dp)
    longest = max(len(s.tokens) for s in samples)
    length = -(-longest // length_multiple) * length_multiple if fixed_shape else None
    rows = micro_batch_size if fixed_shape else None
    out = []
    for step in range(steps):
        start = (step * dp + dp_rank) * per_rank
        mine = samples[start:start + per_rank]
        out.append([make_micro_batch(mine[i:i + micro_batch_size], advantages, pad_id, length, rows)
                    for i in range(0, len(mine), micro_batch_size)])
    return out


def objective(log_probs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch, algo):
    """Per-token loss of one micro-batch, and the masked sums of every STEP_KEYS metric."""
    eps_high = algo.eps_clip_high if algo.eps_clip_high is not None else algo.eps_clip
    adv = mb.advantages[:, None].expand_as(log_probs)
    pg, clipfrac, ppo_kl = policy_loss(log_probs, mb.old_log_probs, adv, algo.eps_clip, eps_high)
    kl = kl_estimate(log_probs, mb.ref_log_probs, algo.kl_loss_type)
    loss = pg - algo.entropy_coef * entropy
    if algo.use_kl_loss:
        loss = loss + algo.kl_loss_coef * kl
    with torch.no_grad():
        diff = (log_probs - mb.rollout_log_probs).abs()
        sums = torch.stack([masked_sum(x.detach(), mb.mask) for x in (
            loss, pg, clipfrac, ppo_kl, kl, entropy, diff)])
    return loss, sums


def step_record(sums: torch.Tensor, num_tokens, grad_norm: float, lr: float, seconds: float,
                peak_memory_mb: float) -> dict:
    record = {k: (v / num_tokens).item() for k, v in zip(STEP_KEYS, sums)}
    return {**record, "train/grad_norm": float(grad_norm), "train/lr": lr,
            "perf/step_time": seconds, "perf/peak_memory_mb": peak_memory_mb}


def rollout_sums(micro_batches: list[MicroBatch]) -> torch.Tensor:
    sums = torch.zeros(5)
    for mb in micro_batches:
        sums += torch.stack([masked_sum(x, mb.mask) for x in (
            mb.old_log_probs, mb.ref_log_probs, mb.old_log_probs - mb.ref_log_probs, mb.entropy,
            torch.ones_like(mb.mask))])
    return sums


def rollout_record(sums: torch.Tensor) -> dict:
    mean = sums[:4] / sums[4]
    return {"rollout/log_probs": mean[0].item(), "rollout/ref_log_probs": mean[1].item(),
            "rollout/kl": mean[2].item(), "rollout/entropy": mean[3].item()}


def per_sample(values: torch.Tensor, mb: MicroBatch) -> dict[int, list[float]]:
    """Per-token values of each real sample's trained positions, by sample index."""
    return {i: values[b][mb.mask[b] > 0].tolist() for b, i in enumerate(mb.indices) if i >= 0}


def first_step_log_probs(micro_batches: list[MicroBatch]) -> dict[int, list[float]]:
    return {i: lp for mb in micro_batches for i, lp in per_sample(mb.old_log_probs, mb).items()
            if i < FIRST_STEP_SAMPLES}


def save_train_data(template: str, rollout_id: int, dp_rank: int, rank: int, samples: list[Sample],
                    micro_batches: list[MicroBatch], advantages: torch.Tensor, kl_type: str,
                    step_metrics: list[dict]) -> None:
    rows = []
    for mb in micro_batches:
        kl = kl_estimate(mb.old_log_probs, mb.ref_log_probs, kl_type)
        columns = {name: per_sample(values, mb) for name, values in (
            ("log_probs", mb.old_log_probs), ("ref_log_probs", mb.ref_log_probs),
            ("rollout_log_probs", mb.rollout_log_probs), ("kl", kl), ("entropy", mb.entropy))}
        for i in (i for i in mb.indices if i >= 0):
            rows.append({"index": i, "tokens": samples[i].tokens, "loss_mask": samples[i].loss_mask,
                         "reward": samples[i].reward, "advantage": advantages[i].item(),
                         **{name: column[i] for name, column in columns.items()}})
    atomic_save({
        "format_version": 1, "rollout_id": rollout_id, "dp_rank": dp_rank, "rank": rank,
        "samples": rows,
        "steps": [{"loss": m["train/loss"], "grad_norm": m["train/grad_norm"]} for m in step_metrics],
    }, fill(template, rollout_id, dp_rank))
