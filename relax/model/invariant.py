"""rollout.true_on_policy: a forward whose every number for a token depends on that token's
prefix only, never on the batch it runs in, its padding, or whether it is decoded with a KV
cache or recomputed in a full forward. Engine and trainer both run transformers' model under
`invariant_ops()` with `attn_implementation=INVARIANT`, so their log-probs agree to the bit.

Matmuls (linear layers, attention's two products) run in tiles of a fixed shape, each one
product, every call holding a product per thread; the softmax's sum runs left to right, so a
masked key adds an exact 0.
How it was shown, and what it costs: docs/true-on-policy.md.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

INVARIANT = "relax_invariant"  # the attention implementation's name in transformers' registries
TILE = 8  # rows per tile of a batched matmul (attention's)
LINEAR_TILE = 64  # rows per tile of a linear layer's: larger tiles pack the weight fewer times
CHUNK = 32  # keys per attention product


def _tiles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, n, k] @ b [B, k, m], attention's: one call per tile of TILE rows, each a product of
    one shape per matrix (by baddbmm, which invariant_ops leaves as it is: aten's own batched
    kernel), with at least one matrix per thread (zeros where too few): BLAS then computes each
    product whole on one thread rather than splitting its sums across threads."""
    batch, n, k = a.shape
    threads = torch.get_num_threads()
    if not a.numel() or not b.numel():
        return a.new_zeros(batch, n, b.shape[2])
    if n % TILE:  # (a padding of 0 would still copy)
        a = torch.nn.functional.pad(a, (0, 0, 0, (-n) % TILE))
    if batch < threads:
        a, b = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, threads - batch)) for x in (a, b))
    zeros = a.new_zeros(()).expand(a.shape[0], TILE, b.shape[2])  # one call per tile: b is not copied per tile
    out = [torch.baddbmm(zeros, a[:, i:i + TILE], b, beta=0) for i in range(0, a.shape[1], TILE)]
    return _cat(out, 1)[:batch, :n]


def _tiled_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A linear layer's product a [n, k] @ b [k, m]: products of LINEAR_TILE rows by m / threads
    columns, each call holding at least one per thread (BLAS then computes each on one thread):
    a call per column block over the row tiles, or, with fewer tiles than threads (a decode
    step), a call per row tile over the column blocks."""
    n, k = a.shape
    m, parts = b.shape[1], torch.get_num_threads()
    if not a.numel() or not b.numel():  # (an empty layer: a zero-width shared expert)
        return a.new_zeros(n, m)
    if m % parts:
        b = torch.nn.functional.pad(b, (0, (-m) % parts))
    if n % LINEAR_TILE:  # (a padding of 0 would still copy)
        a = torch.nn.functional.pad(a, (0, 0, 0, (-n) % LINEAR_TILE))
    tiles, width = a.shape[0] // LINEAR_TILE, b.shape[1] // parts
    blocks = b.unflatten(1, (parts, width)).permute(1, 0, 2)  # [parts, k, width], a view
    if tiles < parts:
        zeros = a.new_zeros(()).expand(parts, LINEAR_TILE, width)
        out = _cat([torch.baddbmm(zeros, a[i:i + LINEAR_TILE].expand(parts, -1, -1), blocks, beta=0)
                    for i in range(0, a.shape[0], LINEAR_TILE)], 1).permute(1, 0, 2)
    else:
        zeros = a.new_zeros(()).expand(tiles, LINEAR_TILE, width)
        out = _cat([torch.baddbmm(zeros, a.view(tiles, LINEAR_TILE, k), block.expand(tiles, -1, -1), beta=0)
                    for block in blocks], 2)
    return out.reshape(a.shape[0], b.shape[1])[:n, :m]


def _cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


def _tiled_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Attention's products, TILE rows a tile; one matrix for the whole batch is a linear layer's
    (matmul on a strided input), computed as that layer's is anywhere else."""
    if b.stride(0) == 0:
        return _tiled_mm(a.reshape(-1, a.shape[2]), b[0]).view(a.shape[0], a.shape[1], -1)
    return _tiles(a, b)


