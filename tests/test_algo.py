"""The RL math against values computed by hand (tests/test_algo_verl.py: against verl)."""

import logging
import math

import pytest
import torch
from omegaconf import OmegaConf

from relax.algo import (check_algo, compute_advantages, group_advantages, gspo_loss, kl_estimate,
                        masked_sum, mismatch_kl, mismatch_ratio, policy_loss, reinforce_plus_plus,
                        rollout_is_weights, sequence_loss_scales, token_log_probs)
from relax.errors import ConfigError

from .conftest import make_cfg


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, group_size=3)
    # group 1: mean 1/3, unbiased std sqrt(1/3); group 2: all equal -> 0 (std 0 + eps)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    expected = [(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std, 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)


def test_groups_of_one_have_mean_zero_std_one():
    rewards = torch.tensor([1.0, 0.0, 2.5])
    assert group_advantages(rewards, 1).tolist() == pytest.approx([1 / (1 + 1e-6), 0.0, 2.5 / (1 + 1e-6)],
                                                                  rel=1e-7)
    assert group_advantages(rewards, 1, normalize_std=False).tolist() == [1.0, 0.0, 2.5]


def test_reinforce_is_mean_baseline_only():
    cfg = OmegaConf.create({"advantage_estimator": "reinforce", "grpo_std_normalization": True})
    adv = compute_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), 2, torch.ones(4), cfg)
    assert adv.tolist() == pytest.approx([0.5, -0.5, 1.0, -1.0])


def test_compute_advantages_passes_the_config_and_token_counts_on():
    """grpo_std_normalization=false leaves GRPO mean-centred only; reinforce_plus_plus whitens
    over the token counts given (not one token a sample)."""
    cfg = OmegaConf.create({"advantage_estimator": "grpo", "grpo_std_normalization": False})
    adv = compute_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), 2, torch.ones(4), cfg)
    assert adv.tolist() == pytest.approx([0.5, -0.5, 1.0, -1.0], abs=1e-6)
    cfg.advantage_estimator = "reinforce_plus_plus"  # the numbers of the test below
    adv = compute_advantages(torch.tensor([1.0, 0.0]), 2, torch.tensor([1, 3]), cfg)
    assert adv.tolist() == pytest.approx([1.5, -0.5], rel=1e-6)


def test_reinforce_plus_plus_whitens_over_tokens_by_hand():
    # rewards 1 (1 token) and 0 (3 tokens): token mean 1/4, biased var 3/16, unbiased x4/3 = 1/4
    adv = reinforce_plus_plus(torch.tensor([1.0, 0.0]), torch.tensor([1, 3]))
    assert adv.tolist() == pytest.approx([0.75 / 0.5, -0.25 / 0.5], rel=1e-6)


def test_ppo_clip_loss_by_hand():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.5]]))  # ratios
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, clipfrac, lower, ppo_kl = policy_loss(new, old, adv, eps_clip=0.2, eps_clip_high=0.3)
    # r=1.5,A=+1: max(-1.5, -1.3) = -1.3 (clipped); r=0.5,A=+1: max(-0.5,-0.8) = -0.5
    # r=1.1,A=-1: max(1.1, 1.1) = 1.1;              r=1.5,A=-1: max(1.5, 1.3) = 1.5 (< 3: no dual clip)
    assert loss.tolist()[0] == pytest.approx([-1.3, -0.5, 1.1, 1.5], abs=1e-6)
    assert clipfrac.tolist()[0] == [1.0, 0.0, 0.0, 0.0]
    assert lower.tolist()[0] == [0.0] * 4
    assert ppo_kl.tolist()[0] == pytest.approx((-new).tolist()[0])


def test_dual_clip_bounds_negative_advantages_by_hand():
    new = torch.log(torch.tensor([[4.0, 0.1, 1.5, 5.0]]))
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0]])
    loss, clipfrac, lower, _ = policy_loss(new, torch.zeros(1, 4), adv, 0.2, 0.2, eps_clip_c=3.0)
    # r=4,A=-1: max(4, 1.2) = 4 -> min(4, 3) = 3 (dual clip); r=0.1,A=-1: max(0.1, 0.8) = 0.8
    # r=1.5,A=+1: max(-1.5, -1.2) = -1.2;                   r=5,A=+1: max(-5, -1.2) = -1.2
    assert loss.tolist()[0] == pytest.approx([3.0, 0.8, -1.2, -1.2], abs=1e-6)
    assert clipfrac.tolist()[0] == [0.0, 1.0, 1.0, 1.0]
    assert lower.tolist()[0] == [1.0, 0.0, 0.0, 0.0]
    off, _, _, _ = policy_loss(new, torch.zeros(1, 4), adv, 0.2, 0.2, eps_clip_c=None)
    assert off[0, 0].item() == pytest.approx(4.0)


