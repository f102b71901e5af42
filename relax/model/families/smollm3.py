"""SmolLM3 (SmolLM3ForCausalLM): Llama's layers and names, some layers without RoPE
(`no_rope_layers`, Megatron's `no_rope_freq`). Megatron's layer spec only: transformers' forward
elsewhere."""

from relax.model.families import O_PROJ_BIAS, Family

FAMILY = Family(architecture="SmolLM3ForCausalLM", model_type="smollm3", qkv_bias=False,
                refused={**O_PROJ_BIAS, "mlp_bias": (True, "MLP biases")}, hand_written=False)
