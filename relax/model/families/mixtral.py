"""Mixtral (MixtralForCausalLM): Mistral's attention, every layer softmax top-k experts with
renormalised weights (Qwen3-MoE's router) under the checkpoint's `block_sparse_moe` names.
Megatron's layer spec only: transformers' forward elsewhere."""

from relax.model.families import Family, MoE


EXPERT = "block_sparse_moe.experts.{e}."
FAMILY = Family(
    architecture="MixtralForCausalLM", model_type="mixtral", qkv_bias=False,
    moe=MoE(expert_size_key="intermediate_size", norm_topk_key=None), sliding_window=True,
    hand_written=False,
    checkpoint_names={"mlp.gate.weight": "block_sparse_moe.gate.weight",
                      "mlp.experts.{e}.gate_proj.weight": EXPERT + "w1.weight",
                      "mlp.experts.{e}.up_proj.weight": EXPERT + "w3.weight",
                      "mlp.experts.{e}.down_proj.weight": EXPERT + "w2.weight"},
)