def test_extreme_log_ratios_stay_finite():
    new = torch.tensor([[100.0, -100.0, 100.0, -1e4]], requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0]])
    loss, _, _, ppo_kl = policy_loss(new, torch.zeros(1, 4), adv, 0.2, 0.2, eps_clip_c=None)
    assert loss[0, 0].item() == pytest.approx(math.exp(20), rel=1e-6)  # clamped at +-20, finite
    assert ppo_kl.tolist()[0] == [-20.0, 20.0, -20.0, 20.0]
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(new.grad).all()
    dual, _, _, _ = policy_loss(new, torch.zeros(1, 4), adv, 0.2, 0.2, eps_clip_c=3.0)
    assert dual[0, 0].item() == 3.0


def test_gspo_uses_the_sequence_ratio_by_hand():
    adv = torch.ones(2, 2)
    mask = torch.ones(2, 2)
    # row 0: token ratios 2 and 0.5 -> geometric mean 1: no clip, loss -A per token
    # row 1: token ratios 2 and 2 -> sequence ratio 2, clipped to 1.2: loss -1.2, no gradient
    lp = torch.log(torch.tensor([[2.0, 0.5], [2.0, 2.0]])).requires_grad_()
    loss, clipfrac, _, _ = gspo_loss(lp, torch.zeros(2, 2), adv, mask, 0.2, 0.2)
    assert loss.flatten().tolist() == pytest.approx([-1.0, -1.0, -1.2, -1.2], abs=1e-6)
    assert clipfrac.tolist() == [[0.0, 0.0], [1.0, 1.0]]
    loss.sum().backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-1.0, -1.0, 0.0, 0.0], abs=1e-6)


def test_a_ratio_exactly_at_the_dual_clip_bound_is_not_counted_as_clipped():
    """verl counts the dual clip with a strict >: r = eps_clip_c exactly (A = -1) leaves the loss at 3."""
    new = torch.log(torch.tensor([[3.0]]))  # exp(log(3)) == 3.0 in fp32
    loss, _, lower, _ = policy_loss(new, torch.zeros(1, 1), -torch.ones(1, 1), 0.2, 0.2, eps_clip_c=3.0)
    assert loss.item() == 3.0 and lower.item() == 0.0


def test_gspo_reports_the_same_per_token_kl_as_ppo():
    """train/ppo_kl is KL(old || new) per token, old - new, whichever the policy loss."""
    old, new = torch.zeros(1, 3), torch.log(torch.tensor([[2.0, 0.5, 1.0]]))
    gspo_kl = gspo_loss(new, old, torch.ones(1, 3), torch.ones(1, 3), 0.2, 0.2)[3]
    assert gspo_kl.tolist()[0] == pytest.approx([-math.log(2), math.log(2), 0.0], abs=1e-6)
    assert torch.allclose(gspo_kl, policy_loss(new, old, torch.ones(1, 3), 0.2, 0.2)[3])


def test_gspo_caps_the_sequence_log_ratio_at_10():
    """As verl: a stale sequence (mean log-ratio 30) under A = -1 costs e^10 a token, not e^30."""
    lp, old, adv, mask = torch.full((1, 2), 30.0), torch.zeros(1, 2), -torch.ones(1, 2), torch.ones(1, 2)
    loss, _, _, _ = gspo_loss(lp, old, adv, mask, 0.2, 0.2)
    assert loss.tolist()[0] == pytest.approx([math.exp(10)] * 2, rel=1e-6)


