"""Weights between two local processes through shared memory that lives as long as they do:
driver -> engine processes (cluster=local with train.async) and trainer rank 0 -> driver
(cluster=local with ranks in processes of their own).

The first time a set of tensors (the same names, dtypes and shapes) is sent, a shared-memory
copy of it travels with the message; every later time the sender copies the new values into
that copy and sends only its key: pickling tensors through a pipe makes new shared-memory
segments each time, many times slower (docs/results.md). What the receiver gets are the shared tensors themselves: they hold the
values sent until the same set is sent again (a receiver that keeps them copies them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SharedBucket:
    """A set of tensors in shared memory, in a message: the tensors travel the first time
    only; later ones name the set by `key`."""
    key: int
    tensors: dict | None


def on_cpu(named) -> bool:
    """Weights of CPU tensors only: what goes through shared memory here, or as raw arrays
    through Ray (relax/cluster/ray_weights.py); CUDA tensors pickle through CUDA IPC."""
    return isinstance(named, dict) and bool(named) and all(
        isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in named.values())


class SharedWeights:
    """One side's record of the sets sent (`pack`, on the sender) or received (`unpack`)."""

    def __init__(self):
        self.sets: dict = {}  # sender: (name, dtype, shape)s -> tensors; receiver: key -> tensors

    def pack(self, named: dict) -> SharedBucket:
        """`named` copied into its set's shared-memory tensors (made, and sent along, the first
        time). Tensors already in shared memory (weights a trainer rank's process sent here) are
        passed on as they are: a real model's weights would otherwise take a second copy in the
        driver on their way from rank 0 to the engines (as large as the model)."""
        signature = tuple((n, t.dtype, tuple(t.shape)) for n, t in named.items())
        first = signature not in self.sets
        if first:
            self.sets[signature] = {n: t if t.is_shared() and not t.requires_grad else
                                    t.detach().to("cpu", copy=True).share_memory_() for n, t in named.items()}
        else:
            for n, t in named.items():
                if self.sets[signature][n] is not t:  # (passed on: rewritten in place by its sender)
                    self.sets[signature][n].copy_(t)
        key = list(self.sets).index(signature)
        return SharedBucket(key, self.sets[signature] if first else None)

    def unpack(self, bucket: SharedBucket) -> dict:
        if bucket.tensors is not None:
            self.sets[bucket.key] = bucket.tensors
        return self.sets[bucket.key]
