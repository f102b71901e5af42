"""Advantages from raw rewards (`algo.advantage_estimator`), one scalar per sample.

Each estimator restates the outcome-reward case of verl 0.9.1's `core_algos` function of
the same name (tests/test_numerics_verl.py checks the numbers).
"""

from __future__ import annotations

import torch

from relax.config import AdvantageEstimator


def group_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO (verl `compute_grpo_outcome_advantage`): each reward minus its group's mean,
    divided by the group's unbiased std + eps. A group of one has no baseline: verl's
    convention gives it mean 0 and std 1, so its advantage is its reward (not a NaN std)."""
    groups = rewards.view(-1, group_size)
    if group_size == 1:
        mean, std = torch.zeros_like(groups), torch.ones_like(groups)
    else:
        mean, std = groups.mean(-1, keepdim=True), groups.std(-1, keepdim=True)
    centred = groups - mean
    if normalize_std:
        centred = centred / (std + eps)
    return centred.reshape(-1)


def reinforce_plus_plus(rewards: torch.Tensor, token_counts: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ (verl `compute_reinforce_plus_plus_outcome_advantage`, gamma 1, outcome
    reward): every response token's return is its sample's reward, whitened over all
    response tokens of the rollout (token-weighted mean, unbiased variance, eps 1e-8)."""
    n = token_counts.to(rewards.dtype)
    total = n.sum()
    mean = (rewards * n).sum() / (total + 1e-8)
    var = ((rewards - mean).square() * n).sum() / (total + 1e-8) * total / (total - 1).clamp(min=1)
    return (rewards - mean) * torch.rsqrt(var + 1e-8)


def compute_advantages(rewards: torch.Tensor, group_size: int, token_counts: torch.Tensor,
                       algo_cfg) -> torch.Tensor:
    estimator = algo_cfg.advantage_estimator
    if estimator == "grpo":
        return group_advantages(rewards, group_size, algo_cfg.grpo_std_normalization)
    if estimator == "reinforce":
        return group_advantages(rewards, group_size, normalize_std=False)
    if estimator == "reinforce_plus_plus":
        return reinforce_plus_plus(rewards, token_counts)
    raise ValueError(f"algo.advantage_estimator={estimator!r}: expected one of {', '.join(AdvantageEstimator)}")
