"""LoRA against full fine-tuning on one job: step time, peak memory and weight-sync time.

    python bench/lora_vs_full.py [--rollouts 20] [--rank 8] [--repeats 2] [key=value ...]

Runs the default job (GRPO on the tiny model; overrides choose another, e.g.
experiment=smollm2_arith_v1) through the real CLI, `full` (every weight trains, beside a frozen
reference copy) and `lora` (train.lora.rank=R: adapters on the base, which is the reference),
interleaved, `--repeats` times each. From each run's metrics.jsonl: the optimizer step
(perf/step_time) and the weight sync (perf/weight_sync_time), medians over the rollouts after
the first; the process's peak memory (perf/peak_memory_mb: max RSS on CPU, where the engine
shares the process; the CUDA allocator's peak on GPU). Each variant keeps its fastest repeat
(on a shared machine noise only adds time); printed with ratios against `full`.
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


def measure(out: Path, args: list[str]) -> dict[str, float]:
    subprocess.run([sys.executable, "-m", "relax", *args, f"hydra.run.dir={out}"], cwd=REPO, check=True,
                   capture_output=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step" in r and r["rollout_id"] > 0]
    rollouts = [r for r in rows if "step" not in r and r["rollout_id"] > 0]
    return {"step_ms": 1e3 * statistics.median(r["perf/step_time"] for r in steps),
            "sync_ms": 1e3 * statistics.median(r["perf/weight_sync_time"] for r in rollouts),
            "peak_mb": max(r["perf/peak_memory_mb"] for r in steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=20)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    common = [*args.overrides, f"rollout.num_rollout={args.rollouts}", "checkpoint.save_interval=null"]
    variants = {"full": common, "lora": [*common, f"train.lora.rank={args.rank}"]}
    best: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, extra in variants.items():
                got = measure(Path(tmp) / f"{name}_{repeat}", extra)
                best[name] = {k: min(v, best.get(name, got)[k]) for k, v in got.items()}
                print(f"repeat {repeat + 1}/{args.repeats} {name:4s} " + "  ".join(
                    f"{k} {v:8.1f}" for k, v in got.items()), flush=True)
    print(f"\n== {' '.join(args.overrides) or 'the default job'}, {args.rollouts} rollouts, LoRA rank "
          f"{args.rank}, fastest of {args.repeats} ==")
    print(f"  {'':4s} {'step (ms)':>10s} {'sync (ms)':>10s} {'peak (MiB)':>11s}")
    for name, got in best.items():
        print(f"  {name:4s} {got['step_ms']:10.1f} {got['sync_ms']:10.1f} {got['peak_mb']:11.0f}")
    ratios = {k: best["lora"][k] / best["full"][k] for k in best["full"]}
    print(f"  lora/full: step x{ratios['step_ms']:.2f}, sync x{ratios['sync_ms']:.2f}, "
          f"peak memory x{ratios['peak_mb']:.2f}")


if __name__ == "__main__":
    main()