def _tiled_mv(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A @ x for one vector (matmul's route for a single row without autograd) as that row's
    linear layer: x^T @ A^T."""
    return _tiled_mm(x.unsqueeze(0), a.t())[0]


def _scaled_sum(bias, product, beta, alpha):
    """beta * bias + alpha * product, as aten's addmm and addmv define it."""
    product = product if alpha == 1 else product * alpha
    return product + (bias if beta == 1 else bias * beta)


def _tiled_addmv(bias, a, x, beta=1, alpha=1):
    return _scaled_sum(bias, _tiled_mv(a, x), beta, alpha)


def _tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, whose CPU kernel may skip mm for inputs without autograd."""
    rows = x.reshape(x.shape[:-1].numel(), x.shape[-1])
    out = _tiled_mm(rows, weight.t()).view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def _tiled_addmm(bias, a, b, beta=1, alpha=1):
    return _scaled_sum(bias, _tiled_mm(a, b), beta, alpha)


@contextmanager
def invariant_ops(enabled: bool = True):
    """aten's mm, addmm, bmm, mv and addmv (and linear, without autograd) on CPU as row tiles while
    the block runs (if `enabled`)."""
    if not enabled:
        yield
        return
    library = torch.library.Library("aten", "IMPL")
    library.impl("mm", _tiled_mm, "CPU")
    library.impl("addmm", _tiled_addmm, "CPU")
    library.impl("bmm", _tiled_bmm, "CPU")
    library.impl("mv", _tiled_mv, "CPU")
    if not torch.is_grad_enabled():  # (with autograd, linear goes through addmm/mm; its backward needs that)
        library.impl("linear", _tiled_linear, "CPU")
    library.impl("addmv", _tiled_addmv, "CPU")
    try:
        yield
    finally:
        library._destroy()


def _sequential_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x summed over `dim` strictly left to right (cumsum is a scan)."""
    return x.cumsum(dim).select(dim, -1)


def invariant_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        softcap=None, **kwargs):
    """transformers' attention interface: query [B, H, Tq, D], key/value [B, Hkv, L, D], a boolean
    mask [B, 1, Tq, L] (True: attend) or an additive one; returns [B, Tq, H, D] and no weights.
    Keys go in chunks of CHUNK from key 0 (padded with masked zeros), so every product has one
    shape, and the chunks' sums are added left to right."""
    B, H, Tq, D = query.shape
    L = key.shape[-2]
    if attention_mask is not None and Tq == L:
        attend = attention_mask[:, 0, :, :L] if attention_mask.dtype == torch.bool else attention_mask[:, 0, :, :L] == 0
        if _packed_rows(attend):
            return _packed(module, query, key, value, attend, scaling, softcap), None
    kv, n = key.shape[1], -(-L // CHUNK)
    rows, pad = H // kv * Tq, n * CHUNK - L  # a key head's queries: its group's heads' (no key repeated)
    if attention_mask is not None and kwargs.get("position_ids") is not None:
        key, value, attention_mask = _left_aligned(key, value, attention_mask, kwargs["position_ids"], n * CHUNK)
    else:
        key, value = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (key, value))
    chunks = key.view(B, kv, n, CHUNK, D).transpose(-1, -2)  # [B, kv, n, D, C]
    grouped = query.reshape(B, kv, 1, rows, D)
    scores = (grouped @ chunks).permute(0, 1, 3, 2, 4).reshape(B, H, Tq, n * CHUNK)
    scores = scores * (scaling if scaling is not None else D ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    keep = torch.arange(n * CHUNK) < L
    if attention_mask is not None:
        mask = torch.nn.functional.pad(attention_mask[..., :L], (0, pad),
                                       value=False if attention_mask.dtype == torch.bool else float("-inf"))
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    scores = scores.float().masked_fill(~keep, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    weights = (scores - top.masked_fill(top == float("-inf"), 0)).exp()
    weights = weights / _sequential_sum(weights, -1).unsqueeze(-1).clamp(min=torch.finfo(weights.dtype).tiny)
    weights = weights.to(value.dtype).view(B, kv, rows, n, CHUNK).transpose(2, 3)  # [B, kv, n, rows, C]
    parts = weights @ value.view(B, kv, n, CHUNK, D)  # [B, kv, n, rows, D]
    out = parts[:, :, 0]
    for i in range(1, n):  # the chunks' sums, left to right
        out = out + parts[:, :, i]
    return out.reshape(B, H, Tq, D).transpose(1, 2).contiguous(), None


def _left_aligned(key, value, mask, position_ids, width: int):
    """A left-padded row's keys (and mask) shifted left by its padding, so that a key's index is
    its position, as in an unpadded row: its chunks then meet the same keys. A row's padding is
    index - position at any query that attends to itself (0 in a right-padded or unpadded row).
    Keys and values come back `width` long (whole chunks; what lies past a row's keys is masked)."""
    B, kv, L, D = key.shape
    Tq = mask.shape[-2]
    mask = mask[..., :L].expand(B, -1, -1, -1)
    index = torch.arange(L - Tq, L)
    diagonal = mask[:, 0, torch.arange(Tq), index]
    attends = diagonal if mask.dtype == torch.bool else diagonal == 0
    shift = ((index - position_ids) * attends).amax(-1)  # [B]
    if not bool(shift.any()):
        return *(torch.nn.functional.pad(x, (0, 0, 0, width - L)) for x in (key, value)), mask
    source = torch.arange(width) + shift[:, None]  # [B, width]: where each key comes from
    inside = (source < L)[:, :L]
    source = source.clamp(max=L - 1)
    rows = (torch.arange(B)[:, None, None] * kv + torch.arange(kv)[None, :, None]) * L + source[:, None]
    take = lambda x: x.reshape(B * kv * L, D).index_select(0, rows.view(-1)).view(B, kv, width, D)  # noqa: E731
    mask = mask.gather(3, source[:, None, None, :L].expand(-1, mask.shape[1], Tq, -1))
    mask = mask & inside[:, None, None] if mask.dtype == torch.bool else mask.masked_fill(~inside[:, None, None], float("-inf"))
    return take(key), take(value), mask


def _packed_rows(attend: torch.Tensor) -> bool:
    """Whether a query sees key 0 and not every key up to itself: a GRPO group's response packed
    behind its prompt and its group's other responses (train.shared_prompt, relax/train/packing.py)."""
    L = attend.shape[-1]
    seen = attend.sum(-1)
    return bool((attend[..., 0] & attend.diagonal(dim1=-2, dim2=-1) & (seen < torch.arange(1, L + 1))).any())


def _packed(module, query, key, value, attend, scaling, softcap) -> torch.Tensor:
    """Packed rows' attention as the rows each response came from: per response, its queries over
    its keys in position order (the prompt's, then its own), so a key's index is its position as
    in the engine's decode. A query that does not see key 0 (padding) gets zeros. Prompts and
    responses go in two calls, each padded to its own longest segment."""
    B, H, L, D = query.shape
    k = torch.arange(L)
    queries = attend.diagonal(dim1=-2, dim2=-1) & attend[..., 0]  # [B, L]
    unseen = ~attend & (k[None, None] <= k[None, :, None])  # keys up to the query it skips
    gap = torch.where(unseen.any(-1), unseen.int().argmax(-1), k + 1)  # the prompt's end, if packed
    own = torch.where(gap <= k, (attend & (k[None, None] >= gap[..., None])).int().argmax(-1), 0)
    b, i = queries.nonzero(as_tuple=True)  # every query in order: a segment's are consecutive
    _, count = torch.unique_consecutive(b * L + own[b, i], return_counts=True)
    first = torch.cumsum(count, 0) - count  # each segment's first query among (b, i)
    seg_b, start = b[first], i[first]
    responds = own[seg_b, start] > 0
    prompt = torch.where(responds, gap[seg_b, start], 0)
    out = query.new_zeros(B, L, H, D)
    for part in (~responds, responds):
        if part.any():
            rows, cols, part_out = _segments(module, query, key, value, seg_b[part], start[part], prompt[part],
                                             count[part], scaling, softcap)
            out = out.index_put((rows, cols), part_out)
    return out


def _segments(module, query, key, value, seg_b, start, prompt, count, scaling, softcap):
    """Attention of segments (a row's `count` queries from `start`, over its first `prompt` keys
    and its own) as rows of their own: the (row, column) of each query, and its output."""
    L, H, D = query.shape[2], query.shape[1], query.shape[3]
    n_keys = prompt + count  # the prompt's keys, then the segment's own (its queries' keys)
    K, Q, S = int(n_keys.max()), int(count.max()), len(count)
    j = torch.arange(K)[None]
    source = torch.where(j < prompt[:, None], j, start[:, None] + j - prompt[:, None]).clamp(max=L - 1)
    qj = torch.arange(Q)[None]
    q_source = (start[:, None] + qj).clamp(max=L - 1)
    take = lambda x, idx: x.transpose(1, 2)[seg_b[:, None], idx].transpose(1, 2)  # noqa: E731  [S, h, n, D]
    mask = (j[:, None] <= (prompt[:, None] + qj)[..., None]) & (j[:, None] < n_keys[:, None, None]) \
        & (qj < count[:, None])[..., None]
    out, _ = invariant_attention(module, take(query, q_source), take(key, source), take(value, source),
                                 mask[:, None], scaling, softcap=softcap)  # [S, Q, H, D]
    valid = (qj < count[:, None]).reshape(-1)
    rows = seg_b[:, None].expand(S, Q).reshape(-1)[valid]
    return rows, q_source.reshape(-1)[valid], out.reshape(-1, H, D)[valid]


def register() -> None:
    """INVARIANT in transformers' attention and mask registries (a boolean mask, always built)."""
    def always_a_mask(*args, **kwargs):  # (transformers would skip a plain causal one)
        return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})

    AttentionInterface.register(INVARIANT, invariant_attention)
    AttentionMaskInterface.register(INVARIANT, always_a_mask)
