"""A resume is the same experiment (issue 46): `relax resume=<run or checkpoint>` composes the
run's own config, new overrides apply on top and are logged as changes, and a change that
would make another experiment is refused at start-up (exit 2, nothing written into the run)
unless `resume_allow_changes` names it."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal

import pytest
from omegaconf import OmegaConf

from relax.checkpoint.experiment import changes, override_key, resume_argv, saved_in
from relax.files import read_jsonl
from relax.logger import read_metrics
from relax.process import read_status

from .conftest import relax_cli, start_cli
from .test_process import wait_for

# not the defaults (400 rollouts of 32 prompts x 8 samples): a resume that ran the defaults shows
RUN = ["rollout.num_rollout=12", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
       "checkpoint.save_interval=1", "seed=7", "hydra.run.dir=outputs/run"]


def tree(folder) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def samples_per_rollout(run_dir) -> list[int]:
    return [r["num_samples"] for r in read_jsonl(run_dir / "samples.jsonl")]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run stopped by SIGTERM after a rollout (its checkpoint written), as a user stops one."""
    cwd = tmp_path_factory.mktemp("resume")
    proc = start_cli(cwd, *RUN)
    wait_for(cwd / "outputs/run/relax.log", "Finish rollout 1")
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(120)
    assert proc.exitcode == 128 + signal.SIGTERM, (cwd / "out.log").read_text()[-3000:]
    return cwd


def copy(stopped, tmp_path):
    shutil.copytree(stopped / "outputs", tmp_path / "outputs")
    return tmp_path / "outputs/run"


