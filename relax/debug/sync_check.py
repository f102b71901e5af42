"""The always-on weight-sync check: after every sync, each engine's fingerprint of every tensor
sent (relax/rollout/fingerprint.py, taken from the engine's own memory) against the trainer's;
a tensor that differs stops the run (WeightSyncFailed), named. On by default
(debug.check_weight_sync); what it costs: docs/debugging.md, "The weight-sync check". The full
comparison stays `debug.check_weight_update_equal` (relax/debug/weights.py)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from relax.errors import WeightSyncFailed
from relax.rollout.fingerprint import SAMPLE, fingerprint, samples

log = logging.getLogger(__name__)
_unchecked: set[int] = set()  # engines already reported as not checked (once per process)


def differences(engine: dict, trainer: dict) -> list[str]:
    """What differs, per tensor, between two fingerprints: the trainer's sample cast to the
    engine's dtype (as the sync's copy casts it) must equal the engine's exactly (NaN where NaN).
    Where both hold the same tensors in one dtype each (the usual case), one comparison."""
    if (engine["names"] == trainer["names"] and engine["shapes"] == trainer["shapes"]
            and len(engine["samples"]) == len(trainer["samples"]) == 1):
        (held,), (sent,) = engine["samples"].values(), trainer["samples"].values()
        if torch.equal(held, sent.to(held.dtype)):
            return []
    out, engine = [], samples(engine)
    for name, (shape, sent) in samples(trainer).items():
        if name not in engine:
            out.append(f"{name}: not in the engine")
            continue
        held_shape, held = engine[name]
        if tuple(held_shape) != tuple(shape):
            out.append(f"{name}: shape {list(held_shape)} in the engine, {list(shape)} sent")
            continue
        a, b = held.double(), sent.to(held.dtype).double()
        differ = ~((a == b) | (a.isnan() & b.isnan()))
        if differ.any():
            delta = (a - b).abs()[differ].max().item()
            out.append(f"{name}: {int(differ.sum())} of {len(a)} sampled elements differ (max |Δ| {delta:.3g})")
    return out


def after_sync(engines, trainer, sent: Mapping[str, torch.Tensor] | None, rollout_id: int) -> None:
    """The loop's call after each sync unless debug.check_weight_sync=false (`sent`: None for the
    NCCL broadcast, which sent the trainer's whole model: gathered here by name)."""
    check_sync_landed(engines, trainer.named_weights() if sent is None else sent, rollout_id)


def check_sync_landed(engines, sent: Mapping[str, torch.Tensor], rollout_id: int) -> int:
    """Raise WeightSyncFailed naming the tensors an engine does not hold as `sent` (what the
    trainer sent: with LoRA the merged projections only); returns the number of tensors checked.
    The sampled elements move with `rollout_id`, so successive syncs look at other elements."""
    if not hasattr(engines, "weight_fingerprints"):  # (a test's stand-in for the engine group)
        return 0
    expected = fingerprint(sent, salt=rollout_id)
    for i, held in enumerate(engines.weight_fingerprints(expected["names"], rollout_id)):
        if held is None:  # SGLang with TP (no HF tensor in a shard), a user's engine class without it
            if i not in _unchecked:
                _unchecked.add(i)
                log.info("The weight-sync check skips engine %d: it gives no weight_fingerprints "
                         "(docs/debugging.md)", i)
            continue
        if problems := differences(held, expected):
            where = f"engine {i}" if engines.num_engines > 1 else "the engine"
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise WeightSyncFailed(
                f"rollout {rollout_id}: the weight sync did not land in {where}: {shown} ({SAMPLE} "
                f"elements per tensor compared; the full comparison: debug.check_weight_update_equal=true "
                f"debug.check_weight_update_every_sync=true; docs/debugging.md)")
    return len(expected["names"])
