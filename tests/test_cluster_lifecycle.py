"""The life of a job on Ray: a rank killed mid-run, a killed driver, Ctrl-C, sweeps on Ray.

The two-node cluster (`two_nodes`, conftest.py) is started for this module only if one of
its tests asks for it: the main tier's test here runs on a private instance."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from relax.logger import read_metrics

from .conftest import REPO, only_run_dir, relax_cli, run_loop
from .extras import RAY, require
from .test_cluster import ROLES, TINY, alive, on, placement, replay, wait_gone


@pytest.fixture(autouse=True)
def needs_ray():
    """Every test here runs a job on Ray (checked per test that runs, not at import: the
    SGLang tier collects this file too)."""
    require("ray", RAY)


@pytest.mark.slow
def test_a_rank_killed_mid_run_fails_it_naming_the_rank_and_resume_continues(two_nodes, tmp_path):
    from relax.cluster.ranks import RankError

    common = [*on(two_nodes, *ROLES), *TINY, "rollout.num_rollout=3", "checkpoint.save_interval=1",
              "parallel=dp2"]
    kill = "+cluster.runtime_env.env_vars.RELAX_FAULT='sigkill_rank:1:1'"  # SIGKILL as rollout 1 trains
    with pytest.raises(RankError, match=r"trainer rank 1 \(node .*, pid \d+\) died"):
        run_loop(tmp_path / "killed", *common, kill)
    pid = placement(tmp_path / "killed")["trainer_ranks"][1]["pid"]
    assert not alive(pid)
    checkpoints = sorted((tmp_path / "killed" / "checkpoints").glob("rollout_*"))
    assert [c.name for c in checkpoints] == ["rollout_000000"]  # the last one, whole
    assert (checkpoints[0] / "relax_state.json").is_file()
    assert (checkpoints[0] / "hf" / "config.json").is_file()
    rollouts, _ = run_loop(tmp_path / "resumed", *common, "resume=true")
    assert [r["rollout_id"] for r in rollouts] == [0, 1, 2]  # rollout 0 from the checkpoint's history
    assert rollouts[0] == read_metrics(tmp_path / "killed")[0][0]


def run_driver(tmp_path, *args) -> tuple[subprocess.Popen, set[tuple[int, int]]]:
    """`relax cluster=ray ...` in its own session, once its actors are up, and the set of its
    processes (Ray's, the actors', the reaper) as (pid, start time), which a thread keeps
    adding to until the driver ends (Ray starts some agents late)."""
    from relax.reaper import descendants

    driver = subprocess.Popen([sys.executable, "-m", "relax", "cluster=ray", *args], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    seen: set[tuple[int, int]] = set()

    def watch():
        while driver.poll() is None:
            seen.update(descendants(driver.pid))
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    deadline = time.time() + 300
    while time.time() < deadline and driver.poll() is None:
        built = list((tmp_path / "outputs" / "runs").glob("*/built.json"))
        if built and "placement" in built[0].read_text():
            return driver, seen
        time.sleep(0.5)
    raise AssertionError(f"the driver never came up: {driver.stderr.read()[-3000:]}")


GROUP_STOPS = {"Ctrl-C": signal.SIGINT, "SIGTERM to the group": signal.SIGTERM}


@pytest.mark.parametrize("end", ["kill -9", *(pytest.param(e, marks=pytest.mark.slow)
                                                for e in ("completes", *GROUP_STOPS))])
def test_a_private_instance_leaves_no_process_behind(tmp_path, tiny_path, end):
    """Whichever way the job ends; a stop that signals every process of the job (a terminal's
    Ctrl-C; `timeout`, `kill -- -PGID`: SIGTERM) is the driver's, and a clean one."""
    from relax.reaper import start_time
    from relax.process import read_status

    num_rollout = 2 if end == "completes" else 100_000
    driver, seen = run_driver(tmp_path, *TINY, f"rollout.num_rollout={num_rollout}")
    if end != "completes":
        time.sleep(3)  # the job runs a little: Ray's late agents are up
    if end == "kill -9":
        driver.kill()
    elif end in GROUP_STOPS:
        os.killpg(driver.pid, GROUP_STOPS[end])
    code = driver.wait(timeout=120)
    assert (code == 0) == (end == "completes"), driver.stderr.read()[-3000:]
    if end in GROUP_STOPS:
        status = read_status(next((tmp_path / "outputs" / "runs").iterdir()))
        assert code == 128 + GROUP_STOPS[end] and status["status"] == "interrupted", status
    time.sleep(0.5)  # the watching thread has seen the driver end and stopped adding
    processes = list(seen)
    assert len(processes) >= 4  # GCS, raylet, the rank's and the engine's actors at least
    deadline = time.time() + 30
    left = processes
    while left and time.time() < deadline:
        left = [(pid, started) for pid, started in left if start_time(pid) == started]
        time.sleep(0.2)
    assert left == [], [open(f"/proc/{pid}/cmdline").read() for pid, _ in left]


