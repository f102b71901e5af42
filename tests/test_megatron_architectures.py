"""train=megatron beyond the hand-written families, fast: what runs on Megatron's layer spec
(Mistral and its sliding window, Mixtral, Phi-3, GLM and StarCoder2 under their own checkpoint names,
SmolLM3) and what
is refused at start-up,
naming the setting or the architecture. The slow tier (tests/test_megatron.py,
test_each_family_round_trips_and_matches_the_torch_trainer) trains each against the torch trainer."""

from __future__ import annotations

import re

import pytest
import torch

from relax.errors import ConfigError
from relax.model import families, load_safetensors_dir, read_hf_config

from .conftest import make_cfg
from .families import ARCHITECTURES, build_family_model

# tests/families.py's architectures train=megatron runs as the tests build them
RUNS = {"mistral", "mixtral", "phi3", "smollm3", "glm", "starcoder2"}


def plan(path, *overrides):
    from relax.debug.plan import resolve

    return resolve(make_cfg("model=hf", f"model.path={path}", "train=megatron", *overrides))


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_megatron_runs_or_refuses_each_architecture_at_start_up(arch, family_model):
    path = family_model(arch)
    architecture = read_hf_config(path)["architectures"][0]
    if arch in RUNS:
        plan(path)
        return
    with pytest.raises(ConfigError) as refusal:
        plan(path)
    message = str(refusal.value)
    assert message.startswith("train=megatron: Megatron-core's layer spec")
    assert message.endswith("use train=torch")
    assert f"this model is {architecture} (no description in relax/model/families/" in message


@pytest.mark.parametrize("arch,config,window", [
    ("mistral", {"sliding_window": None}, None),
    ("mistral", {"sliding_window": 128}, None),  # = max_position_embeddings: no position is masked
    ("mistral", {"sliding_window": 127}, (126, 0)),  # the key and the 126 before it
    ("mixtral", {"sliding_window": 32}, (31, 0)),
    ("phi3", {"sliding_window": 64}, (63, 0)),  # as Phi-3-mini-4k's 2047 of 4096
    ("starcoder2", {"sliding_window": 6}, (5, 0)),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 6}, None),  # a window Qwen2 does not use
])
def test_a_sliding_window_becomes_megatrons_window_size(arch, config, window, tmp_path):
    from transformers import AutoConfig

    from relax.train.megatron.model import transformer_config

    from .test_megatron_convert import layout

    path = build_family_model(tmp_path / arch, arch, **config)
    hf = read_hf_config(path)
    assert hf["max_position_embeddings"] == 128 and families.megatron_blocker(hf) is None
    assert families.runs_on(hf)["Megatron"].startswith("tp, pp, vpp, cp, dp")
    config = transformer_config(AutoConfig.from_pretrained(path), layout(), make_cfg("train=megatron").train,
                                "float32")
    assert config.window_size == window


@pytest.mark.parametrize("arch,config,refused", [
    ("smollm3", {"mlp_bias": True}, "mlp_bias=True: MLP biases"),
    ("starcoder2", {"hidden_act": "relu"}, "hidden_act='relu': silu, gelu_pytorch_tanh are passed on"),
    ("smollm3", {"use_sliding_window": True, "sliding_window": 6},
     "layer_types has 'sliding_attention' layers"),
])
def test_biases_per_layer_windows_and_activations_are_refused_by_their_setting(arch, config, refused,
                                                                               tmp_path):
    hf = read_hf_config(build_family_model(tmp_path / arch, arch, **config))
    with pytest.raises(ConfigError, match=re.escape(refused)):
        families.megatron_family(hf, "train=megatron")
    assert families.runs_on(hf)["Megatron"] == f"refused ({refused.split(':')[0]})"


def llama_names(family_model, arch: str):
    """(the checkpoint's tensors, under Llama's names, and back) through convert.CheckpointNames."""
    from transformers import AutoConfig

    from relax.train.megatron import convert

    path = family_model(arch)
    hf = AutoConfig.from_pretrained(path)
    names = convert.CheckpointNames(families.layer_family(hf.to_dict()), convert.Heads(hf))
    checkpoint = load_safetensors_dir(path)
    llama = names.to_llama(checkpoint)
    return checkpoint, llama, names.to_checkpoint(llama)


def layer_names(tensors) -> set[str]:
    return {re.sub(r"^model\.layers\.0\.", "", n) for n in tensors if n.startswith("model.layers.0.")}


DENSE = {"input_layernorm.weight", "post_attention_layernorm.weight",
         *(f"self_attn.{x}_proj.weight" for x in "qkvo")}


