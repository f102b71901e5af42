"""train.shared_prompt: a GRPO group's prompt runs once, its responses attend to it.

How it works in detail: docs/backends.md, "Inside `relax/train/packing.py`".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax.algo import token_log_probs
from relax.errors import ConfigError
from relax.model import families
from relax.train.common import MicroBatch, batch_variant_fault


def shares_prompt(shared_prompt: bool | None, hf: dict) -> bool:
    """train.shared_prompt for this model (config.json `hf`): null packs the hand-written
    families, whose attention takes the packed mask exactly (rollout.true_on_policy's too: it
    computes each response over its own keys in position order, relax/model/invariant.py);
    other architectures may not (sliding windows would see the whole packed row, absolute
    positions come from the mask)."""
    support = families.check(hf)
    exact = support.family is not None
    if shared_prompt and not exact:
        raise ConfigError(f"train.shared_prompt=true packs a group's responses into one row behind one "
                          f"4-D mask, exact only for the hand-written families; this model is "
                          f"{support.architecture}: use train.shared_prompt=false or null")
    return exact if shared_prompt is None else shared_prompt


@dataclass
class PackedBatch:
    tokens: torch.Tensor          # [G, L] one row per distinct prompt, right-padded
    position_ids: torch.Tensor    # [G, L] each response's positions continue its prompt's
    attention_mask: torch.Tensor  # [G, 1, L, L] additive: 0 where a token may attend, min elsewhere
    keep: torch.Tensor            # [K] the packed positions whose logits are needed (any row)
    rows: torch.Tensor            # [N] per trained-region token: its micro-batch row b ...
    cols: torch.Tensor            # [N] ... and position t (it predicts mb.targets[b, t])
    packed_row: torch.Tensor      # [N] where that token's logits are: packed row ...
    packed_col: torch.Tensor      # [N] ... and index into `keep`
    fed: tuple[torch.Tensor, torch.Tensor]  # (packed row * L + position, b * T + t) of every token
    # the forward feeds (a prompt's serve each row of its group): relax/train/routing.py


def pack(mb: MicroBatch, pad_id: int, dtype: torch.dtype) -> PackedBatch:
    """`mb` as packed rows; positions t >= prompt_length - 1 of each row are the ones computed."""
    groups: dict[tuple, list[int]] = {}  # prompt tokens -> the micro-batch rows that start with it
    for b, (index, prompt_length) in enumerate(zip(mb.indices, mb.prompt_lengths, strict=True)):
        if index >= 0:
            groups.setdefault(tuple(mb.tokens[b, :prompt_length].tolist()), []).append(b)
    packed, positions, spans, where = [], [], [], []  # where: (b, t, row, packed position) per token
    fed = []  # (b, t, row, packed position) of every fed token
    for g, (prompt, rows) in enumerate(groups.items()):
        P, tokens, pos, row_spans = len(prompt), list(prompt), list(range(len(prompt))), [(0, len(prompt))]
        for b in rows:
            response = mb.tokens[b, P:mb.lengths[b] - 1].tolist()  # (the last token predicts nothing)
            start = len(tokens)
            where.append((b, P - 1, g, P - 1))  # the prompt's last token predicts the first response token
            where += [(b, P + j, g, start + j) for j in range(len(response))]
            fed += [(b, t, g, t) for t in range(P)] + [(b, P + j, g, start + j) for j in range(len(response))]
            tokens += response
            pos += range(P, P + len(response))
            row_spans.append((start, len(tokens)))
        packed.append(tokens)
        positions.append(pos)
        spans.append(row_spans)
    G, L = len(packed), max(map(len, packed), default=1)
    allowed = torch.zeros(G, L, L, dtype=torch.bool)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    for g, row_spans in enumerate(spans):
        P = row_spans[0][1]
        allowed[g, :P, :P] = causal[:P, :P]
        for start, end in row_spans[1:]:
            allowed[g, start:end, :P] = True
            allowed[g, start:end, start:end] = causal[:end - start, :end - start]
        allowed[g, len(packed[g]):, len(packed[g]):] = causal[:L - len(packed[g]), :L - len(packed[g])]
    mask = torch.zeros(G, 1, L, L, dtype=dtype).masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    b, t, row, col = (torch.tensor(c, dtype=torch.long) for c in zip(*where)) if where else \
        (torch.zeros(0, dtype=torch.long),) * 4
    keep = torch.unique(col)  # sorted: the packed positions any row needs, one output-layer pass
    T = mb.tokens.shape[1]
    return PackedBatch(
        torch.tensor([r + [pad_id] * (L - len(r)) for r in packed], dtype=torch.long),
        torch.tensor([p + list(range(len(p), L)) for p in positions], dtype=torch.long),
        mask, keep, b, t, row, torch.searchsorted(keep, col),
        (torch.tensor([g * L + c for _, _, g, c in fed], dtype=torch.long),
         torch.tensor([b * T + t for b, t, _, _ in fed], dtype=torch.long)))


def packed(mb: MicroBatch, pad_id: int, dtype: torch.dtype) -> PackedBatch:
    """`mb` packed, once: the reference, old-log-prob and training forwards share it."""
    if mb.packed is None or mb.packed.attention_mask.dtype != dtype:
        mb.packed = pack(mb, pad_id, dtype)
    return mb.packed


def log_probs(model, mb: MicroBatch, pad_id: int, temperature: float,
              entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropy, [b, T] like the unpacked forward's, zeros outside each
    row's response positions (masked out)."""
    p = packed(mb, pad_id, next(model.parameters()).dtype)
    logits = model(input_ids=p.tokens, position_ids=p.position_ids, attention_mask=p.attention_mask,
                   logits_to_keep=p.keep).logits  # [G, K, V]
    logits = batch_variant_fault(logits[p.packed_row, p.packed_col], mb)  # [N, V]
    lp, entropy = token_log_probs(logits, mb.targets[p.rows, p.cols], temperature, entropy_grad)
    shape = mb.tokens.shape
    return (torch.zeros(shape, dtype=lp.dtype).index_put((p.rows, p.cols), lp),
            torch.zeros(shape, dtype=entropy.dtype).index_put((p.rows, p.cols), entropy))
