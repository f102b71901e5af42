"""The Megatron-core model of an HF config of a family in relax/model/families/.

`transformer_config` maps the HF config (through its family: biases, q/k norm, head_dim,
MoE layout) and the layout onto Megatron's TransformerConfig;
`build_chunks` builds GPTModel chunks (one per virtual pipeline stage) from local layer
specs on CPU, Transformer Engine specs on GPU; `wrap_for_training` puts the actor into
Megatron DDP with its optimizer (distributed optimizer and grad clipping included).
Weights are loaded by relax/train/megatron/weights.py.
"""

from __future__ import annotations

import os
from functools import partial

import torch
import torch.nn.functional as F

from relax.model import families, torch_dtype
from relax.train.megatron.context_parallel import ContextParallelAttention
from relax.train.megatron.cpu_compat import SequenceParallelRMSNorm
from relax.train.megatron.layout import Layout

GPU = torch.cuda.is_available()
# config.json's hidden_act (families.MEGATRON_ACTIVATIONS) -> the MLP's activation
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


def deterministic_mode() -> None:
    """train.deterministic on GPU: the settings reproducibility work calls for (set before
    NCCL, cuBLAS and Transformer Engine initialise)."""
    os.environ.setdefault("NCCL_ALGO", "Ring")                      # fixed reduction order
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")      # deterministic cuBLAS
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")   # TE: no atomics-based kernels
    torch.use_deterministic_algorithms(True)


def num_experts(hf) -> int:
    return families.num_experts(hf.to_dict())


def moe_config(hf, family, train_cfg) -> dict:
    """TransformerConfig's MoE fields for an MoE family (empty for a dense one)."""
    if not family.moe:
        return {}
    # Qwen2-MoE's shared expert: sigmoid(x @ gate) * MLP(x), added to the experts'
    shared = hf.shared_expert_intermediate_size if family.moe.shared_expert else 0
    key = family.moe.norm_topk_key
    return dict(num_moe_experts=num_experts(hf), moe_router_topk=hf.num_experts_per_tok,
                # HF: softmax over all experts, top-k, renormalise if norm_topk_prob (Mixtral:
                # always); Megatron's default top-k-then-softmax is the renormalised case.
                moe_router_pre_softmax=not getattr(hf, key) if key else False,
                moe_ffn_hidden_size=getattr(hf, family.moe.expert_size_key),
                moe_router_load_balancing_type="none",
                moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall",
                moe_permute_fusion=train_cfg.moe_permute_fusion, moe_grouped_gemm=False,
                moe_shared_expert_intermediate_size=shared or None, moe_shared_expert_gate=bool(shared))


def rotary_fraction(config_json: dict) -> float:
    """The part of each head RoPE turns (Phi-3's partial_rotary_factor; 1: all of it)."""
    return families.rope_parameters(config_json).get("partial_rotary_factor") \
        or config_json.get("partial_rotary_factor") or 1.0


def window_size(config_json: dict, family) -> tuple[int, int] | None:
    """Megatron's (left, right) window for a family's sliding_window (transformers: a key attends
    to the window's last `sliding_window` positions, itself included); None: nothing masked."""
    window = config_json.get("sliding_window") if family.sliding_window else None
    return (window - 1, 0) if window is not None and window < config_json["max_position_embeddings"] else None


def transformer_config(hf, layout: Layout, train_cfg, dtype_name: str):
    # optional: megatron-core (relax[megatron])
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    dtype, t, config_json = torch_dtype(dtype_name), train_cfg, hf.to_dict()
    family = families.layer_family(config_json)
    # SmolLM3's layers without RoPE: no_rope_layers has 1 where RoPE applies, no_rope_freq where not
    no_rope = [int(not r) for r in config_json.get("no_rope_layers") or []]
    return TransformerConfig(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads,
        kv_channels=families.head_dim(config_json), ffn_hidden_size=hf.intermediate_size,
        normalization=family.norm, layernorm_epsilon=config_json[family.norm_eps_key],
        gated_linear_unit=family.gated_mlp,
        activation_func=ACTIVATIONS[config_json.get("hidden_act", "silu")],
        add_bias_linear=bool(family.linear_bias_key and config_json.get(family.linear_bias_key)),
        add_qkv_bias=families.qkv_bias(config_json), qk_layernorm=family.qk_norm,
        rotary_interleaved=family.rotary_interleaved, window_size=window_size(config_json, family),
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, tensor_model_parallel_size=layout.tp_size,
        pipeline_model_parallel_size=layout.pp_size,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp_size, sequence_parallel=layout.sequence_parallel,
        expert_model_parallel_size=layout.ep_size, expert_tensor_parallel_size=layout.etp_size,
        use_cpu_initialization=not GPU,  # initialisation sets the TP attributes grad-norm needs
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        calculate_per_token_loss=True, no_rope_freq=no_rope if any(no_rope) else None,
        batch_p2p_comm=False,  # gloo trap: batched p2p pairs VPP activations with wrong grads
        deterministic_mode=t.deterministic,
        # no Transformer Engine on CPU
        attention_backend=AttnBackend[t.attention_backend] if GPU else AttnBackend.local,
        **moe_config(hf, family, t))


def layer_spec(config, hf, vp_stage: int | None):
    experts = num_experts(hf) or None
    if GPU:
        # optional: megatron-core (relax[megatron])
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=experts,
                                                          qk_layernorm=config.qk_layernorm)
    # optional: megatron-core (relax[megatron])
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=experts, normalization=config.normalization,
                                    qk_layernorm=config.qk_layernorm)
    if config.context_parallel_size > 1:
        spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    if not config.sequence_parallel:
        return spec
    # optional: megatron-core (relax[megatron])
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    spec.submodules.input_layernorm = SequenceParallelRMSNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    if config.qk_layernorm:  # per head, on TP-sharded heads: its grads are summed over TP all the same
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm
    return TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=SequenceParallelRMSNorm)


def build_chunks(config, hf, layout: Layout) -> list:
    """This rank's model chunks, one per virtual pipeline stage (weights not loaded yet).
    RoPE frequencies are transformers' own (Llama-3 scaling included: Megatron's hard-codes
    an original context of 8192 instead of reading the config's)."""
    # optional: megatron-core (relax[megatron])
    from megatron.core.models.gpt import GPTModel

    inv_freq = families.hf_rotary(hf).inv_freq
    chunks = []
    for chunk in range(layout.vpp):
        vp_stage = chunk if layout.vpp > 1 else None
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=layer_spec(config, hf, vp_stage),
            vocab_size=hf.vocab_size, max_sequence_length=hf.max_position_embeddings,
            pre_process=layout.pre_process(chunk), post_process=layout.post_process(chunk),
            parallel_output=False, share_embeddings_and_output_weights=hf.tie_word_embeddings,
            position_embedding_type="rope", rotary_percent=rotary_fraction(hf.to_dict()),
            vp_stage=vp_stage))
        chunks[-1].rotary_pos_emb.inv_freq.copy_(inv_freq)
    return chunks


def wrap_for_training(chunks: list, config, train_cfg, dtype_name: str):
    """(Megatron DDP chunks, Megatron optimizer) for the actor."""
    # optional: megatron-core (relax[megatron])
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    t = train_cfg
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=t.use_distributed_optimizer)
    wrapped = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                       disable_bucketing=i > 0)
               for i, chunk in enumerate(chunks)]
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
        clip_grad=t.clip_grad, use_distributed_optimizer=t.use_distributed_optimizer,
        params_dtype=torch_dtype(dtype_name), bf16=config.bf16), wrapped)
    return wrapped, optimizer
