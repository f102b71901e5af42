"""The PyTorch trainer (train=torch): HF model, frozen reference copy, AdamW.

One object per rank. `train()` reads top to bottom like the algorithm: advantages from
raw rewards, reference and old log-probs, then `num_steps_per_rollout` PPO-clip steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from relax.algo import compute_advantages, kl_estimate, masked_sum, policy_loss, token_log_probs
from relax.debug import faults
from relax.model import load_causal_lm
from relax.replay import atomic_save, fill, safe_load
from relax.sample import Sample
from relax.train.parallel import (
    apply_layout, check_torch_layout, clip_grad_norm, dp_all_gather, dp_all_reduce, full_tensor,
    init_layout, peak_memory_mb)

log = logging.getLogger(__name__)
FIRST_STEP_SAMPLES = 16  # per-token log-probs of these sample indices go to layout comparisons


@dataclass
class MicroBatch:
    indices: list[int]          # sample indices (positions in the rollout)
    tokens: torch.Tensor        # [b, T] right-padded
    mask: torch.Tensor          # [b, T-1] 1 where position t predicts a trained response token
    advantages: torch.Tensor    # [b]
    rollout_log_probs: torch.Tensor  # [b, T-1]
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def group_size_of(samples: list[Sample]) -> int:
    groups = [s.group_index for s in samples]
    size = groups.count(groups[0])
    if len(samples) % size or groups != sorted(groups):
        raise ValueError("samples must come in equal, contiguous GRPO groups")
    return size


def make_micro_batch(samples: list[Sample], advantages: torch.Tensor, pad_id: int) -> MicroBatch:
    T = max(len(s.tokens) for s in samples)
    tokens = torch.full((len(samples), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), T - 1)
    rollout_lp = torch.zeros(len(samples), T - 1)
    for b, s in enumerate(samples):
        tokens[b, :len(s.tokens)] = torch.tensor(s.tokens)
        start = s.prompt_length - 1  # logits at position t predict token t+1
        mask[b, start:start + s.response_length] = torch.tensor(s.loss_mask, dtype=torch.float)
        rollout_lp[b, start:start + s.response_length] = torch.tensor(s.rollout_log_probs)
    return MicroBatch([s.index for s in samples], tokens, mask, advantages, rollout_lp)


def per_sample(values: torch.Tensor, mb: MicroBatch) -> list[list[float]]:
    """Per-token values of each sample's response positions."""
    return [values[b][mb.mask[b] > 0].tolist() for b in range(len(mb.indices))]


