"""Trainers (conf/train/, conf/parallel/): build the class `train._target_` names, on N ranks.

How it works in detail: docs/backends.md, "Inside `relax/train/__init__.py`".
"""

from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

from relax.algo import check_algo
from relax.errors import ConfigError
from relax.model import torch_dtype
from relax.targets import load_target
from relax.train import lora, routing


def make_trainer(train, algo, parallel, spec, rank: int = 0, world_size: int = 1):
    """Construct the configured trainer (`train._target_`) for one rank (also in spawned ranks:
    module-level, so it pickles; the groups may arrive as plain dicts)."""
    train, algo, parallel = (g if isinstance(g, DictConfig) else OmegaConf.create(g)
                             for g in (train, algo, parallel))
    return load_target(train, "train")(train, algo, parallel, spec, rank=rank, world_size=world_size)


def check_train_keys(t) -> None:
    """train.* values no trainer can use (checked whether or not a trainer is built: the driver
    and every engine process run train.num_threads threads too)."""
    for key in ("micro_batch_size", "num_steps_per_rollout", "num_threads"):
        if t[key] < 1:
            raise ConfigError(f"train.{key}={t[key]}: expected a positive integer")
    if t.num_threads >= 2**31:
        raise ConfigError(f"train.num_threads={t.num_threads}: expected fewer than 2**31 (a C int: "
                          f"torch.set_num_threads)")
    for key in ("lr", "weight_decay", "clip_grad", "adam_eps"):
        if not math.isfinite(t[key]) or t[key] < 0:
            raise ConfigError(f"train.{key}={t[key]}: expected a finite number >= 0")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= t[key] < 1:
            raise ConfigError(f"train.{key}={t[key]}: expected a number in [0, 1)")
    if t.ref_log_probs_interval is not None and t.ref_log_probs_interval < 1:
        raise ConfigError(f"train.ref_log_probs_interval={t.ref_log_probs_interval}: expected a positive "
                          f"number of rollouts, or null (the reference runs at the first step only)")


PARALLEL_SIZES = ("tp", "pp", "vpp", "ep", "etp", "cp", "dp")
MAX_NOISE_ULPS = 1000


def check_parallel_keys(p) -> None:
    """parallel.* values no layout can use (conf/parallel/)."""
    for key in PARALLEL_SIZES:
        if p[key] < 1:
            raise ConfigError(f"parallel.{key}={p[key]} (parallel={p.name}): expected a positive integer")
    for key in ("noise_ulp", "step_noise_ulp"):
        if not 0 <= p.get(key, 0) <= MAX_NOISE_ULPS:
            raise ConfigError(f"parallel.{key}={p[key]} (parallel={p.name}): expected a number of ulps in "
                              f"[0, {MAX_NOISE_ULPS}] (rounding noise is a few; each is a pass over the "
                              f"weights)")
    derived = p.tp * p.pp * p.cp * p.dp
    if p.world_size != derived:
        raise ConfigError(f"parallel.world_size={p.world_size}: it is derived, tp x pp x cp x dp = "
                          f"{derived}; leave it unset")


def check_batch_split(train, parallel, num_samples: int, source: str) -> None:
    """A rollout's samples split into train.num_steps_per_rollout mini-batches, each over
    parallel.dp ranks (a rank's last micro-batch may be smaller than train.micro_batch_size: the
    loss is a token mean over the whole step)."""
    parts = train.num_steps_per_rollout * parallel.dp
    if num_samples % parts:
        raise ConfigError(f"{source} gives {num_samples} samples per rollout, which do not split into "
                          f"train.num_steps_per_rollout={train.num_steps_per_rollout} x parallel.dp="
                          f"{parallel.dp} equal parts: make their product divide {num_samples}")


def check_trainer(train, algo, parallel, rollout, dtype: str, hf_config: dict) -> None:
    """Start-up refusals (after check_train_keys): the trainer class imports, the model's dtype
    (model.dtype) and the algo settings hold (every trainer trains with relax.algo), and its own
    checks pass for this model (`hf_config`: its config.json, see relax.model.model_config)."""
    trainer = load_target(train, "train")

    torch_dtype(dtype)
    check_algo(algo, rollout)
    lora.check_config(train, trainer, hf_config)
    routing.check_config(algo, hf_config, train.num_steps_per_rollout)
    if algo.routing_replay and not getattr(trainer, "replays_routing", False):
        raise ConfigError(f"algo.routing_replay={algo.routing_replay}: {train._target_} cannot "
                          f"route as recorded (use train=torch or train=megatron)")
    if hasattr(trainer, "check_config"):
        trainer.check_config(train, algo, parallel, rollout, dtype, hf_config)


def checkpoint_layout(train, parallel) -> dict:
    """What a checkpoint's trainer state is tied to: the trainer class, its LoRA adapters (or none)
    and whatever that class adds (train=megatron, whose optimizer state is saved per rank: the
    parallel sizes)."""
    trainer = load_target(train, "train")
    extra = trainer.checkpoint_layout(train, parallel) if hasattr(trainer, "checkpoint_layout") else {}
    return {"train._target_": train._target_, "train.lora": lora.layout(train.lora), **extra}


def runs_in_driver(train, parallel, weight_update_mode: str) -> bool:
    """Whether a single-rank trainer may run in the driver process (cluster=local): its class says
    so (`runs_in_driver`; Megatron never: its CPU compatibility layer and global parallel state
    must not leak into the driver), and NCCL weight sync (rollout.weight_update_mode=distributed)
    does not need it in its own process (it broadcasts while the driver waits on the engine)."""
    return (parallel.world_size == 1 and getattr(load_target(train, "train"), "runs_in_driver", False)
            and weight_update_mode != "distributed")
