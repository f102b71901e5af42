"""Rollout engine speed: the torch engine's two forwards vs transformers `generate()`, same batches.

    python bench/rollout_speed.py [--model-path DIR] [--repeats 5]

The hand-written forward (where the model's family has one) and transformers' forward
(relax/rollout/hf_engine.py, every other architecture) against `generate()`, greedy with the
stop token suppressed so every sequence runs to `max_new_tokens`; the greedy tokens are
checked to be identical. Prints tokens/s, the ratios (targets: hand-written >= 2x generate,
transformers' forward >= 1.5x) and each one's peak memory over the process's before it, in
one process with 1 torch thread, the fastest of interleaved repeats.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from pathlib import Path

import psutil

import torch

from relax.model import load_causal_lm, load_tokenizer
from relax.model import families, read_hf_config
from relax.rollout import SamplingParams
from relax.rollout.hf_engine import TransformersEngine
from relax.rollout.spec import EngineSpec
from relax.rollout.torch_engine import TorchEngine
from relax.task.arithmetic import make_problem


GENERIC = "transformers' forward"


def prompts_for(tokenizer, n, samples_per_prompt=1):
    """`n` rows: n / samples_per_prompt distinct prompts, each repeated (a GRPO batch)."""
    rng = random.Random(0)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": make_problem(rng, 10, 99)[0]}],
                                           add_generation_prompt=True, tokenize=False)
             for _ in range(n // samples_per_prompt)]
    return [tokenizer(t, add_special_tokens=False)["input_ids"]
            for t in texts for _ in range(samples_per_prompt)]


def until_eos(tokens, tokenizer):
    # HF's min_new_tokens bans the stop token; the engine (no stop ids) may pick it, after
    # which the two continue differently. Compare up to that point.
    eos = tokenizer.eos_token_id
    return tokens[:tokens.index(eos)] if eos in tokens else tokens


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def best_times(fns: dict, repeats: int) -> dict:
    """Per name, (seconds, output) of the fastest of `repeats` runs, interleaved: this machine's
    noise only ever adds time."""
    for fn in fns.values():
        fn()  # warm-up
    runs = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            runs[name].append(timed(fn))
    return {name: min(r, key=lambda run: run[0]) for name, r in runs.items()}


def peak_mb(fn) -> float:
    """The process's resident memory at its highest while `fn` runs, over what it was before (MB)."""
    process, peak, done = psutil.Process(), [0], threading.Event()
    base = process.memory_info().rss

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)
    thread = threading.Thread(target=sample)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(peak[0] - base, 0) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", type=Path, default=None, help="HF dir (default: tiny model)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from hydra import compose, initialize_config_dir

    from relax import config
    from relax.cli import CONF_DIR
    from relax.model import resolve_model_path

    config.register()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config")
    path = args.model_path or resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, "float32")
    spec = EngineSpec(str(path), eos_token_ids=(), pad_token_id=tokenizer.pad_token_id)  # (no stop: full length)
    engines = {GENERIC: TransformersEngine(cfg.rollout, spec)}
    if families.check(read_hf_config(path)).family is not None:
        engines["hand-written"] = TorchEngine(cfg.rollout, spec)

    print(f"model: {path}")
    print(f"{'batch x new tokens':>20} {'generate tok/s':>15}" + "".join(f" {n + ' tok/s':>27}" for n in engines)
          + " ratios (peak MB: generate / " + " / ".join(engines) + ")")
    # (rows, new tokens, samples per prompt): decode-heavy, then the default RL rollout shape
    # (32 prompts x 8 samples), where the engines prefill each prompt once and HF all 256 rows.
    for batch, new_tokens, group in [(16, 64, 1), (64, 32, 1), (256, 8, 8)]:
        prompts = prompts_for(tokenizer, batch, group)
        ids = torch.tensor(prompts)  # equal lengths: no padding on either side

        def hf():
            with torch.no_grad():
                return model.generate(ids, do_sample=False, max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)

        fns = {"generate": hf} | {name: (lambda e=engine: e.generate(prompts, SamplingParams(0.0, 1.0, new_tokens),
                                                                     seed=0)) for name, engine in engines.items()}
        best = best_times(fns, args.repeats)
        expected = best["generate"][1][:, ids.shape[1]:].tolist()
        n = batch * new_tokens
        label = f"{batch} x {new_tokens}" + (f" ({group}/prompt)" if group > 1 else "")
        line = f"{label:>20} {n / best['generate'][0]:>15,.0f}"
        for name in engines:
            cut = [until_eos(g.tokens, tokenizer) for g in best[name][1]]
            same = cut == [t[:len(c)] for c, t in zip(cut, expected)]
            line += f" {n / best[name][0]:>18,.0f} ({best['generate'][0] / best[name][0]:.2f}x)" \
                + ("" if same else " DIFFER")
        if len(engines) == 2:
            line += f"  hand-written / transformers': {best[GENERIC][0] / best['hand-written'][0]:.2f}x"
        print(line + "  MB: " + " / ".join(f"{peak_mb(fn):.0f}" for fn in fns.values()))


if __name__ == "__main__":
    main()
