"""N rollout engines behind the one-engine interface (relax/rollout/__init__.py).

`EngineGroup` splits each rollout into contiguous shares, one per engine, and passes each
share the index of its first sample, so every sample is drawn with its own seed whatever
the engine count; weight sync and the engine-weights check reach every engine. The engines
live in the driver (`InDriver`, cluster=local) or in Ray actors (`RayHosts`, cluster=ray):
both run one method on every engine and return the results in engine order.
"""

from __future__ import annotations

import os
import socket

from omegaconf import DictConfig, OmegaConf

from relax.cluster.ranks import RankError, on_this_host
from relax.rollout import buckets, build_engine
from relax.rollout.generate import generate_rollout
from relax.rollout.partial import generate_partial_rollout


def make_engine(rollout, spec, base_gpu_id: int = 0):
    """Build one engine (in the driver, or in a process or Ray actor from a plain rollout dict)."""
    if not isinstance(rollout, DictConfig):
        rollout = OmegaConf.create(rollout)
    return build_engine(rollout, spec, base_gpu_id)


def make_engine_host(rollout, spec, base_gpu_id: int = 0) -> EngineHost:
    """make_engine, for an engine in a process of its own (a local process or a Ray actor)."""
    return EngineHost(make_engine(rollout, spec, base_gpu_id))


def sample(engine, names: list[str], salt: int) -> dict | None:
    return engine.weight_fingerprints(names, salt) if hasattr(engine, "weight_fingerprints") else None


class EngineHost:
    """An engine in a process of its own: the engine's methods, and whole rollouts made in
    that process (`generate_rollout`: prompts, the generate_fn's client loop, decoding, rewards),
    so that with train.async only the finished samples reach the driver, whose thread trains
    meanwhile and keeps the interpreter to itself."""

    def __init__(self, engine):
        self.engine, self.rollout = engine, None

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def weight_fingerprints(self, names: list[str], salt: int) -> dict | None:
        return sample(self.engine, names, salt)

    def set_rollout(self, task, tokenizer, rollout_cfg) -> None:
        """What every rollout made here needs; sent once."""
        self.rollout = task, tokenizer, rollout_cfg

    def generate_rollout(self, rollout_id: int, seed: int) -> tuple[list, dict]:
        task, tokenizer, rollout_cfg = self.rollout
        return generate_rollout(self.engine, task, tokenizer, rollout_cfg, rollout_id, seed)

    def generate_partial_rollout(self, rollout_id: int, seed: int, *partial) -> tuple[list, dict, list]:
        task, tokenizer, rollout_cfg = self.rollout
        return generate_partial_rollout(self.engine, task, tokenizer, rollout_cfg, rollout_id, seed, *partial)


class InDriver:
    """Engines as objects in the driver process."""

    def __init__(self, engines: list, devices: list[str]):
        self.engines, self.devices = engines, devices

    def __len__(self) -> int:
        return len(self.engines)

    def map(self, method: str, args: list[tuple], engines: list[int] | None = None) -> list:
        """`method(*args[k])` on engine engines[k] (default: engine k), results in that order."""
        results = []
        for i, a in zip(engines or range(len(args)), args, strict=True):
            try:
                results.append(getattr(self.engines[i], method)(*a))
            except Exception as e:
                e.add_note(f"in rollout engine {i} (in the driver: node {socket.gethostname()}, "
                           f"pid {os.getpid()})")
                raise
        return results

    def share(self, obj):
        return obj

    def placement(self) -> list[dict]:
        return [{"engine": i, **on_this_host(os.getpid(), device)} for i, device in enumerate(self.devices)]

    def kill(self) -> None:
        self.engines = []


