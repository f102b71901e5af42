"""Structured configs behind conf/*.yaml.

Every YAML group merges into these dataclasses, so a misspelt key or a wrong type fails
when Hydra composes the config, before anything is built. This module must not import
torch: `relax --cfg job` and `relax --help` only compose.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, OmegaConf


@dataclass
class TinyModelConfig:
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    num_experts: int = 0  # >0 builds a Qwen2-MoE variant (for expert parallelism)
    shared_expert_intermediate_size: int = 0
    seed: int = 3
    warmup_target_accuracy: float = 0.4
    warmup_max_steps: int = 1500
    warmup_batch_size: int = 64
    warmup_lr: float = 3e-3


@dataclass
class ModelConfig:
    name: str = "tiny"
    path: Optional[str] = None
    cache_dir: str = "~/.cache/relax"
    dtype: str = "float32"
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class RolloutConfig:
    engine: str = "torch"
    num_rollout: int = 400
    rollout_batch_size: int = 32
    n_samples_per_prompt: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    dtype: Optional[str] = None
    rollout_num_gpus: int = 1
    rollout_num_gpus_per_engine: int = 1
    # rollout=sglang only
    mem_fraction_static: Optional[float] = None
    max_total_tokens: int = 8192
    weight_update_mode: str = "tensor"
    weight_update_bucket_mb: int = 512
    colocate: bool = False
    sglang_server_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainConfig:
    backend: str = "torch"
    lr: float = 3e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    num_steps_per_rollout: int = 1
    micro_batch_size: int = 64
    clip_grad: float = 1.0
    on_nonfinite: str = "error"
    num_threads: int = 1
    # train=megatron only
    attention_backend: str = "auto"
    moe_permute_fusion: bool = False
    deterministic: bool = False
    use_distributed_optimizer: bool = True


@dataclass
class ParallelConfig:
    name: str = "single"
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    fsdp: bool = False
    noise_ulp: int = 0  # >0: each initial actor weight nudged by that many ulps (parallel=twin)
    world_size: int = II("mul:${.tp},${.pp},${.cp},${.dp}")


@dataclass
class AlgoConfig:
    advantage_estimator: str = "grpo"
    grpo_std_normalization: bool = True
    eps_clip: float = 0.2
    eps_clip_high: Optional[float] = None
    eps_clip_c: Optional[float] = 3.0
    policy_loss: str = "ppo"
    loss_agg_mode: str = "token-mean"
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    tis: Optional[str] = None
    tis_cap: float = 2.0
    mis: Optional[str] = None
    mis_low: float = 0.5
    mis_high: float = 2.0


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    data_path: Optional[str] = None
    reward_fn: str = "relax.task.arithmetic.exact_match"
    answer_format: Optional[str] = None
    apply_chat_template: bool = True
    min_operand: int = 10
    max_operand: int = 99


@dataclass
class DebugConfig:
    rollout_only: bool = False
    train_only: bool = False
    save_rollout_data: Optional[str] = None
    load_rollout_data: Optional[str] = None
    load_rollout_data_subsample: Optional[float] = None
    allow_manifest_mismatch: bool = False
    save_train_data: Optional[str] = None
    dump_details: Optional[str] = None
    check_weight_update_equal: bool = False
    check_weight_update_every_sync: bool = False
    strict_checks: bool = False


@dataclass
class LoggerConfig:
    tensorboard: bool = False


@dataclass
class CheckpointConfig:
    save_interval: Optional[int] = 100
    keep_last: int = 2


@dataclass
class RelaxConfig:
    seed: int = 1234
    resume: Any = False
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def sweep_subdir(task_overrides: Any) -> str:
    """The multirun job folder name: only the overrides that vary across the sweep.

    `relax -m debug=train_only debug.load_rollout_data=/x/{rollout_id}.pt parallel=tp1,tp2`
    gives `parallel=tp2`, not a path-laden `override_dirname` with slashes in it.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [a for a in sys.argv[1:] if "=" in a and not a.startswith("-")]
    swept = {
        o.key_or_group
        for o in OverridesParser.create().parse_overrides(overrides)
        if o.is_sweep_override()
    }
    chosen = [o for o in task_overrides if o.split("=", 1)[0].lstrip("+~") in swept]
    name = ",".join(chosen or task_overrides) or "default"
    return name.replace("/", "_")


def register() -> None:
    OmegaConf.register_new_resolver("mul", lambda *xs: math.prod(xs), replace=True)
    OmegaConf.register_new_resolver("relax_sweep_subdir", sweep_subdir, replace=True)
    ConfigStore.instance().store(name="relax_schema", node=RelaxConfig)
