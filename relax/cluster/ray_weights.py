"""How weights cross Ray (cluster=ray, relax/cluster/ray_cluster.py): trainer rank 0 puts
them into the object store itself, in buckets of rollout.weight_update_bucket_mb, each tensor
as raw bytes (`Tensors`); the driver holds only the buckets' refs (`StoredWeights`)
and hands them to every engine, which reads them from the store."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import ray
import torch

from relax.cluster.shared_weights import on_cpu


class Tensors(dict):
    """Weights (name -> tensor) that pickle as raw bytes: each CPU tensor as a flat uint8 numpy
    array (bf16 included), which Ray's serializer (pickle protocol 5) copies into the object
    store once, out of band, and a reader maps without a copy. Ray pickles torch tensors
    through torch's own reducer, and a safetensors buffer as a bytes object copied into the
    pickle and out again, both far slower than arrays (bench/cluster_overhead.py,
    docs/results.md). CUDA tensors pickle as they always did."""

    def __reduce__(self):
        if not on_cpu(self):
            return dict, (dict(self),)
        meta = [(name, t.dtype, tuple(t.shape)) for name, t in self.items()]
        raw = [t.detach().contiguous().reshape(-1).view(torch.uint8).numpy() for t in self.values()]
        return _load_tensors, (meta, raw)


class StoredWeights(Mapping):
    """Weights that trainer rank 0 put into Ray's object store, in buckets (`refs`): engines
    read them from there, so they never pass through the driver, which fetches them only if
    something here reads them (the engine-weights check)."""

    def __init__(self, refs: list):
        self.refs, self._tensors = refs, None

    def _fetched(self) -> dict:
        if self._tensors is None:
            self._tensors = {name: t for bucket in ray.get(self.refs) for name, t in bucket.items()}
        return self._tensors

    def __getitem__(self, name: str):
        return self._fetched()[name]

    def __iter__(self):
        return iter(self._fetched())

    def __len__(self) -> int:
        return len(self._fetched())


def _load_tensors(meta: list[tuple], raw: list) -> dict:
    """The tensors, as views of the arrays: out of Ray, of its object store, without a copy
    (a copy into fresh memory costs a real model's sync its page faults: docs/results.md). They are read-only: an
    engine copies them into its own weights (the torch engine's `copy_`, SGLang's serializer
    into shared memory) and drops them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return {name: torch.from_numpy(a).view(dtype).reshape(shape)
                for (name, dtype, shape), a in zip(meta, raw, strict=True)}
