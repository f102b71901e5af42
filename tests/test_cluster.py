"""cluster=local vs cluster=ray (relax/cluster/): placement, engines, equal numbers, failures.

The Ray tests share one real two-node cluster (`ray.cluster_utils.Cluster`: two raylets on
this machine, 2 CPUs each; node A carries the custom resource `trainer`, node B `rollout`)
and run the loop in-process against it with `cluster.address`; only the tests about a
private instance start their own. Rollouts are tiny: 4 prompts x 4 samples.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from relax.logger import read_metrics
from relax.sample import Sample, Samples

from .conftest import REPO, cluster_of, engine_spec, make_cfg, only_run_dir, relax_cli, run_loop, trainer_spec
from .extras import RAY, require

TINY = ["rollout.num_rollout=2", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
        "checkpoint.save_interval=null"]
TRAIN = ["train.micro_batch_size=8"]


def placement(run_dir) -> dict:
    return json.loads((run_dir / "built.json").read_text())["placement"]


def alive(pid: int) -> bool:
    from relax.reaper import start_time

    return start_time(pid) is not None


def wait_gone(pids, seconds: float) -> list[int]:
    deadline = time.time() + seconds
    while time.time() < deadline and any(map(alive, pids)):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def first_step(run_dir) -> dict:
    return torch.load(run_dir / "first_step_log_probs.pt", weights_only=True)


def assert_same_training(run, reference, logprob_atol: float, grad_rtol: float):
    """`relax compare`'s criteria: first-step per-token log-probs, loss and grad_norm per step."""
    a, b = first_step(run), first_step(reference)
    assert sorted(a) == sorted(b) and len(a) == 16
    worst = max((torch.tensor(a[i]) - torch.tensor(b[i])).abs().max().item() for i in a)
    assert worst <= logprob_atol, worst
    (_, steps), (_, ref_steps) = read_metrics(run), read_metrics(reference)
    assert len(steps) == len(ref_steps) == 4  # 2 rollouts x 2 steps
    for s, r in zip(steps, ref_steps, strict=True):
        assert abs(s["train/grad_norm"] - r["train/grad_norm"]) <= grad_rtol * r["train/grad_norm"]
        assert abs(s["train/loss"] - r["train/loss"]) <= 1e-5


# -- no Ray ----------------------------------------------------------------------------------

def ray_cluster(cfg, run_dir):
    from relax.cluster.ray_cluster import RayCluster

    return RayCluster(cfg.cluster, cfg.rollout, cfg.train, cfg.algo, cfg.parallel, run_dir)


def test_placement_follows_the_debug_plan():
    from relax.cluster.placement import plan_bundles

    cfg = make_cfg("parallel=dp2", "cluster=ray", "cluster.num_cpus_per_engine=2")
    separate = plan_bundles(cfg.cluster, cfg.parallel, cfg.rollout, True, True, num_engines=3)
    assert separate.bundles == [{"CPU": 1.0}] * 2 + [{"CPU": 2.0}] * 3
    # bundles come back from Ray sorted by node: ranks and engines keep their own bundles
    assert separate.assign([4, 0, 2, 1, 3]) == ([0, 1], [4, 2, 3])
    rollout_only = plan_bundles(cfg.cluster, cfg.parallel, cfg.rollout, False, True, num_engines=3)
    assert rollout_only.bundles == [{"CPU": 2.0}] * 3 and rollout_only.assign([2, 1, 0]) == ([], [2, 1, 0])
    train_only = plan_bundles(cfg.cluster, cfg.parallel, cfg.rollout, True, False, num_engines=3)
    assert train_only.bundles == [{"CPU": 1.0}] * 2 and train_only.assign([1, 0]) == ([1, 0], [])
    shared = make_cfg("parallel=dp2", "cluster=ray", "cluster.num_gpus_per_rank=1", "rollout.colocate=true")
    colocated = plan_bundles(shared.cluster, shared.parallel, shared.rollout, True, True, num_engines=3)
    assert colocated.bundles == [{"CPU": 1.0, "GPU": 1.0}] * 3  # max(2 ranks, 3 engines), shared
    assert colocated.rank_resources == {"CPU": 0.5, "GPU": 0.5}
    assert colocated.assign([2, 0, 1]) == ([2, 0], [2, 0, 1])
    # colocated but rollout-only: nothing to share, each engine's bundle is its own, whole
    engines_only = plan_bundles(shared.cluster, shared.parallel, shared.rollout, False, True, num_engines=3)
    assert engines_only.bundles == [{"CPU": 1.0}] * 3 and engines_only.roles == ["engine"] * 3
    assert engines_only.engine_resources == {"CPU": 1.0}


@pytest.mark.parametrize("overrides,message", [
    (["cluster.placement_timeout_s=0"], "cluster.placement_timeout_s=0.0: expected > 0"),
    (["cluster.num_gpus_per_rank=-1"], "cluster.num_gpus_per_rank=-1.0: expected >= 0"),
    (["cluster.num_gpus_per_engine=1", "rollout.rollout_num_gpus_per_engine=2"],
     "cluster.num_gpus_per_engine=1.0 but each engine runs on rollout.rollout_num_gpus_per_engine=2"),
    (["cluster.num_gpus_per_engine=2", "rollout.rollout_num_gpus_per_engine=2", "cluster.num_gpus_per_rank=1",
      "rollout.colocate=true"], "engines of 2.0 GPUs need rollout.colocate=false"),
    (["+cluster.runtime_env.env_vars.X=[1,2]"],
     "cluster.runtime_env.env_vars.X=[1, 2]: expected a string or a number"),
    (["+cluster.runtime_env.env_vars=7"], "cluster.runtime_env.env_vars=7: expected a mapping"),
], ids=["timeout_0", "negative", "fewer_gpus_than_tp", "colocated_tp2", "env_var_list",
        "env_vars_not_a_mapping"])
