"""Trainers (conf/train/, conf/parallel/): build the backend the config names, on N ranks.

A trainer implements, for the driver:
  train(rollout_id, samples) -> {"rollout": {...}, "steps": [{...}], ...}
  named_weights() -> {hf_name: tensor}       # what weight sync pushes into the engine
  save_checkpoint(path) / load_checkpoint(path)
  shutdown()
A single-rank torch trainer runs in the driver process; every other trainer runs in
`TrainerGroup` rank processes (Megatron always: its CPU compatibility layer and global
parallel state must not leak into the driver), and the driver cannot tell the difference.
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


def check_backend(cfg, hf_config: dict) -> None:
    """Refuse, before any rank starts, a backend or layout that cannot train this model
    (`hf_config`: its config.json, see relax.model.model_config)."""
    if cfg.train.backend not in BACKENDS:
        raise ConfigError(f"train.backend={cfg.train.backend!r}: expected one of "
                          f"{', '.join(BACKENDS)}")
    if cfg.train.backend == "torch":
        from relax.train.parallel import check_torch_layout

        check_torch_layout(cfg.parallel, hf_config)
    if cfg.train.backend == "megatron":
        if cfg.train.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"train.attention_backend={cfg.train.attention_backend!r}: expected one "
                              f"of {', '.join(ATTENTION_BACKENDS)}")
        from relax.train.megatron.cpu_compat import check_version
        from relax.train.megatron.layout import check_megatron_layout

        check_version()
        check_megatron_layout(cfg.parallel, hf_config)


def checkpoint_layout(cfg) -> dict:
    """What a checkpoint's trainer state is tied to: its backend; for Megatron, whose optimizer
    state is saved per rank, also the parallel sizes and the optimizer kind (train=torch
    saves full state dicts, which load into any layout)."""
    layout = {"train.backend": cfg.train.backend}
    if cfg.train.backend == "megatron":
        layout |= {f"parallel.{k}": cfg.parallel[k] for k in ("tp", "pp", "vpp", "ep", "etp", "cp", "dp")}
        layout["train.use_distributed_optimizer"] = cfg.train.use_distributed_optimizer
    return layout


def build_trainer(cfg, model_path, ref_model_path, pad_token_id, save_train_data, log_dir):
    kwargs = dict(ref_model_path=str(ref_model_path), pad_token_id=pad_token_id,
                  save_train_data=save_train_data)
    world_size = cfg.parallel.world_size
    # NCCL weight sync needs the trainer in its own process (it broadcasts while the driver
    # waits on the engine)
    in_process = cfg.train.backend == "torch" and cfg.rollout.weight_update_mode != "distributed"
    if world_size == 1 and in_process:
        return make_trainer(cfg, str(model_path), **kwargs)
    from relax.train.group import TrainerGroup

    plain = OmegaConf.to_container(cfg, resolve=True)  # picklable, no resolvers needed
    return TrainerGroup(make_trainer, world_size, args=(plain, str(model_path)), kwargs=kwargs,
                        log_dir=log_dir)
