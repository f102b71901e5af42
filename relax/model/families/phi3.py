"""Phi-3 and Phi-4 (Phi3ForCausalLM): Llama's layers with q/k/v in one `qkv_proj` and gate/up in one
`gate_up_proj`, and partial rotary; a window shorter than the context is refused (and LongRoPE, as
every RoPE type but default, linear and llama3). Megatron's layer spec only: transformers' forward
elsewhere."""

from relax.model.families import SHORT_WINDOW, Family

FAMILY = Family(architecture="Phi3ForCausalLM", model_type="phi3", qkv_bias=False, refused=SHORT_WINDOW,
                hand_written=False, fused=("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"))
