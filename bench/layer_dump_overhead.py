"""What the layer dump costs: the default job before the feature, after it with the dump off,
and with it on.

    python bench/layer_dump_overhead.py [--before REV] [--rollouts 40] [--repeats 3] [key=value ...]

Runs the default job (GRPO on the tiny model) through the real CLI three ways, interleaved,
`--repeats` times each: `before` (the source tree at git revision REV, default 4ab10c1, the
last commit without debug.dump_layers, checked out with `git worktree`), `off` (this tree)
and `on` (this tree, debug.dump_layers on for the first rollout). Loop time is the run's own
perf/rollout_time + perf/train_time summed over its rollouts (no start-up); each variant
keeps its fastest run (on a shared 2-core machine noise only adds time). Printed as ratios
against `before`. Goal: `off` within noise of `before` (at most +3 %).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from revisions import REPO, run_job, worktree


def loop_seconds(rows: list[dict]) -> float:
    return sum(r.get("perf/rollout_time", 0.0) + r.get("perf/train_time", 0.0) for r in rows if "step" not in r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="4ab10c1", help="git revision without the layer dump")
    ap.add_argument("--rollouts", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    common = [f"rollout.num_rollout={args.rollouts}", "checkpoint.save_interval=null", *args.overrides]
    with tempfile.TemporaryDirectory() as tmp, worktree(args.before, Path(tmp) / "before") as before:
        variants = {
            "before": (before, common),
            "off": (REPO, common),
            "on": (REPO, [*common, f"debug.dump_layers={tmp}/layers_{{}}"]),
        }
        best: dict[str, float] = {}
        for repeat in range(args.repeats):
            for name, (tree, extra) in variants.items():
                extra = [x.replace("{}", str(repeat)) for x in extra]
                seconds = loop_seconds(run_job(tree, Path(tmp) / f"{name}_{repeat}", extra))
                best[name] = min(best.get(name, seconds), seconds)
                print(f"repeat {repeat + 1}/{args.repeats} {name:6s} loop {seconds:7.2f} s", flush=True)
    print(f"\n== {args.rollouts} rollouts, fastest of {args.repeats} ==")
    for name, seconds in best.items():
        print(f"  {name:6s} {seconds:7.2f} s   x{seconds / best['before']:.3f} of before")
    ok = best["off"] <= 1.03 * best["before"]
    print(f"  [{'ok' if ok else 'MISS'}] dump off within +3% of before: x{best['off'] / best['before']:.3f}")


if __name__ == "__main__":
    main()