def test_cluster_keys_are_refused_at_their_bounds(overrides, message):
    """check_ray_keys' bounds, each just past the edge: a zero timeout, -1 GPUs, an engine of
    fewer GPUs than its TP, a colocated engine wider than the rank's one GPU."""
    from relax.cluster.placement import check_ray_keys
    from relax.errors import ConfigError

    ok = make_cfg("cluster=ray", "cluster.num_gpus_per_rank=1", "cluster.num_gpus_per_engine=1",
                  "rollout.colocate=true")
    check_ray_keys(ok.cluster, ok.rollout, ok.train)  # one GPU each, shared: accepted
    cfg = make_cfg("cluster=ray", *overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_ray_keys(cfg.cluster, cfg.rollout, cfg.train)


def test_runtime_env_vars_reach_ray_as_strings():
    """Hydra reads `env_vars.OMP_NUM_THREADS=4` as an int, which Ray refuses once started."""
    from relax.cluster.placement import ray_runtime_env

    cfg = make_cfg("cluster=ray", "+cluster.runtime_env.env_vars.OMP_NUM_THREADS=4",
                   "+cluster.runtime_env.env_vars.SCALE=0.5", "+cluster.runtime_env.env_vars.FLAG=true",
                   "+cluster.runtime_env.env_vars.NAME=abc", "+cluster.runtime_env.working_dir=/w")
    env_vars = {"OMP_NUM_THREADS": "4", "SCALE": "0.5", "FLAG": "true", "NAME": "abc"}
    assert ray_runtime_env(cfg.cluster) == {"env_vars": env_vars, "working_dir": "/w"}
    assert ray_runtime_env(make_cfg("cluster=ray").cluster) is None


def test_bundles_are_ordered_by_node_ip_as_a_number_then_by_device(monkeypatch):
    """order_bundles sorts by node IP (10.0.0.2 before 10.0.0.10: numerically, not as text),
    not by node id, then by the GPU ids each bundle holds (asked from inside it; cuda:2 before
    cuda:10, numerically), so rank 0 sits on the first node and neighbouring ranks share a node."""
    require("ray", RAY)
    import ray
    import ray.util

    from relax.cluster.placement import order_bundles

    node_of = {0: "b", 1: "b", 2: "a", 3: "b", 4: "b"}
    gpus = {0: [10], 1: [2], 2: [0], 4: [0]}

    class Probe:  # the GPU ids a probe in bundle i reports
        def options(self, scheduling_strategy):
            self.index = scheduling_strategy.placement_group_bundle_index
            return self

        def remote(self):
            return gpus[self.index]
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "a", "NodeManagerAddress": "10.0.0.10"},
                                               {"NodeID": "b", "NodeManagerAddress": "10.0.0.2"}])
    monkeypatch.setattr(ray.util, "placement_group_table", lambda group: {"bundles_to_node_id": node_of})
    monkeypatch.setattr(ray, "remote", lambda **_: lambda fn: Probe())
    monkeypatch.setattr(ray, "get", list)
    bundles = [{"GPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}, {"CPU": 1.0}, {"GPU": 1.0}]
    order, where = order_bundles(object(), bundles)
    assert order == [3, 4, 1, 0, 2]  # node b (10.0.0.2): cpu, cuda:0, cuda:2, cuda:10; then node a
    assert [w["device"] for w in where] == ["cuda:10", "cuda:2", "cuda:0", "cpu", "cuda:0"]
    assert where[2] == {"bundle": 2, "node_id": "a", "node_ip": "10.0.0.10", "device": "cuda:0",
                        "resources": {"GPU": 1.0}}


@pytest.mark.parametrize("override,message", [
    ("cluster.num_cpus_per_engine=0", "cluster.num_cpus_per_engine=0.0: each engine's bundle would reserve"),
    ("cluster.num_gpus_per_engine=2", "rollout.rollout_num_gpus_per_engine=1"),
])
def test_bad_cluster_keys_fail_before_anything_starts(tmp_path, override, message):
    from relax.errors import ConfigError

    require("ray", RAY)  # cluster=ray without ray is refused first, for that

    with pytest.raises(ConfigError, match=re.escape(message)):
        run_loop(tmp_path, *TINY, "cluster=ray", override)
    assert not (tmp_path / "built.json").exists()


def test_samples_do_not_depend_on_the_engine_count(tiny_path, tokenizer):
    """The same seed gives the same samples from 1, 2 or 3 engines: each sample draws its own
    uniforms (seeded by run seed, rollout id and sample index) and picks its token by inverse
    CDF. Log-probs are compared with a tolerance: a row's logits may differ in the last bits
    when the batch around it differs (CPU matmul blocking, left padding). A token flips only if
    a uniform falls within that difference (~1e-7) of a CDF boundary; the seeds are fixed, so
    this test is deterministic, not flaky."""
    from relax.cluster.engines import EngineGroup, InDriver
    from relax.rollout.generate import generate_rollout
    from relax.rollout.torch_engine import TorchEngine
    from relax.task import build_task

    cfg = make_cfg(*TINY, "rollout.rollout_batch_size=6")
    task = build_task(cfg.task, cfg.seed)

    def rollout(n):
        engines = [TorchEngine(cfg.rollout, engine_spec(cfg, tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
                   for _ in range(n)]
        group = EngineGroup(InDriver(engines, ["cpu"] * n), cfg.rollout)
        return generate_rollout(group, task, tokenizer, cfg.rollout, 1, cfg.seed)[0]

    one, two, three = rollout(1), rollout(2), rollout(3)
    assert len(one) == 24 and len({tuple(s.tokens) for s in one}) > 8  # sampled, not all alike
    for other in (two, three):
        assert [s.tokens for s in other] == [s.tokens for s in one]
        worst = max(abs(a - b) for s, t in zip(other, one, strict=True)
                    for a, b in zip(s.rollout_log_probs, t.rollout_log_probs, strict=True))
        assert worst < 1e-5
    again = rollout(1)
    assert [s.rollout_log_probs for s in again] == [s.rollout_log_probs for s in one]  # bit-equal


class RecordingEngine:
    """An engine that returns, per prompt, (the seed it was given, the sample it is)."""

    def __init__(self, calls):
        self.calls = calls

    def generate(self, prompts, sp, seed, first_index=0):
        self.calls.append((self, len(prompts)))
        if isinstance(seed, list):
            return [(s, p) for s, p in zip(seed, prompts, strict=True)]
        return [(seed, first_index + k) for k in range(len(prompts))]

    def fail(self):
        raise ValueError("boom")


def test_engine_shares_are_contiguous_and_numbered_from_their_first_sample():
    """EngineGroup.generate over 3 engines: 7 prompts go 2 + 2 + 3 in order, each share told the
    index of its first sample (an int seed) or given its own seeds (a list); an engine with no
    prompt is not called; InDriver.map runs the engines it is asked for and names a failing one."""
    from relax.cluster.engines import EngineGroup, InDriver

    calls = []
    engines = [RecordingEngine(calls) for _ in range(3)]
    group = EngineGroup(InDriver(engines, ["cpu"] * 3), make_cfg().rollout)
    assert group.generate(list(range(7)), None, 5) == [(5, i) for i in range(7)]
    assert calls == [(engines[0], 2), (engines[1], 2), (engines[2], 3)]
    seeds = [10 + i for i in range(7)]
    assert group.generate(list(range(7)), None, seeds) == [(10 + i, i) for i in range(7)]
    calls.clear()
    assert group.generate([0, 1], None, 5) == [(5, 0), (5, 1)]
    assert calls == [(engines[0], 1), (engines[1], 1)]  # 3 engines, 2 prompts: the last idles
    assert group.hosts.map("generate", [([0], None, 9, 4)], [2]) == [[(9, 4)]] and calls[-1][0] is engines[2]
    with pytest.raises(ValueError, match="boom") as raised:
        group.hosts.map("fail", [()], [1])
    assert any(note.startswith("in rollout engine 1 (in the driver") for note in raised.value.__notes__)


class FakeHosts:
    """Engines in processes of their own, as EngineGroup sees them: what was run, on which."""

    def __init__(self, n, fail=None):
        self.n, self.calls, self.killed, self.fail = n, [], False, fail

    def __len__(self):
        return self.n

    def map(self, method, args, engines=None):
        if self.fail:
            raise self.fail
        self.calls.append((method, args))
        return [None] * len(args)

    def share(self, obj):
        return ("shared", obj)

    def kill(self):
        self.killed = True


def test_engines_in_processes_get_weights_in_buckets_or_at_once_and_shutdown_survives_a_failure():
    """Every engine gets every bucket (rollout.weight_update_bucket_mb, in order) or, through
    rank 0's object-store refs, those refs; disk mode sends all at once. Shutdown after an engine
    failed still kills the engines and lets the first error be the one raised."""
    from relax.cluster.engines import EngineGroup
    from relax.cluster.ranks import RankError

    named = {"a": torch.zeros(2**17), "b": torch.zeros(2**17), "c": torch.zeros(2**18)}  # MiB: 0.5, 0.5, 1
    hosts = FakeHosts(2)
    EngineGroup(hosts, make_cfg("rollout.weight_update_bucket_mb=1").rollout).update_weights(named)
    assert [[list(arg[0][1]) for arg in args] for _, args in hosts.calls] == [[["a", "b"]] * 2, [["c"]] * 2]
    hosts = FakeHosts(2)
    EngineGroup(hosts, make_cfg("rollout.weight_update_mode=disk").rollout).update_weights(named)
    assert [len(args) for _, args in hosts.calls] == [2] and hosts.calls[0][1][0][0][1] is named

    class Stored(dict):  # cluster=ray's StoredWeights: rank 0 put the buckets in the object store
        refs = ["ref0", "ref1"]
    hosts = FakeHosts(1)
    EngineGroup(hosts, make_cfg().rollout).update_weights(Stored(named))
    assert hosts.calls == [("update_weights", [(("shared", ref),)]) for ref in ("ref0", "ref1")]
    hosts = FakeHosts(2, fail=RankError("engine 1 died"))
    EngineGroup(hosts, make_cfg().rollout).shutdown()
    assert hosts.killed


@dataclass
class TaggedSample(Sample):  # a user's Sample with a field of its own
    tag: str = ""


def test_a_rollouts_samples_cross_processes_field_by_field_and_arrive_equal(tiny_path, tokenizer, tmp_path):
    """generate_rollout and load_rollout return Samples, which pickle as one list per field
    (to Ray actors, engine and rank processes) where cloudpickle would walk every Sample object:
    every field arrives equal, metadata and routed_experts included; a subclass pickles whole."""
    import pickle

    from relax.cluster.engines import EngineGroup, InDriver
    from relax.replay import load_rollout, save_rollout
    from relax.rollout.generate import generate_rollout
    from relax.rollout.torch_engine import TorchEngine
    from relax.task import build_task

    cfg = make_cfg(*TINY)
    engine = TorchEngine(cfg.rollout, engine_spec(cfg, tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    group = EngineGroup(InDriver([engine], ["cpu"]), cfg.rollout)
    samples, _ = generate_rollout(group, build_task(cfg.task, cfg.seed), tokenizer, cfg.rollout, 0, cfg.seed)
    assert type(samples) is Samples and len(samples) == 16
    samples[0].metadata["turns"] = [{"role": "tool", "content": "4"}]
    samples[1].routed_experts = list(range(len(samples[1].tokens) - 1))
    blob = pickle.dumps(samples)
    assert len(blob) < 0.9 * len(pickle.dumps(list(samples)))  # field names and class once, not per sample
    arrived = pickle.loads(blob)
    assert type(arrived) is Samples and arrived == samples and arrived[2].routed_experts is None
    save_rollout(tmp_path / "0.pt", 0, samples, {})
    _, loaded = load_rollout(tmp_path / "0.pt")
    assert type(loaded) is Samples and loaded == samples
    tagged = Samples([TaggedSample(**samples[0].to_dict(), tag="kept")])
    assert pickle.loads(pickle.dumps(tagged)) == tagged and pickle.loads(pickle.dumps(Samples())) == []


def test_cluster_local_never_imports_ray(tmp_path, tiny_path):
    code = ("import sys\nfrom pathlib import Path\nfrom tests.conftest import run_loop\n"
            f"run_loop(Path({str(tmp_path)!r}), *{TINY!r}, 'rollout.num_engines=2')\n"
            "print('ray' in sys.modules, sorted(m for m in sys.modules if m.startswith('relax.cluster')))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == "False", proc.stdout
    assert "relax.cluster.ray_cluster" not in proc.stdout
    assert len(placement(tmp_path)["engines"]) == 2


@pytest.mark.parametrize("auto", [False, True], ids=["host:port", "auto"])
def test_an_unreachable_address_fails_fast_naming_it(tmp_path, monkeypatch, auto):
    require("ray", RAY)
    from relax.distributed import free_port
    from relax.errors import ConfigError

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    if auto:  # where `auto` leads (RAY_ADDRESS, or the file of a cluster that has stopped)
        monkeypatch.setenv("RAY_ADDRESS", address)
    port = address.rpartition(":")[2]
    named = rf"auto \([\d.]+:{port}\)" if auto else rf"{address} \([\d.]+:{port}\)"  # and where it leads
    start = time.monotonic()
    with pytest.raises(ConfigError, match=rf"cluster.address={named}: no Ray cluster answers there"):
        run_loop(tmp_path, *TINY, "cluster=ray", f"cluster.address={'auto' if auto else address}")
    assert time.monotonic() - start < 30


class FakeReaper:  # stands in for relax.reaper.Reaper (no process started)
    def __init__(self):
        self.released = False

    def release(self):
        self.released = True


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.init / shutdown / is_initialized recorded instead of run: RayCluster's own decisions."""
    require("ray", RAY)
    import ray

    from relax.cluster import ray_cluster

    calls = {"init": [], "shutdown": 0, "initialized": False}
    monkeypatch.setattr(ray, "is_initialized", lambda: calls["initialized"])
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls["init"].append(kwargs))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("Context", (), {"gcs_address": "here:1"}))
    monkeypatch.setattr(ray_cluster, "Reaper", FakeReaper)
    monkeypatch.setattr(ray_cluster, "check_reachable", lambda address: None)
    return calls


def test_a_private_instance_fits_the_jobs_cpus_and_resources_and_is_stopped_with_its_reaper(
        fake_ray, tmp_path):
    """cluster.address=null: ray.init gets at least the CPUs the bundles need (rounded up), the
    custom resources and the runtime_env; close() shuts Ray down and releases the reaper."""
    import os

    cluster = ray_cluster(make_cfg("cluster=ray", "+cluster.runtime_env.env_vars.X=abc"), tmp_path)
    cpus = os.cpu_count() + 0.5  # more than this machine has, and not whole
    cluster._connect({"CPU": cpus, "GPU": 0, "trainer": 2.0})
    assert fake_ray["init"] == [dict(address="local", num_cpus=os.cpu_count() + 1, resources={"trainer": 2.0},
                                     include_dashboard=False, runtime_env={"env_vars": {"X": "abc"}},
                                     logging_level=logging.WARNING)]
    reaper = cluster.reaper
    assert cluster.private and cluster.owned and isinstance(reaper, FakeReaper)
    assert cluster.placement()["private_instance"] and cluster.placement()["address"] == "here:1"
    cluster.close()
    assert fake_ray["shutdown"] == 1 and reaper.released and cluster.reaper is None


def test_a_joined_or_enclosing_ray_is_left_running_and_a_refused_address_is_named(fake_ray, tmp_path,
                                                                                  monkeypatch):
    """Already connected (a sweep's Ray task): nothing started, nothing shut down at close.
    cluster.address=...: no private instance; ray.init's ConnectionError names the key."""
    from relax.errors import ConfigError

    fake_ray["initialized"] = True
    cluster = ray_cluster(make_cfg("cluster=ray"), tmp_path)
    cluster._connect({"CPU": 1})
    assert fake_ray["init"] == [] and cluster.connected and not cluster.owned and cluster.reaper is None
    cluster.close()
    assert fake_ray["shutdown"] == 0
    fake_ray["initialized"] = False
    cluster = ray_cluster(make_cfg("cluster=ray", "cluster.address=10.0.0.1:6379"), tmp_path)
    cluster._connect({"CPU": 1})
    joined = dict(address="10.0.0.1:6379", runtime_env=None, logging_level=logging.WARNING)
    assert fake_ray["init"] == [joined]
    assert cluster.owned and not cluster.private and cluster.reaper is None
    assert not cluster.placement()["private_instance"]
    cluster.close()
    assert fake_ray["shutdown"] == 1

    def refuse(**kwargs):
        raise ConnectionError("the GCS did not answer")
    monkeypatch.setattr("ray.init", refuse)
    with pytest.raises(ConfigError, match=r"^cluster.address=10.0.0.1:6379: the GCS did not answer$"):
        ray_cluster(make_cfg("cluster=ray", "cluster.address=10.0.0.1:6379"), tmp_path)._connect({"CPU": 1})


def test_ray_hosts_collect_in_order_raise_user_errors_as_themselves_and_a_peers_death_first(monkeypatch):
    """RayHosts.collect with ray.wait/get faked (replies arrive last actor first): results in
    the order asked; a user error raised as itself, noting the actor; a traceback after a peer
    died reports the death first; any failure kills every actor."""
    require("ray", RAY)
    import ray

    from relax.cluster.ray_cluster import RayHosts
    from relax.cluster.ranks import RankError
    from relax.errors import ConfigError

    replies, killed = {}, []

    def get(ref):
        if isinstance(replies[ref], Exception):
            raise replies[ref]
        return replies[ref]
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout=None: (refs[::-1][:num_returns], []))
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: killed.append(actor))

    def hosts(*answers) -> RayHosts:
        replies.clear()
        killed.clear()
        replies.update({f"ref{i}": a for i, a in enumerate(answers)})
        group = RayHosts("trainer rank", ["actor0", "actor1"], [0, 1])
        group.where = [{"node_ip": "10.0.0.1", "node_id": "abcdef0123", "pid": 100 + i} for i in range(2)]
        return group
    assert hosts(("ok", "a"), ("ok", "b")).collect(["ref0", "ref1"]) == ["a", "b"] and killed == []
    with pytest.raises(ConfigError, match="^bad key") as raised:
        hosts(("ok", "a"), ("error", "Traceback", ConfigError("bad key"))).collect(["ref0", "ref1"])
    assert raised.value.__notes__ == ["in trainer rank 1 (node 10.0.0.1 (abcdef01), pid 101)"]
    assert killed == ["actor0", "actor1"]
    with pytest.raises(RankError, match=r"^trainer rank 0 \(node 10.0.0.1 \(abcdef01\), pid 100\) died: The "
                                        r"actor .*\nThen trainer rank 1 \(.*pid 101\) failed:\nTraceback: "
                                        r"connection reset$"):
        hosts(ray.exceptions.RayActorError(), ("error", "Traceback: connection reset", None)).collect(
            ["ref0", "ref1"])
    assert killed == ["actor0", "actor1"]


def test_ray_ranks_keep_only_rank_0s_result_and_an_aborted_call_is_not_waited_on(monkeypatch):
    """RayRanks over fake actors: every rank runs the call, only rank 0 keeps (and, for weights,
    stores) its result, which is the one returned; shutdown calls `shutdown` on the ranks unless
    a call is still in flight (Ctrl-C twice), and kills them either way."""
    require("ray", RAY)
    import ray

    from relax.cluster.ray_cluster import RayHosts, RayRanks

    class Actor:
        def __init__(self, rank):
            self.rank, self.calls = rank, []
            self.call = self  # actor.call.remote(...)

        def remote(self, method, args, kwargs, keep_result, bucket_bytes):
            self.calls.append((method, keep_result, bucket_bytes))
            return ("ok", f"{method} from rank {self.rank}" if keep_result else None)
    killed = []
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout=None: (refs[:num_returns], []))
    monkeypatch.setattr(ray, "get", lambda reply: reply)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: killed.append(actor.rank))
    actors = [Actor(0), Actor(1)]
    ranks = RayRanks(RayHosts("trainer rank", actors, [0, 1]), bucket_bytes=2**20)
    assert ranks.call("train", 0, []) == "train from rank 0" and not ranks.busy
    monkeypatch.setattr("relax.cluster.ray_hosts.StoredWeights", lambda refs: refs)
    assert ranks.named_weights() == "named_weights from rank 0"
    assert [a.calls for a in actors] == [[("train", True, None), ("named_weights", True, 2**20)],
                                         [("train", False, None), ("named_weights", False, 2**20)]]
    ranks.shutdown()
    assert [a.calls[-1][0] for a in actors] == ["shutdown", "shutdown"] and killed == [0, 1]
    actors, killed[:] = [Actor(0), Actor(1)], []
    ranks = RayRanks(RayHosts("trainer rank", actors, [0, 1]), bucket_bytes=2**20)
    ranks.send("train", 0, [])  # interrupted before its collect
    ranks.shutdown()
    assert [a.calls for a in actors] == [[("train", True, None)], [("train", False, None)]]
    assert killed == [0, 1]


def test_socket_hosts_name_an_actor_that_closed_its_socket_or_did_not_serve(monkeypatch):
    """SocketHosts with Ray faked: a socket closed without a reply, its `serve` task ended
    without an error, is reported as that actor closing it, and the group is stopped; a `serve`
    task that ended with an error before it listened is reported as the actor not serving,
    with that error."""
    require("ray", RAY)
    import multiprocessing
    from multiprocessing.connection import Pipe

    import ray

    from relax.cluster.ray_cluster import RayHosts
    from relax.cluster.ray_sockets import SocketHosts, _connect
    from relax.cluster.ranks import RankError

    served, killed = {}, []
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (refs, []))  # serve ended
    monkeypatch.setattr(ray, "get", lambda ref: served[ref])
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: killed.append(actor))
    group = RayHosts("trainer rank", ["actor0"], [0])
    group.where = [{"node_ip": "10.0.0.1", "node_id": "abcdef0123", "pid": 100}]
    driver_end, actor_end = Pipe()
    actor_end.close()  # (its socket, closed with no reply)
    served["serve0"] = ("ok", None)
    hosts = SocketHosts(group, [driver_end], ["serve0"])
    with pytest.raises(RankError, match=r"^trainer rank 0 \(node 10.0.0.1 \(abcdef01\), pid 100\) closed its "
                                        r"socket$"):
        hosts.map("step", [()])
    assert killed == ["actor0"] and hosts.conns == []
    with pytest.raises(RankError, match="the trainer ranks were stopped"):
        hosts.map("step", [()])
    served["serve1"] = ("error", "Traceback ...\nOSError: [Errno 98] Address already in use", None)
    authkey = bytes(multiprocessing.current_process().authkey)
    with pytest.raises(RankError, match=r"^trainer rank 0 \(node .*\) did not serve: Traceback .*\nOSError"):
        _connect(group, 0, "\0relax-test-nobody-listens", "serve1", authkey, time.monotonic() + 5)


