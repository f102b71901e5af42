"""Tiny random-initialised models of every supported family, saved as ordinary HF
directories the way real checkpoints come: sharded safetensors with
`model.safetensors.index.json`, bf16 or fp32, tied or untied embeddings, the chat template
in tokenizer_config.json. Built from transformers' config classes (no download), with the
tiny model's locally built tokenizer; `family_model` in conftest.py builds each once per
session."""

from __future__ import annotations

from pathlib import Path

import torch

# Each family in the shape of its real checkpoints: Llama-3 RoPE scaling (with an original
# context short enough that the scaling changes the positions the tests use) and tied
# embeddings like Llama-3.2-1B; Qwen3 with head_dim != hidden / heads and tied embeddings
# like Qwen3-0.6B; MoE routers with and without renormalised top-k weights.
FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "qwen2": ("Qwen2Config", dict(rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, norm_topk_prob=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=32, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True)),
}
# Architectures without a hand-written forward (transformers' forward on the torch engine), chosen
# to cover what the families lack: sliding windows (small enough to matter here) with per-layer-
# type RoPE, soft-capping, scaled embeddings, LayerNorm with biases, partial rotary, parallel
# attention/MLP blocks, fused projections, q/k norms, MQA, a non-gated MLP, muP multipliers, MoE.
# Gemma 3 and Cohere tie their embeddings, as their checkpoints do (SGLang's models require it).
ARCHITECTURES = {
    "gemma3": ("Gemma3TextConfig", dict(num_key_value_heads=1, head_dim=32, sliding_window=6,
                                        layer_types=["sliding_attention", "full_attention"],
                                        query_pre_attn_scalar=32, tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=6, final_logit_softcapping=30.0,
                                    attn_logit_softcapping=50.0, query_pre_attn_scalar=16)),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5, pad_token_id=None)),
    "mistral": ("MistralConfig", dict(sliding_window=6)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmo2": ("Olmo2Config", {}),
    "gpt_neox": ("GPTNeoXConfig", dict(rotary_pct=0.25, use_parallel_residual=True)),
    "granite": ("GraniteConfig", dict(embedding_multiplier=4.0, residual_multiplier=0.5,
                                      logits_scaling=2.0, attention_multiplier=0.1)),
    "starcoder2": ("Starcoder2Config", dict(use_bias=True, sliding_window=6)),
    "smollm3": ("SmolLM3Config", dict(no_rope_layers=[1, 0], tie_word_embeddings=True)),
    "cohere": ("CohereConfig", dict(use_qk_norm=True, logit_scale=0.5, tie_word_embeddings=True)),
    "glm": ("GlmConfig", dict(head_dim=16, partial_rotary_factor=0.5)),
    "phi": ("PhiConfig", dict(partial_rotary_factor=0.5, qk_layernorm=True)),
}
# rollout=sglang (relax/model/sglang_support.py): the architectures above whose config it serves,
# and servable checkpoints of those it refuses for a setting (Mistral v0.3's: no sliding window; a
# StarCoder2 without one)
SGLANG_RUNS = ("gemma3", "phi3", "mixtral", "olmo2", "granite", "smollm3", "cohere")
SGLANG_VARIANTS = {"mistral_without_window": ("mistral", dict(sliding_window=None)),
                   "starcoder2_without_window": ("starcoder2", dict(sliding_window=None))}
SHARD_SIZE = "40KB"  # several shards even for these tiny models


def build_family_model(path: Path, family: str, dtype: str = "float32", seed: int = 0, **sizes) -> Path:
    """`sizes`: config.json values over the shape below (heads, widths, a larger vocabulary)."""
    import transformers

    from relax.model.tiny import VOCAB_SIZE, build_tokenizer

    tokenizer = build_tokenizer()
    config_class, extra = (FAMILIES | ARCHITECTURES)[family]
    config = getattr(transformers, config_class)(**{
        "vocab_size": VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": tokenizer.eos_token_id,
        # no pad_token_id, as in real Llama-3/Qwen configs: with one, HF's embedding never
        # trains the pad row (padding_idx) and Megatron's does, and a random model samples pads
        "pad_token_id": None, "bos_token_id": None, **extra, **sizes})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: noise makes swapping
        for p in model.parameters():  # or dropping any of them change the outputs
            p.add_(torch.randn_like(p) * 0.05)
    model.to(getattr(torch, dtype))
    model.save_pretrained(path, max_shard_size=SHARD_SIZE)
    tokenizer.save_pretrained(path, save_jinja_files=False)  # the template in tokenizer_config.json
    return path
