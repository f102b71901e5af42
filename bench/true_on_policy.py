"""rollout.true_on_policy against the normal path: step time, rollout time and the mismatch.

    python bench/true_on_policy.py                         # the tiny job and the real model
    python bench/true_on_policy.py --jobs tiny --repeats 3

Each job runs through the real CLI with and without `rollout.true_on_policy=true`, the two
interleaved `--repeats` times (this machine's noise only adds time: the fastest run of each
counts). Printed per job: seconds per training step and per rollout (the mean over its
rollouts, the first left out: start-up), their ratios (goal: at most 1.5x per step), and the
train-vs-rollout mismatch of each (mean per-token |Δ log p| and mismatch_kl: 0 vs the usual).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOBS = {  # the default tiny job, and the real model at the recipe's batch with its eval off
    "tiny": ["rollout.num_rollout=6"],
    "real": ["experiment=smollm2_arith_v1", "eval.interval=null", "rollout.num_rollout=4"],
}
KEYS = ("perf/step_time", "perf/rollout_time", "train/train_rollout_logprob_abs_diff", "train/mismatch_kl")


def run(job: str, exact: bool, out: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "relax", *JOBS[job], f"rollout.true_on_policy={str(exact).lower()}",
           f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"true_on_policy bench: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    merged: dict[int, dict] = {}
    for r in rows:  # a rollout's record and its step's, by rollout_id
        merged.setdefault(r["rollout_id"], {}).update(r)
    later = [merged[i] for i in sorted(merged)[1:]]
    return {k: statistics.mean(r[k] for r in later) for k in KEYS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", default="tiny,real", help=f"comma-separated, of {', '.join(JOBS)}")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    print(f"{'job':>6} {'path':>15} {'step s':>8} {'rollout s':>10} {'|Δ log p|':>10} {'mismatch_kl':>12}")
    for job in args.jobs.split(","):
        best: dict[bool, dict] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.repeats):
                for exact in (False, True):
                    r = run(job, exact, Path(tmp) / f"{exact}-{i}")
                    if exact not in best or r["perf/step_time"] < best[exact]["perf/step_time"]:
                        best[exact] = r
        for exact, r in best.items():
            print(f"{job:>6} {'true on-policy' if exact else 'normal':>15} {r['perf/step_time']:>8.3f} "
                  f"{r['perf/rollout_time']:>10.3f} {r[KEYS[2]]:>10.2e} {r[KEYS[3]]:>12.2e}")
        ratio = {k: best[True][k] / best[False][k] for k in KEYS[:2]}
        print(f"{job:>6} {'ratio':>15} {ratio[KEYS[0]]:>7.2f}x {ratio[KEYS[1]]:>9.2f}x")


if __name__ == "__main__":
    main()