def test_an_actor_removes_its_multiprocessing_folder_before_its_shutdown_reply():
    """ray_sockets.serve as an actor runs it (here in a forked process; the driver's end in this
    one): calls and their replies cross the socket, and before its reply to `shutdown` the actor
    removes multiprocessing's temporary folder, which Ray's kill of the actor would leave in /tmp."""
    require("ray", RAY)
    import multiprocessing
    import os
    from multiprocessing.connection import Client
    from pathlib import Path

    from relax.cluster.ray_sockets import serve

    class Host:
        def call(self, method, args, kwargs, keep_result):
            return "ok", multiprocessing.util.get_temp_dir() if method == "temp_dir" else None

    path = f"\0relax-test-{os.getpid()}-temp-dir"

    def actor():
        multiprocessing.process.current_process()._config.pop("tempdir", None)  # its own, not ours
        serve(Host(), path)
        time.sleep(60)  # until killed, as Ray kills an actor: its exit handlers never run
    proc = multiprocessing.get_context("fork").Process(target=actor)
    proc.start()
    deadline = time.monotonic() + 20
    while True:
        try:
            conn = Client(path, family="AF_UNIX", authkey=bytes(multiprocessing.current_process().authkey))
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline and proc.is_alive()
            time.sleep(0.01)
    with conn:
        conn.send(("temp_dir", [], {}, True))
        status, folder = conn.recv()
        assert status == "ok" and Path(folder).is_dir() and Path(folder).name.startswith("pymp-")
        conn.send(("shutdown", [], {}, True))
        assert conn.recv() == ("ok", None) and not Path(folder).exists()
    proc.kill()
    proc.join(10)


