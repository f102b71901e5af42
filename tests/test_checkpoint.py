"""Checkpoints survive crashes at any moment: leftovers are cleaned, incomplete checkpoints are
skipped on resume, disk-full is a clear error, and keep_last means what it says."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from relax import checkpoint as ckpt
from relax.errors import ConfigError, DiskFull
from relax.model import load_tokenizer

from .conftest import local_trainer, make_cfg, run_loop


@pytest.fixture(scope="module")
def trainer(tiny_path):

    return local_trainer(make_cfg(), str(tiny_path))


def save(trainer, tiny_path, run_dir: Path, rollout_id: int, keep_last=2) -> Path:
    return ckpt.save_checkpoint(trainer, load_tokenizer(tiny_path), run_dir, rollout_id, tiny_path,
                                keep_last, {"train.backend": "torch"}, (make_cfg(), []))


def names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.mark.parametrize("key,value", [("keep_last", -1), ("keep_last", 0), ("save_interval", 0)])
def test_nonsense_checkpoint_settings_are_refused_before_building(tmp_path, key, value):
    with pytest.raises(ConfigError, match=f"checkpoint.{key}={value}"):
        run_loop(tmp_path / "run", f"checkpoint.{key}={value}")
    assert not (tmp_path / "run" / "built.json").exists()


def test_a_loaded_checkpoint_restores_rng_skipped_steps_and_ends_the_first_step(trainer, tiny_path, tmp_path):
    """The trainer side of a resume (relax/train/torch_trainer.py): the torch RNG and the count of
    skipped non-finite steps continue, and the guide's first-step checks (log_probs equal to the
    reference's) no longer apply: a resumed actor is not its reference."""
    import torch

    from relax.sample import Sample

    trainer.skipped_steps = 3
    try:
        torch.manual_seed(123)
        saved_rng = torch.get_rng_state()
        trainer.save_checkpoint(str(tmp_path))
    finally:
        trainer.skipped_steps = 0
    resumed = local_trainer(make_cfg(), str(tiny_path))
    assert resumed.first_step and not torch.equal(torch.get_rng_state(), saved_rng)
    resumed.load_checkpoint(str(tmp_path))
    assert torch.equal(torch.get_rng_state(), saved_rng)
    assert resumed.skipped_steps == 3 and not resumed.first_step
    samples = [Sample(index=i, group_index=0, prompt="", tokens=[5, 6, 7 + i, 8], response_length=2,
                      reward=float(i), loss_mask=[1, 1], rollout_log_probs=[-1.0, -1.0]) for i in range(2)]
    out = resumed.train(2, samples)
    assert "first_step_log_probs" not in out and out["steps"][0]["train/skipped_steps"] == 3


def test_keep_last_keeps_that_many_and_null_keeps_all(trainer, tiny_path, tmp_path):
    for i in range(4):
        save(trainer, tiny_path, tmp_path / "two", i, keep_last=2)
        save(trainer, tiny_path, tmp_path / "all", i, keep_last=None)
    assert names(tmp_path / "two") == ["rollout_000002", "rollout_000003"]
    assert names(tmp_path / "all") == [f"rollout_00000{i}" for i in range(4)]
    state = ckpt.read_state(tmp_path / "two" / "checkpoints" / "rollout_000003")
    assert state["rollout_id"] == 3 and "hf/model.safetensors" in state["files"]


