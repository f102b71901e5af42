"""Start-up of the default job: from the command to the first `Finish rollout` line.

    python bench/startup.py [--repeats 3] [key=value ...]

Runs `relax rollout.num_rollout=1 checkpoint.save_interval=null` through the real CLI,
`--repeats` times, interleaved with the floor that any such job pays before Relax does
anything (a Python process importing torch and transformers), and splits each run by its
own log's timestamps:
  to Building         launch -> `Building ...` (Python, imports, Hydra composition, the run's
                         start-up checks: model and tokenizer, plan, replay and cluster)
  build + rollout 0   -> `Finish rollout 0` (engine and trainer built, 256 samples generated
                         and scored)
  step + close        -> the process has exited (the first optimizer step, weight sync, the
                         run's plot, closing)
Prints the fastest run of each part (timings on shared 2-core machines vary; noise only
adds time) and the time to the first rollout as a ratio of the floor.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

PARTS = ("to Building", "build + rollout 0", "step + close")


def stamp(line: str) -> float:
    return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def one_run(extra: list[str]) -> dict[str, float]:
    cwd = Path(tempfile.mkdtemp(prefix="relax-bench-startup-"))
    cmd = [sys.executable, "-m", "relax", "rollout.num_rollout=1", "checkpoint.save_interval=null",
           "hydra.run.dir=run", *extra]
    launched = time.time()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    ended = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    lines = (cwd / "run" / "relax.log").read_text().splitlines()
    building = stamp(next(line for line in lines if "] - Building " in line))
    rollout0 = stamp(next(line for line in lines if "] - Finish rollout 0" in line))
    return dict(zip(PARTS, (building - launched, rollout0 - building, ended - rollout0)))


def floor() -> float:
    """A Python process that imports what every job imports first, and exits."""
    t0 = time.time()
    subprocess.run([sys.executable, "-c", "import torch, transformers"], check=True, env=os.environ)
    return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args, extra = ap.parse_known_args()
    runs, floors = [], []
    for i in range(args.repeats):
        floors.append(floor())
        runs.append(one_run(extra))
        r = runs[-1]
        print(f"  #{i}: " + ", ".join(f"{k} {v:.2f} s" for k, v in r.items())
              + f" | floor (import torch, transformers) {floors[-1]:.2f} s", flush=True)
    best = {k: min(r[k] for r in runs) for k in PARTS}
    to_rollout = min(r[PARTS[0]] + r[PARTS[1]] for r in runs)
    print(f"\nbest of {args.repeats}: " + ", ".join(f"{k} {v:.2f} s" for k, v in best.items()))
    print(f"command -> `Finish rollout 0`: {to_rollout:.2f} s; whole process "
          f"{min(sum(r.values()) for r in runs):.2f} s; floor {min(floors):.2f} s: "
          f"{to_rollout / min(floors):.2f}x the floor")


if __name__ == "__main__":
    main()
