"""Mistral (MistralForCausalLM): Llama's layers and names, and a sliding window in every layer where
sliding_window is set (v0.1's 4096). Megatron's layer spec only: transformers' forward elsewhere."""

from relax.model.families import Family

FAMILY = Family(architecture="MistralForCausalLM", model_type="mistral", qkv_bias=False, sliding_window=True,
                hand_written=False)
