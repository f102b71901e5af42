"""Backend-free trainer pieces: batching, the per-micro-batch objective, metrics, train dumps.

Every backend (torch, megatron) trains on the same `MicroBatch`es with the same objective
and reports the same metrics; only the forward/backward machinery differs.

Per-token tensors are [b, T] and aligned by position: at position t the model predicts
`targets[t] = tokens[t + 1]`, and `mask[t]` says whether that is a trained response token
(so the last position is always masked). Aligning targets before any sequence split lets
context parallelism cut sequences anywhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from relax import faults
from relax.algo import (compute_advantages, gspo_loss, kl_estimate, masked_sum, mismatch_kl, mismatch_ratio,
                        policy_loss, rollout_is_weights, sequence_loss_scales, token_log_probs)
from relax.files import atomic_save, fill
from relax.sample import Sample, group_size_of
from relax.train import routing
from relax.train.parallel import dp_all_gather, dp_all_reduce

FIRST_STEP_SAMPLES = 16  # per-token log-probs of these sample indices go to layout comparisons
STEP_KEYS = ("train/loss", "train/pg_loss", "train/pg_clipfrac", "train/pg_clipfrac_lower", "train/ppo_kl",
             "train/kl_loss", "train/entropy_loss", "train/train_rollout_logprob_abs_diff",
             "train/token_mult_prob_error", "train/mismatch_kl", "train/mismatch_residual",
             "train/tis_weight_mean", "train/tis_clipfrac", "train/mis_dropfrac")


@dataclass
class MicroBatch:
    indices: list[int]               # sample indices (positions in the rollout); -1 = padding row
    tokens: torch.Tensor             # [b, T] right-padded
    targets: torch.Tensor            # [b, T] tokens shifted left by one
    mask: torch.Tensor               # [b, T] 1 where targets[t] is a trained response token
    advantages: torch.Tensor         # [b]
    rollout_log_probs: torch.Tensor  # [b, T] the engine's, at the same positions
    loss_weights: torch.Tensor       # [b, T] mask x the sample's algo.loss_agg_mode factor
    old_log_probs: torch.Tensor | None = None  # the trainer's, before the update (None: this forward's)
    ref_log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None  # [b, T] rollout correction (algo.tis / algo.mis)
    is_flags: tuple | None = None           # ([b, T] truncated, [b, T] dropped)
    prompt_lengths: list[int] | None = None  # per row: prompt tokens (0: padding row)
    lengths: list[int] | None = None         # per row: prompt + response tokens (0: padding row)
    # MoE (relax/train/routing.py), -1 where unknown: the engine's experts per fed token, [b, T,
    # layers x top_k]; the trainer's own, recorded at the rollout's weights, [b * T, layers, top_k];
    # R2's replayed ones (that record), [b * T, layers x top_k]
    routed_experts: torch.Tensor | None = None
    trainer_experts: torch.Tensor | None = None
    replay_experts: torch.Tensor | None = None
    packed: object | None = None  # train.shared_prompt: the packed rows, built once (packing.packed)


def nudge_ulps(params, ulps: int, seed: int) -> None:
    """parallel.noise_ulp: move every weight `ulps` representable values up or down (random
    signs from `seed` + ulps - 1): a twin run whose distance from the original is rounding noise.
    Twins of 1, 2 and 3 ulps (parallel=twin, twin2, twin3) move in independent directions, so
    they are three samples of that noise: the same signs would repeat one twin's, only larger."""
    if ulps:  # (the random signs alone took seconds a rank on a 135M model)
        nudge(params, ulps, torch.Generator().manual_seed(seed + ulps - 1))


def step_noise(tensors, ulps: int, seed: int, step: int) -> None:
    """parallel.step_noise_ulp: move every element of `tensors` (a step's weights) `ulps`
    representable values up or down, in directions drawn from (seed, ulps, step) alone (`step`:
    the run's optimizer step, so a rerun or a resumed run draws the same): rounding noise added
    at every step, as a layout's other reduction order adds it, where noise_ulp adds it once."""
    if ulps:
        nudge(tensors, ulps, torch.Generator().manual_seed(hash((seed, ulps, step)) & (2**63 - 1)))