def test_ratio_one_means_no_clipping_and_zero_kl():
    lp = torch.randn(3, 5)
    loss, clipfrac, lower, ppo_kl = policy_loss(lp, lp.clone(), torch.ones(3, 5), 0.2, 0.2)
    assert torch.equal(loss, -torch.ones(3, 5))
    assert clipfrac.sum() == 0 and lower.sum() == 0 and ppo_kl.abs().sum() == 0


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = lp - ref  # [0.5, -1.0]
    assert kl_estimate(lp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_estimate(lp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    k3 = [math.exp(-x) - 1 + x for x in d.tolist()]
    assert kl_estimate(lp, ref, "k3").tolist() == pytest.approx(k3)
    assert kl_estimate(lp, ref, "low_var_kl").tolist() == pytest.approx(k3)
    assert kl_estimate(lp, lp, "low_var_kl").abs().sum() == 0
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_estimate(lp, ref, "k4")


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_no_kl_estimator_returns_inf_or_nan_for_finite_inputs(kind):
    lp = torch.tensor([0.0, -1e4, -30.0, 0.0, -50.0])
    ref = torch.tensor([-1e4, 0.0, 0.0, -30.0, -50.0])
    kl = kl_estimate(lp, ref, kind)
    assert torch.isfinite(kl).all(), kl
    if kind in ("k3", "low_var_kl"):  # ref - lp = -1e4, 1e4, 30, -30 -> clamped to +-20, then to [-10, 10]
        assert kl.tolist() == [10.0, 10.0, 10.0, 10.0, 0.0]


def test_loss_aggregation_by_hand():
    counts = [2, 4, 0]  # tokens per sample; the last has none
    losses = [[1.0, 3.0], [2.0, 2.0, 2.0, 6.0], []]
    expected = {"token-mean": 16 / 6, "seq-mean-token-sum": (4 + 12) / 2,
                "seq-mean-token-mean": (2 + 3) / 2, "seq-mean-token-sum-norm": (4 + 12) / 2 / 8}
    for mode, value in expected.items():
        scales = sequence_loss_scales(counts, mode, horizon=8)
        total = sum(f * sum(ls) for f, ls in zip(scales, losses, strict=True))
        assert total / sum(counts) == pytest.approx(value), mode
    assert sequence_loss_scales(counts, "seq-mean-token-mean", 8) == [1.5, 0.75, 0.0]


def test_truncated_and_masked_is_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.9]]))
    rollout = torch.log(torch.tensor([[0.1, 0.9]]))  # token ratios 5 and 1
    mask = torch.ones(1, 2)
    algo = OmegaConf.create({"tis": "token", "tis_cap": 2.0, "mis": None, "mis_low": 0.5, "mis_high": 2.0})
    w, truncated, dropped = rollout_is_weights(old, rollout, mask, algo)
    assert w.tolist()[0] == pytest.approx([2.0, 1.0]) and truncated.tolist() == [[1.0, 0.0]]
    algo.tis = "sequence"  # product 5, capped
    assert rollout_is_weights(old, rollout, mask, algo)[0].tolist()[0] == pytest.approx([2.0, 2.0])
    algo.tis, algo.mis = None, "token"
    w, truncated, dropped = rollout_is_weights(old, rollout, mask, algo)
    assert w.tolist() == [[0.0, 1.0]] and dropped.tolist() == [[1.0, 0.0]]
    algo.mis = None
    assert rollout_is_weights(old, rollout, mask, algo) is None
    assert mismatch_kl(old, rollout).tolist()[0] == pytest.approx([5 - 1 - math.log(5), 0.0], abs=1e-6)


def test_tis_and_mis_together_weight_the_kept_tokens_by_the_capped_ratio():
    """Both on: MIS drops ratios outside [0.2, 4] (5 and 0.1), the kept token keeps its TIS weight 1.5."""
    old, rollout = torch.log(torch.tensor([[5.0, 0.1, 1.5]])), torch.zeros(1, 3)
    algo = OmegaConf.create({"tis": "token", "tis_cap": 2.0, "mis": "token", "mis_low": 0.2, "mis_high": 4.0})
    w, truncated, dropped = rollout_is_weights(old, rollout, torch.ones(1, 3), algo)
    assert w.tolist()[0] == pytest.approx([0.0, 0.0, 1.5], abs=1e-6)
    assert truncated.tolist() == [[1.0, 0.0, 0.0]] and dropped.tolist() == [[1.0, 1.0, 0.0]]


def test_a_ratio_at_the_cap_or_at_the_mis_bounds_is_kept_whole():
    """TIS truncates only above tis_cap; MIS keeps [mis_low, mis_high], ends included (ratios 0.5, 2)."""
    old, rollout = torch.log(torch.tensor([[0.5, 1.0, 2.0]])), torch.zeros(1, 3)
    algo = OmegaConf.create({"tis": "token", "tis_cap": 2.0, "mis": "token", "mis_low": 0.5, "mis_high": 2.0})
    w, truncated, dropped = rollout_is_weights(old, rollout, torch.ones(1, 3), algo)
    assert w.tolist() == [[0.5, 1.0, 2.0]]
    assert truncated.sum() == 0 and dropped.sum() == 0


