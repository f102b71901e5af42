"""Synchronous against asynchronous training (train.max_staleness = k), interleaved in one invocation.

    python bench/staleness.py                       # default and gen_heavy, k = 0 1 2 4, 40 rollouts
    python bench/staleness.py --jobs long_tail --rollouts 8 --repeats 1   # the real model, long answers
    python bench/staleness.py --ks 0,2 --repeats 3
    python bench/staleness.py --jobs long_tail --ks 0,1c,2,2c,2a --rollouts 8   # partial rollouts

A `--ks` entry is k, or k with `c`/`a`: rollout.partial=continue/abort (its default pool: 1.5x
the batch's groups).

Jobs: bench/vs_trl.py's `default` and `gen_heavy`, and `long_tail` (SmolLM2-135M-Instruct on
word_problems, up to 128 new tokens: a few responses run to the limit). Per run, from relax.log
and metrics.jsonl: per-step time (median interval between `Finish rollout` lines), samples per
second, the generation and training idle shares of the loop (1 - the time each was busy /
loop time), the reward first-3 -> last-3, and the reward against wall-clock and against samples
(a plot, staleness.png in the output folder). Ratios are against k = 0 in the same invocation.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file backend)

from vs_trl import JOBS, REPO, Job, intervals, read_relax, run_logged, spread  # noqa: E402

from relax.debug.run_data import read_config  # noqa: E402

PARTIAL = {"c": "continue", "a": "abort"}

STALENESS_JOBS = {
    "default": JOBS["default"],
    "gen_heavy": JOBS["gen_heavy"],
    "long_tail": Job("the real model on word_problems, 4 prompts x 4 samples, up to 128 new tokens",
                     ["model=smollm2", "task=word_problems", "rollout.rollout_batch_size=4",
                      "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=128", "train.lr=1e-5",
                      "train.micro_batch_size=16", "train.num_threads=2"], (), None),
}


def variant(k: str) -> list[str]:
    """The overrides of one --ks entry: train.max_staleness, and rollout.partial for `c`/`a`."""
    if k[-1] not in PARTIAL:
        return [f"train.max_staleness={int(k)}"]
    return [f"train.max_staleness={int(k[:-1])}", f"rollout.partial={PARTIAL[k[-1]]}"]


def measure(run_dir: Path) -> dict:
    stamps, rollouts = read_relax(run_dir)
    step_s, _ = intervals(stamps)
    loop_s = stamps[-1] - stamps[0]
    per_rollout = read_config(run_dir / ".hydra" / "config.yaml")["samples_per_rollout"]
    # busy time within the loop's clock (first `Finish rollout` to last): the later rollouts'
    gen = sum(r["perf/rollout_time"] for r in rollouts[1:])
    train = sum(r["perf/train_time"] for r in rollouts[1:])
    return {"step_s": step_s, "samples_per_s": per_rollout / step_s, "gen_idle": 1 - gen / loop_s,
            "train_idle": 1 - train / loop_s, "rewards": [r["rollout/raw_reward"] for r in rollouts],
            "clock": [t - stamps[0] for t in stamps], "per_rollout": per_rollout}


def plot(runs: dict, out: Path) -> Path:
    """Reward against wall-clock and against samples, one line per (job, k), first repeat."""
    jobs = sorted({job for job, _, _ in runs})
    fig, axes = plt.subplots(len(jobs), 2, figsize=(10, 3.2 * len(jobs)), squeeze=False)
    for row, job in zip(axes, jobs):
        for (j, k, rep), m in sorted(runs.items()):
            if j != job or rep:
                continue
            row[0].plot(m["clock"], m["rewards"], label=f"k={k}")
            trained = [m["per_rollout"] * (i + 1) for i in range(len(m["rewards"]))]
            row[1].plot(trained, m["rewards"], label=f"k={k}")
        row[0].set(title=f"{job}: reward vs wall-clock", xlabel="seconds since the first rollout",
                   ylabel="reward")
        row[1].set(title=f"{job}: reward vs samples", xlabel="samples trained")
        row[0].legend()
    fig.tight_layout()
    path = out / "staleness.png"
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default="default,gen_heavy", help=f"comma list of {', '.join(STALENESS_JOBS)}")
    ap.add_argument("--ks", default="0,1,2,4",
                    help="comma list of train.max_staleness values, with c/a for partial rollouts "
                         "(0 first: the baseline)")
    ap.add_argument("--rollouts", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--relax", default=str(REPO / ".venv" / "bin" / "relax"))
    args = ap.parse_args()
    jobs, ks = args.jobs.split(","), args.ks.split(",")
    if [j for j in jobs if j not in STALENESS_JOBS] or ks[0] != "0" or args.rollouts < 6 or \
            not all(k.rstrip("ca").isdigit() for k in ks):
        ap.error("known jobs only, --ks of k or kc/ka starting with 0 (the baseline), --rollouts >= 6")
    out = REPO / "outputs" / "bench" / f"staleness-{datetime.now():%Y-%m-%d_%H-%M-%S}"
    out.mkdir(parents=True)
    print(f"Run folders and logs: {out}", flush=True)
    runs, plan, t0 = {}, [(job, k, rep) for rep in range(args.repeats) for job in jobs for k in ks], time.time()
    for i, (job, k, rep) in enumerate(plan):
        tag = f"{job}-k{k}-rep{rep}"
        cmd = [args.relax, *STALENESS_JOBS[job].overrides, *variant(k),
               f"rollout.num_rollout={args.rollouts}", "checkpoint.save_interval=null", f"seed={1 + rep}",
               f"hydra.run.dir={out / tag}"]
        run_logged(cmd, out / f"{tag}.out")
        runs[job, k, rep] = m = measure(out / tag)
        eta = (time.time() - t0) / (i + 1) * (len(plan) - i - 1)
        print(f"[{i + 1}/{len(plan)}] {tag}: {m['step_s'] * 1e3:.0f} ms/step, {m['samples_per_s']:.1f} samples/s, "
              f"idle: generation {m['gen_idle']:.0%}, training {m['train_idle']:.0%}; reward "
              f"{statistics.fmean(m['rewards'][:3]):.3f} -> {statistics.fmean(m['rewards'][-3:]):.3f} "
              f"(eta {eta / 60:.1f} min)", flush=True)
    for job in jobs:
        print(f"\n== {job}: {STALENESS_JOBS[job].about}; {args.rollouts} rollouts, {args.repeats} repeat(s): "
              f"median [min..max] ==")
        base = [runs[job, "0", r]["samples_per_s"] for r in range(args.repeats)]
        print(f"{'k':>3} {'ms/step':>16} {'samples/s':>16} {'x k=0':>8} {'gen idle':>10} {'train idle':>11}"
              f"   reward first-3 -> last-3")
        for k in ks:
            ms = [runs[job, k, r] for r in range(args.repeats)]
            first = statistics.median(statistics.fmean(m["rewards"][:3]) for m in ms)
            last = statistics.median(statistics.fmean(m["rewards"][-3:]) for m in ms)
            ratio = statistics.median(m["samples_per_s"] / b for m, b in zip(ms, base))
            print(f"{k:>3} {spread([m['step_s'] * 1e3 for m in ms], '.0f'):>16} "
                  f"{spread([m['samples_per_s'] for m in ms], '.1f'):>16} {ratio:>7.2f}x "
                  f"{statistics.median(m['gen_idle'] for m in ms):>10.0%} "
                  f"{statistics.median(m['train_idle'] for m in ms):>11.0%}   {first:.3f} -> {last:.3f}")
    print(f"\nplot: {plot(runs, out)}")


if __name__ == "__main__":
    main()
