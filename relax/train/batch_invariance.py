"""debug.check_batch_invariance: the run's first-step log-probs, recomputed with other batching.

A sample's log-probs must not depend on which samples share its micro-batch nor on how far
it is padded (verl issue 6280: log-probs that changed with the batch's composition). At the
first step every trained sample is scored again on its own (one sample per micro-batch, with
EXTRA_PADDING more pad tokens on the right), without grad, and the largest |Δ| over trained
tokens against the first pass becomes the step's `debug/batch_invariance_max_abs_diff`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from relax.train.common import MicroBatch
from relax.train.parallel import dp_all_gather

KEY = "debug/batch_invariance_max_abs_diff"
EXTRA_PADDING = 8  # pad tokens added to each recomputed row (rounded up to the layout's length multiple)


def alone(mb: MicroBatch, row: int, pad_id: int, extra: int) -> MicroBatch:
    """Row `row` of `mb` as a micro-batch of its own, `extra` positions longer (all padding)."""
    def pad(x: torch.Tensor, value) -> torch.Tensor:
        return F.pad(x[row:row + 1], (0, extra), value=value)

    return MicroBatch([mb.indices[row]], pad(mb.tokens, pad_id), pad(mb.targets, pad_id), pad(mb.mask, 0.0),
                      mb.advantages[row:row + 1], pad(mb.rollout_log_probs, 0.0), pad(mb.loss_weights, 0.0),
                      prompt_lengths=mb.prompt_lengths[row:row + 1], lengths=mb.lengths[row:row + 1])


def check(due: bool, micro_batches: list[MicroBatch],
          forward: Callable[[list[MicroBatch]], list[torch.Tensor]], pad_id: int, layout,
          holds_results: bool = True, length_multiple: int = 1) -> dict:
    """{KEY: max |Δ| over every DP rank's trained tokens} where `due` (the first step, with
    debug.check_batch_invariance on), else {}. `micro_batches` carry the first pass's
    old_log_probs; `forward` gives the per-token log-probs of a list of micro-batches (a collective on every rank of the layout; only where
    `holds_results`, train=megatron's last pipeline stage, does it return them)."""
    if not due:
        return {}
    extra = -(-EXTRA_PADDING // length_multiple) * length_multiple
    rows = [(mb, b) for mb in micro_batches for b, i in enumerate(mb.indices) if i >= 0]
    with torch.no_grad():
        recomputed = forward([alone(mb, b, pad_id, extra) for mb, b in rows])
    if not holds_results:
        return {}
    diffs = [torch.where(mb.mask[b] > 0, (lp[0, :mb.mask.shape[1]] - mb.old_log_probs[b]).abs(), 0.0).max()
             for (mb, b), lp in zip(rows, recomputed, strict=True)]
    local = torch.stack(diffs).max()  # (torch's max keeps a NaN)
    return {KEY: torch.tensor(dp_all_gather(local.item(), layout)).max().item()}