STOPPING_RAY = """
import os, signal, sys
from tests.conftest import make_cfg
from relax.cluster.ray_cluster import RayCluster

caught = []
cfg = make_cfg("cluster=ray")
cluster = RayCluster(cfg.cluster, cfg.rollout, cfg.train, cfg.algo, cfg.parallel, sys.argv[1])
cluster._connect({"CPU": 1})
signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))  # (the run's Stop)
cluster.close()
mask = next(int(line.split()[1], 16) for line in open("/proc/self/status") if line.startswith("SigCgt"))
os.kill(os.getpid(), signal.SIGTERM)
kernel = "in the kernel's mask" if mask & 1 << signal.SIGTERM - 1 else "default"
print("caught" if caught else "not caught", kernel)
"""


def test_the_drivers_sigterm_handler_outlives_rays_shutdown(tmp_path):
    """Ray's core worker installs Abseil's failure-signal handler in the driver, and resets those
    signals, SIGTERM included, to the system default at ray.shutdown, behind Python's back: a
    SIGTERM while a run's private instance stopped (seconds) killed the driver before it wrote its
    status. The driver's core worker is started without it (keep_sigterm_in_the_driver)."""
    out = subprocess.run([sys.executable, "-c", STOPPING_RAY, str(tmp_path)], cwd=REPO, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "caught in the kernel's mask", out.stderr[-3000:]


@pytest.mark.slow
def test_a_killed_driver_leaves_no_actor_on_a_joined_cluster(two_nodes, tmp_path):
    driver, _ = run_driver(tmp_path, f"cluster.address={two_nodes.address}", *ROLES, *TINY,
                           "rollout.num_rollout=100000", "parallel=dp2")
    run = next((tmp_path / "outputs" / "runs").iterdir())
    where = json.loads((run / "built.json").read_text())["placement"]
    actors = [p["pid"] for p in where["trainer_ranks"] + where["engines"]]
    assert len(actors) == 3 and not where["private_instance"]
    driver.kill()
    driver.wait()
    assert wait_gone(actors, 60) == []


def log_span(job) -> tuple[str, str]:
    """(first, last) timestamp of a job's relax.log."""
    lines = [line[1:24] for line in (job / "relax.log").read_text().splitlines() if line.startswith("[20")]
    return lines[0], lines[-1]


@pytest.mark.slow
def test_a_sweep_on_the_ray_launcher_runs_jobs_at_once_and_survives_a_failure(ray_replay, tmp_path):
    """`relax -m hydra/launcher=ray ...` (hydra-ray-launcher, local mode): the jobs run as Ray
    tasks side by side, the failing one is reported without stopping the others, and
    `relax compare` reads the sweep as it reads one from the basic launcher."""
    launcher = ["hydra/launcher=ray", "hydra.launcher.ray.init.address=local",  # a new one, not two_nodes
                "+hydra.launcher.ray.init.num_cpus=2", "+hydra.launcher.ray.init.include_dashboard=false"]
    together = "meet_at:metrics_written:1:2"  # each of the first two waits there for the other
    proc = relax_cli("-m", *launcher, "parallel=single,dp2,pp2",  # 2 CPUs: the first two side by side
                     *replay(ray_replay), cwd=tmp_path, env={"RAY_AUTH_MODE": "disabled", "RELAX_FAULT": together})
    assert proc.returncode != 0  # the sweep reports the failed job
    assert (tmp_path / "outputs" / "multiruns").is_dir(), proc.stderr[-3000:]
    multirun = only_run_dir(tmp_path, "multiruns")
    assert sorted(p.name for p in multirun.iterdir() if p.is_dir()) == [
        "parallel=dp2", "parallel=pp2", "parallel=single"]
    report = json.loads(relax_cli("compare", str(multirun), "--json", cwd=tmp_path).stdout)
    jobs = {j["layout"]: j for j in report["jobs"]}
    assert jobs["pp2"]["verdict"] == "FAILED" and "use train=megatron" in jobs["pp2"]["reasons"][0]
    assert jobs["dp2"]["verdict"] == "equivalent" and jobs["single"]["status"] == "completed"
    spans = sorted(log_span(multirun / name) for name in ("parallel=single", "parallel=dp2"))
    assert spans[1][0] < spans[0][1]  # the second job started before the first one ended
    assert len(list((tmp_path / ".meet_metrics_written").iterdir())) == 2