class EngineGroup:
    """Rollout engine interface over N engines (InDriver or RayHosts)."""

    def __init__(self, hosts, rollout_cfg):
        self.hosts, self.rollout_cfg = hosts, rollout_cfg
        self._sync_metadata = None  # (name, dtype, shape) of what NCCL weight sync broadcasts
        self._rollout_set = False  # generate_rollout's task, tokenizer and config sent to the engine

    @property
    def num_engines(self) -> int:
        return len(self.hosts)

    def _all(self, method: str, *args) -> list:
        return self.hosts.map(method, [args] * self.num_engines)

    def generate_rollout(self, task, tokenizer, rollout_cfg, rollout_id: int, seed: int) -> tuple[list, dict]:
        """One rollout (relax/rollout/generate.py). A single engine in a process of its own
        (train.async on cluster=local, or cluster=ray) makes it there; otherwise it is made
        here, each engine call spread over the engines."""
        if self.num_engines > 1 or isinstance(self.hosts, InDriver):
            return generate_rollout(self, task, tokenizer, rollout_cfg, rollout_id, seed)
        self._set_rollout(task, tokenizer, rollout_cfg)
        return self._all("generate_rollout", rollout_id, seed)[0]

    def generate_partial_rollout(self, task, tokenizer, rollout_cfg, rollout_id: int, seed: int,
                                 *partial) -> tuple[list, dict, list]:
        """One partial rollout (relax/rollout/partial.py; one engine), made where generate_rollout
        makes one."""
        if isinstance(self.hosts, InDriver):
            return generate_partial_rollout(self, task, tokenizer, rollout_cfg, rollout_id, seed, *partial)
        self._set_rollout(task, tokenizer, rollout_cfg)
        return self._all("generate_partial_rollout", rollout_id, seed, *partial)[0]

    def _set_rollout(self, task, tokenizer, rollout_cfg) -> None:
        if not self._rollout_set:
            self._all("set_rollout", task, tokenizer, rollout_cfg)
            self._rollout_set = True

    def generate(self, prompts: list[list[int]], sp, seed: int | list[int], **partial) -> list:
        """`seed`: the rollout's (prompt i is sample i), or one per prompt (relax.rollout.client);
        `partial`: a partial rollout's `done` and `until`, for its one engine."""
        if partial:
            return self.hosts.map("generate", [(prompts, sp, seed, 0, partial["done"], partial["until"])])[0]
        n, total = self.num_engines, len(prompts)
        bounds = [total * i // n for i in range(n + 1)]  # contiguous: a GRPO group stays together
        # the first share starts at sample 0: an engine that runs alone needs no first_index
        shares = [(prompts[a:b], sp, seed[a:b]) if isinstance(seed, list) else
                  (prompts[a:b], sp, seed, a) if a else (prompts[a:b], sp, seed)
                  for a, b in zip(bounds, bounds[1:]) if b > a]
        return [g for part in self.hosts.map("generate", shares) for g in part]

    def update_weights(self, named) -> None:
        """Every engine gets the same weights. Through Ray's object store, tensors go in buckets
        of rollout.weight_update_bucket_mb (each stored once, read by every engine), put there
        by trainer rank 0 itself (`refs`: cluster=ray's StoredWeights); disk mode writes one
        checkpoint directory, so it gets them all at once."""
        if self.rollout_cfg.weight_update_mode == "disk" or isinstance(self.hosts, InDriver):
            parts = [named]
        else:
            limit = self.rollout_cfg.weight_update_bucket_mb * 2**20
            parts = getattr(named, "refs", None) or buckets(named, limit)
        for bucket in parts:
            self._all("update_weights", self.hosts.share(bucket))

    def update_weights_from_trainer(self, trainer) -> None:
        """rollout.weight_update_mode=distributed (GPU): per engine, an NCCL group of trainer
        rank 0 and the engine's workers at rank 0's node, over which rank 0 broadcasts. Both
        sides block until the other arrives: the ranks are started first (`send`)."""
        tp = self.rollout_cfg.rollout_num_gpus_per_engine
        if self._sync_metadata is None:
            self._sync_metadata = trainer.call("weight_metadata")
            for i in range(self.num_engines):
                host, port = trainer.rank0_address()
                trainer.send("init_weight_sync_group", host, port, 1 + tp, f"relax_sync_{i}")
                self.hosts.map("init_weight_sync", [(host, port, 1 + tp, f"relax_sync_{i}")], [i])
                trainer.collect()
        for i in range(self.num_engines):
            trainer.send("broadcast_weights", f"relax_sync_{i}")
            self.hosts.map("receive_weights", [(self._sync_metadata, f"relax_sync_{i}")], [i])
            trainer.collect()

    def record_layers(self, sequences: list[list[int]]) -> dict:
        """debug.dump_layers: engine 0's module outputs over `sequences` (engines hold the same weights)."""
        return self.hosts.map("record_layers", [(sequences,)], [0])[0]

    def each_named_tensors(self) -> list[dict]:
        """Every engine's tensors by HF name (the engine-weights check compares each)."""
        return self._all("named_tensors")

    def weight_fingerprints(self, names: list[str], salt: int) -> list[dict | None]:
        """Every engine's sample of `names` (relax/rollout/fingerprint.py), taken in its own
        process; None from an engine class without `weight_fingerprints` (a user's)."""
        if isinstance(self.hosts, InDriver):
            return [sample(e, list(names), salt) for e in self.hosts.engines]
        return self._all("weight_fingerprints", list(names), salt)

    def release_memory_occupation(self) -> None:
        self._all("release_memory_occupation")

    def resume_memory_occupation(self) -> None:
        self._all("resume_memory_occupation")

    def placement(self) -> list[dict]:
        return self.hosts.placement()

    def shutdown(self) -> None:
        try:
            self._all("shutdown")
        except RankError:  # an engine already failed, and that error is being raised
            pass
        finally:
            self.hosts.kill()
