"""HF <-> Megatron-core name and layout rules (relax/train/megatron/convert.py), by hand on
labelled tensors, and a rank's place in the layout (relax/train/megatron/layout.py): fast, no
rank processes. The multi-rank round trips of tests/test_megatron.py
(slow tier) check that a model survives HF -> Megatron -> HF; these check the Megatron side is
Megatron's layout (interleaved q/k/v groups, [gate; up], TP parts) and every name rule."""

from types import SimpleNamespace

import torch

from relax.train.megatron import convert
from relax.train.megatron.layout import Layout


def heads(num_heads=4, num_kv_heads=2, hidden=8, head_dim=None):
    return convert.Heads(SimpleNamespace(num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                                         hidden_size=hidden, head_dim=head_dim))


def rows(start, n, width=3):
    """n rows, row i filled with start + i: a tensor whose row order can be read back."""
    return (start + torch.arange(n, dtype=torch.float32))[:, None].expand(n, width).clone()


def test_qkv_is_interleaved_per_query_group_as_megatron_lays_it_out():
    """Megatron's linear_qkv holds [q_g; k_g; v_g] for each KV group g (whole heads, rows of a
    head kept together): the layout its attention splits, and what a TP cut keeps whole."""
    h = heads()  # 4 query heads, 2 KV groups, head_dim 2
    q, k, v = rows(0, 8), rows(100, 4), rows(200, 4)
    fused = h.fuse_qkv(q, k, v)
    assert fused[:, 0].tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    bias = h.fuse_qkv(q[:, 0], k[:, 0], v[:, 0])  # 1-D (Qwen2's qkv bias): the same order
    assert bias.tolist() == fused[:, 0].tolist()
    for got, want in zip(h.split_qkv(fused), (q, k, v), strict=True):
        assert torch.equal(got, want)


def test_head_dim_comes_from_the_config_where_it_is_not_hidden_over_heads():
    """Qwen3 sets head_dim apart from hidden_size / heads; the split must use it."""
    h = heads(num_heads=2, num_kv_heads=1, hidden=4, head_dim=3)
    assert h.head_dim == 3
    q, k, v = rows(0, 6), rows(100, 3), rows(200, 3)
    assert [t.shape[0] for t in h.split_qkv(h.fuse_qkv(q, k, v))] == [6, 3, 3]
    assert heads(num_heads=4, hidden=8).head_dim == 2  # no head_dim: hidden / heads


# Megatron's name within a layer -> HF's, written out (not read from convert.RENAMES)
RENAMED = {"input_layernorm.weight": "input_layernorm.weight",
           "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
           "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
           "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
           "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
           "mlp.linear_fc2.weight": "mlp.down_proj.weight",
           "mlp.router.weight": "mlp.gate.weight",
           "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
           "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
           "mlp.experts.local_experts.3.linear_fc2.weight": "mlp.experts.3.down_proj.weight"}


def hf_layer(pre="model.layers.1."):
    return {pre + "self_attn.q_proj.weight": rows(0, 8), pre + "self_attn.k_proj.weight": rows(100, 4),
            pre + "self_attn.v_proj.weight": rows(200, 4),
            pre + "self_attn.q_proj.bias": torch.arange(8.0),
            pre + "self_attn.k_proj.bias": 100 + torch.arange(4.0),
            pre + "self_attn.v_proj.bias": 200 + torch.arange(4.0),
            pre + "mlp.gate_proj.weight": rows(10, 4), pre + "mlp.up_proj.weight": rows(20, 4),
            pre + "mlp.experts.3.gate_proj.weight": rows(30, 2),
            pre + "mlp.experts.3.up_proj.weight": rows(40, 2),
            pre + "mlp.shared_expert.gate_proj.weight": rows(60, 2),
            pre + "mlp.shared_expert.up_proj.weight": rows(70, 2),
            **{pre + hf: rows(300 + i, 1) for i, hf in enumerate(RENAMED.values())}}


def test_fc1_is_gate_then_up_for_the_mlp_each_expert_and_the_shared_expert():
    """linear_fc1 = [gate; up] (Megatron's swiglu takes the first half as the gate)."""
    hf, h = hf_layer(), heads()
    for name, gate, up in [("decoder.layers.1.mlp.linear_fc1.weight", 10, 20),
                           ("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", 30, 40),
                           ("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", 60, 70)]:
        fc1 = convert.hf_to_megatron(name, hf, h)
        n = fc1.shape[0] // 2
        assert fc1[:, 0].tolist() == [gate + i for i in range(n)] + [up + i for i in range(n)], name
        back = convert.megatron_to_hf(name, fc1, h)
        assert sorted(back) == sorted(k for k in hf if k.endswith(("gate_proj.weight", "up_proj.weight"))
                                      and hf[k][0, 0] in (gate, up)), name
        for key, tensor in back.items():
            assert torch.equal(tensor, hf[key]), key


def test_every_megatron_name_maps_to_its_hf_tensor_of_the_same_layer_and_back():
    """Each 1:1 rename (the expert's fc2 too) and q/k/v weight and bias: HF -> Megatron -> HF
    gives back the same names and tensors, the layer index kept, not shifted."""
    hf, h = hf_layer(), heads()
    for m, name in RENAMED.items():
        want = hf["model.layers.1." + name]
        assert torch.equal(convert.hf_to_megatron(f"decoder.layers.1.{m}", hf, h), want), m
        back = convert.megatron_to_hf(f"decoder.layers.1.{m}", hf["model.layers.1." + name], h)
        assert list(back) == ["model.layers.1." + name], m
    for kind in ("weight", "bias"):
        name = f"decoder.layers.1.self_attention.linear_qkv.{kind}"
        back = convert.megatron_to_hf(name, convert.hf_to_megatron(name, hf, h), h)
        assert sorted(back) == [f"model.layers.1.self_attn.{x}_proj.{kind}" for x in "kqv"]
        for key, tensor in back.items():
            assert torch.equal(tensor, hf[key]), key


