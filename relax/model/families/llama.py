"""Llama 2/3.x (LlamaForCausalLM): no biases, RoPE with Llama-3 scaling, tied or untied embeddings."""

from relax.model.families import O_PROJ_BIAS, Family

FAMILY = Family(
    architecture="LlamaForCausalLM", model_type="llama", qkv_bias=False,
    refused={**O_PROJ_BIAS, "mlp_bias": (True, "MLP biases")},
)
