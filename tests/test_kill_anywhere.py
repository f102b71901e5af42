"""Kill anywhere, resume, lose nothing: a run with checkpoint.save_interval=1 is killed with
SIGKILL at 11 moments (6 chosen code sites inside checkpoint writes and around the metrics,
5 random times), each followed by a resume that must finish with the uninterrupted run's
final weights, bit for bit, and each rollout's metrics exactly once. The same for an
asynchronous run (train.max_staleness=2: its checkpoints keep the rollouts made ahead), at 2 of
the sites and a random time, and with partial rollouts (what is in flight too) at 3 others and one.

The runs are the real CLI, forked from a forkserver that imported Relax once (conftest's
`fork_cli`), so each start costs a fork rather than a Python start-up.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relax.logger import read_metrics
from relax.process import describe, read_status

pytestmark = pytest.mark.slow

ROLLOUTS = 5
ARGS = [f"rollout.num_rollout={ROLLOUTS}", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=4", "checkpoint.save_interval=1", "checkpoint.keep_last=2"]
# (site, n): SIGKILL the n-th time the run passes relax.faults.point(site)
SITES = [("checkpoint_start", 1),     # nothing of the first checkpoint written yet
         ("checkpoint_weights", 2),   # weights and optimizer state in .tmp, no history, no state file
         ("checkpoint_state", 3),     # a whole .tmp checkpoint, not yet renamed into place
         ("checkpoint_delete", 1),    # the oldest checkpoint renamed to .old while pruning, half there
         ("checkpoint_renamed", 4),   # the new checkpoint in place, the old one not yet pruned
         ("metrics_written", 3)]      # a rollout's metrics written, its checkpoint not started
RANDOM_KILLS = 5


def final_weights(*run_dirs: Path) -> dict[str, torch.Tensor]:
    """The last rollout's weights, from the first of `run_dirs` that saved them (a run killed
    after its last checkpoint leaves its resumed run nothing to do, and no checkpoint)."""
    last = f"checkpoints/rollout_{ROLLOUTS - 1:06d}/hf/model.safetensors"
    return load_file(str(next(d / last for d in run_dirs if (d / last).is_file())))


def check_finished_like(run_dir: Path, killed_dir: Path, baseline: Path) -> None:
    assert read_status(run_dir)["status"] == "completed", (run_dir / "relax.log").read_text()[-3000:]
    rollouts, steps = read_metrics(run_dir)
    base_rollouts, base_steps = read_metrics(baseline)
    assert [r["rollout_id"] for r in rollouts] == list(range(ROLLOUTS))  # each rollout once
    assert [(s["rollout_id"], s["step"]) for s in steps] == [(i, 0) for i in range(ROLLOUTS)]
    assert [s["train/loss"] for s in steps] == [s["train/loss"] for s in base_steps]
    assert [r["rollout/raw_reward"] for r in rollouts] == [r["rollout/raw_reward"] for r in base_rollouts]
    assert [r.get("rollout/staleness") for r in rollouts] == [r.get("rollout/staleness") for r in base_rollouts]
    weights, expected = final_weights(run_dir, killed_dir), final_weights(baseline)
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)  # bit-equal


def wait(proc: mp.Process, timeout: float = 300) -> int:
    proc.join(timeout)
    assert proc.exitcode is not None, "run did not finish"
    return proc.exitcode


@pytest.mark.parametrize("extra,sites,random_kills", [
    ([], SITES, RANDOM_KILLS),
    # asynchronous: before a checkpoint with rollouts made ahead, and once it is in place (the
    # sites in between are the partial variant's, which keeps rollouts ahead too)
    (["train.max_staleness=2"], [s for s in SITES if s[0] in ("checkpoint_start", "checkpoint_renamed")], 1),
    # partial rollouts: where a checkpoint's responses in flight are half written, or not yet
    (["train.max_staleness=2", "rollout.partial=continue"],
     [s for s in SITES if s[0] in ("checkpoint_weights", "checkpoint_state", "metrics_written")], 1),
], ids=["sync", "max_staleness=2", "partial"])
def test_kill_anywhere_then_resume_matches_the_uninterrupted_run(tmp_path, fork_cli, tiny_path, extra,
                                                                 sites, random_kills):
    args = [*ARGS, *extra]
    base_dir = tmp_path / "baseline"
    base_dir.mkdir()
    proc = fork_cli(base_dir, *args, "hydra.run.dir=outputs/runs/a")
    assert wait(proc) == 0, (base_dir / "out.log").read_text()[-3000:]
    baseline = base_dir / "outputs/runs/a"

    rng = random.Random(13)
    scenarios = [("site", f"kill_at:{site}:{n}") for site, n in sites] + [("random", "")] * random_kills
    killed = []
    for i, (kind, fault) in enumerate(scenarios):
        cwd = tmp_path / f"s{i}"
        cwd.mkdir()
        run_dir = cwd / "outputs/runs/a"
        for attempt in range(4):  # a random moment that came after the run's end is drawn again
            shutil.rmtree(cwd / "outputs", ignore_errors=True)
            proc = fork_cli(cwd, *args, "hydra.run.dir=outputs/runs/a", fault=fault)
            if kind == "random":  # a random moment once the first checkpoint exists
                while proc.is_alive() and not (run_dir / "checkpoints" / "rollout_000000").exists():
                    time.sleep(0.01)
                time.sleep(rng.uniform(0, 1.5) / 2 ** attempt)
                if proc.is_alive():  # (its forkserver reaps it at once: a finished run's pid is free)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGKILL)
            # a kill after status.json said completed (the process still closing) came after the end too
            if wait(proc) == -signal.SIGKILL and (read_status(run_dir) or {}).get("status") == "running":
                break
        assert proc.exitcode == -signal.SIGKILL, f"scenario {i} ({fault or 'random'}) was never killed before the end"
        killed.append(fault or "random")
        assert describe(read_status(run_dir)).startswith("died: status.json says running")
        # Half resume into the killed run's own dir, half into a new one with resume=true.
        target = "outputs/runs/a" if i % 2 == 0 else "outputs/runs/b"
        resume = f"resume={run_dir}" if i % 2 == 0 else "resume=true"
        proc = fork_cli(cwd, *args, f"hydra.run.dir={target}", resume)
        assert wait(proc) == 0, f"scenario {i} ({fault or 'random'}): {(cwd / 'out.log').read_text()[-3000:]}"
        check_finished_like(cwd / target, run_dir, baseline)
    assert len(killed) == len(sites) + random_kills
