"""Rollout (conf/rollout/): build the engine `rollout._target_` names; prompts become Samples in
relax/rollout/generate.py (rollout.generate_fn, rewards, dynamic sampling).

How it works in detail: docs/rollouts.md, "Inside `relax/rollout/__init__.py`".
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from relax.errors import ConfigError
from relax.model import torch_dtype
from relax.targets import load_function, load_target


@dataclass(frozen=True)
class SamplingParams:
    temperature: float         # 0: greedy (log-probs: relax.sample.log_prob_temperature)
    top_p: float
    max_new_tokens: int

    @classmethod
    def of(cls, rollout_cfg) -> "SamplingParams":
        return cls(rollout_cfg.temperature, rollout_cfg.top_p, rollout_cfg.max_new_tokens)


@dataclass
class Generation:
    tokens: list[int]          # response tokens, stop token included when produced
    log_probs: list[float]     # log p(token) at relax.sample.log_prob_temperature, per token
    status: str                # completed | truncated | aborted
    routed_experts: list[int] | None = None  # MoE: top-k expert ids of every fed token (Sample's)


def torch_cuda_available() -> bool:
    return torch.cuda.is_available()


GENERATE_FN = "fn(client, prompt, sampling_params) -> Sample (async def or def)"
FILTER_FN = "keep(group: list[Sample]) -> bool"
AGENT_FN = "async def agent(client: openai.AsyncOpenAI, row: dict) -> float | dict"
DEFAULT_GENERATE_FN = "relax.rollout.generate.single_turn"
MAX_ROLLOUTS = 10**7  # a run's rollout ids, listed at start-up (1e7 rollouts of 1 s each: 4 months)


def check_rollout(r) -> None:
    """rollout.* values no run can use, refused whether or not an engine is built (a replay
    still takes num_rollout, and its trainer the temperature)."""
    for key in ("num_rollout", "rollout_batch_size", "n_samples_per_prompt", "max_new_tokens",
                "rollout_num_gpus", "rollout_num_gpus_per_engine", "weight_update_bucket_mb"):
        if r[key] < 1:  # (max_new_tokens: an empty response has nothing to train on)
            raise ConfigError(f"rollout.{key}={r[key]}: expected a positive integer")
    if r.num_rollout > MAX_ROLLOUTS:
        raise ConfigError(f"rollout.num_rollout={r.num_rollout}: expected at most {MAX_ROLLOUTS:.0e} (the "
                          f"run lists its rollout ids at start-up)")
    if r.rollout_num_gpus % r.rollout_num_gpus_per_engine:
        raise ConfigError(f"rollout.rollout_num_gpus={r.rollout_num_gpus}: expected a multiple of "
                          f"rollout.rollout_num_gpus_per_engine={r.rollout_num_gpus_per_engine}")
    if not math.isfinite(r.temperature) or r.temperature < 0:
        raise ConfigError(f"rollout.temperature={r.temperature}: expected a number >= 0 (0: greedy)")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p={r.top_p}: expected a probability in (0, 1]")


def check_functions(rollout_cfg) -> None:
    """Start-up refusals: the rollout's functions import, the dynamic sampling sizes make sense."""
    r = rollout_cfg
    load_function(r.generate_fn, "rollout.generate_fn", GENERATE_FN)
    if r.dynamic_sampling_filter:
        load_function(r.dynamic_sampling_filter, "rollout.dynamic_sampling_filter", FILTER_FN)
    if r.over_sampling_batch_size is not None and r.over_sampling_batch_size < 1:
        raise ConfigError(f"rollout.over_sampling_batch_size={r.over_sampling_batch_size}: expected a "
                          f"positive number of prompts, or null (rollout.rollout_batch_size)")
    if r.max_generation_rounds < 1:
        raise ConfigError(f"rollout.max_generation_rounds={r.max_generation_rounds}: expected a positive "
                          f"integer")
    check_agent(r)


