"""The tiny default job's in-loop time at two revisions, interleaved in one invocation: does a
change slow the loop down?

    python bench/revisions.py BEFORE [AFTER] [--repeats 3] [--rollouts 6] [key=value ...]

Checks out each revision (a git commit; AFTER defaults to the working tree) into a temporary
worktree and runs `python -m relax rollout.num_rollout=N checkpoint.save_interval=null` from it
(its own package and conf/, first on PYTHONPATH), alternating the two `--repeats` times. A
rollout's in-loop time is perf/rollout_time + perf/train_time + perf/weight_sync_time, the
first rollout left out (warm-up); each run gives its median, each revision its fastest run
(noise on a shared machine only adds time). Prints both and AFTER / BEFORE.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ("perf/rollout_time", "perf/train_time", "perf/weight_sync_time")


@contextlib.contextmanager
def worktree(revision: str | None, into: Path):
    """The source tree at `revision` (a temporary git worktree, removed after), or this one for None."""
    if revision is None:
        yield REPO
        return
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(into), revision],
                   check=True, capture_output=True)
    try:
        yield into
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(into)], capture_output=True)


def run_job(tree: Path, out: Path, args: list[str]) -> list[dict]:
    """metrics.jsonl of `relax <args>` run from `tree` (its relax and conf/) into `out`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-m", "relax", *args, f"hydra.run.dir={out}"], cwd=tree, env=env,
                   check=True, capture_output=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def in_loop_seconds(rows: list[dict]) -> float:
    """The median in-loop seconds per rollout, the first rollout left out."""
    per_rollout = [sum(r.get(k, 0.0) for k in PARTS) for r in rows if "perf/rollout_time" in r]
    return statistics.median(per_rollout[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="a git revision (commit, branch, tag)")
    parser.add_argument("after", nargs="?", default=None, help="a git revision (default: the working tree)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=6, help="rollouts per run (the first is warm-up)")
    args, overrides = parser.parse_known_args()
    common = [f"rollout.num_rollout={args.rollouts}", "checkpoint.save_interval=null", *overrides]
    with tempfile.TemporaryDirectory(prefix="relax-bench-revisions-") as tmp, \
            worktree(args.before, Path(tmp) / "before") as before, worktree(args.after, Path(tmp) / "after") as after:
        seconds: dict[str, list[float]] = {"before": [], "after": []}
        for repeat in range(args.repeats):
            for name, tree in (("before", before), ("after", after)):
                seconds[name].append(in_loop_seconds(run_job(tree, Path(tmp) / f"{name}_{repeat}", common)))
                print(f"[{repeat + 1}/{args.repeats}] {name}: {seconds[name][-1]:.3f} s per rollout", flush=True)
    fastest = {name: min(s) for name, s in seconds.items()}
    print(f"in-loop seconds per rollout, fastest of {args.repeats}: before ({args.before}) {fastest['before']:.3f}, "
          f"after ({args.after or 'the working tree'}) {fastest['after']:.3f}; "
          f"after / before = {fastest['after'] / fastest['before']:.3f}")


if __name__ == "__main__":
    main()
