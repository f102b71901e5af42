"""Only the work that is needed (relax.train.common.forward_passes): the reference forward runs
where something reads ref_log_probs, the old log-probs come from the training forward when one
optimizer step trains the rollout, or from the engine (algo.use_rollout_log_probs), and none
of it changes a number."""

import pytest
import torch

from relax.errors import ConfigError
from relax.rollout import build_engine
from relax.rollout.generate import generate_rollout
from relax.task import build_task

from .conftest import build_trainer, engine_spec, local_trainer, make_cfg, run_loop

BATCH = ["rollout.rollout_batch_size=8", "train.micro_batch_size=16"]  # 64 samples, 4 micro-batches
PERF = ("perf/step_time", "perf/peak_memory_mb")  # timings and memory: not numbers of the run
REF_ONLY = {"train/kl_loss", "rollout/ref_log_probs", "rollout/kl"}


@pytest.fixture(scope="module")
def rollouts(tiny_path, tokenizer):
    """Three rollouts of fixed data (the engine is never synced: each trainer sees the same)."""
    cfg = make_cfg(*BATCH)
    engine = build_engine(cfg.rollout, engine_spec(cfg, tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    task = build_task(cfg.task, cfg.seed)
    return [generate_rollout(engine, task, tokenizer, cfg.rollout, i, cfg.seed)[0] for i in range(3)]


def as_first_step(trainer) -> None:
    """Make the next rollout run every pass, as the run's first step does (today's full work)."""
    if hasattr(trainer, "call"):  # ranks in their own processes
        trainer.call("__setattr__", "first_step", True)
    else:
        trainer.first_step = True


def train_both(full, lean, rollouts) -> list[tuple[dict, dict]]:
    outs = []
    for rollout_id, samples in enumerate(rollouts):
        as_first_step(full)
        outs.append((full.train(rollout_id, samples), lean.train(rollout_id, samples)))
    return outs


def assert_same_numbers(outs) -> None:
    for rollout_id, (full, lean) in enumerate(outs):
        # the lean trainer leaves out exactly what needs the reference, after its first step
        assert set(full["rollout"]) - set(lean["rollout"]) == (set() if rollout_id == 0 else REF_ONLY - {
            "train/kl_loss"})
        assert lean["rollout"] == {k: full["rollout"][k] for k in lean["rollout"]}
        for a, b in zip(full["steps"], lean["steps"], strict=True):
            assert set(a) - set(b) == (set() if rollout_id == 0 else {"train/kl_loss"})
            assert {k: v for k, v in b.items() if k not in PERF} == {k: a[k] for k in b if k not in PERF}
        assert ("first_step_log_probs" in lean) == (rollout_id == 0)


@pytest.mark.parametrize("algo", [[], ["algo.tis=token", "algo.mis=sequence", "algo.mis_high=1.0000001"]],
                         ids=["ppo", "tis+mis"])
def test_reused_old_log_probs_change_no_number(tiny_path, rollouts, algo):
    """Against a trainer that runs every pass at every rollout (as before): the same losses,
    metrics and weights, bit for bit; the importance weights come from the same log-probs."""
    cfg = make_cfg(*BATCH, *algo)
    full, lean = (local_trainer(cfg, str(tiny_path), ref_model_path=str(tiny_path), pad_token_id=0)
                  for _ in range(2))
    outs = train_both(full, lean, rollouts)
    assert_same_numbers(outs)
    assert outs[-1][0]["steps"][0]["train/grad_norm"] > 0
    if algo:  # the weights did something (some sequences dropped, others weighted)
        assert 0 < outs[1][1]["steps"][0]["train/mis_dropfrac"] < 1
    for (name, a), b in zip(full.model.named_parameters(), lean.model.parameters(), strict=True):
        assert torch.equal(a, b), name


def count_forwards(trainer) -> list[str]:
    """Which model each forward of `trainer` ran on: 'ref', or 'actor' with or without grad."""
    calls, forward = [], trainer._forward

    def counted(model, mb, *args, **kwargs):
        calls.append("ref" if model is trainer.ref else "actor" if torch.is_grad_enabled() else "old")
        return forward(model, mb, *args, **kwargs)
    trainer._forward = counted
    return calls


@pytest.mark.parametrize("overrides,per_rollout", [
    ([], [["ref", "old", "actor"], ["actor"], ["actor"]]),
    (["algo.use_kl_loss=true", "algo.kl_loss_coef=0.1"],
     [["ref", "old", "actor"], ["ref", "actor"], ["ref", "actor"]]),
    (["train.ref_log_probs_interval=2"], [["ref", "old", "actor"], ["actor"], ["ref", "actor"]]),
    (["train.num_steps_per_rollout=2"], [["ref", "old", "actor"], ["old", "actor"], ["old", "actor"]]),
    (["train.num_steps_per_rollout=2", "algo.use_rollout_log_probs=true"],
     [["ref", "old", "actor"], ["actor"], ["actor"]]),
], ids=["default", "kl_loss", "interval", "two_steps", "rollout_log_probs"])
def test_each_pass_runs_only_where_it_is_read(tiny_path, rollouts, overrides, per_rollout):
    trainer = local_trainer(make_cfg(*BATCH, *overrides), str(tiny_path), ref_model_path=str(tiny_path),
                           pad_token_id=0)
    calls = count_forwards(trainer)
    for rollout_id, samples in enumerate(rollouts):
        calls.clear()
        out = trainer.train(rollout_id, samples)
        assert sorted(set(calls)) == sorted(per_rollout[rollout_id])
        assert calls.count("actor") == 4  # every micro-batch trains once
        assert ("rollout/kl" in out["rollout"]) == ("ref" in calls)
        assert ("train/kl_loss" in out["steps"][0]) == ("ref" in calls)


def test_rollout_log_probs_are_the_old_policy(tiny_path, tokenizer):
    """algo.use_rollout_log_probs=true: the PPO ratio is pi_new / pi_rollout, so the first step's
    ppo_kl is the engine/trainer mismatch (a bf16 engine: clearly not 0), and algo.mis still
    masks on pi_train / pi_rollout."""
    cfg = make_cfg(*BATCH, "rollout.dtype=bfloat16")
    samples, _ = generate_rollout(build_engine(cfg.rollout, engine_spec(cfg, tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id)), build_task(cfg.task, cfg.seed), tokenizer,
                                  cfg.rollout, 0, cfg.seed)
    steps = {}
    for name, overrides in (("recomputed", []), ("engine", ["algo.use_rollout_log_probs=true"]),
                            ("engine+mis", ["algo.use_rollout_log_probs=true", "algo.mis=token",
                                            "algo.mis_low=0.999", "algo.mis_high=1.001"])):
        trainer = local_trainer(make_cfg(*BATCH, *overrides), str(tiny_path), ref_model_path=str(tiny_path),
                               pad_token_id=0)
        steps[name] = trainer.train(0, samples)["steps"][0]
    # k1 of the rollout vs the trainer, token mean: what the mismatch metrics measure too
    assert steps["recomputed"]["train/ppo_kl"] == 0.0
    assert abs(steps["engine"]["train/ppo_kl"]) > 1e-5
    assert steps["engine"]["train/mismatch_kl"] == steps["recomputed"]["train/mismatch_kl"] > 1e-5
    assert steps["engine"]["train/grad_norm"] != steps["recomputed"]["train/grad_norm"]
    assert 0 < steps["engine+mis"]["train/mis_dropfrac"] < 1


def test_refusals():
    from relax.algo import check_algo
    from relax.train import check_train_keys

    cfg = make_cfg("algo.use_rollout_log_probs=true", "algo.tis=token")
    with pytest.raises(ConfigError, match="algo.use_rollout_log_probs=true with algo.tis=token"):
        check_algo(cfg.algo, cfg.rollout)
    with pytest.raises(ConfigError, match="train.ref_log_probs_interval=0: expected a positive"):
        check_train_keys(make_cfg("train.ref_log_probs_interval=0").train)


def test_a_run_without_the_reference_still_passes_the_doctor(tmp_path):
    """ref_log_probs at the first rollout only: the guide's checks still see them, the doctor's
    checks pass, the plots draw KL where it exists."""
    from relax.debug.checks import PASS, SKIP, diagnose
    from relax.debug.run_data import load_run

    rollouts, steps = run_loop(tmp_path, "rollout.num_rollout=4", *BATCH, "checkpoint.save_interval=null",
                               "train.ref_log_probs_interval=3", "debug.strict_checks=true")
    assert [("rollout/kl" in r) for r in rollouts] == [True, False, False, True]
    assert rollouts[0]["rollout/log_probs"] == rollouts[0]["rollout/ref_log_probs"]
    assert rollouts[3]["rollout/kl"] != 0.0
    checks = diagnose(load_run(tmp_path))
    assert all(c.verdict in (PASS, SKIP) for c in checks), [(c.id, c.verdict, c.summary) for c in checks]
    assert checks[2].verdict == PASS and checks[3].verdict == PASS
    assert (tmp_path / "reward.png").is_file()


@pytest.mark.parametrize("layout", ["single", pytest.param("cp2", marks=pytest.mark.slow)])
def test_megatron_reused_old_log_probs_change_no_number(tiny_path, rollouts, layout):
    """train=megatron, whose training forward runs in train mode and, under CP, on each rank's
    part of every sequence (the reused log-probs are gathered back into whole sequences)."""
    cfg = make_cfg(*BATCH, "train=megatron", f"parallel={layout}")
    full, lean = build_trainer(cfg, tiny_path), build_trainer(cfg, tiny_path)
    try:
        outs = train_both(full, lean, rollouts)
        assert_same_numbers(outs)
        a, b = full.named_weights(), lean.named_weights()
    finally:
        full.shutdown()
        lean.shutdown()
    assert all(torch.equal(a[name], b[name]) for name in a)
