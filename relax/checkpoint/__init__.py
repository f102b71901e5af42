"""Checkpoints and resume (`checkpoint.*`, `resume`).

How it works in detail: docs/reliability.md, "Inside `relax/checkpoint/__init__.py`".
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from relax import faults
from relax.checkpoint.experiment import save_experiment, saved_in
from relax.errors import ConfigError, DiskFull, NonFiniteError
from relax.files import atomic_open, atomic_write_text, is_disk_full
from relax.model import check_model_dir
from relax.process import describe, is_alive, live_elsewhere, read_status

log = logging.getLogger(__name__)
STATE_FILE = "relax_state.json"
HISTORY = ("metrics.jsonl", "samples.jsonl", "first_step_log_probs.pt")  # run files a checkpoint carries
HEADROOM = 1.2  # a new checkpoint needs the newest one's size, plus this margin


def check_config(ckpt_cfg) -> None:
    if ckpt_cfg.save_interval is not None and ckpt_cfg.save_interval < 1:
        raise ConfigError(f"checkpoint.save_interval={ckpt_cfg.save_interval}: expected a positive "
                          f"number of rollouts, or null to save no checkpoints")
    if ckpt_cfg.keep_last is not None and ckpt_cfg.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={ckpt_cfg.keep_last}: expected at least 1 (the "
                          f"checkpoint just written), or null to keep every checkpoint")


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _delete(path: Path) -> None:
    """Rename out of sight first, so a crash mid-delete never leaves a half checkpoint under
    its real name."""
    trash = path.with_name(f".{path.name}.old")
    shutil.rmtree(trash, ignore_errors=True)
    path.rename(trash)
    faults.point("checkpoint_delete")
    shutil.rmtree(trash, ignore_errors=True)


def scan(run_dir: Path) -> tuple[list[Path], list[Path]]:
    """The run's (complete, incomplete) checkpoints, oldest first; incomplete ones are named."""
    complete, incomplete = [], []
    for path in sorted((Path(run_dir) / "checkpoints").glob("rollout_*")):
        problem = incomplete_reason(path)
        if problem:
            log.warning("incomplete checkpoint %s: %s", path, problem)
        (incomplete if problem else complete).append(path)
    return complete, incomplete


def incomplete_reason(checkpoint: Path) -> str | None:
    try:
        state = read_state(checkpoint)
    except (OSError, ValueError) as e:
        return f"{STATE_FILE} unreadable ({type(e).__name__}: {e})"
    for name, size in state.get("files", {}).items():
        f = checkpoint / name
        if not f.is_file() or f.stat().st_size != size:
            return f"{name} is missing or truncated"
    return None if "files" in state else f"{STATE_FILE} lists no files"


def _ensure_space(root: Path, complete: list[Path], keep_last: int | None) -> None:
    """Room for one more checkpoint: prune early what this save would prune anyway (never the
    newest, which is all there is until the new one exists), or fail naming the space needed."""
    if not complete:
        return
    needed = int(_size(complete[-1]) * HEADROOM)
    prunable = complete[:-max(keep_last - 1, 1)] if keep_last else []
    while shutil.disk_usage(root).free < needed and prunable:
        _delete(prunable.pop(0))
    free = shutil.disk_usage(root).free
    if free < needed:
        raise DiskFull(errno.ENOSPC, f"no space for a checkpoint in {root}: about {needed / 2**20:.0f} MiB "
                       f"needed, {free / 2**20:.0f} MiB free")