class TorchTrainer:
    """Trainer interface: train / named_weights / save_checkpoint / load_checkpoint / shutdown."""

    def __init__(self, cfg, model_path: str, ref_model_path: str | None = None,
                 pad_token_id: int = 0, save_train_data: str | None = None,
                 rank: int = 0, world_size: int = 1):
        check_torch_layout(cfg.parallel)
        self.cfg, self.pad_id, self.save_train_data = cfg, pad_token_id, save_train_data
        self.layout = init_layout(cfg.parallel, rank, world_size)
        self.temperature = cfg.rollout.temperature or 1.0  # greedy rollouts: plain log-probs
        torch.manual_seed(cfg.seed)
        self.model = load_causal_lm(Path(model_path), cfg.model.dtype)
        ref = load_causal_lm(Path(ref_model_path or model_path), cfg.model.dtype)
        ref.requires_grad_(False)
        if faults.active("trainer_dropout"):  # a noisy forward
            self.model.config.attention_dropout = 0.5
            for module in self.model.modules():
                if hasattr(module, "attention_dropout"):
                    module.attention_dropout = 0.5
            self.model.train()
        self.actor = apply_layout(self.model, self.layout, trainable=True)
        self.ref = apply_layout(ref, self.layout, trainable=False)
        if faults.active(f"perturb_shard:{cfg.parallel.name}") and self.layout.rank == 1:
            shard = self.model.model.layers[0].self_attn.q_proj.weight
            with torch.no_grad():  # one rank's weight shard is off by 1e-3
                (shard.to_local() if isinstance(shard, DTensor) else shard).add_(1e-3)
        t = cfg.train
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps, weight_decay=t.weight_decay)

    # -- batching ------------------------------------------------------------------------
    def _shard(self, samples: list[Sample], advantages: torch.Tensor) -> list[list[MicroBatch]]:
        """Per optimizer step, this rank's micro-batches: each step's mini-batch is split
        evenly over the DP ranks, then into micro-batches of `micro_batch_size`."""
        steps, dp = self.cfg.train.num_steps_per_rollout, self.layout.dp_size
        if len(samples) % (steps * dp):
            raise ValueError(f"{len(samples)} samples do not split into num_steps_per_rollout="
                             f"{steps} x dp={dp} equal parts")
        per_rank = len(samples) // (steps * dp)
        out = []
        for step in range(steps):
            start = (step * dp + self.layout.dp_rank) * per_rank
            mine = samples[start:start + per_rank]
            mbs = self.cfg.train.micro_batch_size
            out.append([make_micro_batch(mine[i:i + mbs], advantages[[s.index for s in mine[i:i + mbs]]],
                                         self.pad_id)
                        for i in range(0, len(mine), mbs)])
        return out

    def _log_probs(self, model, mb: MicroBatch):
        logits = model(input_ids=mb.tokens).logits[:, :-1]
        return token_log_probs(logits, mb.tokens[:, 1:], self.temperature)

    # -- the algorithm ---------------------------------------------------------------------
    def train(self, rollout_id: int, samples: list[Sample]) -> dict:
        algo = self.cfg.algo
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float)
        advantages = compute_advantages(rewards, group_size_of(samples), algo)
        steps = self._shard(samples, advantages)
        micro_batches = [mb for step in steps for mb in step]

        with torch.no_grad():  # the policy that sampled (old) and the reference
            for mb in micro_batches:
                mb.ref_log_probs, _ = self._log_probs(self.ref, mb)
                mb.old_log_probs, mb.entropy = self._log_probs(self.actor, mb)
        rollout_metrics = self._rollout_metrics(micro_batches)

        eps_high = algo.eps_clip_high if algo.eps_clip_high is not None else algo.eps_clip
        step_metrics = []
        for step, step_mbs in enumerate(steps):
            t0 = time.perf_counter()
            num_tokens = dp_all_reduce(sum(mb.mask.sum() for mb in step_mbs), self.layout)
            # DDP/FSDP average gradients over dp ranks; scale so the result is a token mean.
            scale = self.layout.dp_size / num_tokens
            sums = torch.zeros(7)
            self.optimizer.zero_grad(set_to_none=True)
            for mb in step_mbs:
                log_probs, entropy = self._log_probs(self.actor, mb)
                adv = mb.advantages[:, None].expand_as(log_probs)
                pg, clipfrac, ppo_kl = policy_loss(log_probs, mb.old_log_probs, adv,
                                                   algo.eps_clip, eps_high)
                kl = kl_estimate(log_probs, mb.ref_log_probs, algo.kl_loss_type)
                loss = pg - algo.entropy_coef * entropy
                if algo.use_kl_loss:
                    loss = loss + algo.kl_loss_coef * kl
                (masked_sum(loss, mb.mask) * scale).backward()
                with torch.no_grad():
                    diff = (log_probs - mb.rollout_log_probs).abs()
                    sums += torch.stack([masked_sum(x, mb.mask) for x in (
                        loss, pg, clipfrac, ppo_kl, kl, entropy, diff)])
            grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.train.clip_grad)
            self.optimizer.step()
            sums = dp_all_reduce(sums, self.layout) / num_tokens
            step_metrics.append({
                "train/loss": sums[0].item(), "train/pg_loss": sums[1].item(),
                "train/pg_clipfrac": sums[2].item(), "train/ppo_kl": sums[3].item(),
                "train/kl_loss": sums[4].item(), "train/entropy_loss": sums[5].item(),
                "train/train_rollout_logprob_abs_diff": sums[6].item(),
                "train/grad_norm": grad_norm, "train/lr": self.optimizer.param_groups[0]["lr"],
                "perf/step_time": time.perf_counter() - t0,
                "perf/peak_memory_mb": peak_memory_mb(),
            })
        if self.save_train_data and self.layout.writes_data:
            self._save_train_data(rollout_id, samples, micro_batches, advantages, step_metrics)
        return {"rollout": rollout_metrics, "steps": step_metrics,
                "first_step_log_probs": self._first_step_log_probs(micro_batches)}

    def _rollout_metrics(self, micro_batches: list[MicroBatch]) -> dict:
        sums = torch.zeros(6)
        for mb in micro_batches:
            kl = mb.old_log_probs - mb.ref_log_probs
            sums += torch.stack([masked_sum(x, mb.mask) for x in (
                mb.old_log_probs, mb.ref_log_probs, mb.rollout_log_probs, kl,
                mb.entropy, torch.ones_like(kl))])
        sums = dp_all_reduce(sums, self.layout)
        mean = sums[:5] / sums[5]
        return {"rollout/log_probs": mean[0].item(), "rollout/ref_log_probs": mean[1].item(),
                "rollout/rollout_log_probs": mean[2].item(), "rollout/kl": mean[3].item(),
                "rollout/entropy": mean[4].item()}

    def _first_step_log_probs(self, micro_batches: list[MicroBatch]) -> dict[int, list[float]]:
        mine = {i: lp for mb in micro_batches
                for i, lp in zip(mb.indices, per_sample(mb.old_log_probs, mb))
                if i < FIRST_STEP_SAMPLES}
        return {i: lp for part in dp_all_gather(mine, self.layout) for i, lp in part.items()}

    def _save_train_data(self, rollout_id, samples, micro_batches, advantages, step_metrics):
        rows = []
        for mb in micro_batches:
            kl = kl_estimate(mb.old_log_probs, mb.ref_log_probs, self.cfg.algo.kl_loss_type)
            for b, i in enumerate(mb.indices):
                m = mb.mask[b] > 0
                rows.append({
                    "index": i, "tokens": samples[i].tokens,
                    "loss_mask": samples[i].loss_mask, "reward": samples[i].reward,
                    "advantage": advantages[i].item(),
                    "log_probs": mb.old_log_probs[b][m].tolist(),
                    "ref_log_probs": mb.ref_log_probs[b][m].tolist(),
                    "rollout_log_probs": mb.rollout_log_probs[b][m].tolist(),
                    "kl": kl[b][m].tolist(), "entropy": mb.entropy[b][m].tolist(),
                })
        atomic_save({
            "format_version": 1, "rollout_id": rollout_id, "dp_rank": self.layout.dp_rank,
            "rank": self.layout.rank, "samples": rows,
            "steps": [{"loss": m["train/loss"], "grad_norm": m["train/grad_norm"]}
                      for m in step_metrics],
        }, fill(self.save_train_data, rollout_id, self.layout.dp_rank))

    # -- weights and checkpoints -------------------------------------------------------------
    def named_weights(self) -> dict[str, torch.Tensor]:
        """Full tensors by HF name (collective under TP/FSDP; rank 0's result is used)."""
        return {name: full_tensor(p.detach()).clone() for name, p in self.model.named_parameters()}

    def save_checkpoint(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        weights = self.named_weights()
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if self.layout.rank == 0:
            hf = Path(path) / "hf"
            hf.mkdir(parents=True, exist_ok=True)
            self.model.config.save_pretrained(hf)
            save_file({k: v.contiguous() for k, v in weights.items()}, hf / "model.safetensors",
                      metadata={"format": "pt"})
            atomic_save({"optimizer": optim, "torch_rng": torch.get_rng_state()},
                        Path(path) / "trainer_state.pt")

    def load_checkpoint(self, path: str) -> None:
        """Restore optimizer and RNG state (the weights were loaded from <path>/hf)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        state = safe_load(Path(path) / "trainer_state.pt")
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
        torch.set_rng_state(state["torch_rng"])

    def shutdown(self) -> None:
        pass