def test_weights_cross_ray_as_one_buffer_with_every_dtype_and_shared_storage():
    """cluster=ray's weight sync (ray_weights.Tensors): what arrives equals what was sent, bit
    for bit, in the order sent; tied tensors (one tensor under two names) and the views an MoE's
    fused experts split into included, and bf16, where safetensors alone refuses tensors that
    share memory and numpy has no bf16."""
    require("ray", RAY)
    import pickle

    from relax.cluster.ray_weights import Tensors

    fused = torch.randn(2, 64, 64)
    embed = torch.randn(16, 8)
    sent = {"embed": embed, "experts.0": fused[0], "experts.1": fused[1],
            "bf16": torch.randn(5, 7).bfloat16(), "transposed": torch.randn(3, 4).t(), "int": torch.arange(6),
            "lm_head": embed}
    blob = pickle.dumps(Tensors(sent))
    assert len(blob) < sum(t.nbytes for t in sent.values()) + 2048  # each tensor once, and a header
    received = pickle.loads(blob)
    assert type(received) is dict and list(received) == list(sent)
    for name, t in sent.items():
        assert received[name].dtype == t.dtype and torch.equal(received[name], t), name


def test_weights_cross_ray_out_of_band_without_a_copy_into_the_pickle():
    """With pickle protocol 5 (Ray's serializer) each tensor's bytes leave as a buffer of their
    own, which Ray copies into its object store once: the pickle itself holds only names,
    dtypes and shapes. As one safetensors `bytes` (before) SmolLM2's 540 MB were copied into
    the pickle and out again: most of a ~2.9 s weight sync. Received, the tensors are views of
    those buffers, not copies."""
    import pickle

    from relax.cluster.ray_weights import Tensors

    sent = {"a": torch.randn(64, 64), "b": torch.randn(3).bfloat16(), "scalar": torch.tensor(2.5)}
    buffers = []
    blob = pickle.dumps(Tensors(sent), protocol=5, buffer_callback=buffers.append)
    assert len(blob) < 1024 and len(buffers) == len(sent)
    assert [len(b.raw()) for b in buffers] == [t.nbytes for t in sent.values()]
    received = pickle.loads(blob, buffers=buffers)
    assert list(received) == list(sent)
    for name, t in sent.items():
        assert received[name].dtype == t.dtype and received[name].shape == t.shape
        assert torch.equal(received[name], t), name
    import numpy as np

    assert received["a"].data_ptr() == np.frombuffer(buffers[0], dtype=np.uint8).ctypes.data  # a view


