"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): q/k/v biases."""

from relax.model.families import SLIDING_WINDOW, Family

FAMILY = Family(architecture="Qwen2ForCausalLM", model_type="qwen2", qkv_bias=True, refused=SLIDING_WINDOW)
