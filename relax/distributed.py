"""Process-group plumbing shared by trainer ranks and engines (below both)."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous or a weight-sync group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gather_tensors(mine: dict, rank: int, world_size: int) -> dict:
    """Every rank's named tensors, merged on rank 0 (a collective; other ranks get {}).

    Names, shapes and dtypes travel as objects, the tensors themselves by send/recv:
    `gather_object` would pickle every byte, far slower for a real model (docs/results.md)."""
    if world_size == 1:
        return mine
    meta = [(name, t.shape, t.dtype) for name, t in mine.items()]
    metas = [None] * world_size if rank == 0 else None
    dist.gather_object(meta, metas, dst=0)
    if rank != 0:
        for t in mine.values():
            dist.send(t.contiguous(), dst=0)
        return {}
    merged = dict(mine)
    device = next(iter(mine.values())).device if mine else "cpu"  # (NCCL: rank 0's GPU)
    for src in range(1, world_size):
        for name, shape, dtype in metas[src]:
            merged[name] = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(merged[name], src=src)
    return merged
