"""The in-process torch rollout engine: batched sampling with a preallocated KV cache.

The families of relax/model/families/ run on a hand-written forward over a preallocated
cache (faster than `transformers.generate()`, the same greedy tokens: docs/results.md);
every other architecture transformers implements runs on transformers' own forward
(relax/rollout/hf_engine.py), chosen when the engine is built. Either way the engine owns
its weights by HF parameter name, loaded from the checkpoint's safetensors like an inference
server, and the trainer pushes new weights in by name (`update_weights`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from relax import faults
from relax.model import families, load_safetensors_dir, read_hf_config, torch_dtype
from relax.rollout import Generation, SamplingParams, engine_dtype, prompt_seeds
from relax.sample import log_prob_temperature

log = logging.getLogger(__name__)



class Layer(NamedTuple):
    """One decoder layer's tensors (views into the engine's HF-named parameters)."""
    input_norm: torch.Tensor
    qkv: torch.Tensor               # [q; k; v] fused
    qkv_bias: torch.Tensor | None
    qk_norm: tuple | None           # (q_norm, k_norm) weights, each [head_dim] (Qwen3)
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    mlp: Callable                   # normed hidden states -> MLP output (dense or MoE)


def rms_norm(x, weight, eps):
    # Same arithmetic as HF's Qwen2RMSNorm/LlamaRMSNorm (fp32 statistics).
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def apply_rope(x, cos, signed_sin):
    """HF's `x * cos + rotate_half(x) * sin` in three ops: rotate_half(x) * sin equals
    x.roll(D/2) * [-sin_1, sin_2] (sign folded into `signed_sin`)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class TorchEngine:
    """Rollout engine interface (relax/rollout/__init__.py). It runs on CPU (in the driver, or in
    a Ray actor), so it has no memory to release for rollout.colocate (refused at start-up)."""

    def __new__(cls, cfg, model_path: Path, *args, **kwargs):
        """TorchEngine builds the hand-written forward where the model's family has one, else
        transformers' (hf_engine.TransformersEngine, which `rollout._target_` can also name)."""
        if cls is TorchEngine and families.check(read_hf_config(model_path)).family is None:
            from relax.rollout.hf_engine import TransformersEngine

            cls = TransformersEngine
        return super().__new__(cls)

    def __init__(self, cfg, model_path: Path, eos_token_ids: list[int], pad_token_id: int):
        if cfg.rollout.rollout_num_gpus > 1:
            log.info("rollout=torch runs on CPU; rollout_num_gpus=%d is used by GPU engines",
                     cfg.rollout.rollout_num_gpus)
        from transformers import AutoConfig

        self.support = families.check(read_hf_config(model_path), f"{model_path}/config.json")
        self.config = AutoConfig.from_pretrained(str(model_path))
        self.num_layers = self.config.num_hidden_layers
        self.eos = torch.tensor(eos_token_ids, dtype=torch.long)
        self.pad_token_id = pad_token_id
        self.dtype = torch_dtype(engine_dtype(cfg))
        self.routes: list[list[torch.Tensor]] | None = None  # while generating an MoE model: per
        # MoE layer, each forward's top-k expert ids ([rows, top_k], rows as flattened [B, T])
        self.num_moe_layers = 0
        self._load_model(model_path)
        log.info("rollout=torch: %s on %s", self.support.architecture, self.forward_name)
        if faults.active("engine_weights"):  # a bad checkpoint load
            g = torch.Generator().manual_seed(0)
            for v in self.weights().values():
                v.copy_(torch.randn(v.shape, generator=g).to(v.dtype) * v.float().std())

    forward_name = "the hand-written forward"

    def _load_model(self, model_path: Path) -> None:
        c = self.config
        self.num_heads, self.num_kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = families.head_dim(c.to_dict())
        self.eps = c.rms_norm_eps
        self.rotary = families.hf_rotary(c)
        if faults.active("engine_rope_theta"):  # the engine's RoPE frequencies of twice the theta
            d = self.rotary.inv_freq.numel()
            theta = self.rotary.inv_freq[1].log() / (-1 / d)  # inv_freq[i] = theta^(-i/d)
            self.rotary.inv_freq.copy_((2 * theta.exp()) ** (-torch.arange(d) / d))
        self.params = self._load(load_safetensors_dir(model_path))

    def weights(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors as the engine holds them, by HF name (no buffers)."""
        return self.params

    def _load(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF-named tensors, where q/k/v and gate/up are views into one fused tensor each
        (one matmul instead of three/two). Weight updates by HF name write into the fused
        storage, so what `named_tensors()` shows is exactly what the forward computes with."""
        params = {k: v.to(self.dtype) for k, v in weights.items()}
        self.layers = []
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            qkv = [pre + f"self_attn.{x}_proj" for x in "qkv"]
            fused_qkv = self._fuse(params, [n + ".weight" for n in qkv])
            if faults.active(f"qkv_half_transposed:{i}"):  # a conversion that put q's two halves back swapped
                q = params[qkv[0] + ".weight"]
                q.copy_(q.roll(q.shape[0] // 2, dims=0))
            fused_bias = self._fuse(params, [n + ".bias" for n in qkv]) \
                if qkv[0] + ".bias" in params else None
            qk_norm = (params[pre + "self_attn.q_norm.weight"], params[pre + "self_attn.k_norm.weight"]) \
                if pre + "self_attn.q_norm.weight" in params else None
            self.layers.append(Layer(
                params[pre + "input_layernorm.weight"], fused_qkv, fused_bias, qk_norm,
                params[pre + "self_attn.o_proj.weight"], params[pre + "post_attention_layernorm.weight"],
                self._mlp(params, pre + "mlp.")))
        if "lm_head.weight" not in params:  # tied embeddings: one tensor, two names
            params["lm_head.weight"] = params["model.embed_tokens.weight"]
        return params

    def _mlp(self, params, pre):
        """The layer's MLP as a function of the normed hidden states: SwiGLU, or an MoE block
        (softmax router, top-k experts, optional gated shared expert: Qwen2-MoE, Qwen3-MoE)."""
        def swiglu(gate_up, down):
            def forward(h):
                gate, up = F.linear(h, gate_up).chunk(2, dim=-1)
                return F.linear(F.silu(gate) * up, down)
            return forward

        def fused(prefix):
            return self._fuse(params, [prefix + "gate_proj.weight", prefix + "up_proj.weight"])

        if pre + "gate.weight" not in params:  # dense
            return swiglu(fused(pre), params[pre + "down_proj.weight"])
        router, c, moe_layer = params[pre + "gate.weight"], self.config, self.num_moe_layers
        self.num_moe_layers += 1
        experts = [swiglu(fused(f"{pre}experts.{e}."), params[f"{pre}experts.{e}.down_proj.weight"])
                   for e in range(c.num_experts)]
        shared = None
        if params.get(pre + "shared_expert.down_proj.weight", torch.empty(0)).numel():
            shared = swiglu(fused(pre + "shared_expert."), params[pre + "shared_expert.down_proj.weight"])

        def moe(h):
            x = h.reshape(-1, h.shape[-1])
            weights, chosen = F.linear(x, router).softmax(-1, dtype=torch.float32).topk(
                c.num_experts_per_tok, dim=-1)
            if c.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            if self.routes is not None:
                self.routes[moe_layer].append(chosen)
            out = torch.zeros_like(x)
            for e, expert in enumerate(experts):
                rows, slot = (chosen == e).nonzero(as_tuple=True)
                if rows.numel():
                    out.index_add_(0, rows, expert(x[rows]) * weights[rows, slot, None].to(x.dtype))
            if shared is not None:
                out = out + torch.sigmoid(F.linear(x, params[pre + "shared_expert_gate.weight"])) * shared(x)
            return out.view_as(h)
        return moe

    @staticmethod
    def _fuse(params, names):
        fused = torch.cat([params[n] for n in names])
        offset = 0
        for n in names:
            rows = params[n].shape[0]
            params[n] = fused[offset:offset + rows]
            offset += rows
        return fused

    # -- weights -----------------------------------------------------------------------
    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the engine computes with: parameters and buffers, by HF name."""
        out = dict(self.params)
        if self.config.tie_word_embeddings:
            out.pop("lm_head.weight")
        out["model.rotary_emb.inv_freq"] = self.rotary.inv_freq
        return out

    def update_weights(self, named: dict[str, torch.Tensor]) -> None:
        targets = self.named_tensors()
        named = faults.perturb_sync(named)
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

    def shutdown(self) -> None:
        self.params.clear()
        self.layers.clear()

    # -- forward -----------------------------------------------------------------------
    def _forward(self, ids, cos, sin, cache, start, mask, record=None):
        """Logits at the last position of `ids`; writes K/V into cache[start:start+T].
        cos/sin: [B, T, 1, D] rotary tables at each token's position (sin sign-folded).
        `record(name, tensor)`, where given, receives every module output of
        relax.train.layer_dump.module_names (the final norm at every position)."""
        B, T = ids.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        record = record or (lambda name, tensor: None)
        x = F.embedding(ids, self.params["model.embed_tokens.weight"])
        record("model.embed_tokens", x)
        end = start + T
        for i, (layer, (keys, values)) in enumerate(zip(self.layers, cache)):
            qk, v = F.linear(rms_norm(x, layer.input_norm, self.eps), layer.qkv, layer.qkv_bias).split(
                [(H + Hkv) * D, Hkv * D], dim=-1)
            qk = qk.view(B, T, H + Hkv, D)
            if layer.qk_norm is not None:  # each head normed with q_norm or k_norm
                q_norm, k_norm = layer.qk_norm
                qk = rms_norm(qk, torch.cat([q_norm.expand(H, D), k_norm.expand(Hkv, D)]), self.eps)
            qk = apply_rope(qk, cos, sin).transpose(1, 2)
            q, keys[:, :, start:end] = qk[:, :H], qk[:, H:]
            values[:, :, start:end] = v.view(B, T, Hkv, D).transpose(1, 2)
            a = F.scaled_dot_product_attention(
                q, keys[:, :, :end], values[:, :, :end], attn_mask=mask,
                is_causal=mask is None and T > 1, enable_gqa=True)
            attn = F.linear(a.transpose(1, 2).reshape(B, T, H * D), layer.o_proj)
            record(f"model.layers.{i}.self_attn", attn)
            x = x + attn
            mlp = layer.mlp(rms_norm(x, layer.post_norm, self.eps))
            record(f"model.layers.{i}.mlp", mlp)
            x = x + mlp
            record(f"model.layers.{i}", x)
        record("model.norm", rms_norm(x, self.params["model.norm.weight"], self.eps))
        x = rms_norm(x[:, -1], self.params["model.norm.weight"], self.eps)
        return F.linear(x, self.params["lm_head.weight"]).float()

    @torch.inference_mode()
    def record_layers(self, sequences: list[list[int]]) -> dict[str, list[torch.Tensor]]:
        """debug.dump_layers: each sequence (prompt + response) prefilled alone, every module
        output of relax.train.layer_dump.module_names recorded ([len, hidden] fp32 per sequence)."""
        out: dict[str, list[torch.Tensor]] = {}
        cos_table, sin_table = self.rotary(torch.empty(0, dtype=self.dtype),
                                           torch.arange(max(map(len, sequences)))[None])
        sin_table = sin_table.clone()
        sin_table[..., :self.head_dim // 2] *= -1
        for tokens in sequences:
            T = len(tokens)
            cache = [(torch.empty(1, self.num_kv_heads, T, self.head_dim, dtype=self.dtype),
                      torch.empty(1, self.num_kv_heads, T, self.head_dim, dtype=self.dtype))
                     for _ in range(self.num_layers)]
            self._forward(torch.tensor([tokens]), cos_table[:, :T, None], sin_table[:, :T, None], cache, 0,
                          None, lambda name, t: out.setdefault(name, []).append(t[0].float().clone()))
        return out

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
                 first_index: int = 0) -> list[Generation]:
        """Sample `prompts[i]` with its own seed (see prompt_seeds); for an MoE model, with the
        top-k experts every fed token was routed to (Generation.routed_experts)."""
        self.routes = [[] for _ in range(self.num_moe_layers)] if self.num_moe_layers else None
        try:
            generations, row_of = self._generate(prompts, sp, seed, first_index)
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

    def _prefill(self, ids, valid, positions, N, row_of):
        """Prefill the distinct left-padded prompts `ids` [U, P] (`valid`: [U, P + N] which
        positions hold tokens; `positions`: [U, P] their position ids), their cache fanned out
        to one row per sample (`row_of`). Returns the last position's logits [B, V] and
        `decode(tokens [B, 1], positions [B, 1], t, valid [B, P + N])`, the next step's logits."""
        U, P = ids.shape
        padded = not bool(valid[:, :P].all())
        cos_table, sin_table = self.rotary(torch.empty(0, dtype=self.dtype), torch.arange(P + N)[None])
        cos_table, sin_table = cos_table[0], sin_table[0].clone()
        sin_table[:, :self.head_dim // 2] *= -1
        rope = lambda pos: (cos_table[pos].unsqueeze(2), sin_table[pos].unsqueeze(2))  # noqa: E731
        cache = [(torch.empty(U, self.num_kv_heads, P + N, self.head_dim, dtype=self.dtype),
                  torch.empty(U, self.num_kv_heads, P + N, self.head_dim, dtype=self.dtype))
                 for _ in range(self.num_layers)]
        mask = None
        if padded:  # causal + key padding; a pad query attends to itself to stay finite
            causal = torch.ones(P, P, dtype=torch.bool).tril()
            mask = (causal & valid[:, None, None, :P]) | torch.eye(P, dtype=torch.bool)
        logits = self._forward(ids, *rope(positions), cache, 0, mask)
        if U < len(row_of):
            logits = logits[row_of]
            cache = [(k[row_of], v[row_of]) for k, v in cache]

        def decode(tokens, pos, t, valid):
            step_mask = valid[:, None, None, :P + t + 1] if padded else None
            return self._forward(tokens, *rope(pos), cache, P + t, step_mask)
        return logits, decode

    def _generate(self, prompts: list[list[int]], sp: SamplingParams, seed: int | list[int],
                  first_index: int) -> tuple[list[Generation], torch.Tensor]:
        B, P, N = len(prompts), max(map(len, prompts)), sp.max_new_tokens
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

        uniforms = torch.stack([torch.rand(N, generator=torch.Generator().manual_seed(s))
                                for s in prompt_seeds(seed, B, first_index)])
        out_tokens = torch.full((B, N), self.pad_token_id, dtype=torch.long)
        out_logp = torch.zeros(B, N)
        response_lens = torch.zeros(B, dtype=torch.long)
        finished = torch.zeros(B, dtype=torch.bool)
        next_pos = positions[:, -1:] + 1
        for t in tqdm(range(N), desc="generate", leave=False, delay=2, disable=None):
            token, logp = self._sample(logits, sp, uniforms[:, t])
            out_tokens[:, t] = token.masked_fill(finished, self.pad_token_id)
            out_logp[:, t] = logp.masked_fill(finished, 0.0)
            response_lens += ~finished
            finished |= (token[:, None] == self.eos).any(-1)
            if finished.all() or t == N - 1:
                break
            logits = decode(out_tokens[:, t:t + 1], next_pos, t, valid)
            next_pos = next_pos + 1
        return [
            Generation(out_tokens[b, :n].tolist(), out_logp[b, :n].tolist(),
                       "completed" if finished[b] else "truncated")
            for b, n in enumerate(response_lens.tolist())
        ], row_of