def test_crash_leftovers_are_cleaned_and_incomplete_checkpoints_skipped(trainer, tiny_path, tmp_path):
    run = tmp_path / "run"
    for i in range(3):
        save(trainer, tiny_path, run, i, keep_last=None)
    root = run / "checkpoints"
    # A crash while pruning rollout_000000 (half deleted), while writing rollout_000003 (a .tmp),
    # and rollout_000002's state file corrupted: resume takes rollout_000001.
    (root / "rollout_000000" / "hf" / "model.safetensors").unlink()
    shutil.copytree(root / "rollout_000001", root / ".rollout_000003.tmp")
    shutil.copytree(root / "rollout_000001", root / ".rollout_000001.old")
    (root / "rollout_000002" / ckpt.STATE_FILE).write_text('{"rollout_id": 2, "fil')
    assert ckpt.find_checkpoint(str(run), tmp_path) == root / "rollout_000001"
    assert ckpt.find_checkpoint(True, tmp_path) == root / "rollout_000001"
    with pytest.raises(ConfigError, match="incomplete checkpoint .*model.safetensors is missing"):
        ckpt.find_checkpoint(str(root / "rollout_000000"), tmp_path)
    # A truncated file is caught by its recorded size, too.
    weights = root / "rollout_000001" / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert ckpt.incomplete_reason(root / "rollout_000001") == "hf/model.safetensors is missing or truncated"
    # The next save removes the leftovers and prunes by complete checkpoints only.
    save(trainer, tiny_path, run, 3, keep_last=1)
    assert names(run) == ["rollout_000003"]


def test_saving_the_same_rollout_again_replaces_it_whole(trainer, tiny_path, tmp_path):
    first = save(trainer, tiny_path, tmp_path, 5)
    (first / "stray.txt").write_text("from the first save")
    again = save(trainer, tiny_path, tmp_path, 5)
    assert again == first and not (again / "stray.txt").exists() and ckpt.incomplete_reason(again) is None


Usage = namedtuple("Usage", "total used free")


def test_low_disk_prunes_early_then_fails_clearly(trainer, tiny_path, tmp_path, monkeypatch):
    for i in range(3):
        save(trainer, tiny_path, tmp_path, i, keep_last=3)
    newest = tmp_path / "checkpoints" / "rollout_000002"
    size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    # Room for one more only once the oldest is gone: with keep_last=2, the save prunes it first.
    free = iter([size // 2, 2 * size, 2 * size, 2 * size, 2 * size])
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda _: Usage(0, 0, next(free)))
    save(trainer, tiny_path, tmp_path, 3, keep_last=2)
    assert names(tmp_path) == ["rollout_000002", "rollout_000003"]
    # No room at all: what keep_last=1 would prune goes, the newest never; the error names the
    # path and the sizes, and nothing half-written is left.
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda _: Usage(0, 0, 1000))
    with pytest.raises(DiskFull, match=r"no space for a checkpoint in .*: about \d+ MiB needed, 0 MiB free"):
        save(trainer, tiny_path, tmp_path, 4, keep_last=1)
    assert names(tmp_path) == ["rollout_000003"]


def test_disk_full_mid_write_leaves_no_half_checkpoint(trainer, tiny_path, tmp_path, monkeypatch):
    def full(path):
        Path(path).mkdir(parents=True)
        (Path(path) / "partial.bin").write_bytes(b"x" * 10)
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(path) / "partial.bin"))

    monkeypatch.setattr(trainer, "save_checkpoint", full)
    with pytest.raises(DiskFull, match="disk full while writing checkpoint .*rollout_000007 .*partial.bin"):
        save(trainer, tiny_path, tmp_path, 7)
    assert names(tmp_path) == []


