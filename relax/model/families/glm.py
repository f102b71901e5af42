"""GLM-4 (GlmForCausalLM): q/k/v biases, gate/up in one `gate_up_proj`, partial RoPE on interleaved
pairs of dims (Megatron's rotary_interleaved). Megatron's layer spec only: transformers' forward
elsewhere."""

from relax.model.families import Family

FAMILY = Family(architecture="GlmForCausalLM", model_type="glm", qkv_bias=True, qkv_bias_key="attention_bias",
                hand_written=False, fused=("mlp.gate_up_proj.weight",), rotary_interleaved=True)
