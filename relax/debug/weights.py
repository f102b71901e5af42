"""The engine-weights check (`debug.check_weight_update_equal`): the guide's first precision
step, automated.

How it works in detail: docs/debugging.md, "Inside `relax/debug/weights.py`".
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from relax.model import load_safetensors_dir

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


def snapshots(engines) -> list[dict[str, torch.Tensor]]:
    """Every engine's tensors (an EngineGroup: relax/cluster/engines.py), as writable copies."""
    return [{k: v.detach().clone() for k, v in named.items()} for named in engines.each_named_tensors()]


def describe(report: dict) -> str:
    engine = f"engine {report['engine']}: " if report.get("engines", 1) > 1 else ""
    if report["passed"]:
        return f"{engine}all {report['compared']} tensors equal"
    parts = [f"{m['name']}: " + ", ".join(
        f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v[0]} vs {v[1]}"
        for k, v in m.items() if k != "name") for m in report["mismatches"][:10]]
    if report["only_in_engine"]:
        parts.append(f"only in the engine: {', '.join(report['only_in_engine'])}")
    if report["only_in_reference"]:
        parts.append(f"missing in the engine: {', '.join(report['only_in_reference'])}")
    return engine + "; ".join(parts)


class WeightCheck:
    """Runs the load and sync comparisons on every engine and records them in the run dir."""

    def __init__(self, engines, model_path: Path, run_dir: Path, weights: dict | None = None):
        """`weights`: what the engines hold instead of `model_path`'s (a resumed LoRA adapter,
        merged into the base by the trainer)."""
        self.loaded = snapshots(engines)
        checkpoint = weights if weights is not None else load_safetensors_dir(model_path)
        self.dtype = next(iter(self.loaded[0].values())).dtype  # the engines' compute dtype
        # a copy: `weights` may be a trainer's shared buffers, which its next weights call rewrites
        self.reference = {k: v.to(self.dtype, copy=True) for k, v in checkpoint.items()}
        # buffers, which no checkpoint holds, are expected to stay as each engine loaded them
        self.buffers = [{k: v for k, v in loaded.items() if k not in checkpoint} for loaded in self.loaded]
        self.path = Path(run_dir) / "weight_check.json"
        self.results: list[dict] = []
        for i, loaded in enumerate(self.loaded):
            self._record("load", None, i, compare_tensors(
                {k: v for k, v in loaded.items() if k in checkpoint}, self.reference))

    def _record(self, stage: str, rollout_id, engine: int, report: dict) -> dict:
        report = {"stage": stage, "rollout_id": rollout_id, "engine": engine,
                  "engines": len(self.loaded), **report}
        self.results.append(report)
        self.path.write_text(json.dumps({"passed": all(r["passed"] for r in self.results),
                                         "checks": self.results}, indent=2))
        level = logging.INFO if report["passed"] else logging.ERROR
        log.log(level, "Engine weights check (%s%s): %s", stage,
                "" if rollout_id is None else f", rollout {rollout_id}", describe(report))
        return report

    def _compare_all(self, engines, expected: dict, rollout_id) -> list[dict]:
        return [self._record("sync", rollout_id, i, compare_tensors(actual, {**expected, **self.buffers[i]}))
                for i, actual in enumerate(snapshots(engines))]

    def check_first_sync(self, engines, trainer, distributed: bool = False) -> list[dict]:
        """Randomise every engine's parameters, sync from the trainer the way every sync goes
        (`distributed`: rollout.weight_update_mode=distributed, the NCCL broadcast), compare
        with the checkpoint."""
        generator = torch.Generator().manual_seed(0)
        engines.update_weights({k: torch.randn(v.shape, generator=generator).to(v.dtype)
                                for k, v in self.reference.items() if k in self.loaded[0]})
        if distributed:
            engines.update_weights_from_trainer(trainer)
        else:
            engines.update_weights(trainer.named_weights())
        return self._compare_all(engines, self.reference, None)

    def check_sync(self, engines, trained: dict[str, torch.Tensor], rollout_id: int) -> list[dict]:
        return self._compare_all(engines, {k: v.to(self.dtype) for k, v in trained.items()}, rollout_id)