def test_disk_full_in_a_run_exits_2_with_the_message(tmp_path, monkeypatch):
    from .conftest import relax_cli

    proc = relax_cli("rollout.num_rollout=1", "rollout.rollout_batch_size=4", cwd=tmp_path,
                     env={"RELAX_FAULT": "disk_full"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "disk full while writing checkpoint" in proc.stderr + proc.stdout
    status = json.loads(next(tmp_path.glob("outputs/runs/*/status.json")).read_text())
    assert status["status"] == "failed" and "disk full" in status["error"]


def test_resumed_runs_hold_each_rollout_once_in_a_new_or_the_same_dir(tmp_path):
    common = ["rollout.num_rollout=4", "rollout.rollout_batch_size=4", "checkpoint.save_interval=2",
              "checkpoint.keep_last=null"]
    rollouts, steps = run_loop(tmp_path / "a", *common)
    first = (tmp_path / "a" / "first_step_log_probs.pt").read_bytes()
    # As if the run died after rollout 3's metrics were written but before its checkpoint.
    shutil.rmtree(tmp_path / "a" / "checkpoints" / "rollout_000003")
    for run_dir in (tmp_path / "b", tmp_path / "a"):  # a new run dir, then the crashed run's own
        again_rollouts, again_steps = run_loop(run_dir, *common, f"resume={tmp_path / 'a'}")
        assert [r["rollout_id"] for r in again_rollouts] == [0, 1, 2, 3]
        assert [(s["rollout_id"], s["step"]) for s in again_steps] == [(i, 0) for i in range(4)]
        assert again_steps == steps[:2] + again_steps[2:]  # rows up to the checkpoint, verbatim
        for a, b in zip(again_steps, steps, strict=True):
            assert a["train/loss"] == b["train/loss"] and a["train/grad_norm"] == b["train/grad_norm"]
        assert (run_dir / "first_step_log_probs.pt").read_bytes() == first
        samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
        assert [s["rollout_id"] for s in samples] == [0, 1, 2, 3]  # each rollout's sample once, too


class Crash(BaseException):
    """A SIGKILL at a faults.point site, in-process: nothing after it runs, no handler cleans up."""


def crash_at(monkeypatch, site: str) -> None:
    def point(name):
        if name == site:
            raise Crash(name)

    monkeypatch.setattr(ckpt.faults, "point", point)


def test_a_crash_while_pruning_leaves_only_a_hidden_leftover_that_the_next_save_removes(
        trainer, tiny_path, tmp_path, monkeypatch):
    """The checkpoint being pruned is renamed out of sight before it is deleted: a crash there
    leaves no half checkpoint under a rollout_* name, and the next save clears the leftover."""
    for i in range(2):
        save(trainer, tiny_path, tmp_path, i, keep_last=None)
    crash_at(monkeypatch, "checkpoint_delete")
    with pytest.raises(Crash):
        save(trainer, tiny_path, tmp_path, 2, keep_last=1)
    assert names(tmp_path) == [".rollout_000000.old", "rollout_000001", "rollout_000002"]
    assert [c.name for c in ckpt.scan(tmp_path)[0]] == ["rollout_000001", "rollout_000002"]
    monkeypatch.undo()
    save(trainer, tiny_path, tmp_path, 3, keep_last=1)
    assert names(tmp_path) == ["rollout_000003"]


def test_the_space_needed_is_the_newest_checkpoints_whole_size_with_headroom(trainer, tiny_path, tmp_path,
                                                                             monkeypatch):
    newest = save(trainer, tiny_path, tmp_path, 0, keep_last=None)
    size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())  # hf/ and history/ too
    free = int(size * ckpt.HEADROOM) - 1
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda _: Usage(0, 0, free))
    with pytest.raises(DiskFull, match=rf"about {int(size * ckpt.HEADROOM) / 2**20:.0f} MiB needed, "
                                       rf"{free / 2**20:.0f} MiB free"):
        save(trainer, tiny_path, tmp_path, 1, keep_last=None)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda _: Usage(0, 0, free + 1))
    save(trainer, tiny_path, tmp_path, 1, keep_last=None)
    assert names(tmp_path) == ["rollout_000000", "rollout_000001"]


@pytest.mark.parametrize("state,reason", [
    ({"rollout_id": 3, "ref_model_path": "/m"}, "relax_state.json lists no files"),
    ({"rollout_id": "3", "ref_model_path": "/m", "files": {}}, "relax_state.json unreadable"),
    ({"rollout_id": 3, "files": {}}, "relax_state.json unreadable"),
    ([3], "relax_state.json unreadable"),
])
def test_a_state_file_without_its_fields_makes_the_checkpoint_incomplete(tmp_path, state, reason):
    """A checkpoint counts as complete only through a state file that lists its files (an
    integer rollout_id, a reference path): anything else is skipped on resume."""
    checkpoint = tmp_path / "checkpoints" / "rollout_000003"
    checkpoint.mkdir(parents=True)
    (checkpoint / ckpt.STATE_FILE).write_text(json.dumps(state))
    assert ckpt.incomplete_reason(checkpoint).startswith(reason)
    assert ckpt.scan(tmp_path) == ([], [checkpoint])


