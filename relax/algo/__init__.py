"""The RL math (conf/algo/): pure tensor functions shared by every trainer backend.

Per-token tensors are [batch, tokens] with a 0/1 `mask` selecting response tokens.
"""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def group_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, divided by the group's std (unbiased)."""
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    if normalize_std:
        centred = centred / (groups.std(-1, keepdim=True) + eps)
    return centred.reshape(-1)


def compute_advantages(rewards: torch.Tensor, group_size: int, algo_cfg) -> torch.Tensor:
    if algo_cfg.advantage_estimator == "grpo":
        return group_advantages(rewards, group_size, algo_cfg.grpo_std_normalization)
    if algo_cfg.advantage_estimator == "reinforce":
        return group_advantages(rewards, group_size, normalize_std=False)
    raise ValueError(f"algo.advantage_estimator={algo_cfg.advantage_estimator!r}: "
                     f"expected grpo or reinforce")


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(actor || ref) estimators from samples of the actor (Schulman's k1/k2/k3)."""
    log_ratio = log_probs - ref_log_probs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        kl = torch.expm1(-log_ratio) + log_ratio  # exp(ref - lp) - 1 - (ref - lp)
        return kl.clamp(-10, 10) if kind == "low_var_kl" else kl
    raise ValueError(f"algo.kl_loss_type={kind!r}: expected k1, k2, k3 or low_var_kl")


def policy_loss(log_probs, old_log_probs, advantages, eps_clip: float, eps_clip_high: float):
    """PPO-clip per token: max(-A·r, -A·clip(r, 1-eps, 1+eps_high)); also clip flags and KL."""
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    ppo_kl = old_log_probs - log_probs
    return loss, clipfrac, ppo_kl


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """log p(target) under softmax(logits / temperature), and the entropy of that softmax."""
    logp = (logits.float() / temperature).log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy
