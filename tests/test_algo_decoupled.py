"""Decoupled PPO (`algo.policy_loss=decoupled_ppo`): against values computed by hand, its
refusals, and steps of both trainers."""

import math

import pytest
import torch

from relax.algo import behaviour_weights, check_algo
from relax.errors import ConfigError
from relax.sample import Sample
from relax.train.common import STEP_KEYS, MicroBatch, attach_is_weights, objective

from .conftest import build_trainer, make_cfg

# five response tokens: probabilities under the engine that sampled them (behaviour), the
# trainer before the step (proximal) and the weights being trained (current)
BEHAVIOUR = [0.5, 0.2, 0.5, 0.1, 0.1]
PROXIMAL = [0.6, 0.6, 0.4, 0.6, 0.2]   # behaviour weights pi_prox / pi_behav: 1.2, 3, 0.8, 6, 2
CURRENT = [0.66, 0.9, 0.2, 0.6, 0.8]   # PPO ratios pi / pi_prox: 1.1, 1.5, 0.5, 1, 4
ADVANTAGES = [1.0, 1.0, -1.0, -1.0, -1.0]
TOL = 1e-5  # float32 logs and exps of these numbers: a few ulps of values near 1


def test_decoupled_ppo_by_hand():
    """eps_clip 0.2, dual clip 3, cap 5. Per token, w * max(-A r, -A clip(r, 0.8, 1.2)), dual-clipped:
      0: A=+1, r=1.1, w=1.2: -1.1 x 1.2          = -1.32  (unclipped: the only gradient, -A r w)
      1: A=+1, r=1.5, w=3:   -1.2 x 3            = -3.6   (clipped)
      2: A=-1, r=0.5, w=0.8:  0.8 x 0.8          =  0.64  (clipped)
      3: A=-1, r=1,   w=6 > cap: dropped         =  0
      4: A=-1, r=4,   w=2:   min(4, 3) x 2       =  6     (dual clip)
    Each token is a row of its own (one advantage a row), through the trainers' objective."""
    cfg = make_cfg("algo.policy_loss=decoupled_ppo", "algo.behav_imp_weight_cap=5")
    column = lambda values: torch.tensor(values)[:, None]  # noqa: E731
    mask, tokens = torch.ones(5, 1), torch.zeros(5, 1, dtype=torch.long)
    mb = MicroBatch(list(range(5)), tokens, tokens, mask, torch.tensor(ADVANTAGES), column(BEHAVIOUR).log(),
                    mask.clone(), old_log_probs=column(PROXIMAL).log())
    attach_is_weights([mb], cfg.algo)
    assert mb.is_weights.flatten().tolist() == pytest.approx([1.2, 3.0, 0.8, 0.0, 2.0], abs=TOL)
    assert mb.is_flags[1].flatten().tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]  # dropped, not truncated
    assert mb.is_flags[0].sum() == 0
    current = column(CURRENT).log().requires_grad_()
    loss, sums = objective(current, torch.zeros(5, 1), mb, cfg.algo)
    assert loss.flatten().tolist() == pytest.approx([-1.32, -3.6, 0.64, 0.0, 6.0], abs=TOL)
    means = dict(zip(STEP_KEYS, (sums / 5).tolist(), strict=True))  # token means, as a step reports them
    assert means["train/loss"] == pytest.approx(1.72 / 5, abs=TOL)
    assert [means[f"train/pg_clipfrac{k}"] for k in ("", "_lower")] == pytest.approx([2 / 5, 1 / 5], abs=TOL)
    assert means["train/tis_weight_mean"] == pytest.approx(7 / 5, abs=TOL)  # (1.2 + 3 + 0.8 + 0 + 2) / 5
    assert means["train/mis_dropfrac"] == pytest.approx(1 / 5, abs=TOL) and means["train/tis_clipfrac"] == 0
    loss.sum().backward()
    assert current.grad.flatten().tolist() == pytest.approx([-1.32, 0.0, 0.0, 0.0, 0.0], abs=TOL)
    cfg.algo.behav_imp_weight_cap = None  # no cap: token 3 counts 1 x 6
    mb.is_weights = None
    attach_is_weights([mb], cfg.algo)
    loss, _ = objective(current, torch.zeros(5, 1), mb, cfg.algo)
    assert loss.flatten().tolist() == pytest.approx([-1.32, -3.6, 0.64, 6.0, 6.0], abs=TOL)


def test_behaviour_weights_by_hand():
    prox, behav = torch.log(torch.tensor([PROXIMAL])), torch.log(torch.tensor([BEHAVIOUR]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # the last position is not trained
    w, truncated, dropped = behaviour_weights(prox, behav, mask, 5.0)
    assert w.tolist()[0] == pytest.approx([1.2, 3.0, 0.8, 0.0, 0.0], abs=TOL)
    assert dropped.tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0]] and truncated.sum() == 0
    w, _, dropped = behaviour_weights(prox, behav, mask, None)  # no cap: token 3 keeps its 6
    assert w.tolist()[0] == pytest.approx([1.2, 3.0, 0.8, 6.0, 0.0], abs=TOL) and dropped.sum() == 0
    assert math.isfinite(behaviour_weights(torch.tensor([[100.0]]), torch.zeros(1, 1), torch.ones(1, 1),
                                           None)[0].item())  # log-ratio clamped to 20


@pytest.mark.parametrize("overrides, match", [
    (["algo.tis=token"], "algo.tis=token"), (["algo.mis=sequence"], "algo.mis=sequence"),
    (["algo.use_rollout_log_probs=true"], "algo.use_rollout_log_probs"),
    (["algo.behav_imp_weight_cap=1.0"], "algo.behav_imp_weight_cap=1.0"),
    (["algo.behav_imp_weight_cap=-2"], "algo.behav_imp_weight_cap=-2")])
def test_decoupled_ppo_refuses_what_would_weight_twice_or_not_at_all(overrides, match):
    cfg = make_cfg("algo.policy_loss=decoupled_ppo", *overrides)
    with pytest.raises(ConfigError, match=match):
        check_algo(cfg.algo, cfg.rollout)
    check_algo(make_cfg("algo.policy_loss=decoupled_ppo", "algo.behav_imp_weight_cap=null").algo,
               cfg.rollout)


def samples():
    """Eight samples of two response tokens whose engine log-probs are far from the tiny model's."""
    return [Sample(index=i, group_index=i // 4, prompt="", tokens=[5, 6, 7 + i, 8 + i], response_length=2,
                   reward=float(i % 2), loss_mask=[1, 1], rollout_log_probs=[-1.0 - 0.5 * (i % 3), -6.0])
            for i in range(8)]


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_decoupled_ppo_trains_a_step_as_ppo_with_uncapped_tis_and_mis_at_its_cap(tiny_path, backend):
    """Each trainer: decoupled_ppo's steps are bit for bit ppo + algo.tis=token (no truncation) +
    algo.mis=token with mis_high at the cap, the same weights applied the same way; and they are
    steps (the weights move, some tokens dropped, the mean weight not 1)."""
    def steps(*overrides):
        cfg = make_cfg(f"train={backend}", "train.num_steps_per_rollout=2", *overrides)
        trainer = build_trainer(cfg, tiny_path)
        try:
            before = {name: w.clone() for name, w in trainer.named_weights().items()}
            out = trainer.train(0, samples())["steps"]
            after = trainer.named_weights()
        finally:
            trainer.shutdown()
        moved = any(not torch.equal(before[name], after[name]) for name in before)
        return [{k: v for k, v in s.items() if not k.startswith("perf/")} for s in out], moved

    decoupled, moved = steps("algo.policy_loss=decoupled_ppo", "algo.behav_imp_weight_cap=20")
    assert moved and len(decoupled) == 2
    first = decoupled[0]
    assert all(math.isfinite(v) for v in first.values())
    assert first["train/tis_weight_mean"] != 1.0 and first["train/tis_clipfrac"] == 0.0
    assert 0.0 < first["train/mis_dropfrac"] < 1.0  # engine log-probs far from the model's: some above 20
    assert first["train/pg_clipfrac"] == 0.0 < decoupled[1]["train/pg_clipfrac"]  # step 1: pi left pi_prox
    spelled, _ = steps("algo.tis=token", "algo.tis_cap=1e30", "algo.mis=token", "algo.mis_low=0",
                       "algo.mis_high=20")
    assert decoupled == spelled