def test_the_sequence_ratio_is_over_response_tokens_only():
    """Padding's log-probs (7 here) do not enter the product of a sequence's token ratios (2 x 2)."""
    old, rollout = torch.tensor([[math.log(2.0), math.log(2.0), 7.0]]), torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert mismatch_ratio(old, rollout, mask, "sequence").tolist()[0] == pytest.approx([4.0, 4.0, 0.0])
    algo = OmegaConf.create({"tis": "sequence", "tis_cap": 10.0, "mis": None, "mis_low": 0.5,
                             "mis_high": 2.0})
    assert rollout_is_weights(old, rollout, mask, algo)[0].tolist()[0] == pytest.approx([4.0, 4.0, 0.0])


def test_mismatch_ratios_stay_finite_for_extreme_log_ratios():
    """The log-ratio is clamped to +-20 before exp: no Inf, and no Inf x 0 = NaN at padding."""
    old, rollout = torch.tensor([[100.0, 0.0], [-100.0, 3.0]]), torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    token = mismatch_ratio(old, rollout, mask, "token")
    assert token.flatten().tolist() == pytest.approx([math.exp(20), 0.0, math.exp(-20), math.exp(3)],
                                                     rel=1e-6)
    sequence = mismatch_ratio(old, rollout, mask, "sequence")
    assert sequence.flatten().tolist() == pytest.approx([math.exp(20), 0.0, math.exp(-20), math.exp(-20)],
                                                        rel=1e-6)


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


@pytest.mark.parametrize("override, match", [
    ("algo.eps_clip_c=1.0", "eps_clip_c"), ("algo.loss_agg_mode=seq-mean", "loss_agg_mode"),
    ("algo.mis_low=1.5", "mis_low"),  # (a value outside an enum's: tests/test_config.py)
    ("algo.tis_cap=0", "tis_cap"), ("algo.mis_high=1.0", "mis_high")])  # the bounds themselves
def test_bad_algo_config_is_refused(override, match):
    cfg = make_cfg(*override.split())
    with pytest.raises(ConfigError, match=match):
        check_algo(cfg.algo, cfg.rollout)


def test_grpo_without_groups_warns(caplog):
    cfg = make_cfg("rollout.n_samples_per_prompt=1")
    with caplog.at_level(logging.WARNING, logger="relax.algo"):
        check_algo(cfg.algo, cfg.rollout)
    assert "no baseline" in caplog.text


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_loss_aggregation_does_not_depend_on_dp_or_micro_batches(mode):
    """What every trainer does: sum loss x loss_weights over its micro-batches, all-reduce,
    divide by the step's token count. Any split of the step's mini-batch gives one value."""
    from relax.sample import Sample
    from relax.train.common import shard_steps

    lengths = [3, 1, 5, 2, 4, 4, 1, 6]
    samples = [Sample(index=i, group_index=i // 4, prompt="", tokens=[1, 2] + [3] * n, response_length=n,
                      loss_mask=[1] * n, rollout_log_probs=[0.0] * n) for i, n in enumerate(lengths)]
    per_token = {i: [0.1 * i + t for t in range(n)] for i, n in enumerate(lengths)}  # a loss per token

    def aggregate(dp, micro_batch_size, steps=2):
        values = []
        for step in range(steps):
            total, tokens = 0.0, 0.0
            for rank in range(dp):
                for mb in shard_steps(samples, torch.zeros(8), steps, dp, rank, micro_batch_size, 0,
                                      loss_agg_mode=mode, horizon=8)[step]:
                    loss = torch.zeros_like(mb.mask)
                    for b, i in enumerate(mb.indices):
                        loss[b, mb.mask[b] > 0] = torch.tensor(per_token[i])
                    total += masked_sum(loss, mb.loss_weights).item()
                    tokens += mb.mask.sum().item()
            values.append(total / tokens)
        return values

    reference = aggregate(1, 4)
    step0 = [per_token[i] for i in range(4)]  # by hand, step 0 holds samples 0-3
    by_hand = {"token-mean": sum(map(sum, step0)) / 11, "seq-mean-token-sum": sum(map(sum, step0)) / 4,
               "seq-mean-token-mean": sum(sum(x) / len(x) for x in step0) / 4,
               "seq-mean-token-sum-norm": sum(map(sum, step0)) / 4 / 8}
    assert reference[0] == pytest.approx(by_hand[mode], rel=1e-6)
    for dp, mbs in ((2, 1), (2, 2), (4, 1), (1, 3)):
        assert aggregate(dp, mbs) == pytest.approx(reference, rel=1e-6), (dp, mbs)


