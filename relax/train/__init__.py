"""Trainers (conf/train/, conf/parallel/): build the backend the config names, on N ranks.

A trainer implements, for the driver:
  train(rollout_id, samples) -> {"rollout": {...}, "steps": [{...}], ...}
  named_weights() -> {hf_name: tensor}       # what weight sync pushes into the engine
  save_checkpoint(path) / load_checkpoint(path)
  shutdown()
relax/cluster/ decides where its ranks run (in the driver, local rank processes, or Ray
actors: see runs_in_driver); the driver cannot tell the difference.
"""

from __future__ import annotations

import importlib

from omegaconf import DictConfig, OmegaConf

from relax.errors import ConfigError

BACKENDS = {
    "torch": "relax.train.torch_trainer:TorchTrainer",
    "megatron": "relax.train.megatron.trainer:MegatronTrainer",
}
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


def make_trainer(cfg, *args, **kwargs):
    """Construct the configured backend's trainer for one rank (also in spawned ranks)."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(cfg)
    module, _, cls = BACKENDS[cfg.train.backend].partition(":")
    return getattr(importlib.import_module(module), cls)(cfg, *args, **kwargs)


def check_backend(cfg) -> None:
    if cfg.train.backend not in BACKENDS:
        raise ConfigError(f"train.backend={cfg.train.backend!r}: expected one of "
                          f"{', '.join(BACKENDS)}")
    if cfg.train.backend == "torch":
        from relax.train.parallel import check_torch_layout

        check_torch_layout(cfg.parallel)
    if cfg.train.backend == "megatron":
        if cfg.train.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"train.attention_backend={cfg.train.attention_backend!r}: expected one "
                              f"of {', '.join(ATTENTION_BACKENDS)}")
        from relax.train.megatron.cpu_compat import check_version

        check_version()


def checkpoint_layout(cfg) -> dict:
    """What a checkpoint's trainer state is tied to: its backend; for Megatron, whose optimizer
    state is saved per rank, also the parallel sizes and the optimizer kind (train=torch
    saves full state dicts, which load into any layout)."""
    layout = {"train.backend": cfg.train.backend}
    if cfg.train.backend == "megatron":
        layout |= {f"parallel.{k}": cfg.parallel[k] for k in ("tp", "pp", "vpp", "ep", "etp", "cp", "dp")}
        layout["train.use_distributed_optimizer"] = cfg.train.use_distributed_optimizer
    return layout


def runs_in_driver(cfg) -> bool:
    """A single-rank torch trainer can run in the driver process (cluster=local); Megatron never
    does (its CPU compatibility layer and global parallel state must not leak into the driver),
    nor a trainer that NCCL weight sync needs in its own process (it broadcasts while the driver
    waits on the engine)."""
    return (cfg.parallel.world_size == 1 and cfg.train.backend == "torch"
            and cfg.rollout.weight_update_mode != "distributed")