def test_the_stop_messages_resume_command_continues_the_runs_own_config(stopped, tmp_path):
    run = copy(stopped, tmp_path)
    message = read_status(run)["error"]
    printed = re.search(r"continue with (resume=\S+)$", message).group(1)
    assert printed == f"resume={stopped / 'outputs/run'}"
    done = relax_cli(printed.replace(str(stopped), str(tmp_path)), "hydra.run.dir=outputs/resumed", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = tmp_path / "outputs/resumed"
    # the run's 12 rollouts of 2 prompts x 2 samples, not the defaults' 400 of 32 x 8
    assert [r["rollout_id"] for r in read_metrics(resumed)[0]] == list(range(12))
    assert samples_per_rollout(resumed)[-1] == 4
    config = OmegaConf.load(resumed / ".hydra/config.yaml")  # what ran, as Hydra records it
    assert (config.seed, config.rollout.rollout_batch_size, config.rollout.num_rollout) == (7, 2, 12)
    assert "changes from the run: none" in (resumed / "relax.log").read_text()


def test_more_rollouts_are_a_listed_change(stopped, tmp_path):
    run = copy(stopped, tmp_path)
    done = relax_cli(f"resume={run}", "rollout.num_rollout=13", "hydra.run.dir=outputs/more", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    log = (tmp_path / "outputs/more/relax.log").read_text()
    assert "resume: rollout.num_rollout=13 (the run: 12)" in log
    assert [r["rollout_id"] for r in read_metrics(tmp_path / "outputs/more")[0]] == list(range(13))
    assert samples_per_rollout(tmp_path / "outputs/more")[-1] == 4


@pytest.mark.parametrize("overrides, expect", [
    (["seed=8"], r"resume: seed=8 \(the run: 7\) would make another experiment"),
    (["rollout.rollout_batch_size=8", "train.lr=0.1"],
     r"rollout.rollout_batch_size=8 \(the run: 2\), train.lr=0.1 \(the run: 0.0003\) would make another "
     r"experiment .*resume_allow_changes=\[rollout.rollout_batch_size,train.lr\]"),
    (["algo.use_kl_loss=true"], r"algo.use_kl_loss=True \(the run: False\)"),
    (["model.path=/elsewhere", "resume_allow_changes=[model]"],
     r"resume: model.path=/elsewhere differs from the run's None .* so model.path cannot change"),
])
def test_a_change_of_experiment_is_refused_and_the_run_left_as_it_was(stopped, tmp_path, overrides, expect):
    run = copy(stopped, tmp_path)
    before = tree(run)
    done = relax_cli(f"resume={run}", *overrides, "hydra.run.dir=outputs/refused", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    out = done.stdout + done.stderr
    errors = [line for line in out.splitlines() if "ERROR" in line or "error:" in line]
    assert len(errors) == 1 and re.search(expect, errors[0]), out[-3000:]
    assert tree(run) == before
    assert not (tmp_path / "outputs/refused/built.json").exists()


def test_an_allowed_change_carries_on_into_later_resumes(stopped, tmp_path):
    run = copy(stopped, tmp_path)
    done = relax_cli(f"resume={run}", "train.lr=0.0001", "resume_allow_changes=[train]",
                     "rollout.num_rollout=13", "hydra.run.dir=outputs/lr", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resume: train.lr=0.0001 (the run: 0.0003)" in (tmp_path / "outputs/lr/relax.log").read_text()
    saved = tmp_path / "outputs/lr/checkpoints/rollout_000012"
    assert OmegaConf.load(saved / "config.yaml").train.lr == 0.0001
    # the next resume continues the changed experiment, with nothing to allow
    again = relax_cli(f"resume={saved}", "rollout.num_rollout=14", "hydra.run.dir=outputs/again", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert OmegaConf.load(tmp_path / "outputs/again/.hydra/config.yaml").train.lr == 0.0001
    # ... and resume_allow_changes itself is not carried: a further change must be named again
    other = relax_cli(f"resume={saved}", "train.lr=0.0002", "hydra.run.dir=outputs/other", cwd=tmp_path)
    assert other.returncode == 2 and "train.lr=0.0002 (the run: 0.0001)" in other.stdout + other.stderr


def test_a_checkpoint_copied_out_of_its_run_resumes_its_own_experiment(stopped, tmp_path):
    """The branch-off recipe (copy the checkpoint, resume the copy): the copy holds the config."""
    ckpt = tmp_path / "branch"
    shutil.copytree(sorted((stopped / "outputs/run/checkpoints").glob("rollout_*"))[-1], ckpt)
    done = relax_cli(f"resume={ckpt}", "hydra.run.dir=outputs/branch", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert samples_per_rollout(tmp_path / "outputs/branch")[-1] == 4
    refused = relax_cli(f"resume={ckpt}", "seed=1", "hydra.run.dir=outputs/no", cwd=tmp_path)
    assert refused.returncode == 2 and "seed=1 (the run: 7)" in refused.stdout + refused.stderr


def test_resume_argv_puts_the_runs_overrides_first_and_the_new_ones_win(tmp_path):
    (tmp_path / "config.yaml").write_text("seed: 1\n")
    OmegaConf.save(OmegaConf.create(["model=smollm2", "seed=7", "resume=/old", "+x.y=1",
                                     "resume_allow_changes=[seed]"]), tmp_path / "overrides.yaml")
    assert saved_in(tmp_path) == tmp_path
    assert resume_argv(["resume=/new", "seed=8", "-m"], tmp_path) == \
        ["model=smollm2", "+x.y=1", "resume=/new", "seed=8", "-m"]
    assert resume_argv(["resume=/new"], None) == ["resume=/new"]
    assert [override_key(o) for o in ("+a.b=1", "~c", "++d=2")] == ["a.b", "c", "d"]


def test_changes_are_the_leaves_that_differ_and_keys_only_one_side_has_are_not():
    old = OmegaConf.create({"a": {"b": 1, "c": [1, 2]}, "gone": 1, "x": "${a.b}"})
    new = OmegaConf.create({"a": {"b": 1, "c": [1, 3]}, "added": 2, "x": "${a.b}"})
    assert changes(old, new) == {"a.c": ([1, 2], [1, 3])}


def test_saved_in_takes_a_runs_newest_restart(tmp_path):
    for sub in (".hydra", ".hydra/restart_2", ".hydra/restart_10"):
        (tmp_path / sub).mkdir(parents=True)
        (tmp_path / sub / "config.yaml").write_text("seed: 1\n")
    assert saved_in(tmp_path) == tmp_path / ".hydra/restart_10"
    assert saved_in(tmp_path / "nothing") is None


def test_resume_true_composes_the_newest_checkpoints_experiment(stopped, tmp_path):
    shutil.copytree(stopped / "outputs/run", tmp_path / "outputs/runs/old")
    done = relax_cli("resume=true", "seed=9", "hydra.run.dir=outputs/runs/new", cwd=tmp_path)
    assert done.returncode == 2 and "seed=9 (the run: 7)" in done.stdout + done.stderr
    done = relax_cli("resume=true", "hydra.run.dir=outputs/runs/new2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert OmegaConf.load(tmp_path / "outputs/runs/new2/.hydra/config.yaml").rollout.rollout_batch_size == 2
