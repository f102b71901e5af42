"""train=megatron's plan-time refusals and checkpoint layout (relax/train/megatron/checks.py), by
hand on config.json dicts: fast, nothing built. (tests/test_megatron.py refuses layouts of the
tiny models in the slow tier.)"""

import re

import pytest

from relax.errors import ConfigError
from relax.train.megatron import checks

from .conftest import make_cfg

# a Qwen2-MoE config.json whose counts every layout below splits
MOE = {"architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "vocab_size": 64, "intermediate_size": 8, "num_experts": 4,
       "moe_intermediate_size": 4, "shared_expert_intermediate_size": 8}


@pytest.mark.parametrize("overrides,hf,message", [
    (["parallel=ep2"], {**MOE, "num_experts": 3},
     "ep=2 needs an MoE model whose expert count is divisible by it (this model has 3 experts)"),
    (["parallel=tp2", "parallel.etp=2"], {**MOE, "moe_intermediate_size": 3},
     "etp=2 must divide the model's moe_intermediate_size=3 ("),
    (["parallel=tp2"], {**MOE, "shared_expert_intermediate_size": 9},
     "tp=2 must divide the model's shared_expert_intermediate_size=9 ("),
])
def test_moe_counts_a_layout_cannot_split_are_refused(overrides, hf, message):
    """An expert count ep does not divide, an expert width etp does not divide, a shared expert
    tp does not divide: each would fail inside the ranks (or build uneven experts)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        checks.check_layout(make_cfg("train=megatron", *overrides).parallel, hf)


def test_an_moe_models_unused_dense_width_is_not_held_against_tp():
    """Megatron builds every layer of an MoE model as MoE: its intermediate_size is never split,
    so tp need not divide it (only the shared expert's width)."""
    checks.check_layout(make_cfg("train=megatron", "parallel=tp2").parallel, {**MOE, "intermediate_size": 5})
    checks.check_layout(make_cfg("train=megatron", "parallel=ep2").parallel, MOE)


def test_the_checkpoint_layout_names_every_parallel_size_and_the_distributed_optimizer():
    """A resume with another vpp or cp, or without the distributed optimizer, would load
    optimizer shards that do not fit: each is part of the layout a checkpoint is tied to."""
    cfg = make_cfg("train=megatron", "parallel=vpp2", "train.use_distributed_optimizer=false")
    assert checks.checkpoint_layout(cfg.train, cfg.parallel) == {
        "parallel.tp": 1, "parallel.pp": 2, "parallel.vpp": 2, "parallel.ep": 1, "parallel.etp": 1,
        "parallel.cp": 1, "parallel.dp": 1, "train.use_distributed_optimizer": False}
    cfg = make_cfg("train=megatron", "parallel=cp2")
    assert checks.checkpoint_layout(cfg.train, cfg.parallel)["parallel.cp"] == 2


def check_config(cfg, hf: dict) -> None:
    checks.check_config(cfg.train, cfg.algo, cfg.parallel, cfg.rollout, cfg.model.dtype, hf)


def test_check_config_refuses_an_unknown_attention_backend_and_another_megatron_version(monkeypatch):
    hf = {**MOE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_experts": 0}
    check_config(make_cfg("train=megatron"), hf)
    from relax.train.megatron import cpu_compat

    monkeypatch.setattr(cpu_compat.importlib.metadata, "version", lambda name: "0.17.0")
    with pytest.raises(ConfigError, match=r"megatron-core==0\.16\.1"):
        check_config(make_cfg("train=megatron"), hf)
