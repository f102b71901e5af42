"""What train.shared_prompt buys: the torch trainer's time per rollout with a group's prompt run
once (packed rows, logits at response positions only) against one row per sample.

    python bench/shared_prompt.py                 # both jobs, 2 interleaved repeats (~12 min, 2 cores)
    python bench/shared_prompt.py --jobs tiny --rollouts 40 --repeats 3

Jobs: `real` (SmolLM2-135M-Instruct, experiment=smollm2_arith_v1: 4 prompts x 8 samples, 16 new
tokens, its prompts ~46 tokens with the chat template's system prompt) and `tiny` (the default
job: 32 prompts x 8 samples, 8-token prompts). Each repeat runs `train.shared_prompt=false`
then `=true` through the real CLI; per run the median perf/train_time over rollouts 1.. (the
first carries the reference's forward) and the largest perf/peak_memory_mb. Printed: medians
over repeats and the ratio off / on (> 1: packing is faster), measured in this invocation.
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
JOBS = {
    "real": ["experiment=smollm2_arith_v1", "eval.interval=null"],
    "tiny": [],
}


def run(job: str, shared: bool, rollouts: int, out: Path) -> tuple[float, float]:
    """(median train seconds per rollout after the first, peak MB) of one run."""
    cmd = [sys.executable, "-m", "relax", *JOBS[job], f"rollout.num_rollout={rollouts}",
           "checkpoint.save_interval=null", f"train.shared_prompt={str(shared).lower()}",
           f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"shared_prompt bench: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rollout_rows = [r for r in rows if "step" not in r]
    return (statistics.median(r["perf/train_time"] for r in rollout_rows[1:]),
            max(r.get("perf/peak_memory_mb", 0.0) for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default="real,tiny", help=f"comma list of {', '.join(JOBS)}")
    ap.add_argument("--rollouts", type=int, default=4, help="rollouts per run (>= 2)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    jobs = args.jobs.split(",")
    if any(j not in JOBS for j in jobs) or args.rollouts < 2 or args.repeats < 1:
        ap.error(f"--jobs from {', '.join(JOBS)}, --rollouts >= 2, --repeats >= 1")
    results = {(j, s): [] for j in jobs for s in (False, True)}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for job in jobs:
                for shared in (False, True):
                    seconds, peak = run(job, shared, args.rollouts, Path(tmp) / f"{job}-{shared}-{rep}")
                    results[job, shared].append((seconds, peak))
                    print(f"[rep {rep}] {job:<4} shared_prompt={str(shared).lower():<5} "
                          f"train {seconds:7.2f} s/rollout, peak {peak:7.0f} MB", flush=True)
    print(f"\n{'job':<5} {'train s/rollout off':>20} {'on':>8} {'off / on':>9} {'peak MB off':>12} {'on':>8}")
    for job in jobs:
        # (lists: a generator inside a generator would read `shared` late, both sides the `on` runs')
        (off, off_mb), (on, on_mb) = [[statistics.median(x[i] for x in results[job, shared]) for i in (0, 1)]
                                      for shared in (False, True)]
        print(f"{job:<5} {off:20.2f} {on:8.2f} {off / on:8.2f}x {off_mb:12.0f} {on_mb:8.0f}")


if __name__ == "__main__":
    main()
