"""Phi-3 and Phi-4 (Phi3ForCausalLM): Llama's layers with q/k/v in one `qkv_proj` and gate/up in one
`gate_up_proj`, partial rotary, and Mistral's sliding window (LongRoPE is refused, as every RoPE
type but default, linear and llama3). Megatron's layer spec only: transformers' forward elsewhere."""

from relax.model.families import Family

FAMILY = Family(architecture="Phi3ForCausalLM", model_type="phi3", qkv_bias=False, sliding_window=True,
                hand_written=False, fused=("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"))
