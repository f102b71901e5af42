"""Model families: what each architecture asks of every engine and backend.

Any causal LM transformers implements runs on the torch trainer and the torch engine (the
engine through transformers' own forward, relax/rollout/hf_engine.py). The families in this
package (one file each, `FAMILY = Family(...)`) also have a hand-written forward: the torch
engine's fast path, SGLang's parameter names and Megatron's layer spec; one with
`hand_written=False` (the same parts, other checkpoint names) Megatron's layer spec only
(`megatron_family`). `check(hf)` says which forward runs a config.json; docs/models.md's support
matrix is `runs_on`'s (`matrix()`). Functions here take config.json as a dict (read_hf_config).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from relax.errors import ConfigError
from relax.model import sglang_support

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
    expert_size_key: str = "moe_intermediate_size"  # config.json key of an expert's MLP width
    norm_topk_key: str | None = "norm_topk_prob"  # renormalise the top-k weights; None: always


@dataclass(frozen=True)
class Family:
    architecture: str            # config.json "architectures"[0]
    model_type: str              # config.json "model_type" (the transformers module name)
    qkv_bias: bool               # q/k/v projections carry biases (o_proj never does)...
    qkv_bias_key: str | None = None  # ...unless this config.json key says otherwise
    qk_norm: bool = False        # per-head RMSNorm of q and k before RoPE (`self_attn.{q,k}_norm`)
    moe: MoE | None = None       # None: a dense SwiGLU MLP in every layer
    # config.json settings its hand-written forward lacks: key -> (value, what it is); the value
    # may be a test `value(config.json's value, config.json) -> bool`
    refused: dict = field(default_factory=dict)
    lora_targets: tuple[str, ...] = PROJECTIONS  # train.lora.target_modules=null: the modules adapted
    hand_written: bool = True    # False: Megatron's layer spec only (no torch-engine forward, no SGLang)
    # checkpoint names within a layer that differ from the families' (Llama's): Llama's -> this
    # architecture's, `{e}` an expert's index (relax/train/megatron/convert.py renames both ways)
    checkpoint_names: dict = field(default_factory=dict)
    # checkpoint tensors within a layer that stack Llama's along dim 0 (convert.FUSED): Phi-3's
    # `self_attn.qkv_proj.weight` (q, k, v) and `mlp.gate_up_proj.weight` (gate, up)
    fused: tuple[str, ...] = ()
    rotary_interleaved: bool = False  # RoPE turns pairs of adjacent dims (GLM), not the two halves
    sliding_window: bool = False  # config.json's sliding_window (null: none) masks every layer
    norm: str = "RMSNorm"         # or "LayerNorm" (with biases: StarCoder2)
    norm_eps_key: str = "rms_norm_eps"
    gated_mlp: bool = True        # act(gate) * up, or act(up) alone (StarCoder2's c_fc, c_proj)
    linear_bias_key: str | None = None  # config.json key that gives every linear layer a bias

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


LAYER_FAMILIES: dict[str, Family] = _discover()  # what Megatron's layer spec is built from
FAMILIES: dict[str, Family] = {a: f for a, f in LAYER_FAMILIES.items() if f.hand_written}
SUPPORTED_ARCHITECTURES = tuple(sorted(FAMILIES))
MEGATRON_ARCHITECTURES = tuple(sorted(LAYER_FAMILIES))


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
    family = layer_family(hf)
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
        if value(hf.get(key), hf) if callable(value) else hf.get(key) == value:
            return f"{key}={hf.get(key)!r}: {why}"
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


def layer_family(hf: dict) -> Family:
    """The family whose parts build this architecture's layers, hand-written forward or not
    (start-up has checked the config: `check`, `megatron_family`)."""
    return LAYER_FAMILIES[hf["architectures"][0]]


# the MLP activations Megatron's layer spec is given (relax/train/megatron/model.py)
MEGATRON_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def megatron_blocker(hf: dict) -> str | None:
    """Why Megatron's layer spec cannot run this config.json (None: it can)."""
    support = check(hf)
    family = LAYER_FAMILIES.get(support.architecture)
    if family is None:
        return ("no description in relax/model/families/; docs/models.md, \"Megatron beyond the "
                "families\", says what it would take")
    if hf.get("hidden_act", "silu") not in MEGATRON_ACTIVATIONS:
        return f"hidden_act={hf['hidden_act']!r}: {', '.join(MEGATRON_ACTIVATIONS)} are passed on"
    return fast_path_blocker(hf, family)


def megatron_family(hf: dict, where: str) -> Family:
    """The family Megatron's layer spec builds this config.json from, or a ConfigError naming
    the setting it lacks (`where`: the option that asked, train=megatron)."""
    why = megatron_blocker(hf)
    if why is None:
        return layer_family(hf)
    architecture = hf["architectures"][0]
    what = f"{where}: Megatron-core's layer spec (built from the family's description) runs"
    if architecture in LAYER_FAMILIES:
        raise ConfigError(f"{what} {architecture} without this model's {why}: use train=torch")
    raise ConfigError(f"{what} {', '.join(MEGATRON_ARCHITECTURES)} only, and this model is "
                      f"{architecture} ({why}): use train=torch")


def sglang_blocker(hf: dict) -> str | None:
    """Why rollout=sglang cannot serve this config.json (None: it can): a family keeps its hand-written
    forward's limits; other architectures, relax.model.sglang_support's table."""
    support = check(hf)
    if support.architecture in FAMILIES:
        return support.why_generic
    return sglang_support.blocker(support.architecture, hf)


MATRIX_COLUMNS = ("torch engine", "SGLang", "torch trainer", "Megatron", "train.shared_prompt",
                  "routing replay", "LoRA default targets")


def runs_on(hf: dict) -> dict[str, str]:
    """What runs a config.json, per engine and backend, as the start-up checks decide it (the
    support matrix in docs/models.md is these rows)."""
    support = check(hf)
    family, moe = support.family, bool(num_experts(hf))
    sglang = sglang_support.matrix_cell(sglang_blocker(hf))
    megatron = megatron_blocker(hf)
    megatron = "tp, pp, vpp, cp, dp" + (", ep" if moe else "") if megatron is None else \
        "refused" + (f" ({megatron.split(':')[0]})" if support.architecture in LAYER_FAMILIES else "")
    if family is None:
        return dict(zip(MATRIX_COLUMNS, ("transformers' forward", sglang, "single, dp, fsdp (tp refused)",
                                         megatron, "off (true refused)", "refused" if moe else "-",
                                         "every linear layer")))
    return dict(zip(MATRIX_COLUMNS, ("hand-written forward", sglang, "single, dp, fsdp, tp",
                                     megatron, "on", "R2, R3" if moe else "-",
                                     ", ".join(family.lora_targets))))


def matrix(configs: list[dict]) -> str:
    """The support matrix of these config.jsons, one markdown row each."""
    rows = [[f"`{hf['architectures'][0]}`", *runs_on(hf).values()] for hf in configs]
    header = ["architecture", *MATRIX_COLUMNS]
    return "\n".join("| " + " | ".join(r) + " |" for r in [header, ["---"] * len(header), *rows])


def hf_rotary(config):
    """transformers' rotary embedding module for a transformers config object: the one source
    of RoPE frequencies (and their scaling) for every engine and backend."""
    family = layer_family(config.to_dict())
    module = importlib.import_module(f"transformers.models.{family.model_type}.modeling_{family.model_type}")
    return getattr(module, f"{family.hf_prefix}RotaryEmbedding")(config)