def test_the_softmax_starts_at_the_first_trained_position_of_any_row():
    """relax/train/common.py computes log-probs from the earliest position any row trains on:
    a position, not a row (here rows 0-2 train on nothing, row 3 from position 1)."""
    from relax.sample import Sample
    from relax.train.common import first_trained_position, make_micro_batch

    samples = [Sample(index=i, group_index=0, prompt="", tokens=[1] * (5 - (i == 3) * 3) + [2, 3],
                      response_length=2,
                      loss_mask=[int(i == 3)] * 2, rollout_log_probs=[0.0] * 2) for i in range(4)]
    mb = make_micro_batch(samples, torch.zeros(4), 0)
    assert mb.mask.nonzero().tolist() == [[3, 1], [3, 2]]
    assert first_trained_position(mb) == 1
    assert first_trained_position(make_micro_batch(samples[:1], torch.zeros(4), 0)) == 0  # nothing trained


def test_each_micro_batch_row_gets_its_own_samples_advantage():
    from relax.sample import Sample
    from relax.train.common import shard_steps

    samples = [Sample(index=i, group_index=i // 2, prompt="", tokens=[1, 2, 3], response_length=1,
                      loss_mask=[1], rollout_log_probs=[0.0]) for i in range(8)]
    advantages = torch.arange(8.0) / 4
    for dp, rank, steps, mine in ((1, 0, 1, range(8)), (2, 1, 2, [6, 7])):  # (rank 1 of 2 at step 1 of 2)
        mbs = shard_steps(samples, advantages, steps, dp, rank, 1, 0)[-1]
        assert [(mb.indices, mb.advantages.tolist()) for mb in mbs] == [([i], [i / 4]) for i in mine]


def test_fixed_shape_length_rounds_up_to_the_multiple():
    """Sequence parallelism needs T a multiple of the TP size: rounded up, never cutting a token."""
    from relax.sample import Sample
    from relax.train.common import shard_steps

    samples = [Sample(index=i, group_index=0, prompt="", tokens=[1, 2] + [3] * (i + 7), response_length=i + 7,
                      loss_mask=[1] * (i + 7), rollout_log_probs=[0.0] * (i + 7))
               for i in range(2)]  # the longest: 10 tokens
    for multiple, length in ((1, 10), (4, 12), (5, 10), (8, 16)):
        (step,) = shard_steps(samples, torch.zeros(2), 1, 1, 0, 2, 0, fixed_shape=True,
                              length_multiple=multiple)
        assert [tuple(mb.tokens.shape) for mb in step] == [(2, length)]
        assert step[0].mask.sum().item() == 7 + 8  # every response token still trained


def test_untrained_response_tokens_count_nowhere():
    """A multi-turn response's tool tokens (loss_mask 0) are in response_length but are no
    tokens of the sample: not for REINFORCE++'s token weighting, not for seq-mean-token-mean."""
    from relax.sample import Sample
    from relax.train.common import advantages_of, shard_steps

    masks = [[1, 0, 0], [1, 1, 1]]  # 1 and 3 trained tokens
    samples = [Sample(index=i, group_index=0, prompt="", tokens=[1, 2, 3, 4, 5], response_length=3,
                      reward=1.0 - i, loss_mask=m, rollout_log_probs=[0.0] * 3) for i, m in enumerate(masks)]
    cfg = OmegaConf.create({"advantage_estimator": "reinforce_plus_plus"})
    # by hand, over the 4 trained tokens: mean 1/4, unbiased variance (9/16 + 3/16) / 3 = 1/4
    assert advantages_of(samples, cfg).tolist() == pytest.approx([0.75 / 0.5, -0.25 / 0.5], abs=1e-6)
    (mb,), = shard_steps(samples, torch.zeros(2), 1, 1, 0, 2, 0, loss_agg_mode="seq-mean-token-mean",
                         horizon=3)
    loss = torch.tensor([[2.0], [6.0]]).expand_as(mb.mask)  # each sample's per-token loss
    # seq-mean-token-mean: (2 + 6) / 2 sequences, once the step's sum is divided by its 4 tokens
    assert (masked_sum(loss, mb.loss_weights) / mb.mask.sum()).item() == pytest.approx(4.0, rel=1e-6)
    assert mb.loss_weights.sum(1).tolist() == pytest.approx([2.0, 2.0], rel=1e-6)


