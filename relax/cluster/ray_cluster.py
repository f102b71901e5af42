"""cluster=ray: trainer ranks and rollout engines as Ray actors in one placement group.

How it works in detail: docs/cluster.md, "Inside `relax/cluster/ray_cluster.py`".
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import signal
import time
import traceback

import torch
from omegaconf import OmegaConf

from relax.targets import require_extra

try:
    import ray
except ImportError:
    require_extra("cluster=ray", "ray")  # not installed: name the extra, not the module
    raise  # installed, but broken: its own error
from ray._private import ray_constants
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from relax.cluster.engines import EngineGroup, make_engine_host
from relax.cluster.placement import check_ray_keys, check_reachable, plan_bundles, ray_runtime_env, reserve
from relax.cluster.ranks import (RankError, RankGroup, freeze_heap, open_store, run_method, start_rank,
                                 thread_lock_for_progress_bars)
from relax.cluster.ray_hosts import RayHosts
from relax.cluster.ray_sockets import reach_by_socket, serve
from relax.cluster.ray_weights import Tensors
from relax.reaper import Reaper
from relax.distributed import free_port
from relax.errors import USER_ERRORS, ConfigError
from relax.process import sigterm_left_to_the_driver
from relax.rollout import buckets, num_engines
from relax.rollout.spec import EngineSpec
from relax.train import make_trainer
from relax.train.spec import TrainerSpec

log = logging.getLogger(__name__)


class Host:
    """Inside a Ray actor: one trainer rank or one engine. Builds its object, runs calls on it."""

    def __init__(self, role: str, index: int, num_threads: int, authkey: bytes | None = None):
        """`authkey`: the driver's multiprocessing key, taken before anything here starts a
        process, so that the job shares one key as a local process tree does (ray_sockets.py)."""
        if authkey:
            multiprocessing.current_process().authkey = authkey
        self.role, self.index, self.obj, self.store = role, index, None, None
        faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints a hung actor's stacks
        thread_lock_for_progress_bars()  # (Ray kills its actors)
        torch.set_num_threads(num_threads)

    def where(self) -> tuple:
        gpus = ray.get_gpu_ids()
        return _guarded(lambda: {
            "node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(), "device": ",".join(f"cuda:{g}" for g in gpus) if gpus else "cpu"})

    def address(self) -> tuple[str, int]:
        """This node's address and a port free on it (for a weight-sync group with rank 0)."""
        return ray.util.get_node_ip_address(), free_port()

    def open_store(self, world_size: int) -> tuple[str, int]:
        """Rank 0: the trainer's rendezvous store, here; where the other ranks find it."""
        self.store = open_store(world_size)
        return ray.util.get_node_ip_address(), self.store.port

    def build(self, factory, args, kwargs, rank_setup: dict | None = None):
        def build():
            if rank_setup:
                start_rank(**rank_setup, store=self.store)
            self.obj = factory(*args, **kwargs)
            freeze_heap()
        return _guarded(build)

    def call(self, method: str, args, kwargs, keep_result: bool = True, bucket_bytes: int | None = None):
        """`bucket_bytes`: the result is weights, put into the object store here in buckets of
        that size (each as one buffer: Tensors); their refs are returned (StoredWeights)."""
        def call():
            # a shared object (weights put once into Ray's object store, read by every engine)
            a = [ray.get(x) if isinstance(x, ray.ObjectRef) else x for x in args]
            result = run_method(self.obj, self.index, method, a, kwargs) if self.role == "trainer rank" \
                else getattr(self.obj, method)(*a, **kwargs)
            if not keep_result:
                return None
            if bucket_bytes is None:
                return result
            return [ray.put(Tensors(bucket)) for bucket in buckets(result, bucket_bytes)]
        return _guarded(call)

    def serve(self, path: str) -> tuple:
        """The driver's calls through a Unix socket at `path`, until it closes (ray_sockets.py)."""
        return _guarded(lambda: serve(self, path))


def _guarded(fn) -> tuple:
    """("ok", result), or ("error", the traceback, the exception if it is a user error)."""
    try:
        return "ok", fn()
    except Exception as e:
        return "error", traceback.format_exc(), e if isinstance(e, USER_ERRORS) else None