def test_low_disk_prunes_early_all_that_keep_last_would_prune_after_the_save(trainer, tiny_path, tmp_path,
                                                                             monkeypatch):
    """keep_last=3 keeps the new checkpoint and the two newest before it: the oldest of three
    may go before the save, when only that makes room."""
    for i in range(3):
        save(trainer, tiny_path, tmp_path, i, keep_last=None)

    def usage(_):  # room once one checkpoint is gone
        return Usage(0, 0, 0 if len(list((tmp_path / "checkpoints").glob("rollout_*"))) > 2 else 10**15)

    monkeypatch.setattr(ckpt.shutil, "disk_usage", usage)
    save(trainer, tiny_path, tmp_path, 3, keep_last=3)
    assert names(tmp_path) == ["rollout_000001", "rollout_000002", "rollout_000003"]


def test_a_truncated_history_file_makes_the_checkpoint_incomplete(trainer, tiny_path, tmp_path):
    """history/ is recorded with its sizes like the weights: a resume from a checkpoint whose
    metrics were cut would lose rollouts."""
    (tmp_path / "metrics.jsonl").write_text('{"rollout_id": 0, "rollout/raw_reward": 0.5}\n' * 3)
    checkpoint = save(trainer, tiny_path, tmp_path, 0)
    saved = checkpoint / "history" / "metrics.jsonl"
    assert saved.read_text() == (tmp_path / "metrics.jsonl").read_text()
    saved.write_text(saved.read_text()[:-10])
    assert ckpt.incomplete_reason(checkpoint) == "history/metrics.jsonl is missing or truncated"


def fake_checkpoint(run_dir: Path, rollout_id: int) -> Path:
    """A complete checkpoint as scan() sees it: a state file listing its (no) files."""
    path = run_dir / "checkpoints" / f"rollout_{rollout_id:06d}"
    path.mkdir(parents=True)
    (path / ckpt.STATE_FILE).write_text(json.dumps({"rollout_id": rollout_id, "ref_model_path": "/m",
                                                    "files": {}}))
    return path


def test_resume_takes_a_runs_newest_checkpoint_and_resume_true_the_one_written_last(tmp_path):
    """resume=<run dir>: its highest rollout; resume=true: of all runs, not the highest rollout
    id but the checkpoint saved most recently, by its state file's mtime."""
    fake_checkpoint(tmp_path / "a", 3)
    a, b = fake_checkpoint(tmp_path / "a", 5), fake_checkpoint(tmp_path / "b", 1)
    fake_checkpoint(tmp_path / "a", 4).rename(tmp_path / "a" / "checkpoints" / ".rollout_000006.tmp")
    assert ckpt.find_checkpoint(str(tmp_path / "a"), tmp_path) == a
    for checkpoint, mtime in ((a, 1_000_000), (b, 2_000_000)):
        os.utime(checkpoint / ckpt.STATE_FILE, (mtime, mtime))
    assert ckpt.find_checkpoint(True, tmp_path) == b
    os.utime(a / ckpt.STATE_FILE, (3_000_000, 3_000_000))
    assert ckpt.find_checkpoint(True, tmp_path) == a


def test_resume_of_a_run_dir_without_checkpoints_restarts_it_and_a_bare_rollout_dir_is_refused(tmp_path):
    died = tmp_path / "died"  # a run that died before its first checkpoint: it starts again
    (died / "checkpoints" / ".rollout_000000.tmp").mkdir(parents=True)
    (died / "status.json").write_text(json.dumps({"status": "failed"}))
    assert ckpt.find_checkpoint(str(died), tmp_path) is None
    assert ckpt.resumed_run(str(died), None) == died.resolve()
    bare = fake_checkpoint(tmp_path / "run", 2).with_name("rollout_000003")
    bare.mkdir()  # named like a checkpoint, no state file: an incomplete one, not a run dir
    with pytest.raises(ConfigError, match=r"rollout_000003': incomplete checkpoint \(relax_state.json "
                                          r"unreadable .*resume the run dir \(.*run\)"):
        ckpt.find_checkpoint(str(bare), tmp_path)