def test_a_process_that_serves_calls_freezes_its_heap_after_collecting_the_garbage():
    """Ray actors, local ranks and engine processes call freeze_heap once built: garbage from
    start-up is freed (not kept forever), what lives on is frozen (never walked again)."""
    import gc
    import weakref

    from relax.cluster.ranks import freeze_heap

    class Node:
        pass

    garbage = Node()
    garbage.self = garbage  # a cycle: only the collector frees it
    gone = weakref.ref(garbage)
    del garbage
    kept = [Node() for _ in range(100)]
    try:
        freeze_heap()
        assert gone() is None
        assert gc.get_freeze_count() >= len(kept)
    finally:
        gc.unfreeze()


class ChangingWeights:
    """A trainer rank whose weights change with every call, as training changes them."""

    def __init__(self, rank: int, world_size: int):
        self.calls = 0

    def named_weights(self):
        self.calls += 1
        return {"w": torch.full((4, 4), float(self.calls)), "bf16": torch.arange(3).bfloat16() * self.calls}

    def synced_weights(self):  # another set of tensors (a LoRA run's merged projections)
        return {"w": torch.full((2,), -float(self.calls))}

    def shutdown(self):
        pass


def test_local_rank_weights_come_through_shared_memory_made_once_per_set_of_tensors():
    """A local rank 0's weights reach the driver in shared memory made at the first call and
    rewritten by later ones (relax/cluster/shared_weights.py), not pickled anew each time
    (~1 s a sync for SmolLM2): every call still returns that call's values, and a second set of
    tensors (synced_weights with LoRA) gets memory of its own."""
    from relax.cluster.ranks import LocalRanks

    group = LocalRanks(ChangingWeights, 1)
    try:
        first = group.named_weights()
        assert first["w"].is_shared() and torch.equal(first["w"], torch.full((4, 4), 1.0))
        second = group.named_weights()
        assert torch.equal(second["w"], torch.full((4, 4), 2.0))
        assert torch.equal(second["bf16"], torch.tensor([0.0, 2.0, 4.0]).bfloat16())
        assert second["w"] is first["w"]  # the same memory, rewritten
        synced = group.synced_weights()
        assert torch.equal(synced["w"], torch.full((2,), -2.0)) and synced["w"] is not first["w"]
        assert torch.equal(group.named_weights()["w"], torch.full((4, 4), 3.0))
        assert torch.equal(synced["w"], torch.full((2,), -2.0))  # another set's call left it alone
    finally:
        group.shutdown()


