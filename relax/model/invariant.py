"""rollout.true_on_policy: a forward whose every number for a token depends on that token's
prefix only, never on the batch it runs in, its padding, or whether it is decoded with a KV
cache or recomputed in a full forward. Engine and trainer both run transformers' model under
`invariant_ops()` with `attn_implementation=INVARIANT`, so their log-probs agree to the bit.

Matmuls (linear layers, attention's two products) run in row tiles of a fixed size, each one
product of one shape; the softmax's sum runs left to right, so a masked key adds an exact 0.
How it was shown, and what it costs: docs/true-on-policy.md.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

INVARIANT = "relax_invariant"  # the attention implementation's name in transformers' registries
TILE = 8  # rows per tile of a batched matmul (attention's)
LINEAR_TILE = 64  # rows per tile of a linear layer's: larger tiles pack the weight fewer times
CHUNK = 32  # keys per attention product


def _tiled_bmm(a: torch.Tensor, b: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """a [B, n, k] @ b [B, k, m] with every row in a tile of TILE rows, each tile one product of
    one shape (by baddbmm, which invariant_ops leaves as it is: aten's own batched kernel)."""
    batch, n, k = a.shape
    if not a.numel() or not b.numel():  # (an empty layer: a zero-width shared expert)
        return a.new_zeros(batch, n, b.shape[2])
    if b.stride(0) == 0 and batch > 1:  # one weight for every batch (a linear layer on a strided input)
        return _tiled_mm(a.reshape(-1, k), b[0]).view(batch, n, -1)
    tiles = torch.nn.functional.pad(a, (0, 0, 0, (-n) % tile)).reshape(batch, -1, tile, k)
    per_tile = b.unsqueeze(1).expand(batch, tiles.shape[1], k, b.shape[2]).reshape(-1, k, b.shape[2])
    out = torch.baddbmm(a.new_zeros(()).expand(per_tile.shape[0], tile, b.shape[2]), tiles.reshape(-1, tile, k),
                        per_tile, beta=0)
    return out.reshape(batch, -1, b.shape[2])[:, :n]


def _tiled_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _tiled_bmm(a.unsqueeze(0), b.unsqueeze(0), LINEAR_TILE)[0]


def _tiled_addmm(bias, a, b, beta=1, alpha=1):
    out = _tiled_mm(a, b)
    out = out if alpha == 1 else out * alpha
    return out + (bias if beta == 1 else bias * beta)


@contextmanager
def invariant_ops(enabled: bool = True):
    """aten's mm, addmm and bmm on CPU as row tiles while the block runs (if `enabled`)."""
    if not enabled:
        yield
        return
    library = torch.library.Library("aten", "IMPL")
    library.impl("mm", _tiled_mm, "CPU")
    library.impl("addmm", _tiled_addmm, "CPU")
    library.impl("bmm", _tiled_bmm, "CPU")
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
    groups, pad = H // key.shape[1], (-L) % CHUNK
    key, value = (torch.nn.functional.pad(x.repeat_interleave(groups, dim=1), (0, 0, 0, pad)) for x in (key, value))
    n = (L + pad) // CHUNK
    chunks = key.view(B, H, n, CHUNK, D).transpose(-1, -2)  # [B, H, n, D, C]
    scores = (query.unsqueeze(2) @ chunks).permute(0, 1, 3, 2, 4).reshape(B, H, Tq, n * CHUNK)
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
    weights = weights.to(value.dtype).view(B, H, Tq, n, CHUNK).transpose(2, 3)  # [B, H, n, Tq, C]
    out = _sequential_sum(weights @ value.view(B, H, n, CHUNK, D), 2)  # [B, H, Tq, D]
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """INVARIANT in transformers' attention and mask registries (a boolean mask, always built)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def always_a_mask(*args, **kwargs):  # (transformers would skip a plain causal one)
        return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})

    AttentionInterface.register(INVARIANT, invariant_attention)
    AttentionMaskInterface.register(INVARIANT, always_a_mask)
