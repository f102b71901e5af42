"""A weight sync's fingerprint: per tensor, its shape and a fixed strided sample of its elements
(`SAMPLE` of them, exactly as stored), taken where the tensor lives (an engine's own memory, the
trainer's weights as sent). relax/debug/sync_check.py compares the two sides after every sync."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

SAMPLE = 64  # elements per tensor (what that costs: docs/debugging.md, "The weight-sync check")


def fingerprint(named: Mapping[str, torch.Tensor], names: Iterable[str] | None = None, salt: int = 0) -> dict:
    """Of each tensor (`names`: only these, those missing left out): elements offset, offset +
    stride, ... of it flattened (stride numel // SAMPLE; offset `salt` mod stride, so successive
    syncs sample other elements), in its own dtype, on CPU. The samples of one dtype are one
    tensor (`samples[dtype]`; tensor i's are `spans[i]` of it), so that sampling costs one view
    per tensor and comparing one op per dtype."""
    out = {"names": [], "shapes": [], "spans": [], "samples": {}}
    views: dict[str, list[torch.Tensor]] = {}
    sizes: dict[str, int] = {}
    with torch.no_grad():
        for name in named if names is None else names:
            if name not in named:
                continue
            t = named[name]
            stride = max(1, t.numel() // SAMPLE)
            count, offset, dtype = min(SAMPLE, t.numel()), salt % stride, str(t.dtype).removeprefix("torch.")
            out["names"].append(name)
            out["shapes"].append(tuple(t.shape))
            out["spans"].append((dtype, sizes.get(dtype, 0), count))
            sizes[dtype] = sizes.get(dtype, 0) + count
            views.setdefault(dtype, []).append(
                t.as_strided((count,), (stride,), t.storage_offset() + offset) if t.is_contiguous()
                else t.reshape(-1)[offset::stride][:count])
        out["samples"] = {dtype: torch.cat(group).cpu() for dtype, group in views.items()}
    return out


def samples(fp: dict) -> dict[str, tuple[tuple[int, ...], torch.Tensor]]:
    """name -> (shape, sample) of a fingerprint."""
    return {name: (shape, fp["samples"][dtype][start:start + count])
            for name, shape, (dtype, start, count) in zip(fp["names"], fp["shapes"], fp["spans"], strict=True)}
