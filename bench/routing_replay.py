"""What MoE routing costs per rollout: recording it in the torch engine, measuring it in the
trainer, and replaying it (algo.routing_replay), on the tiny Qwen2-MoE.

    python bench/routing_replay.py               # 20 interleaved repeats (~30 s, 2 cores)
    python bench/routing_replay.py --repeats 5

In one process, interleaved so that drift on a shared machine hits every variant alike:
  generate    the torch engine's rollout (32 prompts x 8 samples, 8 new tokens) with its
              routing recorded, against the same engine with recording switched off
  train       train=torch's train() on that rollout with algo.routing_replay null (agreement
              measured: hooks on every router), rollout (R3) and train (R2, 2 steps), against
              the same trainer on samples that carry no routing and a model without hooks
Prints median seconds and the ratio to the baseline of each pair (1.00: free).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MOE = ["model.tiny.num_experts=4", "model.tiny.warmup_max_steps=0",
       "model.tiny.shared_expert_intermediate_size=64"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()

    import dataclasses

    import torch
    from tqdm.auto import tqdm

    from relax.model import load_tokenizer, resolve_model_path
    from relax.rollout import SamplingParams
    from relax.rollout.spec import EngineSpec
    from relax.rollout.torch_engine import TorchEngine
    from relax.sample import Sample
    from relax.train import routing
    from tests.conftest import local_trainer, make_cfg

    torch.set_num_threads(1)
    cfg = make_cfg(*MOE)
    path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(path)
    engine = TorchEngine(cfg.rollout, EngineSpec.of(cfg.rollout, cfg.model, cfg.seed, path,
                                                    [tokenizer.eos_token_id], tokenizer.pad_token_id))
    moe_layers = engine.num_moe_layers
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": f"{a}+{a + 7}="}],
                                                       add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)["input_ids"] for a in range(10, 42) for _ in range(8)]
    sp = SamplingParams(1.0, 1.0, 8)

    def generate(record: bool):
        engine.num_moe_layers = moe_layers if record else 0  # 0: the engine keeps no routes
        return engine.generate(prompts, sp, seed=0)

    gens = generate(True)
    samples = [Sample(i, i // 8, "", p + g.tokens, len(g.tokens), reward=float(i % 3 == 0),
                      loss_mask=[1] * len(g.tokens), rollout_log_probs=g.log_probs,
                      routed_experts=g.routed_experts)
               for i, (p, g) in enumerate(zip(prompts, gens, strict=True))]
    bare = [dataclasses.replace(s, routed_experts=None) for s in samples]
    trainers = {mode: local_trainer(make_cfg(*MOE, f"algo.routing_replay={mode}",
                                            "rollout.rollout_batch_size=32", "train.num_steps_per_rollout=2"),
                                   str(path), pad_token_id=tokenizer.pad_token_id)
                for mode in ("null", "rollout", "train")}
    baseline = trainers["null"]

    def no_hooks(model):
        return []

    variants = {
        "generate, recording": lambda: generate(True),
        "generate, not recording": lambda: generate(False),
        "train, measured": lambda: baseline.train(1, samples),
        "train, R3": lambda: trainers["rollout"].train(1, samples),
        "train, R2": lambda: trainers["train"].train(1, samples),
        "train, no routing": lambda: train_without_routing(baseline, bare),
    }

    def train_without_routing(trainer, data):
        original = routing.hf_routers
        routing.hf_routers = no_hooks  # no router hooked: the trainer as before routing existed
        try:
            return trainer.train(1, data)
        finally:
            routing.hf_routers = original

    times = {name: [] for name in variants}
    for _ in tqdm(range(args.repeats), desc="repeats"):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    pairs = [("generate, recording", "generate, not recording"), ("train, measured", "train, no routing"),
             ("train, R3", "train, no routing"), ("train, R2", "train, no routing")]
    print(f"{'variant':<24} {'median s':>9} {'vs':<24} {'ratio':>6}")
    for name, base in pairs:
        print(f"{name:<24} {median[name]:9.3f} {base:<24} {median[name] / median[base]:6.2f}")


if __name__ == "__main__":
    main()
