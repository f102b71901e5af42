"""Finished runs are read-only to Relax (docs/reliability.md, issue 46): a job refused for any
reason writes nothing into a run dir it did not create (status.json, .hydra/ and relax.log
included), a sweep refuses job by job with one line each and exits 2, and what a run writes
(layer dumps included) lands in the job's own dir, never over an existing dump."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from .conftest import make_cfg, relax_cli

SMALL = ("rollout.num_rollout=1", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2")
SWEEP = ("-m", "parallel=single,twin,pp2", *SMALL, "checkpoint.save_interval=null",
         "debug.dump_layers=layers", "hydra.sweep.dir=outputs/sweep")


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder`, hidden ones too, with the sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def error_lines(proc) -> list[str]:
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out[-3000:]
    return [line for line in out.splitlines() if "[ERROR]" in line or line.startswith("relax: error")]


def refused(proc, pattern: str) -> None:
    """Exit 2 and one error line, which names the problem."""
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1 and re.search(pattern, lines[0]), \
        (proc.stdout + proc.stderr)[-3000:]


@pytest.fixture(scope="module")
def done(tmp_path_factory) -> Path:
    """A finished run with a checkpoint: <cwd>/outputs/done."""
    cwd = tmp_path_factory.mktemp("read_only")
    proc = relax_cli(*SMALL, "checkpoint.save_interval=1", "hydra.run.dir=outputs/done", cwd=cwd)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return cwd / "outputs" / "done"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, object]:
    """A sweep whose third job is refused (pp2 needs train=megatron): (the sweep dir, its result)."""
    cwd = tmp_path_factory.mktemp("read_only_sweep")
    return cwd / "outputs" / "sweep", relax_cli(*SWEEP, cwd=cwd)


def test_a_new_run_into_a_finished_run_is_refused_and_changes_nothing(done):
    before = snapshot(done)
    assert {".hydra/config.yaml", "status.json", "relax.log", "metrics.jsonl"} <= set(before)
    refused(relax_cli(*SMALL, "hydra.run.dir=outputs/done", cwd=done.parent.parent), "already holds a run")
    assert snapshot(done) == before


def test_a_refused_resume_into_the_runs_own_dir_changes_nothing(done, tmp_path):
    """Resumed into its own dir, a run may be written; refused (here: an existing layer dump), it is
    left as it was: no .hydra/restart_1, no status, no log line."""
    dump = tmp_path / "layers"
    dump.mkdir()
    (dump / "0_train.pt").write_bytes(b"another run's")
    before, dumped = snapshot(done), snapshot(dump)
    proc = relax_cli("resume=outputs/done", "hydra.run.dir=outputs/done", "rollout.num_rollout=2",
                     f"debug.dump_layers={dump}", cwd=done.parent.parent)
    refused(proc, rf"debug.dump_layers='{dump}' already holds a dump \(0_train.pt\)")
    assert snapshot(done) == before and snapshot(dump) == dumped


def test_a_run_dir_that_a_live_run_writes_is_refused_and_changes_nothing(tmp_path):
    from relax.process import HOST, start_time

    run = tmp_path / "outputs" / "live"
    run.mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({"status": "running", "pid": os.getpid(), "host": HOST,
                                                 "pid_start": start_time(os.getpid())}))
    (run / "relax.log").write_text("[the live run's log]\n")
    before = snapshot(run)
    refused(relax_cli(*SMALL, "hydra.run.dir=outputs/live", cwd=tmp_path), "is being written by a live run")
    assert snapshot(run) == before


def test_a_sweep_says_each_refused_job_in_one_line_goes_on_and_exits_2(sweep):
    """The refused job's line, the others run, a summary and exit 2; the refused job's own dir
    (it created it) records why, as relax compare reports it."""
    sweep_dir, proc = sweep
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 2, (proc.stdout + proc.stderr)[-3000:]
    assert re.search(r"job parallel=pp2: .*train=megatron", lines[0])
    assert lines[1] == "relax: error: 1 job(s) of the sweep ended with an error (above): parallel=pp2"
    status = {job: json.loads((sweep_dir / job / "status.json").read_text())
              for job in ("parallel=single", "parallel=twin", "parallel=pp2")}
    assert [s["status"] for s in status.values()] == ["completed", "completed", "failed"]
    assert "train=megatron" in status["parallel=pp2"]["error"]


def test_each_job_of_a_sweep_dumps_its_layers_into_its_own_dir(sweep):
    """debug.dump_layers=layers is each job's <job dir>/layers, not one dir in the launch
    directory that the jobs overwrite (relax compare --layers then found no difference)."""
    sweep_dir, _ = sweep
    dumps = {job: json.loads((sweep_dir / job / "built.json").read_text())["dump_layers"]
             for job in ("parallel=single", "parallel=twin")}
    assert dumps == {job: str(sweep_dir / job / "layers") for job in dumps}
    single, twin = (snapshot(Path(d)) for d in dumps.values())
    assert set(single) == set(twin) == {"0_train.pt", "0_ref.pt", "0_engine.pt"}
    assert single["0_train.pt"] != twin["0_train.pt"]  # the twin's weights differ by an ulp
    assert not (sweep_dir.parent.parent / "layers").exists()


def test_a_sweep_rerun_into_its_dir_refuses_every_job_and_changes_nothing(sweep):
    sweep_dir, _ = sweep
    before = snapshot(sweep_dir)
    proc = relax_cli(*SWEEP, cwd=sweep_dir.parent.parent)
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 4, (proc.stdout + proc.stderr)[-3000:]
    assert all(re.search(rf"job parallel={job}: .*/parallel={job} already holds a run \(metrics.jsonl\)",
                         line) for job, line in zip(("single", "twin"), lines))
    assert re.search(r"job parallel=pp2: .*train=megatron", lines[2])  # (no run in its dir; not its dir)
    assert lines[3].endswith("3 job(s) of the sweep ended with an error (above): parallel=single, "
                             "parallel=twin, parallel=pp2")
    assert snapshot(sweep_dir) == before  # multirun.yaml too: the same sweep, the same record
    report = relax_cli("compare", str(sweep_dir), "--json", cwd=sweep_dir.parent.parent)
    jobs = {job["layout"]: job for job in json.loads(report.stdout)["jobs"]}
    assert jobs["single"]["status"] == "completed" and jobs["twin"]["status"] == "completed"


def test_a_layer_dump_into_an_existing_dump_is_refused_and_changes_nothing(sweep, tmp_path):
    sweep_dir, _ = sweep
    dump = sweep_dir / "parallel=single" / "layers"
    before = snapshot(dump)
    refused(relax_cli(*SMALL, f"debug.dump_layers='{dump}'", "hydra.run.dir=outputs/other", cwd=tmp_path),
            r"debug.dump_layers='.*/parallel=single/layers' already holds a dump \(0_engine.pt, 0_ref.pt, "
            r"0_train.pt\)")
    assert snapshot(dump) == before


@pytest.mark.parametrize("key, template, names", [
    ("save_rollout_data", "{rollout_id}.pt", "0.pt"), ("save_train_data", "{rollout_id}_{rank}.pt", "0_0.pt")])
def test_saved_data_over_another_runs_files_is_refused_and_a_resume_rewrites_its_own(tmp_path, key, template, names):
    saved = f"debug.{key}='{tmp_path}/data/{template}'"
    first = relax_cli(*SMALL, saved, "checkpoint.save_interval=1", "hydra.run.dir=outputs/first", cwd=tmp_path)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    before = snapshot(tmp_path / "data")
    assert list(before) == [names]
    refused(relax_cli(*SMALL, saved, "hydra.run.dir=outputs/second", cwd=tmp_path),
            rf"debug.{key}='.*/data/{re.escape(template)}' would overwrite another run's files \({names}\)")
    assert snapshot(tmp_path / "data") == before
    resumed = relax_cli(f"resume={tmp_path}/outputs/first", "rollout.num_rollout=2", "hydra.run.dir=outputs/resumed",
                        cwd=tmp_path)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert len(snapshot(tmp_path / "data")) == 2


def test_a_profile_into_another_runs_profile_is_refused_and_changes_nothing(tmp_path):
    first = relax_cli("rollout.num_rollout=2", *SMALL[1:], f"debug.profile_dir={tmp_path}/prof",
                      "hydra.run.dir=outputs/first", cwd=tmp_path)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    before = snapshot(tmp_path / "prof")
    refused(relax_cli("rollout.num_rollout=2", *SMALL[1:], f"debug.profile_dir={tmp_path}/prof",
                      "hydra.run.dir=outputs/second", cwd=tmp_path),
            r"debug.profile_dir='.*/prof' already holds a dump \(rollout_1_rank0.json, rollout_1_rank0.txt\)")
    assert snapshot(tmp_path / "prof") == before


def test_relative_output_paths_land_in_the_run_dir_and_inputs_in_the_launch_dir(tmp_path, monkeypatch):
    from relax.debug.plan import resolve

    monkeypatch.chdir(tmp_path)
    (tmp_path / "replay").mkdir()
    (tmp_path / "replay" / "0.pt").write_bytes(b"")
    run = tmp_path / "outputs" / "run"
    cfg = make_cfg(*SMALL, "debug.load_rollout_data=replay/{rollout_id}.pt", "debug.dump_details=dump",
                   f"debug.save_train_data={tmp_path}/train/{{rollout_id}}_{{rank}}.pt",
                   f"debug.dump_layers={tmp_path}/layers", "debug.profile_dir=profile")
    plan = resolve(cfg, run_dir=run)
    assert (plan.load_rollout_data, plan.dump_dir, plan.save_rollout_data, plan.save_train_data) == (
        str(tmp_path / "replay/{rollout_id}.pt"), run / "dump",
        str(run / "dump/rollout_data/{rollout_id}.pt"), str(tmp_path / "train/{rollout_id}_{rank}.pt"))
    assert (plan.dump_layers, plan.profile_dir) == (str(tmp_path / "layers"), str(run / "profile"))


def test_each_later_job_in_a_run_dir_keeps_its_config_in_its_own_restart_dir(tmp_path):
    """.hydra for the first job, then .hydra/restart_1, restart_2, ...: a resume into the same dir
    never overwrites the config a run was started with."""
    from relax.process import output_subdir

    assert output_subdir(tmp_path) == tmp_path / ".hydra"
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("{}")
    assert output_subdir(tmp_path) == tmp_path / ".hydra" / "restart_1"
    (tmp_path / ".hydra" / "restart_1").mkdir()
    assert output_subdir(tmp_path) == tmp_path / ".hydra" / "restart_2"
