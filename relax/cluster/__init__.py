"""Where trainer ranks and rollout engines run (conf/cluster/): local processes or Ray actors.

How it works in detail: docs/cluster.md, "Inside `relax/cluster/__init__.py`".
"""

from __future__ import annotations

import os

from omegaconf import OmegaConf

from relax.cluster.engine_processes import EngineProcesses
from relax.cluster.engines import EngineGroup, InDriver, make_engine, make_engine_host
from relax.cluster.ranks import LocalRanks, on_this_host
from relax.errors import ConfigError
from relax.rollout import num_engines, uses_gpus
from relax.rollout.prefetch import max_staleness
from relax.rollout.spec import EngineSpec
from relax.targets import load_target
from relax.train import make_trainer, runs_in_driver
from relax.train.spec import TrainerSpec


def check_cluster(cluster, rollout, train):
    """The class `cluster._target_` names, imported, after its start-up refusals (check_config):
    relax.startup.prepare calls this with its other checks, before it writes anything."""
    cls = load_target(cluster, "cluster")
    if hasattr(cls, "check_config"):
        cls.check_config(cluster, rollout, train)
    return cls


def open_cluster(cluster, rollout, train, algo, parallel, run_dir):
    """The cluster, built from the groups it reads: its own, and what it places (engines of
    `rollout`, trainer ranks of `train`, `algo`, `parallel`)."""
    return check_cluster(cluster, rollout, train)(cluster, rollout, train, algo, parallel, run_dir)


class LocalCluster:
    @staticmethod
    def check_config(cluster, rollout, train) -> None:
        if max_staleness(train) and uses_gpus(rollout):
            raise ConfigError("train.max_staleness > 0 (or train.async=true) on cluster=local with GPUs: the "
                              "engines start at cuda:0, where trainer rank 0 runs, so generation and training would share a device; "
                              "use cluster=ray, whose placement group gives engines GPUs of their own")

    def __init__(self, cluster, rollout, train, algo, parallel, log_dir):
        self.rollout, self.train, self.algo, self.parallel = rollout, train, algo, parallel
        self.log_dir = str(log_dir) if log_dir else None
        self.engines = self.trainer = None

    def build(self, engine_spec: EngineSpec | None, trainer_spec: TrainerSpec | None):
        """Returns (engines, trainer), None for what is not asked."""
        if engine_spec:
            self.engines = self._engines(engine_spec)
        if trainer_spec:
            self.trainer = self._trainer(trainer_spec)
        return self.engines, self.trainer

    def _engines(self, spec: EngineSpec):
        r, engines = self.rollout, []
        tp = r.rollout_num_gpus_per_engine
        devices = [f"cuda:{i * tp}" if uses_gpus(r) else "cpu" for i in range(num_engines(r))]
        if max_staleness(self.train):  # generation overlaps training: each engine in a process of its own
            plain = OmegaConf.to_container(r, resolve=True)  # picklable, no resolvers needed
            return EngineGroup(EngineProcesses(make_engine_host, (plain, spec), devices,
                                               [i * tp for i in range(len(devices))], self.log_dir,
                                               self.train.num_threads), r)
        try:
            for i in range(len(devices)):
                engines.append(make_engine(r, spec, base_gpu_id=i * tp))
        except BaseException:
            for engine in engines:
                engine.shutdown()
            raise
        return EngineGroup(InDriver(engines, devices), r)

    def _trainer(self, spec: TrainerSpec):
        groups = (self.train, self.algo, self.parallel)
        if runs_in_driver(self.train, self.parallel, self.rollout.weight_update_mode):
            return make_trainer(*groups, spec)

        plain = [OmegaConf.to_container(g, resolve=True) for g in groups]  # picklable, no resolvers needed
        trainer = load_target(self.train, "train")
        return LocalRanks(make_trainer, self.parallel.world_size, args=(*plain, spec), log_dir=self.log_dir,
                          num_threads=self.train.num_threads,
                          preload=(trainer.__module__, *getattr(trainer, "rank_imports", ())))

    def placement(self) -> dict:
        if self.trainer is None or hasattr(self.trainer, "placement"):
            ranks = self.trainer.placement() if self.trainer else []
        else:  # the trainer runs in the driver
            ranks = [{"rank": 0, **on_this_host(os.getpid(), "cpu")}]
        return {"cluster": "local", "trainer_ranks": ranks,
                "engines": self.engines.placement() if self.engines else []}

    def close(self) -> None:
        if self.engines is not None:  # engine processes that a failed build left behind
            self.engines.hosts.kill()
        self.engines = self.trainer = None
