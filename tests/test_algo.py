"""The RL math against values computed by hand."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from relax.algo import (compute_advantages, group_advantages, kl_estimate, masked_sum,
                        policy_loss, token_log_probs)


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, group_size=3)
    # group 1: mean 1/3, unbiased std sqrt(1/3); group 2: all equal -> 0 (std 0 + eps)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    expected = [(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std, 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)


def test_reinforce_is_mean_baseline_only():
    cfg = OmegaConf.create({"advantage_estimator": "reinforce", "grpo_std_normalization": True})
    adv = compute_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), 2, cfg)
    assert adv.tolist() == pytest.approx([0.5, -0.5, 1.0, -1.0])


def test_ppo_clip_loss_by_hand():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.5]]))  # ratios
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, clipfrac, ppo_kl = policy_loss(new, old, adv, eps_clip=0.2, eps_clip_high=0.3)
    # r=1.5,A=+1: max(-1.5, -1.3) = -1.3 (clipped); r=0.5,A=+1: max(-0.5,-0.8) = -0.5
    # r=1.1,A=-1: max(1.1, 1.1) = 1.1;              r=1.5,A=-1: max(1.5, 1.3) = 1.5
    assert loss.tolist()[0] == pytest.approx([-1.3, -0.5, 1.1, 1.5], abs=1e-6)
    assert clipfrac.tolist()[0] == [1.0, 0.0, 0.0, 0.0]
    assert ppo_kl.tolist()[0] == pytest.approx((-new).tolist()[0])


def test_ratio_one_means_no_clipping_and_zero_kl():
    lp = torch.randn(3, 5)
    loss, clipfrac, ppo_kl = policy_loss(lp, lp.clone(), torch.ones(3, 5), 0.2, 0.2)
    assert torch.equal(loss, -torch.ones(3, 5))
    assert clipfrac.sum() == 0 and ppo_kl.abs().sum() == 0


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = lp - ref  # [0.5, -1.0]
    assert kl_estimate(lp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_estimate(lp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    k3 = [math.exp(-x) - 1 + x for x in d.tolist()]
    assert kl_estimate(lp, ref, "k3").tolist() == pytest.approx(k3)
    assert kl_estimate(lp, ref, "low_var_kl").tolist() == pytest.approx(k3)
    far = kl_estimate(torch.tensor([0.0]), torch.tensor([-30.0]), "low_var_kl")
    assert far.item() == 10.0  # clamped
    assert kl_estimate(lp, lp, "low_var_kl").abs().sum() == 0
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_estimate(lp, ref, "k4")


def test_token_log_probs_and_entropy_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # p = [0.25, 0.75]
    lp, ent = token_log_probs(logits, torch.tensor([[1]]))
    assert lp.item() == pytest.approx(math.log(0.75))
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    lp_t, _ = token_log_probs(logits, torch.tensor([[1]]), temperature=0.5)  # logits x2
    assert lp_t.item() == pytest.approx(math.log(9 / 10))


def test_masked_sum():
    x = torch.tensor([[1.0, 2.0, 100.0]])
    assert masked_sum(x, torch.tensor([[1.0, 1.0, 0.0]])).item() == 3.0
