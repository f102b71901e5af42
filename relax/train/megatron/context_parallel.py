"""Context parallelism (train=megatron, parallel.cp > 1): the batch slicing, and the core
attention without Transformer Engine (CPU).

How it works in detail: docs/backends.md, "Inside `relax/train/megatron/context_parallel.py`".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from relax.train.common import MicroBatch
from relax.train.megatron.layout import Layout


class _GatherOverCP(torch.autograd.Function):
    """[s, ...] -> [cp, s, ...]; backward sums every rank's gradient and keeps this rank's."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank = group, dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def to_sequence_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """[cp, 2c, ...] as gathered from the ranks -> [2cp·c, ...] in sequence order."""
    chunks = [None] * (2 * cp)
    for rank in range(cp):
        first, second = gathered[rank].chunk(2)
        a, b = chunk_ids(rank, cp)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks)


def cp_local(mb: MicroBatch, layout: Layout) -> tuple[MicroBatch, torch.Tensor]:
    """This CP rank's part of every per-position tensor, and the positions it holds."""
    positions = torch.arange(mb.tokens.shape[1]).expand_as(mb.tokens)
    if layout.cp_size == 1:
        return mb, positions
    # optional: megatron-core (relax[megatron])
    from megatron.core.utils import get_batch_on_this_cp_rank

    fields = ("tokens", "targets", "mask", "rollout_log_probs", "loss_weights", "old_log_probs",
              "ref_log_probs", "entropy", "is_weights")
    per_position = {f: getattr(mb, f) for f in fields if getattr(mb, f) is not None}
    flags = dict(enumerate(mb.is_flags or ()))
    local = get_batch_on_this_cp_rank(per_position | {f"flag{k}": v for k, v in flags.items()}
                                      | {"positions": positions})
    out = MicroBatch(mb.indices, advantages=mb.advantages, **{f: local.get(f) for f in fields},
                     is_flags=tuple(local[f"flag{k}"] for k in flags) or None)
    return out, local["positions"]


def cp_gather(local: torch.Tensor, layout: Layout) -> torch.Tensor:
    """[2c, ...] on each CP rank -> [2cp*c, ...] in sequence order (no autograd)."""
    if layout.cp_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(layout.cp_size)]
    dist.all_gather(parts, local.contiguous(), group=layout.cp_group)
    return to_sequence_order(torch.stack(parts), layout.cp_size)


def cp_full(local: torch.Tensor, layout: Layout) -> torch.Tensor:
    """[b, 2c] on each CP rank -> [b, 2cp*c] in sequence order (no autograd)."""
    return cp_gather(local.T, layout).T


class ContextParallelAttention(torch.nn.Module):
    """Drop-in for the local spec's `core_attention` (same constructor and forward)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        # optional: megatron-core (relax[megatron])
        from megatron.core import parallel_state

        self.config = config
        self.group = parallel_state.get_context_parallel_group()
        self.cp = config.context_parallel_size
        self.rank = dist.get_rank(self.group)
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        # query [s, b, heads, d]; key/value [s, b, groups, d] (this rank's two chunks)
        s, b, heads, d = query.shape
        groups = key.shape[2]
        kv = to_sequence_order(_GatherOverCP.apply(torch.cat([key, value], dim=-1), self.group), self.cp)
        key, value = kv.split(d, dim=-1)  # [S, b, groups, d]
        chunk = s // 2
        q_pos = torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in chunk_ids(self.rank, self.cp)])
        behind = q_pos[:, None] - torch.arange(key.shape[0])[None, :]
        causal = behind >= 0
        if self.config.window_size:  # a sliding window: (left, 0), the key itself and `left` before it
            causal &= behind <= self.config.window_size[0]
        out = F.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
            attn_mask=causal, scale=self.softmax_scale, enable_gqa=heads != groups)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)