def test_the_objective_and_its_step_sums_by_hand():
    """relax/train/common.py's objective on a micro-batch whose training forward is 0.1 above the
    old log-probs (ratio e^0.1, inside the clip): loss = -A·r - entropy_coef·entropy per token,
    train/loss summed with the loss weights (seq-mean-token-sum: x tokens/sequences), the other
    sums over trained tokens, the train/rollout difference that of this forward."""
    from relax.sample import Sample
    from relax.train.common import STEP_KEYS, attach_is_weights, objective, shard_steps

    samples = [Sample(index=i, group_index=0, prompt="", tokens=[1, 2, 3, 4, 5], response_length=3,
                      reward=float(i), loss_mask=m, rollout_log_probs=[-1.0] * 3)
               for i, m in enumerate([[1, 1, 1], [1, 0, 0]])]
    (mb,), = shard_steps(samples, torch.tensor([0.5, -2.0]), 1, 1, 0, 2, 0,
                         loss_agg_mode="seq-mean-token-sum", horizon=3)
    mb.old_log_probs = torch.full_like(mb.mask, -0.7) * mb.mask
    log_probs, entropy = mb.old_log_probs + 0.1, torch.full_like(mb.mask, 2.0)
    algo = make_cfg("algo.entropy_coef=0.01").algo
    loss, sums = objective(log_probs, entropy, mb, algo)
    r = math.exp(0.1)
    per_token = torch.tensor([[-0.5 * r - 0.02] * 3, [2.0 * r - 0.02] * 3])
    trained = mb.mask[:, 1:4] > 0
    assert torch.allclose(loss[:, 1:4][trained], per_token[trained], rtol=1e-6, atol=0)
    got = dict(zip(STEP_KEYS, sums.tolist(), strict=True))
    weight = 4 / 2  # seq-mean-token-sum: 4 tokens, 2 sequences
    assert got["train/loss"] == pytest.approx(weight * (3 * (-0.5 * r - 0.02) + (2.0 * r - 0.02)), rel=1e-5)
    assert got["train/pg_loss"] == pytest.approx(3 * -0.5 * r + 2.0 * r, rel=1e-5)
    assert got["train/entropy_loss"] == pytest.approx(4 * 2.0, rel=1e-6)
    assert got["train/train_rollout_logprob_abs_diff"] == pytest.approx(4 * 0.4, rel=1e-5)  # |-0.6 - (-1)|
    assert got["train/ppo_kl"] == pytest.approx(4 * -0.1, rel=1e-4)
    # sequence-level TIS (cap far above): each token weighs its sequence's ratio, e^(3 x 0.3) or e^0.3,
    # which leaves no residual against the sequence-level train/rollout ratio
    algo = make_cfg("algo.tis=sequence", "algo.tis_cap=100").algo
    mb.is_weights = mb.is_flags = None
    attach_is_weights([mb], algo)
    got = dict(zip(STEP_KEYS, objective(log_probs, entropy, mb, algo)[1].tolist(), strict=True))
    assert got["train/tis_weight_mean"] == pytest.approx(3 * math.exp(0.9) + math.exp(0.3), rel=1e-5)
    assert got["train/mismatch_residual"] == pytest.approx(0.0, abs=1e-5)


