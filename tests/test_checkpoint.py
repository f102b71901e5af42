"""Checkpoints survive crashes at any moment: leftovers are cleaned, incomplete checkpoints are
skipped on resume, disk-full is a clear error, and keep_last means what it says."""

from __future__ import annotations

import errno
import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from relax import checkpoint as ckpt
from relax.errors import ConfigError, DiskFull
from relax.model import load_tokenizer

from .conftest import make_cfg, run_loop


@pytest.fixture(scope="module")
def trainer(tiny_path):
    from relax.train.torch_trainer import TorchTrainer

    return TorchTrainer(make_cfg(), str(tiny_path))


def save(trainer, tiny_path, run_dir: Path, rollout_id: int, keep_last=2) -> Path:
    return ckpt.save_checkpoint(trainer, load_tokenizer(tiny_path), run_dir, rollout_id, tiny_path,
                                keep_last, {"train.backend": "torch"})


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
    from relax.train.torch_trainer import TorchTrainer

    trainer.skipped_steps = 3
    try:
        torch.manual_seed(123)
        saved_rng = torch.get_rng_state()
        trainer.save_checkpoint(str(tmp_path))
    finally:
        trainer.skipped_steps = 0
    resumed = TorchTrainer(make_cfg(), str(tiny_path))
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
