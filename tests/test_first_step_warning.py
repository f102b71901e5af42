"""A broken first step never passes silently (relax/debug/strict.py): without
debug.strict_checks, garbage responses or a train-vs-rollout mismatch beyond the doctor's own
levels (verdicts.Thresholds) is a WARNING naming `relax doctor` and the run dir; a healthy run
has none."""

from __future__ import annotations

import logging

from relax.debug.checks import diagnose
from relax.debug.run_data import load_run
from relax.debug.strict import first_step_run, first_step_warning
from relax.debug.verdicts import Thresholds

from .conftest import make_cfg, run_loop

SHORT = ["rollout.rollout_batch_size=8", "checkpoint.save_interval=null", "rollout.num_rollout=1"]
HEALTHY = {"rollout_id": 0, "rollout/raw_reward": 0.5, "rollout/invalid_token_ratio": 0.0,
           "rollout/repetition_ratio": 0.0, "rollout/format_ok_ratio": 1.0, "rollout/truncated_ratio": 0.0}


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "relax doctor" in r.getMessage()]


def warning(record: dict, steps: list[dict], cfg, run_dir):
    return first_step_warning(first_step_run(record, steps, cfg.train, cfg.algo, cfg.rollout, [], None, None),
                              run_dir)


def step(diff: float) -> dict:
    return {"rollout_id": 0, "step": 0, "train/grad_norm": 1.0, "train/train_rollout_logprob_abs_diff": diff}


def test_the_warning_uses_the_doctors_levels(tmp_path):
    """Check 5's level (train_rollout_diff_max) and check 1's (invalid_token_ratio), not copies:
    at the level no warning, just past it one, naming the check, the value and the run dir."""
    th, cfg = Thresholds(), make_cfg()
    level = th.train_rollout_diff_max
    assert warning(HEALTHY, [step(level)], cfg, tmp_path) is None
    line = warning(HEALTHY, [step(level * 1.01)], cfg, tmp_path)
    assert line.startswith("the first step is far outside the healthy range: check 5 (train vs rollout "
                           f"log-prob mismatch): abs diff reaches {level * 1.01:.3g} > {level:g}. ")
    assert f"`relax doctor {tmp_path}`" in line and "\n" not in line
    garbage = {**HEALTHY, "rollout/invalid_token_ratio": th.invalid_token_ratio}
    assert warning(garbage, [step(0.0)], cfg, tmp_path) is None
    garbage["rollout/invalid_token_ratio"] = th.invalid_token_ratio + 0.01
    line = warning(garbage, [step(float("nan"))], cfg, tmp_path)
    assert "check 1 (responses at the first rollout): rollout 0: garbage responses (21% of tokens" in line
    assert "check 5 (train vs rollout log-prob mismatch): abs diff reaches nan" in line  # NaN never passes


def test_a_broken_engine_warns_without_strict_checks_and_a_healthy_run_does_not(tmp_path, monkeypatch,
                                                                               caplog):
    """Corrupted engine weights (fault engine_weights): the run goes on to its end, with one
    WARNING naming checks 1 and 5 with the summaries `relax doctor` gives the finished run; the
    same run without the fault has none."""
    caplog.set_level(logging.WARNING)
    run_loop(tmp_path / "healthy", *SHORT)
    assert warnings_of(caplog) == []
    monkeypatch.setenv("RELAX_FAULT", "engine_weights")
    run_loop(tmp_path / "broken", *SHORT)
    (line,) = warnings_of(caplog)
    doctor = {c.id: c for c in diagnose(load_run(tmp_path / "broken"))}
    assert doctor[1].verdict == doctor[5].verdict == "FAIL"
    assert doctor[5].evidence["max"] > Thresholds().train_rollout_diff_max
    assert line == (f"the first step is far outside the healthy range: check 1 (responses at the first "
                    f"rollout): {doctor[1].summary}; check 5 (train vs rollout log-prob mismatch): "
                    f"{doctor[5].summary}. The run goes on; run `relax doctor {tmp_path / 'broken'}` for the "
                    f"causes and the next command (debug.strict_checks=true stops a run here)")
