"""A weight sync's fingerprint: per tensor, its shape and a fixed strided sample of its elements
(`SAMPLE` of them, exactly as stored), taken where the tensor lives (an engine's own memory, the
trainer's weights as sent). relax/debug/sync_check.py compares the two sides after every sync."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

SAMPLE = 64  # elements per tensor (what that costs: docs/debugging.md, "The weight-sync check")


def fingerprint(named: Mapping[str, torch.Tensor], names: Iterable[str] | None = None,
                salt: int = 0) -> dict[str, tuple[tuple[int, ...], torch.Tensor]]:
    """name -> (shape, sample): elements offset, offset + stride, ... of the flattened tensor
    (stride numel // SAMPLE; offset `salt` mod stride, so successive syncs sample other elements),
    copied to CPU in the tensor's own dtype. `names`: only these (those missing are left out)."""
    out = {}
    for name in named if names is None else names:
        if name not in named:
            continue
        t = named[name].detach()
        flat = t.reshape(-1)  # (a view when contiguous, as every engine's weights are)
        stride = max(1, flat.numel() // SAMPLE)
        out[name] = (tuple(t.shape), flat[salt % stride::stride][:SAMPLE].to("cpu", copy=True))
    return out
