"""The torch engine on transformers' own forward, for every architecture without a hand-written
one (relax/model/families/): sliding windows, soft-capping, scaled embeddings, LayerNorm with
biases, partial rotary, parallel blocks, MQA are whatever transformers computes for the model.

Sampling, seeds, GRPO prefix sharing and the `Generation` fields are relax/rollout/torch_base.py's;
only the forward differs: a transformers `DynamicCache` (which keeps each layer's window), left-padded
prompts with explicit position ids, and the last position's logits only.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.core_model_loading import revert_weight_conversion

from relax.model import load_causal_lm
from relax.model.invariant import invariant_ops
from relax.model.modules import hf_modules, recording
from relax.rollout.torch_base import TorchEngineBase


class TransformersEngine(TorchEngineBase):
    forward_name = "transformers' forward"

    def _load_model(self, model_path: Path) -> None:
        self.model = load_causal_lm(model_path, str(self.dtype).removeprefix("torch."),
                                    invariant=self.true_on_policy).eval().requires_grad_(False)
        self.scattered = self._scattered()
        # the forward's KV-cache argument: `cache` from transformers 5.24, `past_key_values` before (an
        # unknown keyword goes to **kwargs unread, and every decode step would see its token alone)
        accepted = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in accepted else "past_key_values"

    def _generate(self, prompts, sp, seed, first_index, done=None, until=None):
        with invariant_ops(self.true_on_policy):  # (left-padded rows: relax/model/invariant.py aligns their keys)
            return super()._generate(prompts, sp, seed, first_index, done, until)

    def weights(self) -> dict[str, torch.Tensor]:
        """The model's parameters (tied embeddings: one name, the embedding's)."""
        return dict(self.model.named_parameters())

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """By checkpoint name, as the trainer sends them: transformers loads some checkpoint tensors
        into other parameters (renamed, or an MoE's experts fused into one 3-D tensor) and its
        `revert_weight_conversion` names them back; a renamed tensor is the parameter itself."""
        params = self.weights()
        named = revert_weight_conversion(self.model, dict(params))
        for name, (param, index) in self.scattered.items():
            named[name] = params[param].reshape(-1)[index].view(named[name].shape)
        return named | dict(self.model.named_buffers())

    def _scattered(self) -> dict[str, tuple[str, torch.Tensor]]:
        """Checkpoint tensors that are copies, not views, of a parameter (a split of fused experts):
        name -> (parameter, flat indices into it), found by reverting each element's own index."""
        params = self.weights()
        storages = {p.untyped_storage().data_ptr() for p in params.values()}
        named = revert_weight_conversion(self.model, dict(params))
        copies = [n for n, t in named.items() if t.untyped_storage().data_ptr() not in storages]
        if not copies:
            return {}
        offsets, start = {}, 0
        for n, p in params.items():
            offsets[n], start = start, start + p.numel()
        probe = {n: torch.arange(offsets[n], offsets[n] + p.numel(), dtype=torch.float64).view(p.shape)
                 for n, p in params.items()}
        reverted = revert_weight_conversion(self.model, probe)
        out = {}
        for name in copies:
            flat = reverted[name].reshape(-1).long()
            param = next(n for n in params if offsets[n] <= int(flat[0]) < offsets[n] + params[n].numel())
            out[name] = (param, flat - offsets[param])
        return out

    def _write(self, name: str, tensor: torch.Tensor, targets: dict[str, torch.Tensor]) -> None:
        if name in self.scattered:
            param, index = self.scattered[name]
            self.weights()[param].view(-1).index_copy_(0, index, tensor.reshape(-1).to(self.dtype))
        else:
            targets[name].copy_(tensor)

    def shutdown(self) -> None:
        self.model = None

    def _logits(self, ids, valid, positions, cache) -> torch.Tensor:
        # without padding, no mask: transformers then builds none (causal attention as is)
        mask = None if valid is None else valid.long()
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                          **{self.cache_arg: cache}, use_cache=True, logits_to_keep=1).logits[:, -1].float()

    def _prefill(self, ids, valid, positions, N, row_of):
        U, P = ids.shape
        padded = not bool(valid[:, :P].all())
        # true on-policy: every layer keeps every key (its window is the mask's), so a key's index
        # in the cache is its position, as in the trainer's rows
        cache = DynamicCache() if self.true_on_policy else DynamicCache(config=self.model.config)
        logits = self._logits(ids, valid[:, :P] if padded else None, positions, cache)
        if U < len(row_of):
            logits = logits[row_of]
            cache.batch_select_indices(row_of)

        def decode(tokens, pos, t, valid):
            return self._logits(tokens, valid[:, :P + t + 1] if padded else None, pos, cache)
        return logits, decode

    @torch.inference_mode()
    def record_layers(self, sequences: list[list[int]]) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {}
        with invariant_ops(self.true_on_policy), recording(hf_modules(self.model), take=lambda t: t[0].detach().float().clone()) as outputs:
            for tokens in sequences:
                self.model(input_ids=torch.tensor([tokens]), use_cache=False)
                for name, tensor in outputs.items():
                    out.setdefault(name, []).append(tensor)
        return out
