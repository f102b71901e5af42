"""Context parallelism of train=megatron (relax/train/megatron/context_parallel.py) by hand: the
micro-batch cut each CP rank gets, the way back to sequence order, and the CPU attention over
two gloo ranks against causal attention on the whole sequence. Fast: no Megatron model (the
cp2 layout sweep in tests/test_megatron.py is the slow, end-to-end check)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from relax.train.common import MicroBatch
from relax.train.megatron.context_parallel import ContextParallelAttention, cp_local, to_sequence_order

from .test_megatron_convert import layout


def held_by(rank: int, cp: int, length: int) -> torch.Tensor:
    """The positions Megatron gives CP rank `rank`: chunks rank and 2·cp-1-rank of 2·cp."""
    c = length // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def labelled_micro_batch(length: int) -> MicroBatch:
    """Two rows; every per-position field holds its own offset + position, so a cut can be read."""
    field = lambda offset: offset + torch.arange(length).repeat(2, 1)  # noqa: E731
    return MicroBatch([0, 1], field(0), field(100), field(200), torch.tensor([1.0, -1.0]), field(300),
                      field(400), old_log_probs=field(500), ref_log_probs=field(600), entropy=field(700),
                      is_weights=field(800), is_flags=(field(900), field(1000)))


def test_cp_local_cuts_every_per_position_field_as_megatron_does_and_sequence_order_restores_it(
        monkeypatch):
    """A field left out of cp_local's cut (is_weights, the is_flags) would drop TIS/MIS under CP;
    a wrong chunk pairing would put log-probs back at the wrong positions."""
    from megatron.core import parallel_state  # (here: the SGLang tier collects this file without Megatron)

    for cp in (2, 3):
        length = 4 * cp
        mb, locals_ = labelled_micro_batch(length), []
        for rank in range(cp):
            monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda cp=cp: cp)
            monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda rank=rank: rank)
            local, positions = cp_local(mb, layout(cp_size=cp, cp_rank=rank))
            want = held_by(rank, cp, length)
            assert torch.equal(positions, want.repeat(2, 1)), (cp, rank)
            for name in ("tokens", "targets", "mask", "rollout_log_probs", "loss_weights", "old_log_probs",
                         "ref_log_probs", "entropy", "is_weights"):
                assert torch.equal(getattr(local, name), getattr(mb, name)[:, want]), (cp, rank, name)
            assert [f.tolist() for f in local.is_flags] == [f[:, want].tolist() for f in mb.is_flags]
            assert torch.equal(local.advantages, mb.advantages) and local.indices == mb.indices
            locals_.append(local.old_log_probs.T)  # [2c, b], as cp_full gathers them
        assert torch.equal(to_sequence_order(torch.stack(locals_), cp).T, mb.old_log_probs), cp


S, B, HEADS, GROUPS, D, SCALE = 8, 2, 4, 2, 8, 0.3  # GQA; a softmax scale other than 1/sqrt(d)


def _attention_on_rank(rank: int, init_file: str, q, k, v, weights, window) -> None:
    """One of two CP ranks: its queries, keys and values at its positions through
    ContextParallelAttention; output and gradients must be the whole sequence's at them (with
    Megatron's sliding `window`, (left, 0): each query sees itself and `left` keys before it)."""
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        parallel_state._CONTEXT_PARALLEL_GROUP = dist.group.WORLD
        config = type("Config", (), {"context_parallel_size": 2, "window_size": window})
        attention = ContextParallelAttention(config, 1, None, None, softmax_scale=SCALE)
        mine = held_by(rank, 2, S)
        local = [x[mine].clone().requires_grad_() for x in (q, k, v)]
        out = attention(*local, attention_mask=None)
        (out * weights[mine]).sum().backward()

        whole = [x.clone().requires_grad_() for x in (q, k, v)]
        behind = torch.arange(S)[:, None] - torch.arange(S)[None, :]
        allowed = (behind >= 0) & (behind <= (window[0] if window else S))
        expected = F.scaled_dot_product_attention(*(x.permute(1, 2, 0, 3) for x in whole), attn_mask=allowed,
                                                  scale=SCALE, enable_gqa=True)
        expected = expected.permute(2, 0, 1, 3).reshape(S, B, HEADS * D)
        (expected * weights).sum().backward()
        torch.testing.assert_close(out, expected[mine])
        for name, x, full in zip("qkv", local, whole):  # K and V: every rank's queries' share summed
            torch.testing.assert_close(x.grad, full.grad[mine], msg=f"d{name} on rank {rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("window", [None, (2, 0)])
def test_context_parallel_attention_on_two_ranks_is_causal_attention_on_the_whole_sequence(tmp_path, window):
    """Forward and backward: a wrong causal or sliding-window mask, chunk order or K/V gradient
    reduction (each rank's gradient for the keys it holds sums every rank's queries) departs from it."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(S, B, HEADS, D, generator=generator)
    k, v = (torch.randn(S, B, GROUPS, D, generator=generator) for _ in range(2))
    weights = torch.randn(S, B, HEADS * D, generator=generator)
    # forked: the ranks start with torch and Megatron already imported
    mp.start_processes(_attention_on_rank, args=(str(tmp_path / "init"), q, k, v, weights, window), nprocs=2,
                       start_method="fork")