class RayRanks(RankGroup):
    """The RankGroup contract (relax/cluster/ranks.py) over Host actors."""

    def __init__(self, hosts: RayHosts, bucket_bytes: int):
        self.hosts, self.bucket_bytes, self._refs, self.busy = hosts, bucket_bytes, [], False

    def send(self, method: str, *args, **kwargs) -> None:
        self._send(method, args, kwargs)

    def _send(self, method: str, args: tuple, kwargs: dict, bucket_bytes: int | None = None) -> None:
        self.busy = True
        self._refs = [self.hosts.start(rank, method, args, kwargs, rank == 0, bucket_bytes)
                      for rank in range(len(self.hosts))]

    def _stored(self, method: str):
        self._send(method, (), {}, self.bucket_bytes)
        return self.hosts.weights(self.collect())

    def named_weights(self):
        return self._stored("named_weights")

    def synced_weights(self):
        return self._stored("synced_weights")

    def collect(self):
        result = self.hosts.collect(self._refs)[0]
        self.busy = False
        return result

    def rank0_address(self) -> tuple[str, int]:
        return self.hosts.address(0)

    def placement(self) -> list[dict]:
        return self.hosts.placement()

    def shutdown(self):
        if self.hosts.actors and not self.busy:  # busy: aborted mid-call (Ctrl-C twice): kill at once
            try:
                self.call("shutdown")
            except RankError:
                pass
        self.hosts.kill()


def keep_sigterm_in_the_driver() -> None:
    """Before the driver connects: no Abseil failure-signal handler in its core worker. It takes
    SIGTERM (and SIGSEGV, SIGABRT...) at ray.init, Relax's Stop takes SIGTERM back, and at
    ray.shutdown Ray reset them all to the system default, behind Python's back: a SIGTERM
    while Ray stopped (seconds) killed the driver before it wrote its status (`running`, as if
    it had died). Ray's switch is RAY_DISABLE_FAILURE_SIGNAL_HANDLER, read at import; set here
    for this process alone, the actors keep their handler (and its C++ stack on a crash)."""
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


