"""Rollout (conf/rollout/): build the engine the config names, and turn prompts into Samples.

An engine implements four calls, small enough for a Ray actor to wrap:
  generate(prompt_token_lists, SamplingParams, seed) -> list[Generation]
  update_weights({hf_name: tensor})          # weight sync from the trainer
  named_tensors() -> {hf_name: tensor}       # parameters and buffers, for weight checks
  release_memory_occupation() / resume_memory_occupation()   # around training, colocated
  shutdown()
"""

from __future__ import annotations

import logging
from pathlib import Path

from relax.errors import ConfigError
from relax.sample import Sample

log = logging.getLogger(__name__)
ENGINES = ("torch", "sglang")


def sampling_params(rollout_cfg):
    from relax.rollout.torch_engine import SamplingParams

    return SamplingParams(rollout_cfg.temperature, rollout_cfg.top_p, rollout_cfg.max_new_tokens)


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_dtype(cfg) -> str:
    """The engine's dtype: rollout.dtype, or the model's (a bf16 engine against an fp32
    trainer is the classic rollout/train mismatch that algo.tis corrects)."""
    return cfg.rollout.dtype or cfg.model.dtype


def check_engine(cfg) -> None:
    if cfg.rollout.max_new_tokens < 1:
        raise ConfigError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}: a rollout needs at least "
                          f"one generated token (an empty response has nothing to train on)")
    if cfg.rollout.engine not in ENGINES:
        raise ConfigError(f"rollout.engine={cfg.rollout.engine!r}: expected one of "
                          f"{', '.join(ENGINES)}")
    mode = cfg.rollout.weight_update_mode
    if mode not in ("tensor", "disk", "distributed"):
        raise ConfigError(f"rollout.weight_update_mode={mode!r}: expected tensor, disk or distributed")
    if mode == "distributed" and (cfg.rollout.engine != "sglang" or not torch_cuda_available()):
        raise ConfigError("rollout.weight_update_mode=distributed broadcasts weights over NCCL into "
                          "SGLang: it needs rollout=sglang and CUDA GPUs (use tensor or disk)")
    if cfg.rollout.engine == "sglang" and cfg.debug.check_weight_update_equal and \
            cfg.rollout.rollout_num_gpus_per_engine > 1:
        raise ConfigError("debug.check_weight_update_equal reads the engine's tensors back unsharded: "
                          "run it with rollout.rollout_num_gpus_per_engine=1")


def build_engine(cfg, model_path: Path, tokenizer):
    if cfg.rollout.engine == "sglang":
        from relax.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(cfg, model_path, [tokenizer.eos_token_id])
    from relax.rollout.torch_engine import TorchEngine

    if cfg.rollout.rollout_num_gpus > 1:
        log.info("rollout=torch runs in-process on CPU; rollout_num_gpus=%d is used by "
                 "GPU engines", cfg.rollout.rollout_num_gpus)
    return TorchEngine(model_path, engine_dtype(cfg), [tokenizer.eos_token_id],
                       tokenizer.pad_token_id)


def generate_rollout(engine, task, tokenizer, rollout_cfg, rollout_id: int, seed: int) -> list[Sample]:
    """Sample `n_samples_per_prompt` responses per prompt and score them."""
    n = rollout_cfg.n_samples_per_prompt
    prompts = task.prompts(rollout_id, rollout_cfg.rollout_batch_size, tokenizer)
    repeated = [p for p in prompts for _ in range(n)]
    generations = engine.generate([p.tokens for p in repeated], sampling_params(rollout_cfg),
                                  seed=seed * 1_000_003 + rollout_id)
    samples = []
    for i, (prompt, gen) in enumerate(zip(repeated, generations)):
        response = tokenizer.decode(gen.tokens, skip_special_tokens=True)
        samples.append(Sample(
            index=i, group_index=i // n, prompt=prompt.text, tokens=prompt.tokens + gen.tokens,
            response_length=len(gen.tokens), response=response, label=prompt.label,
            reward=task.reward(response, prompt.label), loss_mask=[1] * len(gen.tokens),
            rollout_log_probs=gen.log_probs, status=gen.status,
            metadata={"rollout_id": rollout_id},
        ))
    return samples
