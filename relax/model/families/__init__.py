"""Model families: what each architecture asks of every engine and backend.

Any causal LM transformers implements runs on the torch trainer and the torch engine (the
engine through transformers' own forward, relax/rollout/hf_engine.py). The families in this
package (one file each, `FAMILY = Family(...)`) also have a hand-written forward: the torch
engine's fast path, SGLang's parameter names and Megatron's layer spec. `support(hf)` says which
runs a given config.json; docs/models.md's support matrix is generated from it (`matrix()`).
Functions here take config.json as a dict (relax.model.read_hf_config).
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
# config.json settings the hand-written forward lacks, for several families (Family.refused)
SLIDING_WINDOW = {"use_sliding_window": (True, "sliding-window attention")}
O_PROJ_BIAS = {"attention_bias": (True, "an o_proj bias")}
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
    # config.json settings its hand-written forward lacks: key -> (value, what it is)
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
    """The hand-written family of a config.json, or a ConfigError naming what it lacks."""
    support = check(hf, where)
    if support.family is None:
        raise ConfigError(f"{where}: {support.architecture} has no hand-written forward ({support.why_generic})")
    return support.family


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


@dataclass(frozen=True)
class Support:
    """What runs a model: its family's hand-written forward, or transformers' own."""
    architecture: str
    model_type: str
    family: Family | None    # None: transformers' forward only (torch engine and torch trainer)
    why_generic: str | None  # why not the family's forward: the setting it lacks

    def refuse_unless_fast(self, where: str, what: str, instead: str) -> None:
        """A ConfigError for `what` (an engine or backend that needs the hand-written forward)."""
        if self.family is None:
            raise ConfigError(f"{where}: {what} runs the hand-written families "
                              f"({', '.join(SUPPORTED_ARCHITECTURES)}) only, and this model is "
                              f"{self.architecture} ({self.why_generic}): {instead}")


def causal_lm_class(model_type: str) -> str | None:
    """The causal LM transformers builds for `model_type` (None: it has none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


def check(hf: dict, where: str = "config.json") -> Support:
    """Start-up: which forward runs this config.json, or a ConfigError if none does: `architectures` and
    `model_type` must name the same transformers causal LM (a relabelled config is refused)."""
    architecture = (hf.get("architectures") or [None])[0]
    model_type = hf.get("model_type")
    if not architecture or not model_type:
        raise ConfigError(f"{where}: no 'architectures' entry or no 'model_type'; expected a "
                          f"transformers causal LM's config.json")
    built = causal_lm_class(model_type)
    if built is None:
        raise ConfigError(f"{where}: transformers has no causal LM for model_type={model_type!r} "
                          f"(architecture {architecture}); Relax runs the causal LMs transformers implements")
    if built != architecture:
        raise ConfigError(f"{where}: architectures[0]={architecture} but model_type={model_type!r}, for "
                          f"which transformers builds {built}: a relabelled or mixed-up config.json")
    family = FAMILIES.get(architecture)
    why = fast_path_blocker(hf, family)
    return Support(architecture, model_type, None if why else family, why)


def fast_path_blocker(hf: dict, family: Family | None) -> str | None:
    """The first setting of config.json the family's hand-written forward lacks (None: it has all)."""
    if family is None:
        return "no hand-written forward for this architecture"
    for key, (value, why) in family.refused.items():
        if hf.get(key) == value:
            return f"{key}={value!r}: {why}"
    windowed = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    if windowed:
        return f"layer_types has {windowed[0]!r} layers: only full attention is hand-written"
    rope = hf.get("rope_parameters") or {}
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        return "rope_parameters per layer type: one RoPE setting is hand-written"
    rope_type = rope_parameters(hf)["rope_type"]
    if rope_type not in ROPE_TYPES:
        return f"RoPE type {rope_type!r}: {', '.join(ROPE_TYPES)} are hand-written"
    if family.moe and not num_experts(hf):
        return f"{family.architecture} without num_experts"
    return None


MATRIX_COLUMNS = ("torch engine", "SGLang", "torch trainer", "Megatron", "train.shared_prompt",
                  "routing replay", "LoRA default targets")


def runs_on(hf: dict) -> dict[str, str]:
    """What runs a config.json, per engine and backend, as the start-up checks decide it (the
    support matrix in docs/models.md is these rows)."""
    support = check(hf)
    family, moe = support.family, bool(num_experts(hf))
    if family is None:
        return dict(zip(MATRIX_COLUMNS, ("transformers' forward", "refused", "single, dp, fsdp (tp refused)",
                                         "refused", "off (true refused)", "refused" if moe else "-",
                                         "every linear layer")))
    return dict(zip(MATRIX_COLUMNS, ("hand-written forward", "runs", "single, dp, fsdp, tp",
                                     "tp, pp, vpp, cp, dp" + (", ep" if moe else ""), "on", "R2, R3" if moe else "-",
                                     ", ".join(family.lora_targets))))


def matrix(configs: list[dict]) -> str:
    """The support matrix of these config.jsons, one markdown row each."""
    rows = [[f"`{hf['architectures'][0]}`", *runs_on(hf).values()] for hf in configs]
    header = ["architecture", *MATRIX_COLUMNS]
    return "\n".join("| " + " | ".join(r) + " |" for r in [header, ["---"] * len(header), *rows])


def hf_rotary(config):
    """transformers' rotary embedding module for a transformers config object: the one source
    of RoPE frequencies (and their scaling) for every engine and backend."""
    family = family_of(config.to_dict())
    module = importlib.import_module(f"transformers.models.{family.model_type}.modeling_{family.model_type}")
    return getattr(module, f"{family.hf_prefix}RotaryEmbedding")(config)
