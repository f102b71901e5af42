"""Mistral (MistralForCausalLM): Llama's layers and names; a sliding window (v0.1's 4096) is refused
unless it covers every position. Megatron's layer spec only: transformers' forward elsewhere."""

from relax.model.families import SHORT_WINDOW, Family

FAMILY = Family(architecture="MistralForCausalLM", model_type="mistral", qkv_bias=False,
                refused=SHORT_WINDOW, hand_written=False)
