"""The in-process torch rollout engine: batched sampling with a preallocated KV cache.

The families of relax/model/families/ run on a hand-written forward over a preallocated
cache (faster than `transformers.generate()`, the same greedy tokens: docs/results.md);
every other architecture transformers implements runs on transformers' own forward
(relax/rollout/hf_engine.py), chosen when the engine is built. Either way the engine owns
its weights by HF parameter name, loaded from the checkpoint's safetensors like an inference
server, and the trainer pushes new weights in by name (`update_weights`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from relax import faults
from relax.model import families, load_safetensors_dir, read_hf_config
from relax.rollout.hf_engine import TransformersEngine
from relax.rollout.spec import EngineSpec
from relax.rollout.torch_base import TorchEngineBase



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


class TorchEngine(TorchEngineBase):
    """The hand-written forward over a preallocated cache (relax/rollout/torch_base.py: the rest)."""
    forward_name = "the hand-written forward"

    def __new__(cls, rollout, spec: EngineSpec, *args, **kwargs):
        """TorchEngine builds the hand-written forward where the model's family has one, else
        transformers' (hf_engine.TransformersEngine, which `rollout._target_` can also name), as
        under rollout.true_on_policy: the trainer's forward, batch-invariant."""
        if cls is TorchEngine and (rollout.true_on_policy
                                   or families.check(read_hf_config(spec.model_path)).family is None):
            return TransformersEngine(rollout, spec, *args, **kwargs)  # (not a TorchEngine: built here)
        return super().__new__(cls)

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
