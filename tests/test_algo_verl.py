"""Relax's RL math against verl 0.9.1 (`verl/trainer/ppo/core_algos.py`) on the same inputs.

Two references:
- `Verl*` below restate, line for line, verl 0.9.1's `compute_policy_loss_vanilla` (with
  `clip_ratio_c`), `kl_penalty` (`kl_penalty_forward`), `agg_loss`,
  `compute_grpo_outcome_advantage` and `compute_reinforce_plus_plus_outcome_advantage`
  (gamma 1), `compute_policy_loss_gspo`, and `rollout_corr_helper.compute_rollout_correction_weights`
  (TIS); they always run.
- verl's own functions, the same comparisons (`test_against_verl_itself`). verl is no
  Relax dependency (it pins transformers<5.11, among others): the test command installs the
  [verl] extra (tensordict<=0.10.0 and codetiming, what verl's modules import here), then
  `pip install --no-deps verl==0.9.1`. Without verl that test is skipped; in CI it fails
  (tests/extras.py).
Inputs include extreme log-ratios (|Δ| up to 1e4) and groups of one.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from relax.algo import (group_advantages, gspo_loss, kl_estimate, policy_loss, reinforce_plus_plus,
                        rollout_is_weights, sequence_loss_scales)
from relax.algo.losses import LOSS_AGG_MODES

from .extras import VERL, require


# -- verl 0.9.1, restated -------------------------------------------------------------------

def masked_mean(x, mask, axis=None):
    return (torch.where(mask.bool(), x, 0.0) * mask).sum(axis) / (mask.sum(axis) + 1e-8)


def verl_agg_loss(loss_mat, mask, mode, loss_scale_factor):
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = (loss_mat * mask).sum(-1)
        seq_mask = (mask.sum(-1) > 0).float()
        loss = (seq_losses * seq_mask).sum() / seq_mask.sum()
        return loss / loss_scale_factor if mode == "seq-mean-token-sum-norm" else loss
    seq_counts = mask.sum(-1)
    seq_losses = (loss_mat * mask).sum(-1) / (seq_counts + 1e-8)
    seq_mask = (seq_counts > 0).float()
    return (seq_losses * seq_mask).sum() / seq_mask.sum()


def verl_policy_loss_vanilla(old, lp, adv, mask, clip, clip_c, mode, loss_scale_factor):
    neg_kl = torch.clamp(lp - old, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, mask)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - clip, 1 + clip)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), mask)
    pg_losses3 = -adv * clip_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (adv < 0).float(), mask)
    pg_losses = torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1)
    return verl_agg_loss(pg_losses, mask, mode, loss_scale_factor), pg_clipfrac, ppo_kl, pg_clipfrac_lower


def verl_policy_loss_gspo(old, lp, adv, mask, clip, mode, loss_scale_factor):
    negative_approx_kl = lp - old
    seq_lengths = torch.sum(mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = lp - lp.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    seq_importance_ratio = torch.exp(torch.clamp(log_seq_importance_ratio, max=10.0))
    pg_losses1 = -adv * seq_importance_ratio
    pg_losses2 = -adv * torch.clamp(seq_importance_ratio, 1 - clip, 1 + clip)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), mask)
    return verl_agg_loss(pg_losses, mask, mode, loss_scale_factor), clipfrac


def verl_kl_penalty(lp, ref, kind):
    if kind == "k1":
        return lp - ref
    if kind == "k2":
        return 0.5 * (lp - ref).square()
    kl = torch.clamp(ref - lp, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def verl_grpo_advantage(scores, index, epsilon=1e-6, norm=True):
    scores = scores.clone()
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    for i in range(len(scores)):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        if len(group) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            id2mean[idx], id2std[idx] = torch.mean(torch.stack(group)), torch.std(torch.stack(group))
    for i in range(len(scores)):
        scores[i] = (scores[i] - id2mean[index[i]]) / ((id2std[index[i]] + epsilon) if norm else 1)
    return scores


def verl_reinforce_pp(token_level_rewards, mask):  # gamma 1: returns = reward-to-go
    returns = torch.flip(torch.cumsum(torch.flip(token_level_rewards, [1]), 1), [1]) * mask
    mean = masked_mean(returns, mask)
    var = masked_mean((returns - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1)
    return (returns - mean) * torch.rsqrt(var + 1e-8) * mask


def verl_tis_token(old, rollout, mask, threshold):
    return (torch.exp(torch.clamp(old - rollout, -20, 20)) * mask).clamp(max=threshold)


# -- inputs ---------------------------------------------------------------------------------

def batch(seed=0, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 1, 4, 0, 7, 3][:B]
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    old = -torch.rand(B, T, generator=g) * 3
    lp = old + torch.randn(B, T, generator=g) * 0.5
    lp[0, :3] = old[0, :3] + torch.tensor([1e4, -1e4, 30.0])  # extreme log-ratios
    lp[2, 1] = old[2, 1] + 2.0  # a large ratio (e^2 > 3) under a negative advantage: dual clip
    adv = torch.tensor([-1.0, 0.5, -2.0, 1.0, 0.3, -0.7])[:B, None].expand(B, T).contiguous()
    return old, lp, adv, mask


def relax_agg(loss_mat, mask, mode, horizon):
    scales = torch.tensor(sequence_loss_scales(mask.sum(-1).int().tolist(), mode, horizon))
    return (loss_mat * mask * scales[:, None]).sum() / mask.sum()


# -- comparisons ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_matches_verl_vanilla_with_dual_clip(mode):
    old, lp, adv, mask = batch()
    loss, clipfrac, lower, ppo_kl = policy_loss(lp, old, adv, 0.2, 0.2, eps_clip_c=3.0)
    ref_loss, ref_clipfrac, ref_kl, ref_lower = verl_policy_loss_vanilla(old, lp, adv, mask, 0.2, 3.0,
                                                                         mode, 7)
    assert torch.isfinite(loss).all()
    assert lower.sum() > 0  # the dual clip is exercised
    assert relax_agg(loss, mask, mode, 7).item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert masked_mean(clipfrac, mask).item() == pytest.approx(ref_clipfrac.item(), rel=1e-6)
    assert masked_mean(lower, mask).item() == pytest.approx(ref_lower.item(), rel=1e-6)
    assert masked_mean(ppo_kl, mask).item() == pytest.approx(ref_kl.item(), rel=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gspo_matches_verl_with_its_gradient(mode):
    old, lp, adv, mask = batch()
    lp = (old + (lp - old).clamp(-3, 3)).requires_grad_()  # GSPO clamps only above: keep e^ratio sane
    ours, clipfrac, _, _ = gspo_loss(lp, old, adv, mask, 0.2, 0.2)
    ours = relax_agg(ours, mask, mode, 7)
    (ours_grad,) = torch.autograd.grad(ours, lp)
    theirs, their_clipfrac = verl_policy_loss_gspo(old, lp, adv, mask, 0.2, mode, 7)
    (their_grad,) = torch.autograd.grad(theirs, lp)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    assert masked_mean(clipfrac, mask).item() == pytest.approx(their_clipfrac.item(), rel=1e-6)
    assert torch.allclose(ours_grad, their_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_matches_verl_kl_penalty(kind):
    old, lp, _, _ = batch()
    ref = torch.where(torch.arange(7) % 2 == 0, old, old - 25.0)  # |Δ| beyond the ±20 clamp too
    ours, theirs = kl_estimate(lp, ref, kind), verl_kl_penalty(lp, ref, kind)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_grpo_advantages_match_verl_with_a_group_of_one():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 3.0, 0.0, 0.0, 0.0])
    for size in (1, 2, 4):
        index = np.repeat(np.arange(len(rewards) // size), size)
        for norm in (True, False):
            ours = group_advantages(rewards, size, norm)
            assert torch.allclose(ours, verl_grpo_advantage(rewards, index, norm=norm), rtol=1e-6, atol=1e-7)


def test_reinforce_plus_plus_matches_verl():
    mask = batch()[3]
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0, 1.0])
    token_rewards = torch.zeros_like(mask)  # the outcome reward on the last response token
    for b, n in enumerate(mask.sum(-1).int().tolist()):
        if n:
            token_rewards[b, n - 1] = rewards[b]
    theirs = verl_reinforce_pp(token_rewards, mask)
    ours = reinforce_plus_plus(rewards, mask.sum(-1))[:, None] * mask
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_token_tis_matches_verl_rollout_correction():
    old, lp, _, mask = batch()
    algo = OmegaConf.create({"tis": "token", "tis_cap": 2.0, "mis": None, "mis_low": 0.5, "mis_high": 2.0})
    weights, _, _ = rollout_is_weights(old, lp, mask, algo)
    assert torch.allclose(weights, verl_tis_token(old, lp, mask, 2.0), rtol=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_against_verl_itself(mode):
    verl_core = require("verl.trainer.ppo.core_algos", VERL)
    verl_corr = require("verl.trainer.ppo.rollout_corr_helper", VERL)
    old, lp, adv, mask = batch()
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None,
                               "clip_ratio_c": 3.0, "global_batch_info": {"loss_scale_factor": 7}})
    pg_loss, metrics = verl_core.compute_policy_loss_vanilla(old, lp, adv, mask, mode, config)
    loss, clipfrac, lower, _ = policy_loss(lp, old, adv, 0.2, 0.2, eps_clip_c=3.0)
    assert relax_agg(loss, mask, mode, 7).item() == pytest.approx(pg_loss.item(), rel=1e-6)
    assert masked_mean(lower, mask).item() == pytest.approx(metrics["actor/pg_clipfrac_lower"], rel=1e-6)
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        theirs = verl_core.kl_penalty(lp, old, kind)
        assert torch.allclose(kl_estimate(lp, old, kind), theirs, rtol=1e-5, atol=1e-6)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 3.0, 0.0])
    for size in (1, 2, 3):
        index = np.repeat(np.arange(6 // size), size)
        theirs, _ = verl_core.compute_grpo_outcome_advantage(rewards[:, None], torch.ones(6, 1), index)
        assert torch.allclose(group_advantages(rewards, size), theirs[:, 0], rtol=1e-6)
    weights, _ = verl_corr.compute_rollout_correction_weights(old - lp, mask, "token", 2.0)
    algo = OmegaConf.create({"tis": "token", "tis_cap": 2.0, "mis": None, "mis_low": 0.5, "mis_high": 2.0})
    assert torch.allclose(rollout_is_weights(old, lp, mask, algo)[0], weights, rtol=1e-6)