class RayCluster:
    check_config = staticmethod(check_ray_keys)

    def __init__(self, cluster, rollout, train, algo, parallel, log_dir):
        self.cluster, self.rollout, self.train = cluster, rollout, train
        self.algo, self.parallel = algo, parallel
        self.log_dir = str(log_dir)
        self.connected = self.owned = self.private = False  # owned: ray.init was ours to undo
        self.reaper = self.group = None
        self.hosts: list[RayHosts] = []
        self.bundle_where: list[dict] = []

    def _connect(self, needs: dict[str, float]) -> None:
        c = self.cluster
        runtime_env = ray_runtime_env(c)
        if ray.is_initialized():  # inside a Ray task (e.g. a sweep on Ray): use its cluster
            log.info("Already connected to Ray: this job's actors join that cluster")
            self.connected = True
            return
        keep_sigterm_in_the_driver()
        if c.address is None:  # a new private instance (even where RAY_ADDRESS is set), sized to fit the job
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            self.reaper = Reaper()
            custom = {k: v for k, v in needs.items() if k not in ("CPU", "GPU")}
            num_cpus = max(os.cpu_count() or 1, int(-(-needs.get("CPU", 0) // 1)))
            with sigterm_left_to_the_driver():  # (Ray's stop then waits longer per process type: docs/results.md)
                ray.init(address="local", num_cpus=num_cpus, resources=custom or None,
                         include_dashboard=False, runtime_env=runtime_env, logging_level=logging.WARNING)
            self.private = True
        else:
            check_reachable(c.address)
            try:
                ray.init(address=c.address, runtime_env=runtime_env, logging_level=logging.WARNING)
            except ConnectionError as e:
                raise ConfigError(f"cluster.address={c.address}: {e}") from None
        self.connected = self.owned = True
        log.info("Ray %s at %s (%s)", ray.__version__, ray.get_runtime_context().gcs_address,
                 "private instance" if self.private else "joined")

    def build(self, engine_spec: EngineSpec | None, trainer_spec: TrainerSpec | None):
        """Start every engine and trainer rank; returns (engines, trainer)."""
        plan = plan_bundles(self.cluster, self.parallel, self.rollout, trainer_spec is not None,
                            engine_spec is not None, num_engines(self.rollout))
        needs: dict[str, float] = {}
        for bundle in plan.bundles:
            for k, v in bundle.items():
                needs[k] = needs.get(k, 0) + v
        self._connect(needs)
        t0 = time.perf_counter()
        self.group, order, self.bundle_where = reserve(plan, self.cluster.placement_strategy,
                                                       self.cluster.placement_timeout_s)
        rank_bundles, engine_bundles = plan.assign(order)
        threads = self.train.num_threads
        ranks = self._start("trainer rank", rank_bundles, plan.rank_resources, threads)
        engines = self._start("rollout engine", engine_bundles, plan.engine_resources, threads)
        started = [(hosts, [a.where.remote() for a in hosts.actors]) for hosts in (ranks, engines)]
        for hosts, refs in started:  # every actor starts at once; this waits for them all
            hosts.where = hosts.collect(refs)
        builds = []
        if engines.actors:
            rollout = OmegaConf.to_container(self.rollout, resolve=True)  # picklable, no resolvers needed
            args = [(make_engine_host, (rollout, engine_spec), {"base_gpu_id": 0})] * len(engines)
            builds.append((engines, [a.build.remote(*x) for a, x in zip(engines.actors, args, strict=True)]))
        if ranks.actors:
            address, port = ray.get(ranks.actors[0].open_store.remote(len(ranks)))
            groups = [OmegaConf.to_container(g, resolve=True)  # picklable, no resolvers needed
                      for g in (self.train, self.algo, self.parallel)]
            builds.append((ranks, [actor.build.remote(
                make_trainer, (*groups, trainer_spec), {"rank": r, "world_size": len(ranks)},
                dict(rank=r, world_size=len(ranks), address=address, port=port, log_dir=self.log_dir,
                     num_threads=threads, device_index=0)) for r, actor in enumerate(ranks.actors)]))
        for hosts, refs in builds:
            hosts.collect(refs)  # on an error: its actors stopped here, the others by close()
        if self.cluster.same_node_sockets:
            self.hosts = [ranks, engines] = [reach_by_socket(hosts) for hosts in self.hosts]
        log.info("Ray actors ready in %.1f s: %d trainer rank(s), %d engine(s)", time.perf_counter() - t0,
                 len(ranks), len(engines))
        return (EngineGroup(engines, self.rollout) if engines.actors else None,
                RayRanks(ranks, self.rollout.weight_update_bucket_mb * 2**20) if ranks.actors else None)

    def _start(self, role: str, bundles: list[int], resources: dict, threads: int) -> RayHosts:
        options = dict(num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
                       resources={k: v for k, v in resources.items() if k not in ("CPU", "GPU")},
                       max_restarts=0)
        authkey = bytes(multiprocessing.current_process().authkey)
        actors = [ray.remote(Host).options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=b)).remote(role, i, threads, authkey)
            for i, b in enumerate(bundles)]
        hosts = RayHosts(role, actors, bundles)
        self.hosts.append(hosts)
        return hosts

    def placement(self) -> dict:
        c = self.cluster
        ranks, engines = self.hosts or (None, None)
        address = ray.get_runtime_context().gcs_address if self.connected else None
        return {"cluster": "ray", "address": address,
                "private_instance": self.private, "strategy": c.placement_strategy,
                "bundles": self.bundle_where, "trainer_ranks": ranks.placement() if ranks else [],
                "engines": engines.placement() if engines else []}

    def close(self) -> None:
        for hosts in self.hosts:
            hosts.kill()
        if self.group is not None:
            try:
                remove_placement_group(self.group)
            except Exception as e:  # Ray already gone (e.g. Ctrl-C reached it first)
                log.warning("Could not remove the placement group: %s", e)
        if self.owned:
            ray.shutdown()
        if self.reaper:
            self.reaper.release()
        self.connected = self.owned = False
        self.group = self.reaper = None
