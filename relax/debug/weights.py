"""The engine-weights check (`debug.check_weight_update_equal`): the guide's first precision
step, automated.

1. load: the tensors the engine loaded are compared with the checkpoint on disk.
2. sync: the engine's parameters are overwritten with random values, the trainer's
   weights are pushed through the normal sync path, and every engine tensor — parameters
   and buffers (the rotary `inv_freq` or `cos_sin_cache`) — is compared with the
   checkpoint (buffers, which no checkpoint holds, with the engine's values after load).
   A tensor the sync path misses, corrupts or drops shows up by name.
With `debug.check_weight_update_every_sync`, every later sync is checked against the
trainer's weights the same way. Results go to <run dir>/weight_check.json.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def compare_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                    atol: float = 0.0) -> dict:
    """Per-name differences: value (max |Δ|), shape, dtype, and names on one side only."""
    mismatches = []
    for name in sorted(actual.keys() & expected.keys()):
        a, e = actual[name], expected[name]
        entry = {"name": name}
        if a.shape != e.shape:
            entry["shape"] = [list(a.shape), list(e.shape)]
        else:
            diff = (a.double() - e.double()).abs().max().item() if a.numel() else 0.0
            if not diff <= atol:  # NaN counts as a mismatch
                entry["max_abs_diff"] = diff
        if a.dtype != e.dtype:
            entry["dtype"] = [str(a.dtype), str(e.dtype)]
        if len(entry) > 1:
            mismatches.append(entry)
    only_engine = sorted(actual.keys() - expected.keys())
    only_reference = sorted(expected.keys() - actual.keys())
    return {"passed": not (mismatches or only_engine or only_reference),
            "compared": len(actual.keys() & expected.keys()), "mismatches": mismatches,
            "only_in_engine": only_engine, "only_in_reference": only_reference}


def snapshot(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.named_tensors().items()}


def describe(report: dict) -> str:
    if report["passed"]:
        return f"all {report['compared']} tensors equal"
    parts = [f"{m['name']}: " + ", ".join(
        f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v[0]} vs {v[1]}"
        for k, v in m.items() if k != "name") for m in report["mismatches"][:10]]
    if report["only_in_engine"]:
        parts.append(f"only in the engine: {', '.join(report['only_in_engine'])}")
    if report["only_in_reference"]:
        parts.append(f"missing in the engine: {', '.join(report['only_in_reference'])}")
    return "; ".join(parts)


class WeightCheck:
    """Runs the load and sync comparisons and records them in the run dir."""

    def __init__(self, engine, model_path: Path, run_dir: Path):
        from relax.model import load_safetensors_dir

        self.loaded = snapshot(engine)
        checkpoint = load_safetensors_dir(model_path)
        self.dtype = next(iter(self.loaded.values())).dtype  # the engine's compute dtype
        self.reference = {k: v.to(self.dtype) for k, v in checkpoint.items()}
        self.buffers = {k: v for k, v in self.loaded.items() if k not in checkpoint}
        self.path = Path(run_dir) / "weight_check.json"
        self.results: list[dict] = []
        self._record("load", None, compare_tensors(
            {k: v for k, v in self.loaded.items() if k in checkpoint}, self.reference))

    def _record(self, stage: str, rollout_id, report: dict) -> dict:
        report = {"stage": stage, "rollout_id": rollout_id, **report}
        self.results.append(report)
        self.path.write_text(json.dumps({"passed": all(r["passed"] for r in self.results),
                                         "checks": self.results}, indent=2))
        level = logging.INFO if report["passed"] else logging.ERROR
        log.log(level, "Engine weights check (%s%s): %s", stage,
                "" if rollout_id is None else f", rollout {rollout_id}", describe(report))
        return report

    def check_first_sync(self, engine, trainer) -> dict:
        """Randomise the engine's parameters, sync from the trainer, compare with the checkpoint."""
        generator = torch.Generator().manual_seed(0)
        engine.update_weights({k: torch.randn(v.shape, generator=generator).to(v.dtype)
                               for k, v in self.reference.items() if k in self.loaded})
        engine.update_weights(trainer.named_weights())
        return self._record("sync", None, compare_tensors(snapshot(engine),
                                                          {**self.reference, **self.buffers}))

    def check_sync(self, engine, trained: dict[str, torch.Tensor], rollout_id: int) -> dict:
        expected = {**{k: v.to(self.dtype) for k, v in trained.items()}, **self.buffers}
        return self._record("sync", rollout_id, compare_tensors(snapshot(engine), expected))
