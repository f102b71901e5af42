"""The scoring behind `relax mismatch` (relax/tools/mismatch.py): a rollout's trained tokens
teacher-forced through the run's torch engine (its prefill and KV-cache decode, in its batch or
each sample alone, or the batch prefilled again at every position) and through transformers'
full forward (its own MoE routing, or the engine's replayed), as per-token log-probs under a
temperature (and top-p renormalisation)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from omegaconf import OmegaConf, open_dict

from relax.model import load_causal_lm
from relax.model.invariant import invariant_ops
from relax.rollout.torch_base import TorchEngineBase
from relax.rollout.torch_engine import TorchEngine
from relax.targets import load_target
from relax.train import routing


def token_log_probs(logits, tokens, temperature: float, top_p: float = 1.0):
    """log p(token) under logits / temperature; with top_p < 1, renormalised over the nucleus
    (what an engine that reports the processed distribution's log-probs gives)."""
    logp = (logits / temperature).log_softmax(-1)
    out = logp.gather(-1, tokens[:, None])[:, 0]
    if top_p < 1.0:
        sorted_p, _ = logp.exp().sort(-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) <= top_p
        out = out - torch.where(keep, sorted_p, 0).sum(-1).log()
    return out


def torch_inference(fn):
    def wrapped(*args, **kwargs):
        with torch.inference_mode():
            return fn(*args, **kwargs)
    return wrapped


class Scorer:
    """Each variant's per-token log-probs of the trained tokens, one flat tensor per variant."""

    def __init__(self, rollout, spec, rows, tokenizer):
        """`rollout`, `spec`: the run's rollout group and EngineSpec, from which each engine is
        rebuilt; `rows`: dicts with tokens (prompt + response) and loss_mask (per response token)."""
        self.rollout, self.spec, self.tokenizer = rollout, spec, tokenizer
        self.stand_in: str | None = None  # why the run's engine class is not the one rebuilt
        self.prompts = [r["tokens"][:len(r["tokens"]) - len(r["loss_mask"])] for r in rows]
        self.responses = [r["tokens"][len(p):] for p, r in zip(self.prompts, rows, strict=True)]
        self.masks = [r["loss_mask"] for r in rows]
        self._models: dict = {}

    def _flat(self, per_sample):
        return torch.cat([lp[torch.tensor(m, dtype=torch.bool)] for lp, m in zip(per_sample, self.masks, strict=True)])

    def engine(self, path: Path, dtype: str | None = None):
        rollout = OmegaConf.create(OmegaConf.to_container(self.rollout))
        with open_dict(rollout):
            rollout.rollout_num_gpus = 1
        try:
            cls = load_target(rollout, "rollout")
        except Exception as e:  # noqa: BLE001 - a class this machine cannot import: the stock engine
            cls, self.stand_in = TorchEngine, f"rollout._target_ does not import here ({e}): the torch engine stands in"
        if not (isinstance(cls, type) and issubclass(cls, TorchEngineBase)):
            cls, self.stand_in = TorchEngine, f"rollout._target_={rollout._target_}: the torch engine stands in"
        return cls(rollout, dataclasses.replace(self.spec, model_path=str(path), dtype=dtype or self.spec.dtype))

    def decode(self, engine, variants: dict, alone: bool = False, recompute: bool = False) -> dict:
        """Teacher-forced through the engine's own prefill and KV-cache decode, the samples in one
        batch as the engine generated them (left-padded, a GRPO group's prompt prefilled once),
        or each alone. `variants`: name -> (temperature, top_p). Returns name -> flat tensor."""
        if alone:
            parts = [self._decode(engine, [i], variants) for i in range(len(self.prompts))]
            return {k: torch.cat([p[k] for p in parts]) for k in variants}
        return self._decode(engine, list(range(len(self.prompts))), variants, recompute)

    @torch_inference
    def _decode(self, engine, which: list[int], variants: dict, recompute: bool = False) -> dict:
        """`recompute`: no KV cache: at each step the batch's prompts and responses so far
        prefilled again (the same rows and padding), the engine's own forward over all of it."""
        prompts = [self.prompts[i] for i in which]
        responses = [self.responses[i] for i in which]
        pad = engine.pad_token_id
        B, P = len(prompts), max(map(len, prompts))
        N = max(max(map(len, responses)), int(self.rollout.max_new_tokens))
        unique: dict[tuple, int] = {}
        row_of = torch.tensor([unique.setdefault(tuple(p), len(unique)) for p in prompts])
        ids = torch.tensor([[pad] * (P - len(p)) + list(p) for p in unique])
        lens = torch.tensor([len(p) for p in unique])
        valid = torch.ones(len(unique), P + N, dtype=torch.bool)
        valid[:, :P] = torch.arange(P)[None] >= (P - lens)[:, None]
        positions = (valid[:, :P].long().cumsum(-1) - 1).clamp(min=0)
        steps = max(map(len, responses))
        forced = torch.tensor([r + [pad] * (steps - len(r)) for r in responses])
        out = {k: torch.zeros(B, steps) for k in variants}
        with invariant_ops(getattr(engine, "true_on_policy", False)):
            logits, decode = engine._prefill(ids, valid, positions, N, row_of)
            valid_b, positions_b = valid[row_of], positions[row_of]
            if len(unique) < B:
                valid, positions = valid_b, positions_b
            next_pos = positions[:, -1:] + 1
            for t in range(steps):
                for k, (temperature, top_p) in variants.items():
                    out[k][:, t] = token_log_probs(logits.float(), forced[:, t], temperature, top_p)
                if t == steps - 1:
                    break
                if recompute:
                    seq = torch.cat([ids[row_of], forced[:, :t + 1]], 1)
                    seen = torch.cat([valid_b[:, :P + t + 1], torch.ones(B, 1, dtype=torch.bool)], 1)
                    pos = (seen[:, :P + t + 1].long().cumsum(-1) - 1).clamp(min=0)
                    logits, _ = engine._prefill(seq, seen, pos, 1, torch.arange(B))
                else:
                    logits = decode(forced[:, t:t + 1], next_pos, t, valid)
                next_pos = next_pos + 1
        return {k: self._flat_of(which, v) for k, v in out.items()}

    def _flat_of(self, which, table):
        return torch.cat([table[b, :len(self.responses[i])][torch.tensor(self.masks[i], dtype=torch.bool)]
                          for b, i in enumerate(which)])

    def model(self, path: Path, dtype: str):
        """transformers' model of `path` in `dtype` (the torch trainer's forward), loaded once."""
        key = (str(path), dtype)
        if key not in self._models:
            self._models[key] = load_causal_lm(Path(path), dtype).eval()
        return self._models[key]

    @torch_inference
    def full_forward(self, path: Path, dtype: str, temperature: float, experts: list | None = None):
        """One full forward per sample (transformers' model, as the torch trainer runs it).
        `experts`: per sample, routing to replay (Sample.routed_experts' layout: every fed token
        routed to them, as algo.routing_replay=rollout does). Returns the flat log-probs and the
        [2] (token, layer) pairs where the model's own routers chose `experts`' top-k, and those
        compared (zeros: a dense model, or no `experts`)."""
        model = self.model(path, dtype)
        out, agree = [], torch.zeros(2)
        for b, (p, r) in enumerate(zip(self.prompts, self.responses, strict=True)):
            tokens = p + r
            replay = None
            if experts is not None:
                replay = torch.full((len(tokens), len(experts[b]) // (len(tokens) - 1)), -1, dtype=torch.long)
                replay[:-1] = torch.tensor(experts[b]).view(len(tokens) - 1, -1)
            fed = routing.unpacked_fed([len(tokens)], len(tokens))
            with routing.routed(model, fed, len(tokens), replay) as record:
                logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, len(p) - 1:-1].float()
            if record is not None and replay is not None:
                agree += routing.agreement_sums(record.own[:-1], replay[:-1]).sum(-1)
            out.append(token_log_probs(logits, torch.tensor(r), temperature))
        return self._flat(out), agree
