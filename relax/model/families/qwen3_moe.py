"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention (q/k RMSNorm), experts without a shared expert."""

from relax.model.families import ATTENTION_PROJECTIONS, O_PROJ_BIAS, SLIDING_WINDOW, Family, MoE

FAMILY = Family(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", qkv_bias=False, qk_norm=True,
                moe=MoE(shared_expert=False), refused={**SLIDING_WINDOW, **O_PROJ_BIAS},
                # peft takes the MLP names for the fused experts' 3-D parameters (transformers 5's
                # layout), an adapter that relax.train.lora does not merge: LoRA on attention
                lora_targets=ATTENTION_PROJECTIONS)