def test_top_level_names_and_a_tied_output_layer():
    """Embedding, final norm and output layer map 1:1; a tied model (no lm_head.weight in
    its files) builds Megatron's output layer from the embedding."""
    h, emb, norm, head = heads(), rows(0, 5), rows(10, 1), rows(20, 5)
    hf = {"model.embed_tokens.weight": emb, "model.norm.weight": norm, "lm_head.weight": head}
    for name, want in [("embedding.word_embeddings.weight", emb), ("decoder.final_layernorm.weight", norm),
                       ("output_layer.weight", head)]:
        assert torch.equal(convert.hf_to_megatron(name, hf, h), want), name
        assert list(convert.megatron_to_hf(name, want, h)) == [convert.TOP[name]]
    tied = {"model.embed_tokens.weight": emb, "model.norm.weight": norm}
    assert torch.equal(convert.hf_to_megatron("output_layer.weight", tied, h), emb)


def test_tp_parts_of_fc1_hold_each_rank_its_gate_and_up_rows():
    """Under TP each rank's linear_fc1 is [gate_r; up_r], not a plain cut of [gate; up];
    other tensors are cut along their partition dim; unshard joins the parts back."""
    fc1_name = "decoder.layers.0.mlp.linear_fc1.weight"
    fc1 = torch.cat([rows(10, 4), rows(20, 4)])
    parts = [convert.shard(fc1_name, fc1, 0, r, 2) for r in range(2)]
    assert [p[:, 0].tolist() for p in parts] == [[10, 11, 20, 21], [12, 13, 22, 23]]
    assert torch.equal(convert.unshard(fc1_name, parts, 0), fc1)
    proj = "decoder.layers.0.self_attention.linear_proj.weight"
    full = torch.arange(24.0).reshape(4, 6)
    parts = [convert.shard(proj, full, 1, r, 3) for r in range(3)]
    assert [p.tolist() for p in parts] == [full[:, 2 * r:2 * r + 2].tolist() for r in range(3)]
    assert torch.equal(convert.unshard(proj, parts, 1), full)
    norm = "decoder.layers.0.input_layernorm.weight"  # not split: every rank holds it all
    assert convert.shard(norm, full, None, 1, 2) is full
    assert convert.unshard(norm, [full, full.clone()], None) is full


def layout(**kw):
    fields = {f: 0 for f in Layout.__dataclass_fields__} | dict(
        world_size=1, tp_size=1, pp_size=1, vpp=1, cp_size=1, dp_size=1, ep_size=1, etp_size=1,
        sequence_parallel=False, tp_group="tp", etp_group="etp")
    return Layout(**(fields | kw))


def test_the_embedding_is_on_the_first_chunk_and_the_output_on_the_last_stage_s_last_chunk():
    """With virtual stages, chunk c of pipeline rank r holds layers of stage c * pp + r: the
    embedding goes on (rank 0, chunk 0), final norm and output layer on (rank pp-1, chunk vpp-1)."""
    ranks = [layout(pp_rank=r, pp_size=2, vpp=2) for r in range(2)]
    places = {(r, c): (ranks[r].pre_process(c), ranks[r].post_process(c)) for r in range(2) for c in range(2)}
    assert places == {(0, 0): (True, False), (0, 1): (False, False),
                      (1, 0): (False, False), (1, 1): (False, True)}
    assert layout(pp_rank=1, pp_size=2).is_last_stage and not layout(pp_rank=0, pp_size=2).is_last_stage
    assert layout().pre_process(0) and layout().post_process(0)


def test_which_rank_writes_owns_and_splits_what():
    """One data writer per DP shard (TP and CP ranks hold the same samples); one owner of each
    gathered weight per replica group (expert weights: per expert-DP x expert-TP group); expert
    parameters (allreduce=False) split over the expert-TP group; sequence lengths a multiple of
    the sequence-parallel TP size and of 2 * cp."""
    writers = [layout(tp_rank=t, cp_rank=c).writes_data for t, c in ((0, 0), (1, 0), (0, 1))]
    assert writers == [True, False, False]
    dense, expert = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    expert.allreduce = False
    assert layout(tp_rank=1, tp_size=2, etp_rank=0, etp_size=1).tp_of(expert) == (0, 1, "etp")
    assert layout(tp_rank=1, tp_size=2, etp_rank=0, etp_size=1).tp_of(dense) == (1, 2, "tp")
    owners = [layout(dp_cp_rank=d, tp_rank=t).owns(dense) for d, t in ((0, 0), (1, 0), (0, 1))]
    assert owners == [True, False, False]
    owners = [layout(expert_dp_rank=d, etp_rank=t, tp_rank=1, dp_cp_rank=1).owns(expert)
              for d, t in ((0, 0), (1, 0), (0, 1))]
    assert owners == [True, False, False]
    assert layout(tp_size=4, sequence_parallel=True).length_multiple == 4
    assert layout(tp_size=4).length_multiple == 1
    assert layout(cp_size=2).length_multiple == 4
    assert layout(tp_size=2, sequence_parallel=True, cp_size=3).length_multiple == 6