def nudge(tensors, ulps: int, generator: torch.Generator) -> None:
    """Each element `ulps` representable values up or down, in random directions from `generator`
    (a DTensor's: its local shard)."""
    with torch.no_grad():
        for t in tensors:
            t = t.to_local() if isinstance(t, DTensor) else t
            target = torch.where(torch.rand(t.shape, generator=generator) < 0.5, -torch.inf, torch.inf)
            for _ in range(ulps):
                t.copy_(torch.nextafter(t, target.to(t.dtype)))


def advantages_of(samples: list[Sample], algo) -> torch.Tensor:
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float)
    token_counts = torch.tensor([sum(s.loss_mask) for s in samples])
    return compute_advantages(rewards, group_size_of(samples), token_counts, algo)


def first_trained_position(mb: MicroBatch) -> int:
    """The first position any row of `mb` trains on (0 for a micro-batch of padding rows)."""
    trained = mb.mask.any(0).nonzero()
    return int(trained[0]) if len(trained) else 0


def batch_variant_fault(logits: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """The `batch_variant` fault: logits whose value depends on the micro-batch's row count."""
    return logits * (1 + 1e-4 * mb.tokens.shape[0]) if faults.active("batch_variant") else logits


def trained_log_probs(logits: torch.Tensor, mb: MicroBatch, first: int, temperature: float,
                      entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropy, [b, T], from `logits` of positions `first`.. (or of all
    positions, then cut there): the vocabulary-wide softmax runs only where something is
    trained, zeros before (masked out)."""
    logits = batch_variant_fault(logits[:, first - mb.tokens.shape[1] + logits.shape[1]:], mb)
    log_probs, entropy = token_log_probs(logits, mb.targets[:, first:], temperature, entropy_grad)
    return F.pad(log_probs, (first, 0)), F.pad(entropy, (first, 0))


def make_micro_batch(samples: list[Sample], advantages: torch.Tensor, pad_id: int,
                     length: int | None = None, rows: int | None = None,
                     scales: dict[int, float] | None = None) -> MicroBatch:
    """Right-pad to `length` tokens and `rows` rows (fixed shapes for pipeline schedules)."""
    T = length or max(len(s.tokens) for s in samples)
    B = rows or len(samples)

    def row(s: Sample, values: list) -> list:  # a response's values at its positions: t predicts t + 1
        start = s.prompt_length - 1
        return [0] * start + values + [0] * (T - start - len(values))

    padding = [[0] * T] * (B - len(samples))  # (one tensor per field: per-sample tensors cost more)
    tokens = torch.tensor([s.tokens + [pad_id] * (T + 1 - len(s.tokens)) for s in samples]
                          + [[pad_id] * (T + 1)] * (B - len(samples)), dtype=torch.long)
    mask = torch.tensor([row(s, s.loss_mask) for s in samples] + padding, dtype=torch.float)
    rollout_lp = torch.tensor([row(s, s.rollout_log_probs) for s in samples] + padding, dtype=torch.float)
    adv, scale = torch.zeros(B), torch.zeros(B)
    adv[:len(samples)] = advantages[[s.index for s in samples]]
    scale[:len(samples)] = torch.tensor([(scales or {}).get(s.index, 1.0) for s in samples])
    indices = [s.index for s in samples] + [-1] * (B - len(samples))
    experts = routing.engine_experts(samples, T)
    if experts is not None and B > len(samples):
        experts = torch.cat([experts, experts.new_full((B - len(samples), *experts.shape[1:]), -1)])
    return MicroBatch(indices, tokens[:, :T], tokens[:, 1:], mask, adv, rollout_lp, mask * scale[:, None],
                      prompt_lengths=[s.prompt_length for s in samples] + [0] * (B - len(samples)),
                      lengths=[len(s.tokens) for s in samples] + [0] * (B - len(samples)),
                      routed_experts=experts)


def shard_steps(samples: list[Sample], advantages: torch.Tensor, steps: int, dp: int, dp_rank: int,
                micro_batch_size: int, pad_id: int, fixed_shape: bool = False,
                length_multiple: int = 1, loss_agg_mode: str = "token-mean",
                horizon: int = 1) -> list[list[MicroBatch]]:
    """Per optimizer step, this rank's micro-batches: each step's mini-batch is split evenly
    over the DP ranks, then into micro-batches of `micro_batch_size` samples. With
    `fixed_shape`, every micro-batch has the same [rows, T] (padding rows are masked out), rows
    no more than the largest micro-batch holds: a rollout smaller than `micro_batch_size` is not
    padded up to it (8 samples in 64 rows would make Megatron's step 8 times the work).
    The loss weights of `loss_agg_mode` come from the whole step's mini-batch, which every
    rank sees here, so no layout changes them."""
    if len(samples) % (steps * dp):
        raise ValueError(f"{len(samples)} samples do not split into num_steps_per_rollout="
                         f"{steps} x dp={dp} equal parts")
    per_rank = len(samples) // (steps * dp)
    longest = max(len(s.tokens) for s in samples)
    length = -(-longest // length_multiple) * length_multiple if fixed_shape else None
    rows = min(micro_batch_size, per_rank) if fixed_shape else None
    out = []
    for step in range(steps):
        batch = samples[step * dp * per_rank:(step + 1) * dp * per_rank]
        factors = sequence_loss_scales([sum(s.loss_mask) for s in batch], loss_agg_mode, horizon)
        scales = {s.index: f for s, f in zip(batch, factors, strict=True)}
        mine = batch[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        out.append([make_micro_batch(mine[i:i + micro_batch_size], advantages, pad_id, length, rows, scales)
                    for i in range(0, len(mine), micro_batch_size)])
    return out


def forward_passes(train, algo, rollout_id: int, first_step: bool, save_train_data: str | None) -> tuple[bool, bool]:
    """Which no-grad passes a rollout needs: (reference, old log-probs). The reference only
    where something reads ref_log_probs: a KL loss, the run's first step (the guide's
    log_probs == ref_log_probs check), every train.ref_log_probs_interval rollouts, dumps.
    A separate old-log-prob pass only where the training forward cannot give them: several
    optimizer steps per rollout (later steps start from updated weights), unless the
    engine's log-probs are the old policy; and at the first step, so that its ppo_kl
    compares two forwards (a non-deterministic one shows) rather than one with itself."""
    interval = train.ref_log_probs_interval
    ref = (algo.use_kl_loss or first_step or save_train_data is not None
           or bool(interval and rollout_id % interval == 0))
    old = first_step or (train.num_steps_per_rollout > 1 and not algo.use_rollout_log_probs)
    return ref, old


def attach_is_weights(micro_batches: list[MicroBatch], algo, seq_sum=None) -> None:
    """Rollout-correction weights from the old (pre-update) log-probs, once per rollout."""
    for mb in micro_batches:
        out = rollout_is_weights(mb.old_log_probs, mb.rollout_log_probs, mb.mask, algo, seq_sum)
        if out is not None:
            mb.is_weights, mb.is_flags = out[0], out[1:]


def objective(log_probs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch, algo, seq_sum=None):
    """Per-token loss of one micro-batch (the trainers reduce it with `mb.loss_weights`),
    and the sums of every STEP_KEYS metric: train/loss weighted like the loss, so that
    dividing by the step's token count gives the algo.loss_agg_mode aggregate; the others
    plain token sums (token means once divided). `seq_sum` sums a [b, t] tensor over each
    whole sequence (an all-reduce when a sequence is split over context-parallel ranks).
    Without a separate old-log-prob pass (`forward_passes`), the pre-update log-probs are
    this forward's (bit-identical to a no-grad pass: same weights, same kernels). The PPO
    ratio's old policy is the engine's with algo.use_rollout_log_probs, else the trainer's
    (algo.policy_loss=decoupled_ppo: the proximal policy; `mb.is_weights` holds its behaviour
    weights, from attach_is_weights)."""
    if mb.old_log_probs is None:
        mb.old_log_probs, mb.entropy = log_probs.detach(), entropy.detach()
        attach_is_weights([mb], algo, seq_sum)
    if faults.active("nan_log_probs") and 3 in mb.indices:  # one sample's forward turns NaN
        log_probs = log_probs * torch.tensor([[float("nan") if i == 3 else 1.0] for i in mb.indices])
    old = mb.rollout_log_probs if algo.use_rollout_log_probs else mb.old_log_probs
    eps_high = algo.eps_clip_high if algo.eps_clip_high is not None else algo.eps_clip
    adv = mb.advantages[:, None].expand_as(log_probs)
    if algo.policy_loss == "gspo":
        pg, clipfrac, clipfrac_lower, ppo_kl = gspo_loss(log_probs, old, adv, mb.mask,
                                                         algo.eps_clip, eps_high, seq_sum)
    else:
        pg, clipfrac, clipfrac_lower, ppo_kl = policy_loss(log_probs, old, adv, algo.eps_clip,
                                                           eps_high, algo.eps_clip_c)
    is_weights = mb.is_weights if mb.is_weights is not None else mb.mask
    truncated, dropped = mb.is_flags or (torch.zeros_like(mb.mask),) * 2
    if mb.is_weights is not None:
        pg = pg * mb.is_weights
    kl = kl_estimate(log_probs, mb.ref_log_probs, algo.kl_loss_type) if mb.ref_log_probs is not None \
        else torch.zeros_like(log_probs)  # no reference pass: no KL term (see forward_passes)
    loss = pg - algo.entropy_coef * entropy
    if algo.use_kl_loss:
        loss = loss + algo.kl_loss_coef * kl
    with torch.no_grad():
        diff = (log_probs - mb.rollout_log_probs).abs()
        # NeMo-RL's token_mult_prob_error (1.0: identical); where() keeps exp() of an untrained
        # position's difference out of the sum (inf x 0 would be NaN)
        mult = torch.where(mb.mask > 0, diff, 0.0).exp()
        mismatch = mismatch_kl(mb.old_log_probs, mb.rollout_log_probs)
        # the part of pi_train/pi_rollout the update leaves uncorrected: its bias is
        # E_rollout[(weight - ratio) * A * grad log pi]
        ratio = mismatch_ratio(mb.old_log_probs, mb.rollout_log_probs, mb.mask, algo.tis or "token", seq_sum)
        residual = (is_weights - ratio).abs()
        sums = torch.stack([masked_sum(loss.detach(), mb.loss_weights)] + [
            masked_sum(x.detach(), mb.mask) for x in (pg, clipfrac, clipfrac_lower, ppo_kl, kl, entropy, diff,
                                                      mult, mismatch, residual, is_weights, truncated,
                                                      dropped)])
    return loss, sums


class TrainLog:
    """A rollout's training report, kept alike by every backend on the ranks that hold the
    results (train=megatron: the last pipeline stage): a record per optimizer step, the steps
    skipped as non-finite (`train.on_nonfinite`), then the rollout's metrics, its train dump
    (debug.save_train_data) and, at the run's first step, the first samples' log-probs."""

    def __init__(self, layout, with_ref: bool):
        self.layout, self.with_ref = layout, with_ref
        self.steps: list[dict] = []
        self.nonfinite: list[dict] = []

    def step(self, step: int, step_mbs: list[MicroBatch], mb_losses: list[torch.Tensor], sums: torch.Tensor,
             num_tokens, grad_norm: float, stepped: bool, lr: float, started: float, peak_memory_mb: float,
             skipped_steps: int) -> None:
        """One optimizer step that `stepped` or was skipped; `sums` and `num_tokens` are over DP
        ranks, `mb_losses` this rank's train/loss sum per micro-batch, `started` its perf_counter()."""
        if not stepped:  # the samples of the non-finite micro-batches, from every DP rank
            bad = dp_all_gather(nonfinite_indices(step_mbs, mb_losses), self.layout)
            self.nonfinite.append(nonfinite_event(step, (sums[0] / num_tokens).item(), grad_norm,
                                                  [i for part in bad for i in part]))
        self.steps.append(step_record(sums, num_tokens, grad_norm, lr, time.perf_counter() - started,
                                      peak_memory_mb, skipped_steps, self.with_ref))

    def result(self, micro_batches: list[MicroBatch], first_step: bool, save_to: str | None,
               rollout_id: int, samples: list[Sample], advantages: torch.Tensor, kl_type: str,
               routed: tuple = (None, None)) -> dict:
        """What `train()` returns, from the micro-batches of the steps that ran (all, unless
        train.on_nonfinite=error stopped the rollout); `save_to`: the debug.save_train_data template;
        `routed`: an MoE model's routing sums over all ranks (relax/train/routing.py)."""
        layout = self.layout
        trained = [mb for mb in micro_batches if mb.old_log_probs is not None]
        out = {"rollout": rollout_record(dp_all_reduce(rollout_sums(trained), layout), self.with_ref)
               | routing.metrics(*routed), "steps": self.steps, "nonfinite": self.nonfinite}
        if save_to and layout.writes_data:
            save_train_data(save_to, rollout_id, layout.dp_rank, layout.rank, samples, trained, advantages,
                            kl_type, self.steps, routing.per_layer(routed[0]))
        if first_step:
            first = dp_all_gather(first_step_log_probs(trained), layout)
            out["first_step_log_probs"] = {i: lp for part in first for i, lp in part.items()}
        return out


def step_record(sums: torch.Tensor, num_tokens, grad_norm: float, lr: float, seconds: float,
                peak_memory_mb: float, skipped_steps: int, with_ref: bool) -> dict:
    """One step's metrics; train/kl_loss only where the rollout had a reference pass."""
    record = {k: (v / num_tokens).item() for k, v in zip(STEP_KEYS, sums, strict=True)
              if with_ref or k != "train/kl_loss"}
    return {**record, "train/grad_norm": float(grad_norm), "train/lr": lr,
            "train/skipped_steps": skipped_steps, "perf/step_time": seconds,
            "perf/peak_memory_mb": peak_memory_mb}


def nonfinite_event(step: int, loss: float, grad_norm: float, indices: list[int]) -> dict:
    """What `train.on_nonfinite` reports to the driver: the step, what was non-finite, and
    the samples of the micro-batches whose loss was (all the step's, when only the grad
    norm was)."""
    return {"step": step, "loss": loss, "grad_norm": grad_norm, "indices": sorted(indices)}


def nonfinite_indices(step_mbs: list[MicroBatch], mb_losses: list[torch.Tensor]) -> list[int]:
    bad = [i for mb, loss in zip(step_mbs, mb_losses, strict=True) if not torch.isfinite(loss)
           for i in mb.indices if i >= 0]
    return bad or [i for mb in step_mbs for i in mb.indices if i >= 0]


def rollout_sums(micro_batches: list[MicroBatch]) -> torch.Tensor:
    """Token sums of log_probs, entropy, ref_log_probs and kl (0 without a reference pass), and the count."""
    sums = torch.zeros(5)
    for mb in micro_batches:
        ref = mb.ref_log_probs if mb.ref_log_probs is not None else torch.zeros_like(mb.mask)
        sums += torch.stack([masked_sum(x, mb.mask) for x in (
            mb.old_log_probs, mb.entropy, ref, mb.old_log_probs - ref, torch.ones_like(mb.mask))])
    return sums


def rollout_record(sums: torch.Tensor, with_ref: bool) -> dict:
    """rollout/log_probs and rollout/entropy; rollout/ref_log_probs and rollout/kl only for a
    rollout that ran the reference pass (forward_passes)."""
    mean = sums[:4] / sums[4]
    record = {"rollout/log_probs": mean[0].item(), "rollout/entropy": mean[1].item()}
    if with_ref:
        record |= {"rollout/ref_log_probs": mean[2].item(), "rollout/kl": mean[3].item()}
    return record


def per_sample(values: torch.Tensor, mb: MicroBatch) -> dict[int, list[float]]:
    """Per-token values of each real sample's trained positions, by sample index."""
    return {i: values[b][mb.mask[b] > 0].tolist() for b, i in enumerate(mb.indices) if i >= 0}


def first_step_log_probs(micro_batches: list[MicroBatch]) -> dict[int, list[float]]:
    """Per-token log_probs of the first FIRST_STEP_SAMPLES samples (the run's first step only)."""
    return {i: lp for mb in micro_batches for i, lp in per_sample(mb.old_log_probs, mb).items()
            if i < FIRST_STEP_SAMPLES}


def save_train_data(template: str, rollout_id: int, dp_rank: int, rank: int, samples: list[Sample],
                    micro_batches: list[MicroBatch], advantages: torch.Tensor, kl_type: str,
                    step_metrics: list[dict], routing_per_layer: list | None = None) -> None:
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
        **({"routing_agreement_per_layer": routing_per_layer} if routing_per_layer else {}),
    }, fill(template, rollout_id, dp_rank))
