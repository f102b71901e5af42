"""Pure-PyTorch versions of the vLLM custom ops that SGLang's CPU fallback path calls.

Each function follows the calling convention of the vLLM op of the same name: the
results are written in place into the given tensors and nothing is returned.
"""

import torch
import torch.nn.functional as F


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Rotate the first ``rotary_dim`` channels of every head of query/key, in place.

    positions: token positions, any shape with ``num_tokens`` elements.
    query, key: ``[..., num_heads * head_size]`` or ``[..., num_heads, head_size]``
        with ``num_tokens`` rows; key may be None.
    cos_sin_cache: ``[max_position, rotary_dim]``, cos in the first half, sin in the
        second half.
    is_neox: rotate the two halves (GPT-NeoX style) instead of even/odd pairs (GPT-J).
    """
    pos = positions.reshape(-1)
    num_tokens = pos.numel()
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.index_select(0, pos).chunk(2, dim=-1)
    cos = cos.unsqueeze(1)  # [num_tokens, 1, rotary_dim // 2]
    sin = sin.unsqueeze(1)
    for x in (query, key):
        if x is None:
            continue
        heads = x.reshape(num_tokens, -1, head_size)
        rot = heads[..., :rotary_dim].to(cos.dtype)
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if is_neox:
            rotated = torch.cat((o1, o2), dim=-1)
        else:
            rotated = torch.stack((o1, o2), dim=-1).flatten(-2)
        out = torch.cat((rotated.to(x.dtype), heads[..., rotary_dim:]), dim=-1)
        x.copy_(out.reshape(x.shape))


def _gated(out: torch.Tensor, x: torch.Tensor, act) -> None:
    d = x.shape[-1] // 2
    out.copy_(act(x[..., :d]) * x[..., d:])


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    _gated(out, x, F.silu)


def gelu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    _gated(out, x, F.gelu)


def gelu_tanh_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    _gated(out, x, lambda t: F.gelu(t, approximate="tanh"))


def moe_sum(input: torch.Tensor, output: torch.Tensor) -> None:
    """Sum ``input`` ``[num_tokens, topk, hidden]`` over topk into ``output``."""
    torch.sum(input, dim=1, out=output)
