"""What cluster=ray costs against cluster=local: start-up, time per rollout, memory.

    python bench/cluster_overhead.py [--rollouts 6] [--repeats 2] [--layout single|dp2] [key=value ...]

Runs the default job (GRPO on the tiny model, 32 prompts x 8 samples per rollout; extra
key=value overrides pick another, e.g. `experiment=smollm2_arith_v1 eval.interval=null` for
the real model) through the real CLI, cluster=local and cluster=ray (a private Ray
instance) in turn: `ray` as it runs by default (the actors on the driver's node reached
through Unix sockets and shared memory: cluster.same_node_sockets), `ray-calls` with every
call and weight sync through Ray's calls and object store, as for actors on other nodes;
with `--layout single` also `processes`: cluster=local with the trainer and the engine each
in a process of its own, as under Ray (bench/local_in_processes.py), which splits Ray's cost
into that of separate processes and Ray's own; `--repeats` times each, interleaved, and
keeps each side's fastest run
(timings on shared 2-core machines vary up to 3x, and noise only ever adds time).
Measured from the run's own log:
  start-up      launch -> rollout 0 begins (imports, model, Ray instance and actors)
  per rollout   median time between consecutive `Finish rollout` lines (generate, train,
                weight sync: the steady state), and each phase's median from metrics.jsonl
  memory        resident memory of the job's processes once rollout 1 is done: the driver,
                its ranks or actors, and (cluster=ray) Ray's own processes
Goals on 2 cores: start-up at most +10 s, per rollout at most +10 %.

Then Ray's own floor on this machine (a private instance, one actor): what a call costs
beyond its work, alone, around 25 ms of compute, and with a default rollout's 256 samples as
its argument or its result (as a plain list of Sample, and as the Samples the loop sends,
which pickle field by field). A `ray-calls` rollout makes four Ray calls (generate the
rollout, train on it, the trainer's weights, the engine's update) and moves the samples
twice, so 4 x (call) + 2 x (samples) is about the least Ray's calls add to a rollout here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from relax.reaper import descendants


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return 0.0


def kind(pid: int, driver: int) -> str:
    if pid == driver:
        return "driver"
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            cmd = f.read().replace("\0", " ")
    except OSError:
        return "gone"
    if cmd.startswith("ray::Host") or "relax-rank" in cmd or "multiprocessing.spawn" in cmd:
        return "ranks/actors"
    if "relax.reaper" in cmd:
        return "relax reaper"
    # "other": e.g. the multiprocessing resource tracker of local ranks
    return "ray itself" if cmd.startswith("ray::") or "/ray/" in cmd else "other"


def finish_times(run: Path) -> list[float]:
    """When each `Finish rollout` line was logged (right after that rollout's generation)."""
    return [datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for line in (run / "relax.log").read_text().splitlines() if "] - Finish rollout " in line]


SIDES = {"local": ["-m", "relax", "cluster=local"],
         "processes": [str(Path(__file__).with_name("local_in_processes.py")), "cluster=local"],
         "ray": ["-m", "relax", "cluster=ray"],  # actors on this node reached by socket (the default)
         "ray-calls": ["-m", "relax", "cluster=ray", "cluster.same_node_sockets=false"]}


def one_run(side: str, args, extra: list[str]) -> dict:
    cwd = Path(tempfile.mkdtemp(prefix=f"relax-bench-{side}-"))
    cmd = [sys.executable, *SIDES[side], f"rollout.num_rollout={args.rollouts}",
           f"parallel={args.layout}", "checkpoint.save_interval=null", "hydra.run.dir=run", *extra]
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    launched = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    memory: dict[str, float] = {}
    metrics = cwd / "run" / "metrics.jsonl"
    while proc.poll() is None:
        rollouts = [r for r in (json.loads(x) for x in metrics.read_text().splitlines()) if "step" not in r] \
            if metrics.is_file() else []
        if len(rollouts) >= 2 and not memory:  # steady state: sample once
            for pid in [proc.pid] + [p for p, _ in descendants(proc.pid)]:
                k = kind(pid, proc.pid)
                memory[k] = memory.get(k, 0.0) + rss_mb(pid)
        time.sleep(0.2)
    if proc.returncode != 0:
        raise SystemExit(f"{side} failed:\n{proc.stderr.read()[-3000:]}")
    stamps = finish_times(cwd / "run")
    rollouts = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step" not in r]
    steady = rollouts[1:] or rollouts
    # perf/train_time runs from the training step through the weight sync
    phases = {"generate": [r["perf/rollout_time"] for r in steady],
              "train": [r["perf/train_time"] - r["perf/weight_sync_time"] for r in steady],
              "sync": [r["perf/weight_sync_time"] for r in steady]}
    return {"startup": stamps[0] - rollouts[0]["perf/rollout_time"] - launched,
            "per_rollout": statistics.median(b - a for a, b in zip(stamps, stamps[1:])),
            "phases": {k: statistics.median(v) for k, v in phases.items()},
            "memory": memory, "dir": str(cwd)}


def ray_floor(repeats: int = 30) -> dict[str, float]:
    """Median ms a call costs beyond the work it does (see the module's docstring); the cases
    take turns, so that the machine's drift spreads over all of them."""
    import ray
    import torch

    from relax.sample import Sample, Samples

    tokens = [2, 10, 9, 15, 8, 12, 18, 3, 14, 6, 1]
    samples = Samples(Sample(i, i // 8, "<|user|>54+37=<|assistant|>", list(tokens), 3, "91", "91", 1.0,
                             [1, 1, 1], [-0.05, -0.17, -0.004], metadata={"rollout_id": 0})
                      for i in range(256))
    as_list = list(samples)

    class Worker:
        def __init__(self, results: dict):
            torch.set_num_threads(1)
            self.x, self.results = torch.randn(256, 256), results

        def work(self, ms: float, argument=None, result: str | None = None):
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < ms / 1000:
                self.x @ self.x
            return time.perf_counter() - t0, self.results.get(result)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # as the jobs above: no token set-up
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        worker = ray.remote(Worker).remote({"list": as_list, "Samples": samples})
        cases = {"a call": (0, None, None), "a call around 25 ms of work": (25, None, None),
                 "... with the samples as argument (a list)": (25, as_list, None),
                 "... with the samples as argument (Samples)": (25, samples, None),
                 "... with the samples as result (a list)": (25, None, "list"),
                 "... with the samples as result (Samples)": (25, None, "Samples")}
        extra = {name: [] for name in cases}
        for _ in range(repeats + 3):
            for name, (ms, argument, result) in cases.items():
                t0 = time.perf_counter()
                worked, _ = ray.get(worker.work.remote(ms, argument, result))
                extra[name].append(time.perf_counter() - t0 - worked)
        return {name: statistics.median(times[3:]) * 1000 for name, times in extra.items()}
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--layout", default="single", help="parallel=<layout> of both jobs")
    args, extra = ap.parse_known_args()
    sides = ["local", "ray", "ray-calls"] if args.layout != "single" else list(SIDES)
    runs: dict[str, list] = {side: [] for side in sides}
    for i in range(args.repeats):
        for side in runs:
            runs[side].append(one_run(side, args, extra))
            r = runs[side][-1]
            phases = ", ".join(f"{k} {v * 1000:.0f}" for k, v in r["phases"].items())
            print(f"  {side:9s} #{i}: start-up {r['startup']:.1f} s, per rollout "
                  f"{r['per_rollout'] * 1000:.0f} ms ({phases}), memory {sum(r['memory'].values()):.0f} MB",
                  flush=True)
    best = {c: {"startup": min(r["startup"] for r in rs), "per_rollout": min(r["per_rollout"] for r in rs),
                "memory": min((r["memory"] for r in rs), key=lambda m: sum(m.values()))}
            for c, rs in runs.items()}
    local, ray = best["local"], best["ray"]
    job = " ".join(extra) or "the default job (32 prompts x 8 samples)"
    print(f"\nparallel={args.layout}, {args.rollouts} rollouts of {job}; best of {args.repeats}")
    print(f"start-up:    local {local['startup']:.1f} s, ray {ray['startup']:.1f} s: "
          f"+{ray['startup'] - local['startup']:.1f} s (goal <= +10 s), "
          f"ratio {ray['startup'] / local['startup']:.2f}")
    print(f"per rollout: local {local['per_rollout'] * 1000:.0f} ms, "
          f"ray {ray['per_rollout'] * 1000:.0f} ms: ratio "
          f"{ray['per_rollout'] / local['per_rollout']:.3f} (goal <= 1.10)")
    calls = best["ray-calls"]["per_rollout"]
    print(f"per rollout through Ray's calls and object store (cluster.same_node_sockets=false): "
          f"{calls * 1000:.0f} ms: ratio {calls / local['per_rollout']:.3f}")
    if "processes" in best:  # the same processes as ray, without Ray: what is left is Ray's own
        procs = best["processes"]["per_rollout"]
        print(f"per rollout, trainer and engine in local processes: {procs * 1000:.0f} ms: ratio "
              f"{procs / local['per_rollout']:.3f} to local; ray {ray['per_rollout'] / procs:.3f} of it")
    for name, b in best.items():
        parts = ", ".join(f"{k} {v:.0f} MB" for k, v in sorted(b["memory"].items()))
        print(f"memory {name:9s}: {sum(b['memory'].values()):.0f} MB ({parts})")
    print(f"the Ray instance itself: {ray['memory'].get('ray itself', 0):.0f} MB resident")
    floor = ray_floor()
    print("\nRay's floor here, ms beyond the work (median of 30): " + ", ".join(
        f"{name} {ms:.1f}" for name, ms in floor.items()))
    call = floor["a call around 25 ms of work"]
    sent = [ms for name, ms in floor.items() if name.endswith("(Samples)")]  # what the loop sends
    samples = sum(sent) / len(sent) - call
    least = 4 * call + 2 * samples
    print(f"least Ray's calls add to a rollout: 4 calls x {call:.1f} + 2 x {samples:.1f} for the samples = "
          f"{least:.0f} ms; measured (ray-calls) {(calls - local['per_rollout']) * 1000:.0f} ms; "
          f"the 1.1x goal allows {local['per_rollout'] * 100:.0f} ms")


if __name__ == "__main__":
    main()
