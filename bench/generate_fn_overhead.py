"""The cost of the rollout.generate_fn path against the bare batched engine call that the
rollout used to be, same prompts, seeds and engine: a default rollout (single_turn, made as
one engine call and one batch decode, plus rewards), and the same samples through a custom
async generate_fn (one coroutine per sample, their requests batched into one engine call).

    python bench/generate_fn_overhead.py [--repeats 7] [key=value ...]

Prints the fastest of interleaved repeats of each (timings on shared 2-core machines vary
up to 3x; noise only ever adds time) and the ratios (target for the default: within noise,
<= 1.15x), and checks that all draw the same tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def coroutine_single_turn(client, prompt, sampling_params):
    """single_turn as any custom generate_fn runs: a coroutine per sample."""
    from relax.rollout.generate import single_turn

    return await single_turn(client, prompt, sampling_params)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. rollout.max_new_tokens=16")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from relax import config
    from relax.cli import CONF_DIR
    from relax.model import load_tokenizer, resolve_model_path
    from relax.rollout import SamplingParams, build_engine
    from relax.rollout.spec import EngineSpec
    from relax.rollout.generate import generate_rollout
    from relax.task import build_task

    config.register()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=args.overrides)
    path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(path)
    spec = EngineSpec.of(cfg.rollout, cfg.model, cfg.seed, path, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    engine, task, r = build_engine(cfg.rollout, spec), build_task(cfg.task, cfg.seed), cfg.rollout
    prompts = [p.tokens for p in task.prompts(0, r.rollout_batch_size, tokenizer)
               for _ in range(r.n_samples_per_prompt)]

    def bare():
        return engine.generate(prompts, SamplingParams.of(r), cfg.seed * 1_000_003)

    def rollout(generate_fn):
        with_fn = OmegaConf.merge(r, {"generate_fn": generate_fn})
        return lambda: generate_rollout(engine, task, tokenizer, with_fn, 0, cfg.seed)[0]

    variants = {"bare": bare, "generate_fn": rollout(r.generate_fn),
                "coroutines": rollout("__main__.coroutine_single_turn")}
    for fn in variants.values():  # warm-up
        fn()
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            if name == "bare":
                tokens = [g.tokens for g in out]
            else:
                assert [s.tokens[s.prompt_length:] for s in out] == tokens, f"{name}: different tokens"
    best = {k: min(v) * 1e3 for k, v in times.items()}
    print(f"{len(prompts)} samples x max {r.max_new_tokens} new tokens: bare engine call "
          f"{best['bare']:.1f} ms; "
          f"default generate_fn ({r.generate_fn}) {best['generate_fn']:.1f} ms, ratio "
          f"{best['generate_fn'] / best['bare']:.2f}x (goal <= 1.15x); a custom async generate_fn "
          f"{best['coroutines']:.1f} ms, ratio {best['coroutines'] / best['bare']:.2f}x (same tokens)")

if __name__ == "__main__":
    main()
