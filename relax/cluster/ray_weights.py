"""How weights cross Ray (cluster=ray, relax/cluster/ray_cluster.py): trainer rank 0 puts
them into the object store itself, in buckets of rollout.weight_update_bucket_mb, each bucket
one safetensors buffer (`Tensors`); the driver holds only the buckets' refs (`StoredWeights`)
and hands them to every engine, which reads them from the store."""

from __future__ import annotations

from collections.abc import Mapping

import ray


class Tensors(dict):
    """Weights (name -> tensor) that pickle as one safetensors buffer. Ray pickles torch
    tensors one by one through torch's own reducer: a weight sync of the tiny model (27
    tensors, 0.5 MB) through the driver took ~25 ms that way and ~12 ms as one buffer. CUDA
    tensors pickle as they always did."""

    def __reduce__(self):
        import torch
        from safetensors.torch import save

        if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in self.values()):
            return dict, (dict(self),)
        flat, storages = {}, set()
        for name, t in self.items():  # safetensors refuses tensors that share memory: copy those
            storage = t.untyped_storage().data_ptr()
            flat[name] = (t.clone() if storage in storages else t.detach()).contiguous()
            storages.add(storage)
        return _load_tensors, (save(flat), list(flat))


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


def _load_tensors(buffer: bytes, names: list[str]) -> dict:
    from safetensors.torch import load

    tensors = load(buffer)
    return {name: tensors[name] for name in names}  # in the order sent (safetensors sorts them)
