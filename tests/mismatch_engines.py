"""Torch engines with one fault each, for tests/test_mismatch.py (`rollout._target_=tests.mismatch_engines.X`):
each makes the engine's log-probs differ from the trainer's through one factor of `relax mismatch`."""

from __future__ import annotations

import dataclasses

import torch

from relax.rollout.torch_base import TorchEngineBase
from relax.rollout.torch_engine import TorchEngine


class HotEngine(TorchEngine):
    """Samples (and reports log-probs) at temperature 0.7 whatever rollout.temperature says."""

    @staticmethod
    def _sample(logits, sp, uniforms):
        return TorchEngineBase._sample(logits, dataclasses.replace(sp, temperature=0.7), uniforms)


class LossyCacheEngine(TorchEngine):
    """Keeps its KV cache in bfloat16 (computing in float32): a decoded token reads rounded keys
    and values, a full forward does not."""

    def _forward(self, ids, cos, sin, cache, start, mask, record=None):
        logits = super()._forward(ids, cos, sin, cache, start, mask, record)
        end = start + ids.shape[1]
        for keys, values in cache:
            keys[:, :, start:end] = keys[:, :, start:end].bfloat16().float()
            values[:, :, start:end] = values[:, :, start:end].bfloat16().float()
        return logits


class BatchVariantEngine(TorchEngine):
    """Logits that depend on how many rows the batch has (exact for a row alone)."""

    def _forward(self, ids, cos, sin, cache, start, mask, record=None):
        logits = super()._forward(ids, cos, sin, cache, start, mask, record)
        return logits * (1 + 2e-3 * (ids.shape[0] - 1))
