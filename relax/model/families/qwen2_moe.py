"""Qwen2-MoE / Qwen1.5-MoE (Qwen2MoeForCausalLM): q/k/v biases, experts and a gated shared expert."""

from relax.model.families import SLIDING_WINDOW, Family, MoE

FAMILY = Family(
    architecture="Qwen2MoeForCausalLM", model_type="qwen2_moe", qkv_bias=True, qkv_bias_key="qkv_bias",
    moe=MoE(shared_expert=True), refused=SLIDING_WINDOW,
)
