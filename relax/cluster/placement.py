"""Placement (cluster=ray): one Ray placement group per job, sized by the debug plan as slime
sizes it (slime/ray/placement_group.py):

    full run, separate    trainer ranks + engines          world_size + num_engines bundles
    full run, colocated   rank i and engine i share one     max(world_size, num_engines) bundles
    rollout_only          engines only (no trainer bundle)  num_engines bundles
    train_only            trainer ranks only (no engine)    world_size bundles

How it works in detail: docs/cluster.md, "Inside `relax/cluster/placement.py`".
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import time
from dataclasses import dataclass

from omegaconf import OmegaConf

from relax.errors import ConfigError

log = logging.getLogger(__name__)
MAX_RESOURCE = 1e14  # what Ray takes as one resource's quantity
ADDRESS = re.compile(r"auto|local|(ray://)?\S+:\d+")  # what ray.init(address=) joins
WAIT_LOG_S = 30  # how often a placement that is still waiting says what it misses


class PlacementTimeout(RuntimeError):
    """The cluster could not give the job its bundles within cluster.placement_timeout_s."""


@dataclass
class BundlePlan:
    bundles: list[dict[str, float]]  # the resources of each bundle, in the order asked
    roles: list[str]                 # each bundle's role: trainer, engine, or shared (colocated)
    num_ranks: int
    num_engines: int
    rank_resources: dict[str, float]    # what a trainer rank's actor takes from its bundle
    engine_resources: dict[str, float]  # what an engine's actor takes from its bundle

    def assign(self, order: list[int]) -> tuple[list[int], list[int]]:
        """The bundle of each rank and of each engine, handed out in `order`."""
        def first(n, roles):
            return [b for b in order if self.roles[b] in roles][:n]
        return first(self.num_ranks, ("trainer", "shared")), first(self.num_engines, ("engine", "shared"))


def _shape(cpus: float, gpus: float, custom) -> dict[str, float]:
    return {k: float(v) for k, v in {"CPU": cpus, "GPU": gpus, **dict(custom)}.items() if v}


def check_ray_keys(cluster, rollout, train) -> None:
    """cluster=ray's start-up refusals (RayCluster.check_config), before Ray starts."""
    c = cluster
    if c.address is not None and not ADDRESS.fullmatch(c.address):
        raise ConfigError(f"cluster.address={c.address!r}: expected auto, host:port or ray://host:port "
                          f"(null: a private Ray instance)")
    if not c.placement_timeout_s > 0:
        raise ConfigError(f"cluster.placement_timeout_s={c.placement_timeout_s}: expected > 0")
    amounts = {f"cluster.{k}": c[k] for k in ("num_cpus_per_rank", "num_gpus_per_rank", "num_cpus_per_engine",
                                              "num_gpus_per_engine")}
    for side in ("rank", "engine"):
        amounts |= {f"cluster.resources_per_{side}.{k}": v for k, v in c[f"resources_per_{side}"].items()}
    for key, amount in amounts.items():
        if not 0 <= amount <= MAX_RESOURCE:
            raise ConfigError(f"{key}={amount}: expected >= 0 and at most {MAX_RESOURCE:.0e} (Ray's largest "
                              f"resource quantity)")
    for side in ("rank", "engine"):
        if not _shape(c[f"num_cpus_per_{side}"], c[f"num_gpus_per_{side}"], c[f"resources_per_{side}"]):
            cpus = c[f"num_cpus_per_{side}"]
            raise ConfigError(f"cluster.num_cpus_per_{side}={cpus}: each {side}'s bundle would reserve "
                              f"nothing (no CPU, GPU or custom resource); expected > 0")
    tp = rollout.rollout_num_gpus_per_engine
    if c.num_gpus_per_engine and c.num_gpus_per_engine != tp:
        raise ConfigError(f"cluster.num_gpus_per_engine={c.num_gpus_per_engine} but each engine runs on "
                          f"rollout.rollout_num_gpus_per_engine={tp} GPUs: make them equal")
    ray_runtime_env(c)
    if rollout.colocate and c.num_gpus_per_engine > max(c.num_gpus_per_rank, 1):
        raise ConfigError(f"cluster=ray with rollout.colocate=true shares one GPU between rank i and "
                          f"engine i; engines of {c.num_gpus_per_engine} GPUs need rollout.colocate=false")


def ray_runtime_env(c) -> dict | None:
    """cluster.runtime_env as Ray takes it: its env_vars' values as strings (Hydra reads
    `env_vars.OMP_NUM_THREADS=4` as the int 4, which Ray refuses only once it has started)."""
    env = OmegaConf.to_container(c.runtime_env, resolve=True) or {}
    env_vars = env.get("env_vars")
    if env_vars is None:
        return env or None
    if not isinstance(env_vars, dict):
        raise ConfigError(f"cluster.runtime_env.env_vars={env_vars!r}: expected a mapping of variable names "
                          f"to values")
    for name, value in env_vars.items():
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigError(f"cluster.runtime_env.env_vars.{name}={value!r}: expected a string or a number "
                              f"(an environment variable's value)")
    env["env_vars"] = {name: str(value).lower() if isinstance(value, bool) else str(value)
                       for name, value in env_vars.items()}
    return env


