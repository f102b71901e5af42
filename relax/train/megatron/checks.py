"""train=megatron's start-up refusals and checkpoint layout, read by the driver before any
rank starts (relax/train/__init__.py).

The layout checks read the model's config.json (relax.model.model_config), not the model:
what the parallel sizes allow among themselves, and what they need of the layer, head,
vocabulary and expert counts. Megatron itself would refuse most of these only inside a
rank, after start-up.
"""

from __future__ import annotations

from relax.errors import ConfigError
from relax.model import families
from relax.train.megatron.cpu_compat import check_version
from relax.train.parallel import check_divides


def check_config(train, algo, parallel, rollout, dtype: str, hf_config: dict) -> None:
    if rollout.true_on_policy:
        raise ConfigError("rollout.true_on_policy=true is refused with train=megatron: its layers reduce in "
                          "their own order (fused kernels, tensor-parallel sums); use train=torch")
    families.megatron_family(hf_config, "train=megatron")
    if train.shared_prompt:
        raise ConfigError("train.shared_prompt=true is train=torch's (relax/train/packing.py): "
                          "Megatron-core's GPTModel applies RoPE by position in the row and ignores "
                          "position ids outside THD packing, which needs Transformer Engine; "
                          "train=megatron runs each sample as its own row (train.shared_prompt=false, "
                          "its default)")

    check_version()
    check_layout(parallel, hf_config)


def check_layout(p, hf: dict) -> None:
    if p.fsdp:
        raise ConfigError(f"parallel={p.name}: fsdp is train=torch's FSDP2; train=megatron shards "
                          f"optimizer state over dp with its distributed optimizer "
                          f"(train.use_distributed_optimizer): use a layout with parallel.fsdp=false")
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"parallel={p.name}: virtual pipeline stages (vpp) need pp > 1")
    if p.sequence_parallel and families.layer_family(hf).norm != "RMSNorm":
        raise ConfigError(f"parallel={p.name}: sequence_parallel with {families.layer_family(hf).norm}: "
                          f"Relax's layer spec has a sequence-parallel RMSNorm only; use a layout "
                          f"without parallel.sequence_parallel")
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError(f"parallel={p.name}: sequence_parallel shards activations over the "
                          f"tensor-parallel group and needs tp > 1")
    if p.world_size % (p.etp * p.ep * p.pp):
        raise ConfigError(f"parallel={p.name}: etp={p.etp} x ep={p.ep} x pp={p.pp} must divide the "
                          f"world size tp x pp x cp x dp = {p.world_size}")
    if hf["num_hidden_layers"] % (p.pp * p.vpp):
        raise ConfigError(f"parallel={p.name}: {hf['num_hidden_layers']} layers do not split "
                          f"into pp={p.pp} x vpp={p.vpp} equal chunks")
    experts = families.num_experts(hf)
    if experts and not all(families.moe_layers(hf)):
        dense = [i for i, moe in enumerate(families.moe_layers(hf)) if not moe]
        raise ConfigError(f"train=megatron builds every layer of an MoE model as an MoE layer; this "
                          f"model's layers {dense} are dense (mlp_only_layers / decoder_sparse_step "
                          f"in config.json): use train=torch")
    if p.ep > 1 and (not experts or experts % p.ep):
        raise ConfigError(f"parallel={p.name}: ep={p.ep} needs an MoE model whose expert count is "
                          f"divisible by it (this model has {experts} experts); try "
                          f"model.tiny.num_experts=4")
    check_divides(p, "tp", hf, ("num_attention_heads", "num_key_value_heads", "vocab_size",
                                "shared_expert_intermediate_size" if experts else "intermediate_size"))
    if experts:
        check_divides(p, "etp", hf, (families.layer_family(hf).moe.expert_size_key,))


def checkpoint_layout(train, parallel) -> dict:
    """Optimizer state is saved per rank: a resume needs the same parallel sizes and optimizer."""
    layout = {f"parallel.{k}": parallel[k] for k in ("tp", "pp", "vpp", "ep", "etp", "cp", "dp")}
    layout["train.use_distributed_optimizer"] = train.use_distributed_optimizer
    return layout
