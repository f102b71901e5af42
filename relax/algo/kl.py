"""KL estimators and the rollout/train mismatch correction (`algo.tis`, `algo.mis`, and
decoupled PPO's behaviour weight, `algo.policy_loss=decoupled_ppo`).

Every function here is bounded: for finite inputs no value is Inf or NaN. The
log-ratio is clamped to ±20 before `exp` (verl's bound); k3 is additionally clamped to
[-10, 10] exactly as verl 0.9.1's `kl_penalty` does for both `k3` and `low_var_kl`
(docs/algorithms.md says why).
"""

from __future__ import annotations

import torch

from relax.algo.losses import LOG_RATIO_BOUND
from relax.config import KLType

K3_BOUND = 10.0


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(actor || ref) estimators from samples of the actor (Schulman's k1/k2/k3)."""
    log_ratio = log_probs - ref_log_probs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        d = (-log_ratio).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # ref - actor
        return (torch.expm1(d) - d).clamp(-K3_BOUND, K3_BOUND)      # exp(d) - 1 - d >= 0
    raise ValueError(f"algo.kl_loss_type={kind!r}: expected one of {', '.join(KLType)}")


def rollout_is_weights(old_log_probs, rollout_log_probs, mask, algo, seq_sum=None):
    """Importance weights pi_train / pi_rollout that correct for an engine whose sampling
    distribution differs from the trainer's (verl's rollout correction, decoupled mode):
    truncated IS (`algo.tis`: weights capped at `algo.tis_cap`) and masked IS (`algo.mis`:
    weight 0 where the ratio is outside [`algo.mis_low`, `algo.mis_high`]), per token or
    per sequence (the product of its token ratios); or decoupled PPO's (`behaviour_weights`).
    Returns the weights (no gradient), and per-token flags: truncated, dropped. None when
    none is on."""
    if algo.get("policy_loss") == "decoupled_ppo":  # (check_algo refuses it with tis or mis)
        return behaviour_weights(old_log_probs, rollout_log_probs, mask, algo.behav_imp_weight_cap)
    if algo.tis is None and algo.mis is None:
        return None
    with torch.no_grad():
        def raw(level):
            return mismatch_ratio(old_log_probs, rollout_log_probs, mask, level, seq_sum)

        weights, truncated, dropped = mask.clone(), torch.zeros_like(mask), torch.zeros_like(mask)
        if algo.tis is not None:
            w = raw(algo.tis)
            truncated = (w > algo.tis_cap).float() * mask
            weights = w.clamp(max=algo.tis_cap)
        if algo.mis is not None:
            w = raw(algo.mis)
            dropped = ((w < algo.mis_low) | (w > algo.mis_high)).float() * mask
            weights = weights * (1 - dropped)
    return weights, truncated, dropped


def behaviour_weights(prox_log_probs, behav_log_probs, mask, cap: float | None):
    """Decoupled PPO (AReaL): the PPO ratio is taken against a proximal policy (here the
    trainer's pre-update log-probs), and each token's loss is weighted by pi_prox / pi_behav,
    the behaviour policy being the engine that sampled it. A token whose weight exceeds `cap`
    is dropped (weight 0: a filter, where TIS would truncate); null drops none. Returns the
    weights (no gradient) and per-token flags: truncated (never), dropped."""
    with torch.no_grad():
        w = mismatch_ratio(prox_log_probs, behav_log_probs, mask, "token")
        dropped = (w > cap).float() * mask if cap is not None else torch.zeros_like(mask)
        return w * (1 - dropped), torch.zeros_like(mask), dropped


def mismatch_ratio(old_log_probs, rollout_log_probs, mask, level: str = "token", seq_sum=None):
    """pi_train / pi_rollout per token, or per sequence (the product of its token ratios,
    broadcast over its tokens); 0 at masked positions, log-ratio clamped to ±20."""
    seq_sum = seq_sum or (lambda x: x.sum(-1))
    log_ratio = (old_log_probs - rollout_log_probs) * mask
    if level == "sequence":
        log_ratio = seq_sum(log_ratio)[:, None].expand_as(mask)
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)) * mask


def mismatch_kl(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_rollout || pi_train) from the engine's samples (verl's
    `rollout_corr/k3_kl`): how far the distribution that sampled is from the one trained."""
    return kl_estimate(rollout_log_probs, old_log_probs, "k3")
