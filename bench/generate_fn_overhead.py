"""The cost of the rollout.generate_fn path: a default rollout (one coroutine per sample, their
requests batched into one engine call, rewards) against the bare batched engine call that the
rollout used to be, same prompts, seeds and engine.

    python bench/generate_fn_overhead.py [--repeats 7] [key=value ...]

Prints the fastest of interleaved repeats of each (timings on shared 2-core machines vary
up to 3x; noise only ever adds time) and their ratio (target: within noise, <= 1.15x), and
checks that both draw the same tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. rollout.max_new_tokens=16")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from hydra import compose, initialize_config_dir

    from relax import config
    from relax.cli import CONF_DIR
    from relax.model import load_tokenizer, resolve_model_path
    from relax.rollout import SamplingParams, build_engine
    from relax.rollout.generate import generate_rollout
    from relax.task import build_task

    config.register()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=args.overrides)
    path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(path)
    engine, task, r = build_engine(cfg, path, tokenizer), build_task(cfg), cfg.rollout
    prompts = [p.tokens for p in task.prompts(0, r.rollout_batch_size, tokenizer)
               for _ in range(r.n_samples_per_prompt)]

    def bare():
        return engine.generate(prompts, SamplingParams.of(r), cfg.seed * 1_000_003)

    def path_fn():
        return generate_rollout(engine, task, tokenizer, r, 0, cfg.seed)[0]

    bare(), path_fn()  # warm-up
    times = {"bare": [], "generate_fn": []}
    for _ in range(args.repeats):
        for name, fn in (("bare", bare), ("generate_fn", path_fn)):
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            if name == "bare":
                tokens = [g.tokens for g in out]
            else:
                assert [s.tokens[s.prompt_length:] for s in out] == tokens, "different tokens"
    best = {k: min(v) for k, v in times.items()}
    n = len(prompts)
    print(f"{n} samples x max {r.max_new_tokens} new tokens: bare engine call "
          f"{best['bare'] * 1e3:.1f} ms, generate_fn path {best['generate_fn'] * 1e3:.1f} ms, "
          f"ratio {best['generate_fn'] / best['bare']:.2f}x (same tokens)")


if __name__ == "__main__":
    main()
