"""train=megatron's model build (relax/train/megatron/model.py) and its CPU compatibility
layer (relax/train/megatron/cpu_compat.py), fast: the TransformerConfig each family and
layout map to, the CPU layer specs, a single-rank model built from an HF directory that
computes transformers' logits, and each CPU shim by hand (the installed layer in forked
ranks, so that this process stays untouched). The slow tier (tests/test_megatron.py) runs
every layout end to end. Megatron is imported inside the tests: the SGLang tier collects
every test file without it."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .conftest import make_cfg
from .families import FAMILIES
from .test_megatron_convert import layout


def hf_config(family: str, **overrides):
    """A transformers config of `family` (tests/families.py) with the architecture set, as read
    from a checkpoint's config.json."""
    import transformers

    config_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**{
        "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6, "pad_token_id": None, **extra, **overrides})
    config.architectures = [config_class.removesuffix("Config") + "ForCausalLM"]
    return config


def fields(config, names: str) -> dict:
    return {name: getattr(config, name) for name in names.split()}


def test_transformer_config_maps_each_family_and_the_layout():
    """GQA groups, Qwen3's explicit head_dim, the norm epsilon, q/k/v biases and q/k norm, the
    MoE router and shared expert, the dtype, and every parallel size of the layout."""
    from megatron.core.transformer.enums import AttnBackend

    from relax.train.megatron.model import transformer_config

    from relax.model import families
    from relax.train.megatron.model import moe_config

    train = make_cfg("train=megatron", "train.deterministic=true").train
    big = layout(tp_size=2, sequence_parallel=True, pp_size=2, vpp=2, cp_size=2, ep_size=2, etp_size=1)
    # Qwen3-MoE: head_dim 32 != 64 / 4, q/k norm, no bias, renormalised top-k, no shared expert
    config = transformer_config(hf_config("qwen3_moe", num_hidden_layers=4), big, train, "bfloat16")
    assert fields(config, "num_layers num_query_groups kv_channels ffn_hidden_size layernorm_epsilon "
                          "add_qkv_bias add_bias_linear qk_layernorm bf16 params_dtype "
                          "pipeline_dtype") == dict(
        num_layers=4, num_query_groups=2, kv_channels=32, ffn_hidden_size=128, layernorm_epsilon=1e-6,
        add_qkv_bias=False, add_bias_linear=False, qk_layernorm=True, bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    assert fields(config, "tensor_model_parallel_size sequence_parallel pipeline_model_parallel_size "
                          "virtual_pipeline_model_parallel_size context_parallel_size "
                          "expert_model_parallel_size expert_tensor_parallel_size") == dict(
        tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2,
        expert_tensor_parallel_size=1)
    assert fields(config, "calculate_per_token_loss batch_p2p_comm deterministic_mode attention_backend "
                          "hidden_dropout attention_dropout") == dict(
        calculate_per_token_loss=True, batch_p2p_comm=False, deterministic_mode=True,
        attention_backend=AttnBackend.local, hidden_dropout=0.0, attention_dropout=0.0)
    assert fields(config, "num_moe_experts moe_router_topk moe_router_pre_softmax moe_ffn_hidden_size "
                          "moe_shared_expert_intermediate_size moe_shared_expert_gate moe_permute_fusion "
                          "moe_aux_loss_coeff") == dict(
        num_moe_experts=4, moe_router_topk=2, moe_router_pre_softmax=False, moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False, moe_permute_fusion=False,
        moe_aux_loss_coeff=0.0)
    # (permute fusion needs Transformer Engine: the setting is passed on, checked without Megatron)
    qwen3_moe = hf_config("qwen3_moe")
    fused = moe_config(qwen3_moe, families.family_of(qwen3_moe.to_dict()),
                       SimpleNamespace(moe_permute_fusion=True))
    assert fused["moe_permute_fusion"] is True

    # Qwen2-MoE: q/k/v biases, softmax over all experts before top-k (norm_topk_prob=False),
    # a gated shared expert; fp32 on a single rank
    train = make_cfg("train=megatron").train
    config = transformer_config(hf_config("qwen2_moe"), layout(), train, "float32")
    assert fields(config, "kv_channels add_qkv_bias qk_layernorm bf16 params_dtype "
                          "virtual_pipeline_model_parallel_size sequence_parallel deterministic_mode "
                          "moe_router_pre_softmax moe_shared_expert_intermediate_size moe_shared_expert_gate "
                          "moe_permute_fusion") == dict(
        kv_channels=16, add_qkv_bias=True, qk_layernorm=False, bf16=False, params_dtype=torch.float32,
        virtual_pipeline_model_parallel_size=None, sequence_parallel=False, deterministic_mode=False,
        moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True,
        moe_permute_fusion=False)
    dense = transformer_config(hf_config("llama", rms_norm_eps=1e-5 / 3), layout(), train, "float16")
    assert (dense.num_moe_experts, dense.layernorm_epsilon, dense.bf16, dense.params_dtype) == (
        None, 1e-5 / 3, False, torch.float16)


def test_cpu_layer_specs_take_sequence_parallel_norms_and_context_parallel_attention():
    """Under sequence parallelism every norm (input, pre-MLP, q/k, final) is the one that marks
    its weight for the TP all-reduce of its gradient; under CP the core attention is the CPU
    CP attention; otherwise Megatron's local spec is left as it is."""
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from relax.train.megatron.context_parallel import ContextParallelAttention
    from relax.train.megatron.cpu_compat import SequenceParallelRMSNorm
    from relax.train.megatron.model import layer_spec, transformer_config

    train = make_cfg("train=megatron").train
    hf = hf_config("qwen3", num_hidden_layers=4)
    sp = transformer_config(hf, layout(tp_size=2, sequence_parallel=True, pp_size=2, vpp=2), train, "float32")
    parallel_state.set_pipeline_model_parallel_rank(1)  # (what init_layout would have set up)
    try:
        blocks = [layer_spec(sp, hf, vp_stage) for vp_stage in (0, 1)]
    finally:
        parallel_state.set_pipeline_model_parallel_rank(None)
    for block in blocks:
        assert len(block.layer_specs) == 1  # 4 layers over 2 stages x 2 virtual stages
        assert block.layer_norm is SequenceParallelRMSNorm
        layer = block.layer_specs[0].submodules
        attention = layer.self_attention.submodules
        norms = [layer.input_layernorm, layer.pre_mlp_layernorm, attention.q_layernorm, attention.k_layernorm]
        assert norms == [SequenceParallelRMSNorm] * 4
        assert attention.core_attention is DotProductAttention

    plain = layer_spec(transformer_config(hf, layout(), train, "float32"), hf, None)
    cp = layer_spec(transformer_config(hf, layout(cp_size=2), train, "float32"), hf, None)
    assert plain.submodules.self_attention.submodules.core_attention is DotProductAttention
    assert cp.submodules.self_attention.submodules.core_attention is ContextParallelAttention
    for spec in (plain, cp):
        layer = spec.submodules
        assert SequenceParallelRMSNorm not in (layer.input_layernorm, layer.pre_mlp_layernorm)


def test_deterministic_mode_sets_its_environment_and_torch_s_deterministic_algorithms(monkeypatch):
    from relax.train.megatron import model

    calls = []
    monkeypatch.setattr(model.torch, "use_deterministic_algorithms", calls.append)
    for name in ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own setting is kept
    model.deterministic_mode()
    assert [os.environ["NCCL_ALGO"], os.environ["CUBLAS_WORKSPACE_CONFIG"],
            os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"]] == ["Ring", ":16:8", "0"]
    assert calls == [True]


# -- a model built on one CPU rank ------------------------------------------------------------
BUILT = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def _build_on_one_rank(rank: int, init_file: str, cases: list, train) -> None:
    from transformers import AutoConfig

    from relax.train.megatron import cpu_compat
    from relax.train.megatron.layout import init_layout
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from relax.train.megatron.model import build_chunks, transformer_config, wrap_for_training
    from relax.train.megatron.weights import Weights, inner_optimizers

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        cpu_compat.apply()
        single = SimpleNamespace(tp=1, pp=1, vpp=1, cp=1, ep=1, etp=1, sequence_parallel=False)
        one = init_layout(single, 0, 0, 1)
        for family, path, tokens, expected, inv_freq in cases:
            hf = AutoConfig.from_pretrained(path)
            config = transformer_config(hf, one, train, "float32")
            [chunk] = Weights(hf, one).load(build_chunks(config, hf, one), path)
            assert (chunk.pre_process, chunk.post_process) == (True, True), family
            assert chunk.share_embeddings_and_output_weights == hf.tie_word_embeddings, family
            torch.testing.assert_close(chunk.rotary_pos_emb.inv_freq, inv_freq, rtol=0, atol=0, msg=family)
            with torch.no_grad():
                logits = chunk(input_ids=tokens, position_ids=torch.arange(tokens.shape[1]).expand_as(tokens),
                               attention_mask=None)
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5, msg=family)

        # the last pipeline stage's two virtual stages (Megatron's own state stays single-rank:
        # only the chunks' places are read): the output layer is on its last chunk only
        hf = hf_config("qwen2", num_hidden_layers=4)
        last = layout(pp_size=2, pp_rank=1, vpp=2)
        chunks = build_chunks(transformer_config(hf, last, train, "float32"), hf, last)
        assert [(c.pre_process, c.post_process, len(c.decoder.layers)) for c in chunks] == [
            (False, False, 1), (False, True, 1)]

        # Megatron DDP and its optimizer with the configured Adam (train=torch's AdamW)
        config = transformer_config(hf, one, train, "float32")
        wrapped, optimizer = wrap_for_training(build_chunks(config, hf, one), config, train, "float32")
        assert config.finalize_model_grads_func is finalize_model_grads  # per-token loss scaling, DP sums
        ddp = wrapped[0].ddp_config
        assert (ddp.grad_reduce_in_fp32, ddp.overlap_grad_reduce, ddp.use_distributed_optimizer) == (
            True, False, True)
        groups = [group for inner in inner_optimizers(optimizer) for group in inner.param_groups]
        assert {(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in groups} == {
            (2e-3, (0.8, 0.95), 1e-6, 0.1)}
        assert sum(len(g["params"]) for g in groups) == len(list(wrapped[0].parameters()))
        assert optimizer.config.clip_grad == 0.5
    finally:
        dist.destroy_process_group()


def test_a_model_built_on_one_cpu_rank_computes_transformers_logits(tmp_path):
    """Per family (Llama-3 RoPE scaling and tied embeddings, Qwen2's q/k/v biases, Qwen3's q/k
    norm and head_dim, both MoE routers and the gated shared expert): the Megatron model that
    transformer_config, build_chunks and the HF weights make gives transformers' logits; a
    pipeline stage's chunks hold what their virtual stages should; wrap_for_training passes the
    configured optimizer settings on."""
    import megatron.core.models.gpt  # noqa: F401  (imported before the fork, once)
    import transformers

    from relax.model import families

    cases = []
    for i, family in enumerate(BUILT):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="eager")
        with torch.no_grad():  # norms away from 1, biases away from 0
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model.save_pretrained(tmp_path / family)
        tokens = torch.randint(0, 64, (2, 40))
        with torch.no_grad():
            expected = model(input_ids=tokens).logits
        inv_freq = families.hf_rotary(model.config).inv_freq
        cases.append((family, str(tmp_path / family), tokens, expected, inv_freq))
    llama_default = transformers.LlamaConfig(**{**hf_config("llama").to_dict(), "rope_parameters": None})
    assert not torch.allclose(cases[0][4], families.hf_rotary(llama_default).inv_freq)  # scaled
    train = make_cfg("train=megatron", "train.lr=2e-3", "train.adam_beta1=0.8", "train.adam_beta2=0.95",
                     "train.adam_eps=1e-6", "train.weight_decay=0.1", "train.clip_grad=0.5").train
    mp.start_processes(_build_on_one_rank, args=(str(tmp_path / "init"), cases, train), nprocs=1,
                       start_method="fork")


# -- the CPU compatibility layer --------------------------------------------------------------
def test_cuda_to_cpu_moves_cuda_allocations_and_copies_to_the_cpu():
    from relax.train.megatron.cpu_compat import CudaToCpu, _cpu

    assert [_cpu("cuda"), _cpu("cuda:1"), _cpu(torch.device("cuda", 0)), _cpu(0)] == [torch.device("cpu")] * 4
    assert (_cpu("cpu"), _cpu(torch.device("cpu")), _cpu(None)) == ("cpu", torch.device("cpu"), None)
    x = torch.arange(3.0)
    with CudaToCpu():
        made = [torch.zeros(2, device="cuda"), torch.ones(2, device="cuda:0"), torch.empty(2, device=0),
                torch.tensor([1.0], device="cuda", pin_memory=True), torch.empty(2, pin_memory=True)]
        assert all(t.device.type == "cpu" for t in made)
        assert x.cuda() is x
        assert x.to("cuda").device.type == "cpu" and x.to(0, non_blocking=True).device.type == "cpu"
        assert x.to(torch.float64).dtype == torch.float64
        assert x.record_stream(torch.Stream("cpu")) is None  # (no CPU kernel: swallowed)
        assert (x.type(), x.long().type()) == ("torch.cuda.FloatTensor", "torch.cuda.LongTensor")
        assert x.type(torch.float64).dtype == torch.float64
    assert x.type() == "torch.FloatTensor"  # the mode is off again


def test_cuda_stream_and_event_stand_ins_do_nothing_and_hand_back_events():
    from relax.train.megatron.cpu_compat import _Event, _Stream

    stream, event = _Stream(), _Event()
    assert stream.record_event(event) is event and isinstance(stream.record_event(), _Event)
    done = [stream.wait_stream(_Stream()), stream.synchronize(), event.record(stream), event.wait(stream)]
    assert done == [None] * 4


def test_the_sequence_parallel_norm_keeps_its_epsilon_and_marks_its_weight():
    from relax.train.megatron.cpu_compat import SequenceParallelRMSNorm

    norm = SequenceParallelRMSNorm(SimpleNamespace(sequence_parallel=True), 4, eps=0.5, unused_option=1)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    x = torch.tensor([[1.0, -1.0, 2.0, 0.0]])
    expected = x / torch.sqrt(torch.tensor(6.0 / 4 + 0.5)) * norm.weight
    torch.testing.assert_close(norm(x), expected, rtol=1e-6, atol=1e-6)
    assert norm.weight.sequence_parallel is True
    plain = SequenceParallelRMSNorm(SimpleNamespace(sequence_parallel=False), 4)
    assert plain.weight.sequence_parallel is False


def test_all_to_all_split_sizes_reach_c10d_as_lists():
    from relax.train.megatron.cpu_compat import _all_to_all_single_lists

    seen = []
    wrapped = _all_to_all_single_lists(lambda out, inp, out_splits, in_splits, *a, **kw: seen.append(
        (out_splits, in_splits, a, kw)))
    wrapped("out", "in", torch.tensor([1, 2]), torch.tensor([3, 0]), "group", async_op=True)
    wrapped("out", "in")
    assert seen == [([1, 2], [3, 0], ("group",), {"async_op": True}), (None, None, (), {})]


def _installed_layer_on_rank(rank: int, init_file: str) -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    from relax.train.megatron import cpu_compat

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        cpu_compat.apply()
        gather, all_to_all = dist.all_gather_into_tensor, dist.all_to_all_single
        cpu_compat.apply()  # idempotent: nothing wrapped twice
        assert (dist.all_gather_into_tensor, dist.all_to_all_single) == (gather, all_to_all)
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.zeros(1, device="cuda").device.type == "cpu"  # the mode is on for good
        # the RNG tracker's "CUDA" states are the CPU generator's
        state = megatron_random._get_cuda_rng_state()
        first = torch.rand(4)
        megatron_random._set_cuda_rng_state(state)
        assert torch.equal(torch.rand(4), first)
        # uneven all-gather (MoE TP x EP with sequence parallelism): rank 0 holds 2 rows, rank 1 one
        mine = torch.full((2 - rank, 3), float(rank + 1))
        out = torch.empty(3, 3)
        assert dist.all_gather_into_tensor(out, mine) is None
        assert out[:, 0].tolist() == [1.0, 1.0, 2.0]
        even = torch.empty(2, 3)
        dist.all_gather_into_tensor(even, torch.full((1, 3), float(rank)))
        assert even[:, 0].tolist() == [0.0, 1.0]
        # split sizes as tensors, as MoE dispatch passes them: rank r sends r + 1 rows to each rank
        send = torch.full((2 * (rank + 1),), float(rank))
        received = torch.empty(3)
        dist.all_to_all_single(received, send, torch.tensor([1, 2]), torch.tensor([rank + 1, rank + 1]))
        assert received.tolist() == [0.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_the_installed_layer_on_two_gloo_ranks(tmp_path):
    """apply(): CPU device and RNG stubs, the process-wide CUDA-to-CPU mode, and the gloo
    collectives it patches (uneven all-gather, tensor split sizes), installed once."""
    import megatron.core.tensor_parallel  # noqa: F401  (imported before the fork, once)

    if torch.cuda.is_available():
        pytest.skip("the layer is installed on CPU only")
    mp.start_processes(_installed_layer_on_rank, args=(str(tmp_path / "init"),), nprocs=2,
                       start_method="fork")
