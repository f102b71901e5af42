"""The train-vs-rollout mismatch of bf16 on the real model, and what algo.tis does to it.

    python bench/bf16_mismatch.py                    # 4 jobs x 6 rollouts (~10 min, 2 cores)
    python bench/bf16_mismatch.py --jobs fp32,bf16-engine --rollouts 3

Every job is experiment=smollm2_arith_v1 (SmolLM2-135M-Instruct, 4 prompts x 8 samples, 16 new
tokens) with its evaluation off, the same seed, through the real CLI:
  fp32              engine and trainer in fp32: the mismatch is rounding alone
  bf16-engine       rollout.dtype=bfloat16 against the fp32 trainer (the usual RL setup)
  bf16-engine-tis   the same with algo.tis=token (truncated importance sampling, cap 2)
  bf16              model.dtype=bfloat16: engine and trainer both bf16
Printed per job, as the mean over its rollouts: train/mismatch_kl (k3 KL of rollout against
train policy), train/train_rollout_logprob_abs_diff (mean per-token |Δ log p|),
train/token_mult_prob_error (less 1), train/mismatch_residual (the ratio the update leaves uncorrected),
train/tis_weight_mean, train/tis_clipfrac, the largest per-token |Δ| of the first step, the raw
reward and seconds per rollout. docs/real-model.md has the numbers.
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
sys.path.insert(0, str(REPO))
from relax.files import safe_load  # noqa: E402
JOBS = {
    "fp32": [],
    "bf16-engine": ["rollout.dtype=bfloat16"],
    "bf16-engine-tis": ["rollout.dtype=bfloat16", "algo.tis=token"],
    "bf16": ["model.dtype=bfloat16"],
}
METRICS = ("train/mismatch_kl", "train/train_rollout_logprob_abs_diff", "train/token_mult_prob_error",
           "train/mismatch_residual", "train/tis_weight_mean", "train/tis_clipfrac")


def run(job: str, rollouts: int, out: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "relax", "experiment=smollm2_arith_v1", "eval.interval=null",
           f"rollout.num_rollout={rollouts}", *JOBS[job], f"hydra.run.dir={out}",
           f"debug.save_train_data={out}/train/{{rollout_id}}.pt"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"bf16 bench: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "train/loss" in r]
    per_rollout = [r for r in rows if "rollout/raw_reward" in r]
    result = {k: statistics.mean(s[k] for s in steps if k in s) for k in METRICS}
    result["reward"] = statistics.mean(r["rollout/raw_reward"] for r in per_rollout)
    result["seconds"] = statistics.mean(r["perf/rollout_time"] + r["perf/train_time"] for r in per_rollout)
    first = safe_load(out / "train" / "0.pt")  # the first step's per-token |Δ|
    result["max_abs_diff"] = max(abs(a - b) for s in first["samples"]
                                 for a, b in zip(s["log_probs"], s["rollout_log_probs"], strict=True))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default=",".join(JOBS), help=f"comma list of {', '.join(JOBS)}")
    ap.add_argument("--rollouts", type=int, default=6)
    args = ap.parse_args()
    jobs = args.jobs.split(",")
    if any(j not in JOBS for j in jobs) or args.rollouts < 1:
        ap.error(f"--jobs from {', '.join(JOBS)}, --rollouts >= 1")
    heads = ("mismatch_kl", "|Δ| mean", "|Δ| max", "mult_err-1", "residual", "tis_w", "tis_clip", "reward",
             "s/roll")
    print(f"{'job':<16}" + "".join(f"{h:>11}" for h in heads), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for job in jobs:
            r = run(job, args.rollouts, Path(tmp) / job)
            values = (r["train/mismatch_kl"], r["train/train_rollout_logprob_abs_diff"], r["max_abs_diff"],
                      r["train/token_mult_prob_error"] - 1, r["train/mismatch_residual"],
                      r["train/tis_weight_mean"], r["train/tis_clipfrac"], r["reward"], r["seconds"])
            print(f"{job:<16}" + "".join(f"{v:11.3g}" for v in values), flush=True)


if __name__ == "__main__":
    main()