def test_shared_weights_travel_once_then_as_a_key():
    """The sender's second pack of the same tensors (names, dtypes, shapes) sends only a key;
    another set, or the same names with another shape, is a set of its own."""
    import pickle

    from relax.cluster.shared_weights import SharedWeights, on_cpu

    sender, receiver = SharedWeights(), SharedWeights()
    first = sender.pack({"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.int64)})
    assert first.key == 0 and first.tensors["a"].is_shared()
    got = receiver.unpack(first)
    again = sender.pack({"a": torch.full((3,), 7.0), "b": torch.tensor([5, 6])})
    assert again.key == 0 and again.tensors is None and len(pickle.dumps(again)) < 100
    assert receiver.unpack(again) is got and torch.equal(got["a"], torch.full((3,), 7.0))
    assert torch.equal(got["b"], torch.tensor([5, 6]))
    assert sender.pack({"a": torch.ones(4), "b": torch.zeros(2, dtype=torch.int64)}).key == 1
    assert sender.pack({"a": torch.ones(3)}).key == 2
    assert on_cpu({"a": torch.ones(1)}) and not on_cpu({}) and not on_cpu({"loss": 1.0}) and not on_cpu(None)


def test_a_shared_set_is_keyed_by_names_dtypes_and_shapes_and_is_a_copy_of_its_own():
    """SharedWeights by hand: the same names and shapes in another dtype are another set; each
    set's key stays its own when sets alternate; the shared memory is a copy (the sender's
    tensors are neither moved nor rewritten by later packs), detached from autograd (a parameter
    that requires grad pickles); a bucket that carries tensors (re)defines its key on the
    receiver. Only dicts of CPU tensors and nothing else go this way."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (torch's reductions for pipes)

    from relax.cluster.shared_weights import SharedBucket, SharedWeights, on_cpu

    sender, receiver = SharedWeights(), SharedWeights()
    weight = torch.nn.Parameter(torch.ones(3))
    first = sender.pack({"w": weight})
    assert not weight.is_shared() and first.tensors["w"] is not weight
    assert not first.tensors["w"].requires_grad
    ForkingPickler.dumps(first)  # as a pipe sends it (torch refuses a non-leaf that requires grad)
    got = receiver.unpack(first)
    assert sender.pack({"w": torch.ones(3, dtype=torch.float64)}).key == 1
    assert sender.pack({"w": torch.ones(3, dtype=torch.float64)}).key == 1
    again = sender.pack({"w": torch.full((3,), 2.0)})
    assert again.key == 0 and again.tensors is None
    assert torch.equal(weight.detach(), torch.ones(3))  # the sender's own tensor left alone
    assert torch.equal(first.tensors["w"], torch.full((3,), 2.0))
    assert torch.equal(receiver.unpack(again)["w"], torch.full((3,), 2.0)) and receiver.unpack(again) is got
    # weights already in shared memory (rank 0's, received here) are passed on, not copied
    passed = torch.ones(2).share_memory_()
    assert sender.pack({"p": passed}).tensors["p"] is passed
    passed.add_(1)
    assert sender.pack({"p": passed}).tensors is None and torch.equal(passed, torch.full((2,), 2.0))
    replaced = {"w": torch.zeros(3)}  # a sender started anew: its first bucket under a known key
    assert receiver.unpack(SharedBucket(0, replaced)) is replaced
    assert receiver.unpack(SharedBucket(0, None)) is replaced
    assert not on_cpu({"w": torch.ones(1), "loss": 1.0}) and not on_cpu({"w": torch.ones(1, device="meta")})


def test_ray_tensors_with_anything_else_pickle_as_a_plain_dict_and_parameters_as_their_values():
    """Tensors (cluster=ray's weights) holding a value that is not a tensor pickle as a dict of
    their values; a parameter that requires grad, and a broadcast view (stride 0, whose flat view
    is not contiguous) go as raw bytes like any CPU tensor."""
    require("ray", RAY)
    import pickle

    from relax.cluster.ray_weights import Tensors

    mixed = pickle.loads(pickle.dumps(Tensors({"w": torch.ones(2), "step": 3})))
    assert type(mixed) is dict and mixed["step"] == 3 and torch.equal(mixed["w"], torch.ones(2))
    weight = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    buffers = []
    broadcast = torch.tensor([1.5]).expand(6)  # (a 1-D one: reshape(-1) gives it back as it is)
    blob = pickle.dumps(Tensors({"w": weight, "b": broadcast}), protocol=5, buffer_callback=buffers.append)
    received = pickle.loads(blob, buffers=buffers)
    assert [len(b.raw()) for b in buffers] == [24, 24] and not received["w"].requires_grad
    assert torch.equal(received["w"], weight.detach()) and torch.equal(received["b"], broadcast)


def test_stored_weights_fetch_every_bucket_once_and_only_when_read(monkeypatch):
    """StoredWeights (cluster=ray): nothing is fetched until something reads it; then every
    bucket, once, in order, whatever is read after."""
    require("ray", RAY)
    from relax.cluster import ray_weights

    gets = []

    def get(refs):
        gets.append(list(refs))
        return [{f"{r}.{i}": torch.full((1,), float(i)) for i in range(2)} for r in refs]
    monkeypatch.setattr(ray_weights.ray, "get", get)
    stored = ray_weights.StoredWeights(["a", "b", "c"])
    assert gets == []
    assert len(stored) == 6 and list(stored) == ["a.0", "a.1", "b.0", "b.1", "c.0", "c.1"]
    assert torch.equal(stored["c.1"], torch.ones(1)) and dict(stored).keys() == set(list(stored))
    assert gets == [["a", "b", "c"]]


def test_local_ranks_return_rank_0s_result_and_a_failing_rank_stops_the_group_naming_it():
    """LocalRanks' collect over pipes (no process started): rank 0's result whichever rank answers
    first; a user error raised as itself with the rank noted, a traceback as a RankError, a pipe
    closed by a dead rank as "died (exit code N)" naming its log; each one kills the group."""
    from multiprocessing import Pipe

    from relax.cluster.ranks import LocalRanks, RankError
    from relax.errors import ConfigError

    class Dead:  # a rank process that exited
        exitcode = 9

        def join(self, timeout=None):
            pass

    def ranks(*replies):
        group, killed = object.__new__(LocalRanks), []
        pipes = [Pipe() for _ in replies]
        group.conns, group.procs, group.pids = [a for a, _ in pipes], [Dead()] * len(replies), [100, 101]
        group.kill = lambda: killed.append(True)
        for (_, child), reply in reversed(list(zip(pipes, replies, strict=True))):
            child.send(reply) if reply else child.close()
        return group, killed
    group, killed = ranks(("ok", {"loss": 1.0}), ("ok", None))
    assert group.collect() == {"loss": 1.0} and not group.busy and not killed
    group, killed = ranks(("ok", None), ("error", ConfigError("bad key")))
    with pytest.raises(ConfigError, match="bad key") as raised:
        group.collect()
    assert raised.value.__notes__ == [f"in trainer rank 1 (node {socket.gethostname()}, pid 101)"] and killed
    group, killed = ranks(("ok", None), ("error", "Traceback: boom"))
    with pytest.raises(RankError, match=r"trainer rank 1 \(node .*, pid 101\) failed:\nTraceback: boom"):
        group.collect()
    assert killed
    group, killed = ranks(("ok", None), None)
    with pytest.raises(RankError, match=r"rank 1 \(.*pid 101\) died \(exit code 9\); see its rank1.log"):
        group.collect()
    assert killed


# -- Ray: a real two-node cluster on this machine (`two_nodes`, `ray_replay`: conftest.py) ------

def on(cluster, *more) -> list[str]:
    return ["cluster=ray", f"cluster.address={cluster.address}", *more]


ROLES = ["+cluster.resources_per_rank.trainer=1", "+cluster.resources_per_engine.rollout=1"]


def replay(root) -> list[str]:
    return ["debug=train_only", f"debug.load_rollout_data={root}/rollout_data/{{rollout_id}}.pt",
            "train.num_steps_per_rollout=2", *TRAIN]


def test_rollout_only_on_ray_has_no_trainer_and_samples_as_one_local_engine(ray_replay, tmp_path):
    from relax.files import safe_load

    where = placement(ray_replay / "run")
    assert where["trainer_ranks"] == [] and len(where["bundles"]) == 2
    assert [e["engine"] for e in where["engines"]] == [0, 1]
    run_loop(tmp_path, *TINY, "debug=rollout_only", f"debug.save_rollout_data={tmp_path}/{{rollout_id}}.pt")
    for rollout_id in (0, 1):
        ours = safe_load(ray_replay / "rollout_data" / f"{rollout_id}.pt")["samples"]
        local = safe_load(tmp_path / f"{rollout_id}.pt")["samples"]
        assert [s["tokens"] for s in ours] == [s["tokens"] for s in local]


@pytest.fixture(scope="module")
def local_single(ray_replay, tmp_path_factory):
    run = tmp_path_factory.mktemp("local_single")
    run_loop(run, *replay(ray_replay))
    return run


def test_dp2_ranks_on_two_nodes_train_like_local(two_nodes, ray_replay, local_single, tmp_path):
    run_loop(tmp_path, *on(two_nodes, "cluster.placement_strategy=STRICT_SPREAD"), *replay(ray_replay),
             "parallel=dp2")
    where = placement(tmp_path)
    assert where["engines"] == [] and len(where["bundles"]) == 2  # train_only: no engine, no bundle
    ranks = where["trainer_ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["node_id"] != ranks[1]["node_id"]
    assert {r["device"] for r in ranks} == {"cpu"} and sorted(r["bundle"] for r in ranks) == [0, 1]
    assert_same_training(tmp_path, local_single, logprob_atol=1e-5, grad_rtol=1e-4)


def test_engines_on_one_node_trainer_on_the_other_full_loop(two_nodes, tmp_path):
    checks = ["debug.check_weight_update_equal=true", "debug.check_weight_update_every_sync=true"]
    ray_run, local_run = tmp_path / "ray", tmp_path / "local"
    ours, _ = run_loop(ray_run, *on(two_nodes, *ROLES), *TINY, "rollout.num_engines=2", *checks)
    theirs, _ = run_loop(local_run, *TINY)
    where = placement(ray_run)
    engine_nodes = {e["node_id"] for e in where["engines"]}
    assert len(where["engines"]) == 2 and len(engine_nodes) == 1
    assert {r["node_id"] for r in where["trainer_ranks"]}.isdisjoint(engine_nodes)
    report = json.loads((ray_run / "weight_check.json").read_text())
    assert report["passed"]  # every engine: at load, after the first sync, after each rollout
    assert [(c["stage"], c["rollout_id"], c["engine"]) for c in report["checks"]] == [
        ("load", None, 0), ("load", None, 1), ("sync", None, 0), ("sync", None, 1),
        ("sync", 0, 0), ("sync", 0, 1), ("sync", 1, 0), ("sync", 1, 1)]
    # rollout 1 comes from weights synced into both engines: the same samples as one local engine
    for a, b in zip(ours, theirs, strict=True):
        assert a["rollout/raw_reward"] == b["rollout/raw_reward"]
        assert abs(a["rollout/rollout_log_probs"] - b["rollout/rollout_log_probs"]) < 1e-6


@pytest.mark.slow  # ~40 s on 2 cores: two runs
@pytest.mark.parametrize("overlap,staleness", [
    (["train.async=true"], [0, 1]),
    (["train.max_staleness=2", "rollout.partial=continue", "rollout.num_rollout=3"], [0, 1, 2]),
], ids=["async", "partial"])
def test_train_async_on_ray_through_sockets_makes_the_rollouts_of_local_async(two_nodes, tmp_path, overlap,
                                                                              staleness):
    """train.async=true on cluster=ray, rank and engine on the driver's node (reached by socket):
    the engine's actor makes rollout k+1 while the rank trains on k, one policy step behind, and
    the run makes and trains on what cluster=local's async run (the engine in a process of its
    own) does; with partial rollouts too (the actor carries what is in flight from one to the next)."""
    on_drivers_node = ["+cluster.resources_per_rank.trainer=1", "+cluster.resources_per_engine.trainer=1"]
    ours, our_steps = run_loop(tmp_path / "ray", *on(two_nodes, *on_drivers_node), *TINY, *overlap)
    theirs, their_steps = run_loop(tmp_path / "local", *TINY, *overlap)
    where = placement(tmp_path / "ray")
    assert [h["reached_by"] for h in (*where["trainer_ranks"], *where["engines"])] == ["socket", "socket"]
    assert [r["rollout/staleness"] for r in ours] == [r["rollout/staleness"] for r in theirs] == staleness
    for a, b in zip(ours, theirs, strict=True):  # later rollouts: from the weights synced after a step
        assert a["rollout/raw_reward"] == b["rollout/raw_reward"]
        assert abs(a["rollout/rollout_log_probs"] - b["rollout/rollout_log_probs"]) < 1e-6
        assert a.get("rollout/partial_carried_groups") == b.get("rollout/partial_carried_groups")
    assert [s["rollout_id"] for s in our_steps] == list(range(len(staleness)))
    for a, b in zip(our_steps, their_steps, strict=True):
        assert abs(a["train/grad_norm"] - b["train/grad_norm"]) <= 1e-4 * b["train/grad_norm"]


def test_rank_0_puts_the_weights_into_the_object_store_in_buckets(two_nodes):
    """cluster=ray's weight sync: trainer rank 0 puts its weights into Ray's object store in
    buckets of rollout.weight_update_bucket_mb, and only their refs reach the driver (the
    engines read the buckets; the full loop above checks what they then hold)."""
    import ray

    from relax.cluster.ray_cluster import Host
    from relax.cluster.ray_weights import StoredWeights

    sent = {f"layers.{i}.weight": torch.randn(10, 10) for i in range(5)}  # 400 bytes each

    def trainer():
        class Trainer:
            def named_weights(self):
                return sent
        return Trainer()

    ray.init(address=two_nodes.address)
    try:
        rank = ray.remote(Host).options(resources={"trainer": 1}).remote("trainer rank", 0, 1)
        assert ray.get(rank.build.remote(trainer, (), {}))[0] == "ok"
        status, refs = ray.get(rank.call.remote("named_weights", (), {}, True, 1000))
        assert status == "ok" and all(isinstance(r, ray.ObjectRef) for r in refs)
        assert [[name[7] for name in bucket] for bucket in ray.get(refs)] == [["0", "1"], ["2", "3"], ["4"]]
        received = StoredWeights(refs)
        assert list(received) == list(sent) and all(torch.equal(received[k], v) for k, v in sent.items())
    finally:
        ray.shutdown()


def test_actors_on_the_drivers_node_are_called_through_a_socket_and_weights_cross_in_shared_memory(
        two_nodes):
    """cluster.same_node_sockets: once built, actors on the driver's node (node A) serve the
    driver's calls through a Unix socket; rank 0's weights arrive in shared memory made by the
    first call and rewritten in place by the next; an engine gets its weights the same way; an
    actor on the other node (B) keeps Ray's calls. A user error is raised as itself; an actor
    killed mid-run is named, with Ray's word on its death."""
    import multiprocessing
    import os
    import signal

    import ray

    from relax.cluster.ray_cluster import Host, RayHosts, RayRanks
    from relax.cluster.ray_sockets import SocketHosts, _connect, reach_by_socket
    from relax.cluster.ranks import RankError
    from relax.errors import ConfigError

    def model():  # plays both a trainer rank and an engine
        class Model:
            def __init__(self):
                self.weights = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4).bfloat16()}

            def named_weights(self):
                return self.weights

            def step(self):
                for t in self.weights.values():
                    t.add_(1)

            def update_weights(self, named):
                self.weights = {k: v.clone() for k, v in named.items()}
                return sorted(named)

            def fail(self):
                raise ConfigError("model.path: no such file")

            def unpicklable(self):
                return lambda: None
        return Model()

    def start(role: str, node_resource: str) -> RayHosts:
        actor = ray.remote(Host).options(resources={node_resource: 1}).remote(role, 0, 1, authkey)
        assert ray.get(actor.build.remote(model, (), {}))[0] == "ok"
        hosts = RayHosts(role, [actor], [0])
        hosts.where = [ray.get(actor.where.remote())[1]]
        return hosts

    authkey = bytes(multiprocessing.current_process().authkey)
    ray.init(address=two_nodes.address)
    try:
        far = start("rollout engine", "rollout")
        assert reach_by_socket(far) is far and far.placement()[0]["reached_by"] == "ray"
        ranks = RayRanks(reach_by_socket(start("trainer rank", "trainer")), bucket_bytes=2**20)
        engine = reach_by_socket(start("rollout engine", "trainer"))
        assert isinstance(ranks.hosts, SocketHosts) and isinstance(engine, SocketHosts)
        assert ranks.placement()[0]["reached_by"] == "socket"
        first = ranks.named_weights()
        assert first["w"].is_shared() and torch.equal(first["w"], torch.arange(6.0).reshape(2, 3))
        ranks.call("step")
        second = ranks.named_weights()
        assert second["w"] is first["w"]  # the same shared memory, rewritten: no new segments
        assert torch.equal(second["w"], torch.arange(1.0, 7.0).reshape(2, 3))
        assert torch.equal(second["b"], torch.full((4,), 2, dtype=torch.bfloat16))
        assert engine.map("update_weights", [(engine.share(dict(second)),)]) == [["b", "w"]]
        far.map("update_weights", [(far.share(dict(second)),)])  # the other node: the object store
        for hosts in (engine, far):
            received = hosts.map("named_weights", [()])[0]
            assert all(torch.equal(received[k], second[k]) for k in second)
        with pytest.raises(ConfigError, match=r"^model.path: no such file\nin rollout engine 0 \(node "):
            engine.map("fail", [()])
        with pytest.raises(RankError, match="were stopped"):  # a failure stops the group
            engine.map("named_weights", [()])
        engine = reach_by_socket(start("rollout engine", "trainer"))  # a reply that cannot be sent
        with pytest.raises(RankError, match=r"rollout engine 0 \(node .*\) failed:\nTraceback(.|\n)*pickle"):
            engine.map("unpicklable", [()])
        hint = (r"did not open its socket relax-nobody in time \(an actor in a network namespace of its "
                r"own, e.g. a container\? cluster.same_node_sockets=false keeps Ray's calls\)")
        with pytest.raises(RankError, match=hint):
            _connect(far, 0, "\0relax-nobody", ray.remote(lambda: time.sleep(60)).remote(), authkey,
                     deadline=time.monotonic() + 0.5)  # (its serving task still runs: it did not fail)
        os.kill(ranks.hosts.where[0]["pid"], signal.SIGKILL)
        with pytest.raises(RankError, match=r"^trainer rank 0 \(node .*, pid \d+\) died: .+"):
            ranks.call("step")
    finally:
        ray.shutdown()


