"""Qwen3 (Qwen3ForCausalLM): per-head q/k RMSNorm, explicit head_dim, no biases."""

from relax.model.families import O_PROJ_BIAS, SLIDING_WINDOW, Family

FAMILY = Family(architecture="Qwen3ForCausalLM", model_type="qwen3", qkv_bias=False, qk_norm=True,
                refused={**SLIDING_WINDOW, **O_PROJ_BIAS})
