"""The RL math (conf/algo/): pure tensor functions shared by every trainer backend.

Per-token tensors are [batch, tokens] with a 0/1 `mask` selecting response tokens.
advantages.py: advantage estimators; losses.py: policy losses and loss aggregation;
kl.py: KL estimators and the rollout/train mismatch correction.
"""

from __future__ import annotations

import logging

import torch

from relax.algo.advantages import compute_advantages, group_advantages, reinforce_plus_plus
from relax.algo.kl import behaviour_weights, kl_estimate, mismatch_kl, mismatch_ratio, rollout_is_weights
from relax.algo.losses import (LOSS_AGG_MODES, gspo_loss, policy_loss,
                               sequence_loss_scales)
from relax.errors import ConfigError

__all__ = ["compute_advantages", "group_advantages", "reinforce_plus_plus", "kl_estimate", "mismatch_kl",
           "mismatch_ratio",
           "rollout_is_weights", "behaviour_weights", "gspo_loss", "policy_loss", "sequence_loss_scales",
           "masked_sum",
           "token_log_probs", "check_algo"]
log = logging.getLogger(__name__)


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    entropy_grad: bool = True):
    """log p(target) under softmax(logits / temperature), and the entropy of that softmax
    (without a graph unless `entropy_grad`: with algo.entropy_coef=0 it is only a metric, and
    its graph would hold two more vocabulary-wide tensors per position until backward)."""
    logp = (logits.float() / temperature).log_softmax(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def check_algo(algo, rollout) -> None:
    """Refuse an algo config that cannot train, before anything is built; warn about GRPO
    without groups."""
    if algo.loss_agg_mode not in LOSS_AGG_MODES:  # (the other choices are enums: relax/config.py)
        raise ConfigError(f"algo.loss_agg_mode={algo.loss_agg_mode!r}: expected one of "
                          f"{', '.join(LOSS_AGG_MODES)}")
    if algo.eps_clip_c is not None and algo.eps_clip_c <= 1.0:
        raise ConfigError(f"algo.eps_clip_c={algo.eps_clip_c}: the dual-clip bound must be > 1 "
                          f"(verl's clip_ratio_c; default 3.0), or null to disable it")
    if algo.tis_cap <= 0:
        raise ConfigError(f"algo.tis_cap={algo.tis_cap}: the truncation cap must be > 0")
    for key in ("eps_clip", "eps_clip_high", "kl_loss_coef"):
        if algo[key] is not None and algo[key] < 0:
            raise ConfigError(f"algo.{key}={algo[key]}: expected a number >= 0")
    if not 0 <= algo.mis_low < 1:  # masked IS keeps ratios in [mis_low, mis_high], around 1
        raise ConfigError(f"algo.mis_low={algo.mis_low}: expected a ratio in [0, 1)")
    if not algo.mis_high > 1:
        raise ConfigError(f"algo.mis_high={algo.mis_high}: expected a ratio > 1")
    cap = algo.behav_imp_weight_cap
    if cap is not None and not cap > 1:  # (a NaN too)
        raise ConfigError(f"algo.behav_imp_weight_cap={cap}: expected a ratio > 1 (decoupled_ppo drops the "
                          f"tokens whose pi_old / pi_rollout exceeds it), or null to drop none")
    if algo.policy_loss == "decoupled_ppo":
        check_decoupled_ppo(algo)
    if algo.use_rollout_log_probs and algo.tis is not None:
        raise ConfigError(f"algo.use_rollout_log_probs=true with algo.tis={algo.tis}: the PPO ratio is then "
                          f"pi_new / pi_rollout, already the importance ratio that TIS would apply a second "
                          f"time (its clip bounds it). Drop algo.tis, or keep it with recomputed old "
                          f"log-probs (use_rollout_log_probs=false); algo.mis works with both")
    if algo.advantage_estimator == "grpo" and rollout.n_samples_per_prompt == 1:
        log.warning("algo.advantage_estimator=grpo with rollout.n_samples_per_prompt=1: GRPO without a "
                    "group has no baseline (each advantage is its raw reward, verl's mean 0 / std 1 "
                    "convention); sample several responses per prompt or use reinforce_plus_plus")


def check_decoupled_ppo(algo) -> None:
    """decoupled_ppo weights each token by pi_old / pi_rollout itself, so TIS or MIS would apply
    that ratio a second time; and it needs two distinct policies in that ratio."""
    for key in ("tis", "mis"):
        if algo[key] is not None:
            raise ConfigError(f"algo.policy_loss=decoupled_ppo with algo.{key}={algo[key]}: decoupled PPO "
                              f"already weights each token by pi_old / pi_rollout (dropping those above "
                              f"algo.behav_imp_weight_cap), the ratio algo.{key} would apply a second time. "
                              f"Drop algo.{key}, or use algo.policy_loss=ppo with it")
    if algo.use_rollout_log_probs:
        raise ConfigError("algo.policy_loss=decoupled_ppo with algo.use_rollout_log_probs=true: the proximal "
                          "policy would be the engine's (the behaviour policy itself), every weight 1. "
                          "Set use_rollout_log_probs=false: the trainer's recomputed log-probs are the "
                          "proximal policy")