def test_errors_name_the_rank_or_engine_node_and_traceback(two_nodes, tiny_path, tokenizer, tmp_path):
    from relax.cluster.ranks import RankError

    cfg = make_cfg(*on(two_nodes, *ROLES), "parallel=dp2", "rollout.num_engines=2")
    cluster = cluster_of(cfg, tmp_path)
    try:
        engines, trainer = cluster.build(engine_spec(cfg, tiny_path, [tokenizer.eos_token_id]),
                                         trainer_spec(cfg, tiny_path, tiny_path))
        where = cluster.placement()
        rank_pids = [r["pid"] for r in where["trainer_ranks"]]
        node = where["trainer_ranks"][0]["node_ip"]
        with pytest.raises(RankError, match=rf"trainer rank \d \(node {node} \(\w{{8}}\), pid \d+\) failed"
                                            r"(.|\n)*Traceback(.|\n)*no_such_method"):
            trainer.call("no_such_method")
        assert wait_gone(rank_pids, 20) == []  # the whole group is stopped
        with pytest.raises(RankError, match=r"rollout engine \d \(node .*, pid \d+\) failed(.|\n)*no_such"):
            engines.hosts.map("no_such_method", [(), ()])
        assert wait_gone([e["pid"] for e in where["engines"]], 20) == []
    finally:
        cluster.close()