def check_finite_weights(folder: Path) -> None:
    """Refuse to checkpoint NaN/Inf weights (its HF dir's, its LoRA adapter's), tensor by tensor
    (nothing is held in memory)."""
    for file in sorted(Path(folder).rglob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if not torch.isfinite(f.get_tensor(name)).all():
                    raise NonFiniteError(f"checkpoint: weight {name} is not finite; no checkpoint was "
                                         f"written (the run trained on a non-finite step)")


def save_checkpoint(trainer, tokenizer, run_dir: Path, rollout_id: int, ref_model_path: Path,
                    keep_last: int | None, layout: dict, experiment: tuple,
                    write_more: Callable[[Path], None] = lambda folder: None) -> Path:
    """`experiment`: the run's (config, overrides), which a resume composes again; `write_more`
    adds the loop's own files to the folder before it is complete."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for leftover in [*root.glob(".*.tmp"), *root.glob(".*.old")]:  # from a crash mid-save
        shutil.rmtree(leftover, ignore_errors=True)
    final = root / f"rollout_{rollout_id:06d}"
    tmp = root / f".{final.name}.tmp"
    _ensure_space(root, scan(run_dir)[0], keep_last)
    faults.point("checkpoint_start")
    try:
        trainer.save_checkpoint(str(tmp))
        check_finite_weights(tmp)
        faults.point("checkpoint_weights")
        if faults.active("disk_full"):
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "hf"))
        if (tmp / "hf").is_dir():  # (a LoRA adapter alone: the reference model has the tokenizer)
            tokenizer.save_pretrained(tmp / "hf")
        save_experiment(tmp, *experiment)
        write_more(tmp)
        (tmp / "history").mkdir()
        for name in HISTORY:
            if (Path(run_dir) / name).is_file():
                shutil.copy2(Path(run_dir) / name, tmp / "history" / name)
        files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        atomic_write_text(tmp / STATE_FILE, json.dumps(
            {"rollout_id": rollout_id, "ref_model_path": str(ref_model_path), "trainer_layout": layout,
             "files": files}, indent=2))
    except NonFiniteError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise DiskFull(e.errno, f"disk full while writing checkpoint {final} "
                           f"({e.filename or root}): free space there, or lower "
                           f"checkpoint.keep_last") from None
        raise
    faults.point("checkpoint_state")
    if final.exists():  # the same rollout saved again (a resumed run)
        _delete(final)
    tmp.rename(final)
    faults.point("checkpoint_renamed")
    complete, incomplete = scan(run_dir)
    for old in incomplete + (complete[:-keep_last] if keep_last else []):  # resume skips the former
        _delete(old)
    return final


def _latest_in(run_dir: Path) -> Path | None:
    complete = scan(run_dir)[0]
    return complete[-1] if complete else None


def find_checkpoint(resume, runs_root: Path) -> Path | None:
    """`resume=true`: the newest complete checkpoint under runs_root; a path: that checkpoint,
    or the newest complete one of that run (None for a run that died before its first one:
    it starts again from rollout 0)."""
    if resume is False or resume is None:
        return None
    if resume is True:
        candidates = [c for run in Path(runs_root).glob("*") if (c := _latest_in(run))]
        if not candidates:
            raise ConfigError(f"resume=true but no complete checkpoint exists under {runs_root}")
        return max(candidates, key=lambda c: (c / STATE_FILE).stat().st_mtime)
    path = Path(str(resume)).expanduser().absolute()
    if (path / STATE_FILE).exists() or path.name.startswith("rollout_"):
        problem = incomplete_reason(path)
        if problem:
            raise ConfigError(f"resume={resume!r}: incomplete checkpoint ({problem}); resume the run "
                              f"dir ({path.parent.parent}) to take its newest complete checkpoint")
        return path
    latest = _latest_in(path)
    if latest is None and (path / "status.json").is_file():
        log.warning("resume=%s: that run saved no complete checkpoint: it starts again from rollout 0",
                    resume)
    elif latest is None:
        raise ConfigError(f"resume={resume!r}: neither a checkpoint ({STATE_FILE}) nor a run "
                          f"dir with complete checkpoints/")
    return latest


def experiment_of(checkpoint: Path | None, source: Path | None) -> Path | None:
    """Where the experiment a resume continues is saved: its checkpoint's config, else its run's
    (`source`; checkpoints saved before Relax kept one); None if neither has one."""
    return (checkpoint and saved_in(checkpoint)) or (source and saved_in(source)) or None


def resumed_run(resume, checkpoint: Path | None) -> Path | None:
    """The run dir a resumed run continues: its checkpoint's, or the run `resume` names when it
    has none (find_checkpoint)."""
    if checkpoint:
        return Path(checkpoint).resolve().parent.parent
    return None if resume in (None, False, True) else Path(str(resume)).expanduser().resolve()


def check_run_dir(run_dir: Path, source: Path | None) -> None:
    """A run dir holds one run: a new run never writes into another run's files, and a resumed
    run goes into a fresh dir or the dir of the run it continues (`source`), which must not be
    running."""
    run_dir = Path(run_dir).resolve()
    held = [name for name in ("metrics.jsonl", "checkpoints") if (run_dir / name).exists()]
    if held and source != run_dir:
        raise ConfigError(f"{run_dir} already holds a run ({' and '.join(held)}): another run's files "
                          f"would mix with it. Run in a new directory, or continue that run with "
                          f"resume={run_dir}")
    status = read_status(source) if source else None
    if live_elsewhere(status):
        raise ConfigError(f"resume: {source} is a run that is still {describe(status)}: "
                          f"stop it first (kill -INT {status['pid']}); to branch off it, copy the "
                          f"checkpoint and resume from the copy")
    if status and status["status"] == "running" and is_alive(status) is not True:
        log.warning("resuming %s: its run %s", source, describe(status))


def restore_history(checkpoint: Path | None, run_dir: Path) -> None:
    """The run dir's history files as the checkpoint saw them (rows of rollouts after the
    checkpoint, which the resumed run redoes, are dropped; also when resuming in the same dir).
    No checkpoint: a run restarted from rollout 0 has no history."""
    for name in HISTORY:
        if checkpoint is None:
            (Path(run_dir) / name).unlink(missing_ok=True)
            continue
        saved = Path(checkpoint) / "history" / name
        if saved.is_file():
            with atomic_open(Path(run_dir) / name) as f:
                f.write(saved.read_bytes())
        else:
            log.warning("%s has no history/%s (saved by an older Relax): the resumed run's %s "
                        "starts empty", checkpoint, name, name)


def read_state(checkpoint: Path) -> dict:
    """relax_state.json; a ValueError if it is not one (incomplete_reason reports it)."""
    state = json.loads((Path(checkpoint) / STATE_FILE).read_text())
    if not isinstance(state, dict) or not isinstance(state.get("rollout_id"), int) or \
            not isinstance(state.get("ref_model_path"), str) or not isinstance(state.get("files", {}), dict):
        raise ValueError(f"{Path(checkpoint) / STATE_FILE}: no rollout_id, ref_model_path and files")
    return state


def reference_model(checkpoint: Path, state: dict) -> Path:
    """The model the checkpoint's run started from (its reference), which must still be whole,
    like the checkpoint's own weights."""
    path = Path(state["ref_model_path"])
    weights = [] if adapter_only(checkpoint) else [(Path(checkpoint) / "hf", "its weights")]
    for folder, what in ((path, "its run's reference model (relax_state.json ref_model_path)"), *weights):
        try:
            check_model_dir(folder)
        except ConfigError as e:
            raise ConfigError(f"resume: {checkpoint} needs {what} {folder}, which is unusable: {e}") from None
    return path


def adapter_only(checkpoint: Path) -> bool:
    """A LoRA checkpoint without train.lora.save_merged: the adapter, no merged hf/ dir."""
    return not (Path(checkpoint) / "hf").is_dir() and (Path(checkpoint) / "adapter").is_dir()


def check_layout(checkpoint: Path, state: dict, layout: dict) -> None:
    """A resumed trainer must match what its saved state (`state`, the checkpoint's
    relax_state.json) is tied to (relax.train.checkpoint_layout)."""
    saved = state.get("trainer_layout", {})
    differ = [f"{k}={saved.get(k)} (this run: {v})" for k, v in layout.items() if saved.get(k) != v]
    if differ:
        raise ConfigError(f"resume: {checkpoint} holds trainer state saved with {', '.join(differ)}; "
                          f"resume it with the same settings")
