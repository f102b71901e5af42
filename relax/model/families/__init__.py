"""Model families: what each supported architecture asks of every engine and backend.

Each module in this package describes one family as `FAMILY = Family(...)`; the registry
below imports them all, so supporting the next family is one file, as long as its layers
are made of the parts the engines implement: RMSNorm, RoPE (default, linear or Llama-3
scaling), attention with optional q/k/v biases and per-head q/k RMSNorm, and a SwiGLU MLP
or a softmax top-k MoE (optionally with a gated shared expert), embeddings tied or not.
What reads it: relax.model (start-up refusals), the torch engine (its forward), the SGLang
engine (parameter names), the Megatron trainer (TransformerConfig and layer spec). The
torch trainer runs the transformers model itself.

Functions here take the model's config.json as a dict (relax.model.read_hf_config), the
form every start-up check has before anything is built.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field

from relax.errors import ConfigError

# RoPE variants that only change the inverse frequencies (HF's attention factor is 1):
# every backend takes HF's `inv_freq` for them (Megatron's own Llama-3 scaling hard-codes
# an original context of 8192, so it is not used).
ROPE_TYPES = ("default", "linear", "llama3")
# config.json settings refused by several families (see Family.refused)
SLIDING_WINDOW = {"use_sliding_window": (True, "sliding-window attention: no engine implements it")}
O_PROJ_BIAS = {"attention_bias": (True, "an o_proj bias: no engine implements it")}
# What every family's layers name their attention and MLP projections (HF's names; an MoE
# layer's shared expert and dense layers too): LoRA's default targets (Family.lora_targets)
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
PROJECTIONS = (*ATTENTION_PROJECTIONS, "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class MoE:
    """A softmax top-k MoE layer: router `mlp.gate`, experts `mlp.experts.<e>.{gate,up,down}_proj`."""
    shared_expert: bool = False  # plus sigmoid(x @ mlp.shared_expert_gate) * mlp.shared_expert(x)


@dataclass(frozen=True)
class Family:
    architecture: str            # config.json "architectures"[0]
    model_type: str              # config.json "model_type" (the transformers module name)
    qkv_bias: bool               # q/k/v projections carry biases (o_proj never does)...
    qkv_bias_key: str | None = None  # ...unless this config.json key says otherwise
    qk_norm: bool = False        # per-head RMSNorm of q and k before RoPE (`self_attn.{q,k}_norm`)
    moe: MoE | None = None       # None: a dense SwiGLU MLP in every layer
    # config.json settings no engine implements for this family: key -> (refused value, why)
    refused: dict = field(default_factory=dict)
    lora_targets: tuple[str, ...] = PROJECTIONS  # train.lora.target_modules=null: the modules adapted

    @property
    def hf_prefix(self) -> str:
        """transformers' class prefix: Qwen3MoeForCausalLM -> Qwen3Moe (Qwen3MoeRotaryEmbedding...)."""
        return self.architecture.removesuffix("ForCausalLM")


def _discover() -> dict[str, Family]:
    families = {}
    for module in pkgutil.iter_modules(__path__):
        family = importlib.import_module(f"{__name__}.{module.name}").FAMILY
        families[family.architecture] = family
    return families


FAMILIES: dict[str, Family] = _discover()
SUPPORTED_ARCHITECTURES = tuple(sorted(FAMILIES))


def family_of(hf: dict, where: str = "config.json") -> Family:
    """The family of a config.json, or a ConfigError naming the architecture and the supported ones."""
    architectures = hf.get("architectures") or []
    if not architectures:
        raise ConfigError(f"{where}: no 'architectures' entry; expected one of "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if architectures[0] not in FAMILIES:
        raise ConfigError(f"{where}: architecture {architectures[0]} is not supported; supported: "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return FAMILIES[architectures[0]]


def rope_parameters(hf: dict) -> dict:
    """RoPE settings: transformers 5 writes `rope_parameters`; older checkpoints `rope_scaling`
    (None without scaling) and `rope_theta`."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    return rope


def head_dim(hf: dict) -> int:
    """Per-head width: explicit in Qwen3 (may differ from hidden_size / heads)."""
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def qkv_bias(hf: dict) -> bool:
    family = family_of(hf)
    return bool(hf.get(family.qkv_bias_key, family.qkv_bias)) if family.qkv_bias_key else family.qkv_bias


def num_experts(hf: dict) -> int:
    """Experts per MoE layer (0: dense). transformers 5 saves Qwen3-MoE's as num_local_experts."""
    return hf.get("num_experts") or hf.get("num_local_experts") or 0


def moe_layers(hf: dict) -> list[bool]:
    """Which decoder layers are MoE layers (transformers' rule for Qwen2-MoE and Qwen3-MoE)."""
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    return [bool(num_experts(hf)) and i not in dense and (i + 1) % step == 0
            for i in range(hf["num_hidden_layers"])]


def check(hf: dict, where: str = "config.json") -> Family:
    """Start-up refusals for a model's config.json (before anything is built)."""
    family = family_of(hf, where)
    for key, (value, why) in family.refused.items():
        if hf.get(key) == value:
            raise ConfigError(f"{where}: {key}={value!r} is not supported for {family.architecture} "
                              f"({why})")
    rope_type = rope_parameters(hf)["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{where}: RoPE type {rope_type!r} is not supported; supported: "
                          f"{', '.join(ROPE_TYPES)}")
    if family.moe and not num_experts(hf):
        raise ConfigError(f"{where}: {family.architecture} needs num_experts > 0")
    return family


def hf_rotary(config):
    """transformers' rotary embedding module for a transformers config object: the one source
    of RoPE frequencies (and their scaling) for every engine and backend."""
    family = family_of(config.to_dict())
    module = importlib.import_module(f"transformers.models.{family.model_type}.modeling_{family.model_type}")
    return getattr(module, f"{family.hf_prefix}RotaryEmbedding")(config)