def test_placement_timeout_names_what_was_asked_and_offered(two_nodes, ray_replay, tmp_path, monkeypatch,
                                                           caplog):
    from relax.cluster import placement as placement_module
    from relax.cluster.placement import PlacementTimeout

    monkeypatch.setattr(placement_module, "WAIT_LOG_S", 0.5)  # 30 s in real runs
    caplog.set_level(logging.INFO, logger="relax.cluster.placement")
    start = time.monotonic()
    with pytest.raises(PlacementTimeout, match=r"asked for 1 x \{CPU: 8\} \(PACK\); the cluster offers "
                                               r"2 node\(s\)"):
        run_loop(tmp_path, *on(two_nodes, "cluster.num_cpus_per_rank=8", "cluster.placement_timeout_s=2"),
                 *TINY, *replay(ray_replay))
    assert time.monotonic() - start < 20
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Waiting")]
    assert len(waiting) >= 2 and "to place 1 x {CPU: 8} (PACK); the cluster offers 2 node(s)" in waiting[0]


def test_sweep_local_vs_ray_private_instance_is_equivalent(ray_replay, tmp_path):
    """`relax -m cluster=local,ray ... parallel=dp2` (the Ray job on a private instance of its
    own): `relax compare` says equivalent, and the numbers are in fact bit-equal."""
    proc = relax_cli("-m", "cluster=local,ray", "parallel=dp2", *replay(ray_replay), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    multirun = only_run_dir(tmp_path, "multiruns")
    local, ray_job = multirun / "cluster=local", multirun / "cluster=ray"
    assert placement(ray_job)["private_instance"] and len(placement(ray_job)["trainer_ranks"]) == 2
    report = json.loads(relax_cli("compare", str(multirun), "--json", cwd=tmp_path).stdout)
    assert report["baseline"] == "cluster=local"
    assert [(j["name"], j["verdict"]) for j in report["jobs"][1:]] == [("cluster=ray", "equivalent")]
    assert first_step(ray_job) == first_step(local)
    assert [s["train/grad_norm"] for s in read_metrics(ray_job)[1]] == \
        [s["train/grad_norm"] for s in read_metrics(local)[1]]


# (plain tp2 is in dp2tp2 and tp2sp: each layout's collectives cross the nodes once)
MEGATRON = [["train=megatron", f"parallel={p}"] for p in ("pp2", "cp2", "tp2sp")]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel=fsdp2"], ["parallel=dp2tp2"], *MEGATRON],
                         ids=" ".join)
def test_layouts_with_ranks_on_two_nodes_train_like_local(two_nodes, ray_replay, local_single, tmp_path,
                                                         layout):
    spread = "STRICT_SPREAD" if layout[-1] != "parallel=dp2tp2" else "PACK"  # 4 ranks: 2 per node
    run_loop(tmp_path, *on(two_nodes, f"cluster.placement_strategy={spread}"), *replay(ray_replay), *layout)
    ranks = placement(tmp_path)["trainer_ranks"]
    assert len({r["node_id"] for r in ranks}) == 2
    assert_same_training(tmp_path, local_single, logprob_atol=1e-5, grad_rtol=1e-4)