def test_restore_history_puts_back_the_checkpoints_files_or_none_for_a_restart(trainer, tiny_path, tmp_path):
    """Rows written after the checkpoint (the resumed run redoes those rollouts) are dropped; a
    run restarted from rollout 0 keeps none of its old history."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"rollout_id": 0}\n')
    (run / "samples.jsonl").write_text('{"rollout_id": 0}\n')
    checkpoint = save(trainer, tiny_path, run, 0)
    (run / "metrics.jsonl").write_text('{"rollout_id": 0}\n{"rollout_id": 1}\n')
    ckpt.restore_history(checkpoint, run)
    assert (run / "metrics.jsonl").read_text() == '{"rollout_id": 0}\n'
    ckpt.restore_history(None, run)
    assert not (run / "metrics.jsonl").exists() and not (run / "samples.jsonl").exists()


def test_a_new_run_refuses_a_dir_holding_only_checkpoints_and_a_live_run_is_not_resumed(tmp_path):
    from relax.process import HOST, start_time

    old = tmp_path / "old"
    fake_checkpoint(old, 0)
    with pytest.raises(ConfigError, match=r"old already holds a run \(checkpoints\)"):
        ckpt.check_run_dir(old, None)
    ckpt.check_run_dir(old, old.resolve())  # resumed in its own dir
    parent = os.getppid()  # a live process other than this one, as a still running run's driver
    (old / "status.json").write_text(json.dumps({"status": "running", "pid": parent, "host": HOST,
                                                 "pid_start": start_time(parent)}))
    with pytest.raises(ConfigError, match=rf"resume: .*old is a run that is still running \(pid {parent} "):
        ckpt.check_run_dir(tmp_path / "new", old.resolve())


def test_an_error_other_than_disk_full_is_raised_as_itself_and_leaves_nothing(trainer, tiny_path, tmp_path,
                                                                              monkeypatch):
    def denied(path):
        Path(path).mkdir(parents=True)
        raise PermissionError(errno.EACCES, "Permission denied", str(Path(path) / "hf"))

    monkeypatch.setattr(trainer, "save_checkpoint", denied)
    with pytest.raises(PermissionError, match="Permission denied"):
        save(trainer, tiny_path, tmp_path, 7)
    assert names(tmp_path) == []


def test_resume_checks_the_reference_model_the_checkpoints_weights_and_its_trainer_layout(
        trainer, tiny_path, tmp_path):
    """A checkpoint resumes only with its run's reference model and its own hf/ whole (same-size
    garbage passes the size check), and with the trainer layout its state was saved with."""
    checkpoint = save(trainer, tiny_path, tmp_path, 0)
    state = ckpt.read_state(checkpoint)
    assert ckpt.reference_model(checkpoint, state) == tiny_path
    assert (checkpoint / "hf" / "tokenizer_config.json").is_file()  # a normal HF dir, tokenizer too
    with pytest.raises(ConfigError, match=r"needs its run's reference model \(relax_state.json "
                                          r"ref_model_path\) /gone, which is unusable"):
        ckpt.reference_model(checkpoint, {**state, "ref_model_path": "/gone"})
    weights = checkpoint / "hf" / "model.safetensors"
    weights.write_bytes(b"\0" * weights.stat().st_size)
    with pytest.raises(ConfigError, match=r"needs its weights .*hf, which is unusable"):
        ckpt.reference_model(checkpoint, state)
    ckpt.check_layout(checkpoint, state, {"train.backend": "torch"})
    with pytest.raises(ConfigError, match=r"saved with train.backend=torch \(this run: megatron\), "
                                          r"parallel.tp=None \(this run: 2\)"):
        ckpt.check_layout(checkpoint, state, {"train.backend": "megatron", "parallel.tp": 2})
