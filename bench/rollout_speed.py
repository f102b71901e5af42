"""Rollout engine speed: Relax's torch engine vs transformers `generate()`, same model and batch.

    python bench/rollout_speed.py [--model-path DIR] [--repeats 5]

Both sample greedily with the stop token suppressed so every sequence generates exactly
`max_new_tokens`; the greedy tokens are checked to be identical. Prints tokens/s of each
and the ratio (target: >= 2x), measured in the same process with 1 torch thread, taking
the fastest of interleaved repeats (timings on shared 2-core machines vary up to 3x).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from relax.model import load_causal_lm, load_tokenizer
from relax.rollout import SamplingParams
from relax.rollout.torch_engine import TorchEngine
from relax.task.arithmetic import make_problem


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


def best_times(fn_a, fn_b, repeats):
    """Fastest of `repeats` runs each, interleaved: this machine's noise only ever adds time."""
    fn_a(), fn_b()  # warm-up
    runs_a, runs_b = zip(*[(timed(fn_a), timed(fn_b)) for _ in range(repeats)])
    return min(runs_a, key=lambda r: r[0]), min(runs_b, key=lambda r: r[0])


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
    engine = TorchEngine(cfg, path, eos_token_ids=[], pad_token_id=tokenizer.pad_token_id)

    print(f"model: {path}")
    print(f"{'batch x new tokens':>20} {'HF generate tok/s':>18} {'Relax tok/s':>12} {'ratio':>7}")
    # (rows, new tokens, samples per prompt): decode-heavy, then the default RL rollout shape
    # (32 prompts x 8 samples), where Relax prefills each prompt once and HF all 256 rows.
    for batch, new_tokens, group in [(16, 64, 1), (64, 32, 1), (256, 8, 8)]:
        prompts = prompts_for(tokenizer, batch, group)
        ids = torch.tensor(prompts)  # equal lengths: no padding on either side

        def hf():
            with torch.no_grad():
                return model.generate(ids, do_sample=False, max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)

        def relax():
            return engine.generate(prompts, SamplingParams(0.0, 1.0, new_tokens), seed=0)

        (t_hf, out_hf), (t_rx, out_rx) = best_times(hf, relax, args.repeats)
        cut = [until_eos(g.tokens, tokenizer) for g in out_rx]
        same = cut == [t[:len(c)] for c, t in zip(cut, out_hf[:, ids.shape[1]:].tolist())]
        n = batch * new_tokens
        label = f"{batch} x {new_tokens}" + (f" ({group}/prompt)" if group > 1 else "")
        print(f"{label:>20} {n / t_hf:>18,.0f} {n / t_rx:>12,.0f} {t_hf / t_rx:>6.2f}x"
              + ("" if same else "  (greedy tokens DIFFER)"))


if __name__ == "__main__":
    main()