def test_mixtral_checkpoint_names_convert_to_llamas_and_back(family_model):
    """Every Mixtral tensor gets the name the conversion reads (Llama's and Qwen3-MoE's), and
    the inverse gives the checkpoint's names back."""
    checkpoint, llama, back = llama_names(family_model, "mixtral")
    experts = {f"mlp.experts.{e}.{p}_proj.weight" for e in range(4) for p in ("gate", "up", "down")}
    assert layer_names(llama) == {*DENSE, "mlp.gate.weight", *experts}
    assert llama["model.layers.1.mlp.experts.3.up_proj.weight"] is \
        checkpoint["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    assert list(back) == list(checkpoint) and all(back[n] is checkpoint[n] for n in checkpoint)
    # the hand-written families' names are the conversion's own
    assert convert_names_of("Qwen3MoeForCausalLM") == ([], [])


def convert_names_of(architecture: str):
    from relax.train.megatron import convert

    return convert.checkpoint_renames(families.LAYER_FAMILIES[architecture])


def test_phi3_fused_projections_split_into_llamas_and_join_back(family_model):
    """qkv_proj is [q; k; v] (4 query heads, 2 KV heads of 16), gate_up_proj [gate; up]: split on
    load into the tensors the conversion fuses its own way, joined bit for bit on the way back."""
    checkpoint, llama, back = llama_names(family_model, "phi3")
    assert layer_names(llama) == {*DENSE, *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
    qkv = checkpoint["model.layers.0.self_attn.qkv_proj.weight"]
    assert [llama[f"model.layers.0.self_attn.{x}_proj.weight"].shape[0] for x in "qkv"] == [64, 32, 32]
    assert llama["model.layers.0.self_attn.k_proj.weight"].equal(qkv[64:96])
    gate_up = checkpoint["model.layers.0.mlp.gate_up_proj.weight"]
    assert llama["model.layers.0.mlp.up_proj.weight"].equal(gate_up[128:])
    assert sorted(back) == sorted(checkpoint) and all(back[n].equal(checkpoint[n]) for n in checkpoint)


def test_starcoder2_maps_to_layernorm_biases_and_a_gelu_mlp(family_model):
    """c_fc and c_proj (with biases) are a non-gated MLP's up and down projections; LayerNorm with
    norm_epsilon, a bias on every linear layer from use_bias, GELU (tanh); sequence parallelism
    (an RMSNorm of Relax's own) is refused."""
    from transformers import AutoConfig

    from relax.train.megatron import checks
    from relax.train.megatron.model import transformer_config

    from .test_megatron_convert import layout

    checkpoint, llama, back = llama_names(family_model, "starcoder2")
    biases = {n.replace("weight", "bias") for n in DENSE | {"mlp.up_proj.weight", "mlp.down_proj.weight"}}
    assert layer_names(llama) == DENSE | {"mlp.up_proj.weight", "mlp.down_proj.weight"} | biases
    assert llama["model.layers.1.mlp.up_proj.bias"] is checkpoint["model.layers.1.mlp.c_fc.bias"]
    assert list(back) == list(checkpoint)
    hf = AutoConfig.from_pretrained(family_model("starcoder2"))
    config = transformer_config(hf, layout(), make_cfg("train=megatron").train, "float32")
    assert (config.normalization, config.layernorm_epsilon, config.gated_linear_unit,
            config.add_bias_linear, config.add_qkv_bias, config.activation_func(torch.tensor([1.0])).item()) == (
        "LayerNorm", hf.norm_epsilon, False, True, True, pytest.approx(0.841192, abs=1e-6))
    hf.use_bias = False
    config = transformer_config(hf, layout(), make_cfg("train=megatron").train, "float32")
    assert (config.add_bias_linear, config.add_qkv_bias) == (False, False)
    with pytest.raises(ConfigError, match="sequence_parallel with LayerNorm: Relax's layer spec has a sequence"):
        checks.check_layout(make_cfg("train=megatron", "parallel=tp2sp").parallel, hf.to_dict())


def test_mixtral_maps_to_megatrons_moe_fields_and_its_expert_width(family_model):
    """Mixtral's experts are intermediate_size wide and always renormalise their top-k weights
    (Megatron's top-k-then-softmax); etp must divide that width."""
    from transformers import AutoConfig

    from relax.train.megatron import checks
    from relax.train.megatron.model import transformer_config

    from .test_megatron_convert import layout

    hf = AutoConfig.from_pretrained(family_model("mixtral"))
    config = transformer_config(hf, layout(), make_cfg("train=megatron").train, "float32")
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size,
            config.moe_router_pre_softmax, config.moe_shared_expert_intermediate_size, config.add_qkv_bias,
            config.qk_layernorm) == (4, 2, 128, False, None, False, False)
    uneven = {**hf.to_dict(), "intermediate_size": 33, "architectures": ["MixtralForCausalLM"]}
    with pytest.raises(ConfigError, match=re.escape("etp=2 must divide the model's intermediate_size=33")):
        checks.check_layout(make_cfg("train=megatron", "parallel=tp2", "parallel.etp=2").parallel, uneven)


def test_smollm3_layers_without_rope_and_phi3_and_glm_rotary_reach_megatron(family_model):
    """SmolLM3's no_rope_layers (1: RoPE) become no_rope_freq (1: none); Phi-3's and GLM's
    partial_rotary_factor is the GPTModel's rotary_percent (half of each 16-wide head here); GLM
    turns interleaved pairs, with q/k/v biases unless attention_bias=false."""
    from transformers import AutoConfig

    from relax.train.megatron.model import rotary_fraction, transformer_config

    from .test_megatron_convert import layout

    train = make_cfg("train=megatron").train
    smollm3 = AutoConfig.from_pretrained(family_model("smollm3"))
    assert smollm3.no_rope_layers == [1, 0]
    assert transformer_config(smollm3, layout(), train, "float32").no_rope_freq == [0, 1]
    phi3 = read_hf_config(family_model("phi3"))
    assert (rotary_fraction(phi3), rotary_fraction(read_hf_config(family_model("mixtral")))) == (0.5, 1.0)
    assert transformer_config(AutoConfig.from_pretrained(family_model("mixtral")), layout(), train,
                              "float32").no_rope_freq is None
    glm = AutoConfig.from_pretrained(family_model("glm"))
    config = transformer_config(glm, layout(), train, "float32")
    assert (rotary_fraction(glm.to_dict()), config.rotary_interleaved, config.add_qkv_bias) == \
        (0.5, True, True)
    glm.attention_bias = False
    assert transformer_config(glm, layout(), train, "float32").add_qkv_bias is False