def test_rollout_metrics_first_step_log_probs_and_train_dump_by_hand(tmp_path):
    """What a trainer reports from its micro-batches after the passes (relax/train/common.py):
    token means of log_probs, entropy, ref_log_probs and KL(actor || ref) over trained tokens,
    the first 16 samples' trained log-probs, and the train dump's per-sample columns."""
    from types import SimpleNamespace

    from relax.files import safe_load
    from relax.sample import Sample
    from relax.train.common import TrainLog, make_micro_batch

    n = 18  # 9 groups of 2; an odd sample's second response token is untrained (a tool reply)
    samples = [Sample(index=i, group_index=i // 2, prompt="", tokens=[1, 2, 3 + i, 4], response_length=2,
                      reward=float(i % 2), loss_mask=[1, 1 - i % 2], rollout_log_probs=[-0.3, -0.4])
               for i in range(n)]
    advantages = torch.linspace(-1, 1, n)
    old = {i: [-0.1 * (i + 1), -0.2 * (i + 1)] for i in range(n)}  # per response token
    ref = {i: [lp - 0.01 * (i + 1) for lp in old[i]] for i in range(n)}
    micro_batches = [make_micro_batch(samples[a:a + 9], advantages, 0) for a in (0, 9)]
    for mb in micro_batches:
        mb.old_log_probs, mb.ref_log_probs, mb.entropy = (torch.zeros_like(mb.mask) for _ in range(3))
        for b, i in enumerate(mb.indices):  # the prompt's last position (1) predicts the first response token
            mb.old_log_probs[b, 1:3], mb.ref_log_probs[b, 1:3] = torch.tensor(old[i]), torch.tensor(ref[i])
            mb.entropy[b, 1:3] = torch.tensor([1.0 + i, 2.0])
    trained = [(i, t) for i in range(n) for t in range(2) if samples[i].loss_mask[t]]
    layout = SimpleNamespace(dp_size=1, dp_rank=0, rank=0, writes_data=True)

    template = f"{tmp_path}/{{rollout_id}}_{{rank}}.pt"
    out = TrainLog(layout, with_ref=True).result(micro_batches, True, template, 5, samples, advantages, "k1")
    mean = lambda f: sum(f(i, t) for i, t in trained) / len(trained)  # noqa: E731
    assert out["rollout"] == pytest.approx({
        "rollout/log_probs": mean(lambda i, t: old[i][t]),
        "rollout/entropy": mean(lambda i, t: [1.0 + i, 2.0][t]),
        "rollout/ref_log_probs": mean(lambda i, t: ref[i][t]),
        "rollout/kl": mean(lambda i, t: 0.01 * (i + 1))},
        rel=1e-5)
    assert out["rollout"]["rollout/kl"] > 0
    first = out["first_step_log_probs"]
    assert sorted(first) == list(range(16))
    assert all(first[i] == pytest.approx(old[i][:2 - i % 2], rel=1e-6) for i in range(16))
    dump = safe_load(tmp_path / "5_0.pt")
    assert [r["index"] for r in dump["samples"]] == list(range(n))
    for row in dump["samples"]:
        i = row["index"]
        assert row["advantage"] == pytest.approx(advantages[i].item(), abs=1e-7)
        assert row["kl"] == pytest.approx([0.01 * (i + 1)] * (2 - i % 2), rel=1e-4)
        assert row["log_probs"] == pytest.approx(old[i][:2 - i % 2], rel=1e-6)
        assert row["loss_mask"] == [1, 1 - i % 2]
    without_ref = TrainLog(layout, with_ref=False).result(micro_batches, False, None, 5, samples, advantages,
                                                          "k1")
    assert set(without_ref["rollout"]) == {"rollout/log_probs", "rollout/entropy"}
    assert "first_step_log_probs" not in without_ref


@pytest.mark.parametrize("micro_batch_size, rows", [(64, 4), (3, 3), (4, 4)])
def test_fixed_shape_micro_batches_are_no_larger_than_the_rollout(micro_batch_size, rows):
    """Megatron's schedule needs one [rows, T] for every micro-batch; a rollout smaller than
    train.micro_batch_size is not padded up to it (8 real-model samples in 64 rows made the step
    8x the work), and a short last micro-batch is padded with masked rows."""
    from relax.sample import Sample
    from relax.train.common import shard_steps

    samples = [Sample(index=i, group_index=i // 4, prompt="", tokens=[1, 2] + [3] * (i + 1),
                      response_length=i + 1, loss_mask=[1] * (i + 1), rollout_log_probs=[0.0] * (i + 1))
               for i in range(8)]
    (step,) = shard_steps(samples, torch.zeros(8), 1, 2, 0, micro_batch_size, 0, fixed_shape=True)
    assert {tuple(mb.tokens.shape) for mb in step} == {(rows, 10)}  # rank 0: 4 samples, longest overall 10
    assert sum(int((mb.mask.sum(1) > 0).sum()) for mb in step) == 4  # padding rows train on nothing
