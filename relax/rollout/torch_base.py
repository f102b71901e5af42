"""The torch rollout engine's sampling loop, shared by its two forwards: the hand-written one
(relax/rollout/torch_engine.py) and transformers' own (relax/rollout/hf_engine.py). Batched
inverse-CDF sampling, one seed per sample, GRPO groups prefilled once, weights by HF name."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig

from relax import faults
from relax.errors import ConfigError
from relax.model import families, read_hf_config, torch_dtype
from relax.rollout import Generation, SamplingParams, engine_dtype, prompt_seeds
from relax.rollout.fingerprint import fingerprint
from relax.rollout.spec import EngineSpec
from relax.sample import log_prob_temperature

log = logging.getLogger(__name__)


class TorchEngineBase:
    """Rollout engine interface (relax/rollout/__init__.py). It runs on CPU (in the driver, or in
    a Ray actor), so it has no memory to release for rollout.colocate (refused at start-up).
    A forward provides `_load_model`, `weights`, `named_tensors`, `_prefill`, `record_layers`
    and `shutdown`."""
    forward_name = ""  # what the start-up log line says runs the model

    @staticmethod
    def check_config(rollout, model, algo, debug) -> None:
        r = rollout
        if r.true_on_policy and r.top_p < 1:
            raise ConfigError(f"rollout.true_on_policy=true with rollout.top_p={r.top_p} is refused: the trainer "
                              f"scores the whole softmax, so the engine must sample from it (rollout.top_p=1)")
        if r.true_on_policy and engine_dtype(r, model) != model.dtype:
            raise ConfigError(f"rollout.true_on_policy=true with rollout.dtype={r.dtype} is refused: engine and "
                              f"trainer compute in one dtype (model.dtype={model.dtype}); leave rollout.dtype null")

    def __init__(self, rollout, spec: EngineSpec):
        if rollout.rollout_num_gpus > 1:
            log.info("rollout=torch runs on CPU; rollout_num_gpus=%d is used by GPU engines",
                     rollout.rollout_num_gpus)
        model_path = Path(spec.model_path)

        self.support = families.check(read_hf_config(model_path), f"{model_path}/config.json")
        self.config = AutoConfig.from_pretrained(str(model_path))
        self.num_layers = self.config.num_hidden_layers
        self.eos = torch.tensor(spec.eos_token_ids, dtype=torch.long)
        self.pad_token_id = spec.pad_token_id
        self.dtype = torch_dtype(spec.dtype)
        self.true_on_policy = rollout.true_on_policy
        self.routes: list[list[torch.Tensor]] | None = None  # while generating an MoE model: per
        # MoE layer, each forward's top-k expert ids ([rows, top_k], rows as flattened [B, T])
        self.num_moe_layers = 0
        self._load_model(model_path)
        log.info("rollout=torch: %s on %s", self.support.architecture, self.forward_name)
        if faults.active("engine_weights"):  # a bad checkpoint load
            g = torch.Generator().manual_seed(0)
            for v in self.weights().values():
                v.copy_(torch.randn(v.shape, generator=g).to(v.dtype) * v.float().std())

    def update_weights(self, named: dict[str, torch.Tensor]) -> None:
        targets = self.named_tensors()
        named = faults.skip_sync(faults.perturb_sync(named))
        if faults.active("drop_buffer"):  # a buffer lost, as release_memory_occupation can do
            for name in targets:
                if name.endswith("inv_freq"):
                    targets[name].zero_()
        for name, tensor in named.items():
            if name not in targets:
                raise KeyError(f"update_weights: the engine has no tensor named {name!r}")
            if targets[name].shape != tensor.shape:
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                                 f"the engine expects {tuple(targets[name].shape)}")
            self._write(name, tensor, targets)

    def _write(self, name: str, tensor: torch.Tensor, targets: dict[str, torch.Tensor]) -> None:
        targets[name].copy_(tensor)

    def weight_fingerprints(self, names: list[str], salt: int) -> dict:
        """The weight-sync check's sample of `names`, from what the forward computes with."""
        return fingerprint(self.named_tensors(), names, salt)

    @staticmethod
    def _sample(logits, sp: SamplingParams, uniforms):
        """One token per row by inverse CDF at that row's own uniform draw: a sample depends on
        its seed and its logits only, never on which other rows share the batch."""
        logp = (logits / log_prob_temperature(sp.temperature)).log_softmax(-1)
        if sp.temperature == 0:
            token = logits.argmax(-1)
            return token, logp.gather(-1, token[:, None])[:, 0]
        probs = logp.exp()
        if sp.top_p < 1.0:
            sorted_p, order = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > sp.top_p
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0))
        cdf = probs.cumsum(-1)
        token = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True)[:, 0]
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)  # u*total rounded up
        token = torch.minimum(token, last)
        return token, logp.gather(-1, token[:, None])[:, 0]

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], sp: SamplingParams, seed: int | list[int],
                 first_index: int = 0, done: list[int] | None = None,
                 until: tuple[list[int], int] | None = None) -> list[Generation]:
        """Sample `prompts[i]` with its own seed (see prompt_seeds); for an MoE model, with the
        top-k experts every fed token was routed to (Generation.routed_experts). Partial rollouts
        (relax/rollout/partial.py): `done[i]` response tokens already end prompts[i] (it goes on
        at their seed's draw done[i], within max_new_tokens in all); `until=(groups, enough)`
        stops decoding once `enough` of the groups (groups[i]: prompt i's) have every prompt
        finished, the unfinished ones returned `aborted` with what they have."""
        self.routes = [[] for _ in range(self.num_moe_layers)] if self.num_moe_layers else None
        try:
            generations, row_of = self._generate(prompts, sp, seed, first_index, done, until)
            if self.routes is not None:
                routed = self._routed_experts(prompts, row_of, generations)
                for generation, experts in zip(generations, routed, strict=True):
                    generation.routed_experts = experts
            return generations
        finally:
            self.routes = None

    def _routed_experts(self, prompts: list[list[int]], row_of: torch.Tensor,
                        generations: list[Generation]) -> list[list[int]]:
        """Per sample, its prompt's routing from the prefill (left padding cut off; a group's rows
        share it) and its response's from the decode steps that fed its tokens (not the last
        one, which nothing fed), flattened [len(prompt) + len(response) - 1, layers, top_k]."""
        prefill = torch.stack([forwards[0].view(len(set(row_of.tolist())), -1, forwards[0].shape[-1])
                               for forwards in self.routes], dim=2)  # [U, P, layers, top_k]
        decode = torch.stack([torch.stack(forwards[1:], dim=1) if len(forwards) > 1
                              else prefill.new_empty(len(prompts), 0, prefill.shape[-1])
                              for forwards in self.routes], dim=2)  # [B, steps, layers, top_k]
        return [torch.cat([prefill[row_of[b], prefill.shape[1] - len(p):],
                           decode[b, :len(g.tokens) - 1]]).flatten().tolist()
                for b, (p, g) in enumerate(zip(prompts, generations, strict=True))]

    def _generate(self, prompts: list[list[int]], sp: SamplingParams, seed: int | list[int],
                  first_index: int, done: list[int] | None = None,
                  until: tuple[list[int], int] | None = None) -> tuple[list[Generation], torch.Tensor]:
        B, P, N = len(prompts), max(map(len, prompts)), sp.max_new_tokens
        done = torch.tensor(done if done is not None else [0] * B, dtype=torch.long)
        # Identical prompts (a GRPO group) are prefilled once and their KV cache shared.
        unique: dict[tuple, int] = {}
        row_of = torch.tensor([unique.setdefault(tuple(p), len(unique)) for p in prompts])
        # Left padding: every prompt ends at P-1, so all rows decode in lock step.
        ids = torch.tensor([[self.pad_token_id] * (P - len(p)) + list(p) for p in unique])
        prompt_lens = torch.tensor([len(p) for p in unique])
        valid = torch.ones(len(unique), P + N, dtype=torch.bool)
        valid[:, :P] = torch.arange(P)[None] >= (P - prompt_lens)[:, None]
        positions = (valid[:, :P].long().cumsum(-1) - 1).clamp(min=0)
        logits, decode = self._prefill(ids, valid, positions, N, row_of)
        if len(unique) < B:  # fan the shared prefixes out to one row per sample
            valid, positions = valid[row_of], positions[row_of]

        # a response's t-th token draws its seed's t-th uniform, wherever the call that samples it starts
        uniforms = torch.stack([torch.rand(N, generator=torch.Generator().manual_seed(s))
                                for s in prompt_seeds(seed, B, first_index)])
        uniforms = torch.nn.functional.pad(uniforms, (0, N)).gather(1, done[:, None] + torch.arange(N))
        out_tokens = torch.full((B, N), self.pad_token_id, dtype=torch.long)
        out_logp = torch.zeros(B, N)
        response_lens = torch.zeros(B, dtype=torch.long)
        stopped = torch.zeros(B, dtype=torch.bool)  # by a stop token
        finished = done >= N  # stopped, or at max_new_tokens
        groups = torch.tensor(until[0]) if until else None
        next_pos = positions[:, -1:] + 1
        for t in tqdm(range(N), desc="generate", leave=False, delay=2, disable=None):
            token, logp = self._sample(logits, sp, uniforms[:, t])
            out_tokens[:, t] = token.masked_fill(finished, self.pad_token_id)
            out_logp[:, t] = logp.masked_fill(finished, 0.0)
            response_lens += ~finished
            stopped |= ~finished & (token[:, None] == self.eos).any(-1)
            finished |= stopped | (done + response_lens >= N)
            if finished.all() or t == N - 1 or (until and complete_groups(groups, finished) >= until[1]):
                break
            logits = decode(out_tokens[:, t:t + 1], next_pos, t, valid)
            next_pos = next_pos + 1
        return [
            Generation(out_tokens[b, :n].tolist(), out_logp[b, :n].tolist(),
                       "completed" if stopped[b] else "truncated" if finished[b] else "aborted")
            for b, n in enumerate(response_lens.tolist())
        ], row_of


def complete_groups(groups: torch.Tensor, finished: torch.Tensor) -> int:
    """How many of the groups (groups[i]: row i's) have every row finished."""
    unfinished = torch.zeros(int(groups.max()) + 1).index_add_(0, groups, (~finished).float())
    present = torch.zeros_like(unfinished).index_add_(0, groups, torch.ones(len(groups)))
    return int(((unfinished == 0) & (present > 0)).sum())