def check_agent(r) -> None:
    """Start-up refusals for rollout.agent (relax/rollout/agent.py) and rollout.agent_timeout."""
    if not (math.isfinite(r.agent_timeout) and r.agent_timeout > 0):
        raise ConfigError(f"rollout.agent_timeout={r.agent_timeout}: expected a positive number of seconds")
    if not r.agent:
        return
    if r.generate_fn != DEFAULT_GENERATE_FN:
        raise ConfigError(f"rollout.agent={r.agent} and rollout.generate_fn={r.generate_fn}: the agent makes "
                          f"the samples in place of a generate_fn; set one of them")
    missing = [m for m in ("openai", "aiohttp") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"rollout.agent={r.agent} needs {' and '.join(missing)}: the [agent] extra "
                          f"(pip install -c constraints.txt -e '.[agent]')")
    if not inspect.iscoroutinefunction(load_function(r.agent, "rollout.agent", AGENT_FN)):
        raise ConfigError(f"rollout.agent={r.agent} is not an async def function: expected {AGENT_FN}")


def engine_dtype(rollout, model) -> str:
    """The engine's dtype: rollout.dtype, or the model's (a bf16 engine against an fp32
    trainer is the classic rollout/train mismatch that algo.tis corrects)."""
    return rollout.dtype or model.dtype


def check_engine(rollout, model, algo, debug) -> None:
    """Start-up refusals: the engine class imports and supports what the config asks of it."""
    engine = load_target(rollout, "rollout")
    r = rollout
    if r.weight_update_mode == "distributed" and (
            not hasattr(engine, "receive_weights") or not torch_cuda_available()):
        raise ConfigError("rollout.weight_update_mode=distributed broadcasts weights over NCCL into "
                          "SGLang: it needs rollout=sglang and CUDA GPUs (use tensor or disk)")
    if r.colocate and not hasattr(engine, "release_memory_occupation"):
        raise ConfigError(f"rollout.colocate=true: {r._target_} cannot release its memory while the "
                          f"trainer runs (it has no release_memory_occupation; rollout=torch runs on CPU "
                          f"in the driver: no accelerator memory to share); use rollout=sglang or "
                          f"rollout.colocate=false")
    if r.num_engines is not None and r.num_engines < 1:
        raise ConfigError(f"rollout.num_engines={r.num_engines}: expected at least 1 (or null)")

    torch_dtype(engine_dtype(r, model), "rollout.dtype" if r.dtype else "model.dtype")
    if hasattr(engine, "check_config"):
        engine.check_config(r, model, algo, debug)
    check_functions(r)


def num_engines(rollout) -> int:
    """rollout.num_engines, or else rollout_num_gpus / rollout_num_gpus_per_engine GPU engines
    (1 on CPU)."""
    r = rollout
    if r.num_engines is not None:
        return r.num_engines
    return r.rollout_num_gpus // r.rollout_num_gpus_per_engine if uses_gpus(r) else 1


def uses_gpus(rollout) -> bool:
    """Whether the engine places itself on GPUs (it takes `base_gpu_id`) and there are GPUs."""
    engine = load_target(rollout, "rollout")
    return torch_cuda_available() and "base_gpu_id" in inspect.signature(engine).parameters


def build_engine(rollout, spec, base_gpu_id: int = 0):
    """One engine (`spec`: an EngineSpec, relax/rollout/spec.py); a GPU engine on the visible
    GPUs base_gpu_id.. (its tensor-parallel size)."""
    gpus = {"base_gpu_id": base_gpu_id} if uses_gpus(rollout) else {}
    return load_target(rollout, "rollout")(rollout, spec, **gpus)


# numpy's SeedSequence constants (numpy/random/bit_generator.pyx): pool of 4 32-bit words
INIT_A, MULT_A, INIT_B, MULT_B = 0x43b0d7e5, 0x931e8875, 0x8b51f9dd, 0x58f38ded
MIX_MULT_L, MIX_MULT_R, XSHIFT, MASK32 = 0xca01f9dd, 0x4973f715, 16, 0xFFFFFFFF


def rollout_seed(seed: int, rollout_id: int) -> int:
    """The seed a rollout's samples draw theirs from (sample_seeds), from the run's `seed`."""
    return seed * 1_000_003 + rollout_id


