"""Torch engines with one fault each, for tests/test_mismatch.py (`rollout._target_=tests.mismatch_engines.X`):
each makes the engine's log-probs differ from the trainer's through one factor of `relax mismatch`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from relax.model import load_tokenizer
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


class RerouteEngine(TorchEngine):
    """An MoE router that decides near-ties its own way: where a token's k-th and (k+1)-th
    experts' router probabilities are within 0.05, it runs the (k+1)-th instead (weighted by the
    router's probability of it) and records the experts it ran."""

    def _mlp(self, params, pre):
        moe = super()._mlp(params, pre)
        if pre + "gate.weight" not in params:
            return moe

        def rerouted(h):
            topk = torch.Tensor.topk
            torch.Tensor.topk = near_ties_swapped(topk)  # (the router's is the block's one top-k)
            try:
                return moe(h)
            finally:
                torch.Tensor.topk = topk
        return rerouted


def near_ties_swapped(topk, margin: float = 0.01):
    def swapped(probs, k, dim=-1):
        values, ranked = topk(probs, k + 1, dim=dim)
        near = values[..., k - 1] - values[..., k] < margin
        chosen = ranked[..., :k].clone()
        chosen[near, k - 1] = ranked[near, k]
        return probs.gather(dim, chosen), chosen
    return swapped


class TextPromptEngine(TorchEngine):
    """Takes its prompts as text: each call's prompt ids decoded and encoded again (a server fed
    the conversation as text). A multi-turn sample's later turns then read the earlier turns'
    text re-encoded, other ids than the trained ones wherever the model's ids were not the
    tokenizer's own encoding of their text."""

    def __init__(self, rollout, spec):
        super().__init__(rollout, spec)
        self.tokenizer = load_tokenizer(Path(spec.model_path))

    def generate(self, prompts, sp, seed, first_index=0):
        text = [self.tokenizer(self.tokenizer.decode(p), add_special_tokens=False)["input_ids"] for p in prompts]
        return super().generate(text, sp, seed, first_index)
