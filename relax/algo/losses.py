"""Policy losses (`algo.policy_loss`) and loss aggregation (`algo.loss_agg_mode`).

The per-token formulas restate verl 0.9.1's `compute_policy_loss_vanilla` (with
`clip_ratio_c`) and `compute_policy_loss_gspo`; `sequence_loss_scales` gives the same
value as its `agg_loss`, but from the whole mini-batch, so that neither data-parallel
ranks nor micro-batches change it.
"""

from __future__ import annotations

import torch

LOG_RATIO_BOUND = 20.0  # exp(20) ~ 4.9e8: a stale token's ratio stays finite
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def ppo_clip(advantages, ratio, eps_clip: float, eps_clip_high: float):
    """max(-A·r, -A·clip(r, 1-eps, 1+eps_high)) per token, and where the clipped term won."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def policy_loss(log_probs, old_log_probs, advantages, eps_clip: float, eps_clip_high: float,
                eps_clip_c: float | None = 3.0):
    """PPO-clip per token, max(-A·r, -A·clip(r, 1-eps, 1+eps_high)), and for A < 0 the dual
    clip min(that, -A·eps_clip_c): a token whose ratio exploded cannot dominate the step.
    Returns the loss, the clip flags (upper/lower and dual), and the per-token KL(old||new)."""
    log_ratio = (log_probs - old_log_probs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    loss, clipfrac = ppo_clip(advantages, torch.exp(log_ratio), eps_clip, eps_clip_high)
    clipfrac_lower = torch.zeros_like(loss)
    if eps_clip_c is not None:
        bound = -advantages * eps_clip_c
        negative = advantages < 0
        clipfrac_lower = ((loss > bound) & negative).float()
        loss = torch.where(negative, torch.minimum(loss, bound), loss)
    return loss, clipfrac, clipfrac_lower, -log_ratio


def gspo_loss(log_probs, old_log_probs, advantages, mask, eps_clip: float, eps_clip_high: float,
              seq_sum=None):
    """GSPO: the PPO clip on the sequence-level ratio (the geometric mean of the token
    ratios), applied per token with the token's own gradient. `seq_sum` sums a [b, t]
    tensor over each whole sequence (an all-reduce when a sequence is split over ranks)."""
    seq_sum = seq_sum or (lambda x: x.sum(-1))
    with torch.no_grad():
        lengths = seq_sum(mask).clamp(min=1)
        seq_log_ratio = seq_sum((log_probs - old_log_probs) * mask) / lengths
    log_ratio = (log_probs - log_probs.detach() + seq_log_ratio[:, None]).clamp(max=10.0)
    loss, clipfrac = ppo_clip(advantages, torch.exp(log_ratio), eps_clip, eps_clip_high)
    return loss, clipfrac, torch.zeros_like(loss), old_log_probs - log_probs


def sequence_loss_scales(token_counts: list[int], mode: str, horizon: int) -> list[float]:
    """Per-sample factors f_s for one optimizer step's whole mini-batch (every DP rank's
    samples): weighting each token of sample s by f_s and dividing the sum over the
    mini-batch by its token count gives `mode`'s aggregate of the per-token loss:
      token-mean               sum_t l / tokens
      seq-mean-token-sum       sum_s (sum_t l) / sequences
      seq-mean-token-mean      sum_s (sum_t l / n_s) / sequences
      seq-mean-token-sum-norm  sum_s (sum_t l) / (sequences * horizon)   (Dr. GRPO)
    Sequences with no trained token are not counted. `horizon` must be a constant (the
    generation budget), not a padded length that depends on how the batch was split."""
    if mode == "token-mean":
        return [1.0] * len(token_counts)
    tokens, sequences = sum(token_counts), sum(n > 0 for n in token_counts)
    scale = tokens / max(sequences, 1)
    if mode == "seq-mean-token-sum":
        return [scale] * len(token_counts)
    if mode == "seq-mean-token-mean":
        return [scale / n if n else 0.0 for n in token_counts]
    if mode == "seq-mean-token-sum-norm":
        return [scale / horizon] * len(token_counts)
    raise ValueError(f"algo.loss_agg_mode={mode!r}: expected one of {', '.join(LOSS_AGG_MODES)}")