def sample_seeds(seed: int, indices, calls=None) -> list[int]:
    """The seed of each engine call k: from the rollout's seed, the sample's index in the
    rollout (indices[k]) and the call's number within the sample (calls[k], default 0: a
    multi-turn rollout calls the engine once per turn). What a sample draws does not depend on
    how the rollout is split across engines or batched. The value: numpy's SeedSequence of
    [seed mod 2**64, index(, call if > 0)], its first 64 bits >> 2 (< 2**62), with the hashing
    done once per step for all calls, not one SeedSequence each: faster by an order of
    magnitude (docs/results.md). Its word mixing is
    unsigned 32-bit arithmetic, which numpy arrays wrap like C does."""
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    calls = np.zeros_like(indices) if calls is None else np.asarray(calls, dtype=np.int64).reshape(-1)
    if len(indices) and (min(indices.min(), calls.min()) < 0 or max(indices.max(), calls.max()) > MASK32):
        raise ValueError("sample indices and call numbers must fit in 32 bits")
    seed %= 2**64  # SeedSequence's words: the seed's 32-bit words (1 or 2), the index, the call if > 0
    seed_words = [seed & MASK32] + ([seed >> 32] if seed >> 32 else [])
    out = np.zeros(len(indices), dtype=np.uint64)
    for with_call in (False, True):
        rows = np.flatnonzero((calls > 0) == with_call)
        if not len(rows):
            continue
        words = [np.full(len(rows), w, dtype=np.uint32) for w in seed_words]
        words += [indices[rows].astype(np.uint32)] + ([calls[rows].astype(np.uint32)] if with_call else [])
        out[rows] = _seed_sequence_state(words)
    return [int(v) for v in out >> np.uint64(2)]


def _seed_sequence_state(words: list) -> np.ndarray:
    """SeedSequence(entropy).generate_state(1, uint64) for a column of entropy arrays at once:
    `words[j]` holds word j of every row (at most the pool's 4 words)."""
    u32 = np.uint32
    hash_const = INIT_A

    def hashmix(value):
        nonlocal hash_const
        value = value ^ u32(hash_const)
        hash_const = (hash_const * MULT_A) & MASK32
        value = value * u32(hash_const)
        return value ^ (value >> u32(XSHIFT))

    assert len(words) <= 4
    zero = np.zeros_like(words[0])
    pool = [hashmix(words[i] if i < len(words) else zero) for i in range(4)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                mixed = u32(MIX_MULT_L) * pool[dst] - u32(MIX_MULT_R) * hashmix(pool[src])
                pool[dst] = mixed ^ (mixed >> u32(XSHIFT))
    state, hash_const = [], INIT_B
    for word in pool[:2]:  # two 32-bit words, little-endian, make the uint64
        value = word ^ u32(hash_const)
        hash_const = (hash_const * MULT_B) & MASK32
        value = value * u32(hash_const)
        state.append((value ^ (value >> u32(XSHIFT))).astype(np.uint64))
    return state[0] | (state[1] << np.uint64(32))


def buckets(named: dict, limit_bytes: int) -> list[dict]:
    """Weights (name -> tensor) split in order into buckets of at most `limit_bytes` each
    (rollout.weight_update_bucket_mb; a tensor larger than that gets a bucket of its own)."""
    out, size = [{}], 0
    for name, tensor in named.items():
        if out[-1] and size + tensor.nbytes > limit_bytes:
            out.append({})
            size = 0
        out[-1][name] = tensor
        size += tensor.nbytes
    return out


def prompt_seeds(seed: int | list[int], n: int, first_index: int = 0) -> list[int]:
    """Each of an engine call's `n` prompts' seed: given (a list), or the samples first_index..
    of the rollout whose seed is `seed`."""
    if isinstance(seed, int):
        return sample_seeds(seed, range(first_index, first_index + n))
    if len(seed) != n:
        raise ValueError(f"{len(seed)} seeds for {n} prompts")
    return list(seed)
