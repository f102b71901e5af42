"""`relax mismatch`: for a fault of each kind (an engine class of tests/mismatch_engines.py through
rollout._target_, another engine dtype, train.async's stale weights) the tool names the factor it
injected first; `relax doctor` prints that factor under its failing check 5."""

from __future__ import annotations

import json

import pytest

from .conftest import only_run_dir, relax_cli

TINY = ["rollout.rollout_batch_size=4", "debug=dump"]
ONE = ["rollout.num_rollout=1", "checkpoint.save_interval=null"]
ENGINE = "rollout._target_=tests.mismatch_engines."

FAULTS = {  # factor -> (the run's overrides, the rollout the tool picks, what the engine side reads)
    "engine dtype": ([*ONE, "rollout.dtype=bfloat16"], 0, "bfloat16"),
    "KV-cache decode vs full forward": ([*ONE, ENGINE + "LossyCacheEngine"], 0, "KV-cache decode"),
    "batch composition": ([*ONE, ENGINE + "BatchVariantEngine"], 0, "in its batch"),
    "logits processing": ([*ONE, ENGINE + "HotEngine"], 0, "temperature 0.7"),
    "weights' version": (["rollout.num_rollout=2", "train.async=true", "checkpoint.save_interval=1",
                          "checkpoint.keep_last=null"], 1, "initial model"),
}


def run_with(tmp_path, overrides) -> object:
    proc = relax_cli(*TINY, *overrides, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return only_run_dir(tmp_path)


@pytest.mark.parametrize("factor", FAULTS)
def test_mismatch_names_the_injected_factor_first(factor, tmp_path, tiny_path):
    overrides, rollout_id, engine_side = FAULTS[factor]
    run = run_with(tmp_path, overrides)
    proc = relax_cli("mismatch", str(run), "--json", "--out", str(tmp_path / "plots"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    top, *rest = report["factors"]
    assert report["rollout_id"] == rollout_id and report["mismatch"] > 1e-4
    assert report["replica_error"] < 1e-3 * report["mismatch"]  # the engine rebuilt: its log-probs
    assert (top["name"], top["engine"]) == (factor, engine_side), report
    assert top["share"] > 0.9 and all(f["share"] is not None and f["share"] < 0.5 for f in rest), report
    assert (tmp_path / "plots" / f"mismatch_{rollout_id}.png").is_file()
    kernels = factor in ("engine dtype", "KV-cache decode vs full forward", "batch composition")
    assert ("rollout.true_on_policy=true" in (report["cure"] or "")) == kernels


def test_doctor_prints_the_top_factor_under_its_failing_mismatch_check(tmp_path, tiny_path):
    run = run_with(tmp_path, [*ONE, ENGINE + "HotEngine"])
    proc = relax_cli("doctor", str(run), "--train-rollout-diff-max", "0.01", "--out", str(tmp_path / "d"),
                     cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("[FAIL] 5."))
    after = next(line for line in lines[at + 1:] if not line.startswith("    likely cause") and
                 not line.startswith("    next"))
    assert after.startswith("    relax mismatch: top factor at rollout 0: logits processing"), proc.stdout


def test_mismatch_refuses_a_run_without_train_data(tmp_path, tiny_path):
    run = run_with(tmp_path, [*ONE, "debug=none"])
    proc = relax_cli("mismatch", str(run), cwd=tmp_path)
    assert proc.returncode == 2 and "no train data (run with debug=dump" in proc.stderr, proc.stderr