def plan_bundles(cluster, parallel, rollout, builds_train: bool, builds_rollout: bool,
                 num_engines: int) -> BundlePlan:
    """The bundles a job asks for and which bundle each rank and engine gets."""
    c = cluster
    rank = _shape(c.num_cpus_per_rank, c.num_gpus_per_rank, c.resources_per_rank)
    engine = _shape(c.num_cpus_per_engine, c.num_gpus_per_engine, c.resources_per_engine)
    world = parallel.world_size if builds_train else 0
    engines = num_engines if builds_rollout else 0
    if rollout.colocate and world and engines:
        shared = {k: max(rank.get(k, 0.0), engine.get(k, 0.0)) for k in rank.keys() | engine.keys()}
        half = lambda shape: {k: v / 2 for k, v in shape.items()}  # noqa: E731 (both fit in one bundle)
        n = max(world, engines)
        return BundlePlan([shared] * n, ["shared"] * n, world, engines, half(rank), half(engine))
    return BundlePlan([rank] * world + [engine] * engines, ["trainer"] * world + ["engine"] * engines,
                      world, engines, rank, engine)


def describe(bundles: list[dict[str, float]]) -> str:
    counts: dict[str, int] = {}
    for b in bundles:
        key = "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(b.items())) + "}"
        counts[key] = counts.get(key, 0) + 1
    return " + ".join(f"{n} x {k}" for k, n in counts.items())


def offered() -> str:
    """What the cluster has, in all and free, per node."""
    # optional: ray (relax[ray])
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    per_node = "; ".join(
        f"{n['NodeManagerAddress']} ({n['NodeID'][:8]}): " + ", ".join(
            f"{k} {v:g}" for k, v in sorted(n["Resources"].items())
            if k in ("CPU", "GPU") or not k.startswith(("node:", "memory", "object_store")))
        for n in nodes)
    free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
    return f"{len(nodes)} node(s): {per_node}; free now: {free}"


def reserve(plan: BundlePlan, strategy: str, timeout_s: float):
    """Create the placement group and wait for it (logging what is missing every 30 s); then
    order its bundles by node and device. Returns (group, order, bundle_nodes)."""
    # optional: ray (relax[ray])
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(plan.bundles, strategy=strategy)
    asked = f"{describe(plan.bundles)} ({strategy})"
    start = time.monotonic()
    while not group.wait(min(WAIT_LOG_S, max(timeout_s - (time.monotonic() - start), 0.1))):
        waited = time.monotonic() - start
        if waited >= timeout_s:
            remove_placement_group(group)
            raise PlacementTimeout(
                f"cluster.placement_timeout_s={timeout_s:g}: Ray could not place this job's bundles: "
                f"asked for {asked}; the cluster offers {offered()}")
        log.info("Waiting %.0f s for Ray to place %s; the cluster offers %s", waited, asked, offered())
    return group, *order_bundles(group, plan.bundles)


def order_bundles(group, bundles) -> tuple[list[int], list[dict]]:
    """Bundle indices sorted by (node IP, node id, GPU ids), and where each bundle landed."""
    # optional: ray (relax[ray])
    import ray
    from ray.util import placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    node_of = placement_group_table(group)["bundles_to_node_id"]
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    gpus_of = [[] for _ in bundles]  # a CPU bundle's [] sorts before any GPU's
    gpu_bundles = [i for i, b in enumerate(bundles) if b.get("GPU")]
    if gpu_bundles:  # which GPUs each bundle holds, asked from inside it (as slime does)
        probe = ray.remote(num_cpus=0, num_gpus=0.01)(lambda: [int(g) for g in ray.get_gpu_ids()])
        found = ray.get([probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=i)).remote() for i in gpu_bundles])
        for i, gpus in zip(gpu_bundles, found, strict=True):
            gpus_of[i] = gpus
    devices = [",".join(f"cuda:{g}" for g in gpus) or "cpu" for gpus in gpus_of]

    def key(i):
        ip = ips.get(node_of[i], "")
        try:
            ip_key = tuple(ipaddress.ip_address(ip).packed)
        except ValueError:
            ip_key = tuple(map(ord, ip))
        return ip_key, node_of[i], gpus_of[i]  # GPU ids as numbers: cuda:2 before cuda:10

    where = [{"bundle": i, "node_id": node_of[i], "node_ip": ips.get(node_of[i]), "device": devices[i],
              "resources": bundles[i]} for i in range(len(bundles))]
    return sorted(range(len(bundles)), key=key), where


def check_reachable(address: str) -> None:
    """Fail within seconds, naming the address, where ray.init would retry for minutes. `auto`
    is what Ray would pick (RAY_ADDRESS, else the last cluster `ray start` recorded), which may
    be a cluster that has since stopped."""
    if "://" in address:  # Ray Client: ray.init reports it
        return
    # optional: ray (relax[ray])
    from ray._private.services import canonicalize_bootstrap_address

    try:
        resolved = canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError) as e:
        raise ConfigError(f"cluster.address={address}: {e}") from None
    host, _, port = resolved.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except (OSError, ValueError) as e:
        where = address if resolved == address else f"{address} ({resolved})"
        raise ConfigError(f"cluster.address={where}: no Ray cluster answers there ({e}). Start one with "
                          f"`ray start --head`, or use cluster.address=null for a private instance") from None
