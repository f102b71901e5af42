"""Checkpoints and resume (`checkpoint.*`, `resume`).

<run dir>/checkpoints/rollout_000099/
    hf/                  the actor as a normal HF directory (config, safetensors, tokenizer)
    trainer_state.pt     optimizer and RNG state (plain tensors; loaded weights_only);
                         train=megatron: trainer_state_rank<R>.pt, one per rank
    relax_state.json     rollout_id, the reference model's path, and the trainer layout
                         the state is tied to (checked before a resumed run builds anything)
Written into a temp directory and renamed into place, so a crash never leaves a half
checkpoint that resume would pick. Prompts and sampling seeds derive from `rollout_id`,
so a resumed run continues exactly where the uninterrupted one would be.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from relax.errors import ConfigError, NonFiniteError

STATE_FILE = "relax_state.json"


def check_finite_weights(hf_dir: Path) -> None:
    """Refuse to checkpoint NaN/Inf weights, tensor by tensor (nothing is held in memory)."""
    import torch
    from safetensors import safe_open

    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if not torch.isfinite(f.get_tensor(name)).all():
                    raise NonFiniteError(f"checkpoint: weight {name} is not finite; no checkpoint was "
                                         f"written (the run trained on a non-finite step)")


def save_checkpoint(trainer, tokenizer, run_dir: Path, rollout_id: int, ref_model_path: Path,
                    keep_last: int, layout: dict) -> Path:
    root = Path(run_dir) / "checkpoints"
    final = root / f"rollout_{rollout_id:06d}"
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.save_checkpoint(str(tmp))
    try:
        check_finite_weights(tmp / "hf")
    except NonFiniteError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tokenizer.save_pretrained(tmp / "hf")
    (tmp / STATE_FILE).write_text(json.dumps(
        {"rollout_id": rollout_id, "ref_model_path": str(ref_model_path), "trainer_layout": layout},
        indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(root.glob("rollout_*"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _latest_in(run_dir: Path) -> Path | None:
    found = sorted((Path(run_dir) / "checkpoints").glob(f"rollout_*/{STATE_FILE}"))
    return found[-1].parent if found else None


def find_checkpoint(resume, runs_root: Path) -> Path | None:
    """`resume=true`: the newest checkpoint under runs_root; a path: that checkpoint or run."""
    if resume is False or resume is None:
        return None
    if resume is True:
        candidates = [c for run in Path(runs_root).glob("*") if (c := _latest_in(run))]
        if not candidates:
            raise ConfigError(f"resume=true but no checkpoint exists under {runs_root}")
        return max(candidates, key=lambda c: (c / STATE_FILE).stat().st_mtime)
    path = Path(str(resume)).expanduser().absolute()
    if (path / STATE_FILE).is_file():
        return path
    latest = _latest_in(path)
    if latest is None:
        raise ConfigError(f"resume={resume!r}: neither a checkpoint ({STATE_FILE}) nor a run "
                          f"dir with checkpoints/")
    return latest


def read_state(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def check_layout(checkpoint: Path, state: dict, layout: dict) -> None:
    """A resumed trainer must match what its saved state (`state`, the checkpoint's
    relax_state.json) is tied to (relax.train.checkpoint_layout)."""
    saved = state.get("trainer_layout", {})
    differ = [f"{k}={saved.get(k)} (this run: {v})" for k, v in layout.items() if saved.get(k) != v]
    if differ:
        raise ConfigError(f"resume: {checkpoint} holds trainer state saved with {', '.join(differ)}; "
                          f"resume it with the same settings")
