"""The OpenAI-compatible endpoint (rollout.agent) against the engine's direct batched call (the
default single-turn generate_fn): same prompts, seeds and sampling; and agents in flight against
throughput.

    python bench/agent_endpoint.py                  # tiny model, 3 interleaved repeats
    python bench/agent_endpoint.py --job real       # SmolLM2, 4 prompts x 4 samples, 32 new tokens

Each run is `relax <job> debug=rollout_only` (the engine only), with or without
`rollout.agent=agent_endpoint.one_turn` (one chat completion per sample, as the direct call
makes one generation). Per run: seconds per response token (1 / perf/tokens_per_s, the median
over rollouts, the first left out); the endpoint's ratio to the direct call, repeats interleaved.
Then the endpoint alone with rollout.rollout_batch_size x 8 samples in flight: tokens per second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
from datetime import datetime
from pathlib import Path

from relax.logger import read_metrics

REPO = Path(__file__).resolve().parent.parent
JOBS = {"tiny": [], "real": ["model=smollm2", "rollout.rollout_batch_size=4",
                             "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=32"]}


async def one_turn(client, row) -> float:
    """One chat completion of the task's question; reward 1 for the label exactly."""
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = await client.chat.completions.create(model="policy", messages=messages)
    return float((reply.choices[0].message.content or "").strip() == row["label"])


def seconds_per_token(relax: str, overrides: list[str], run_dir: Path) -> float:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'bench'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [relax, *overrides, "debug=rollout_only", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rollouts, _ = read_metrics(run_dir)
    return statistics.median(1 / r["perf/tokens_per_s"] for r in rollouts[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", choices=list(JOBS), default="tiny")
    ap.add_argument("--rollouts", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--in-flight", default="1,4,16,64", help="rollout.rollout_batch_size values (x 8 samples)")
    ap.add_argument("--relax", default=str(REPO / ".venv" / "bin" / "relax"))
    args = ap.parse_args()
    out = REPO / "outputs" / "bench" / f"agent_endpoint-{datetime.now():%Y-%m-%d_%H-%M-%S}"
    base = [*JOBS[args.job], f"rollout.num_rollout={args.rollouts}", "checkpoint.save_interval=null"]
    agent = "rollout.agent=agent_endpoint.one_turn"
    print(f"Run folders: {out}", flush=True)
    direct, endpoint = [], []
    for rep in range(args.repeats):
        direct.append(seconds_per_token(args.relax, base, out / f"direct-{rep}"))
        endpoint.append(seconds_per_token(args.relax, [*base, agent], out / f"endpoint-{rep}"))
        print(f"[{rep + 1}/{args.repeats}] direct {direct[-1] * 1e3:.3f} ms/token, endpoint "
              f"{endpoint[-1] * 1e3:.3f} ms/token ({endpoint[-1] / direct[-1]:.2f}x)", flush=True)
    ratios = [e / d for e, d in zip(endpoint, direct)]
    print(f"\n{args.job}: endpoint / direct, seconds per response token: median "
          f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}..{max(ratios):.2f}] over {args.repeats} "
          f"repeats (goal <= 1.2x)")
    if args.job == "tiny":
        print("\nin flight (samples)   endpoint tokens/s")
        for prompts in map(int, args.in_flight.split(",")):
            s = seconds_per_token(args.relax, [*base, agent, f"rollout.rollout_batch_size={prompts}"],
                                  out / f"in-flight-{prompts}")
            print(f"{prompts * 8:>19}   {1 / s:>17.0f}", flush=True)


if __name__ == "__main__":
    main()
