"""The in-process torch rollout engine: batched sampling with a preallocated KV cache.

Why not `transformers.generate()`: for small models its per-step Python and cache
bookkeeping dominates; a direct Qwen2/Llama forward over a preallocated cache is 2-3x
faster (bench/rollout_speed.py) and gives the same greedy tokens. The engine owns its
weights by HF parameter name, loaded from the checkpoint's safetensors, exactly like an
inference server: the trainer pushes new weights in by name (`update_weights`).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tqdm.auto import tqdm

from relax.errors import ConfigError
from relax.model import read_hf_config, torch_dtype

ROTARY_CLASSES = {"qwen2": "Qwen2RotaryEmbedding", "llama": "LlamaRotaryEmbedding"}


@dataclass
class SamplingParams:
    temperature: float = 1.0   # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 8


@dataclass
class Generation:
    tokens: list[int]          # response tokens, stop token included when produced
    log_probs: list[float]     # log p(token) under logits / temperature, per token
    status: str                # completed | truncated


def load_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: no *.safetensors files to load")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def rms_norm(x, weight, eps):
    # Same arithmetic as HF's Qwen2RMSNorm/LlamaRMSNorm (fp32 statistics).
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchEngine:
    """Rollout engine interface: generate / update_weights / named_tensors / shutdown."""

    def __init__(self, model_path: Path, dtype: str, eos_token_ids: list[int], pad_token_id: int):
        hf = read_hf_config(model_path)
        if hf.get("model_type") not in ROTARY_CLASSES:
            raise ConfigError(f"rollout=torch runs dense Qwen2/Llama models; {model_path} is "
                              f"{hf.get('model_type')!r} (use rollout=sglang)")
        from transformers import AutoConfig

        self.config = AutoConfig.from_pretrained(str(model_path))
        c = self.config
        self.num_layers = c.num_hidden_layers
        self.num_heads, self.num_kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        self.eos = torch.tensor(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.dtype = torch_dtype(dtype)
        self.params = {k: v.to(self.dtype) for k, v in load_safetensors_dir(model_path).items()}
        if "lm_head.weight" not in self.params:  # tied embeddings: one tensor, two names
            self.params["lm_head.weight"] = self.params["model.embed_tokens.weight"]
        module = importlib.import_module(f"transformers.models.{c.model_type}.modeling_{c.model_type}")
        self.rotary = getattr(module, ROTARY_CLASSES[c.model_type])(c)
        if os.environ.get("RELAX_FAULT") == "engine_weights":  # test-only: a bad checkpoint load
            g = torch.Generator().manual_seed(0)
            for v in self.params.values():
                v.copy_(torch.randn(v.shape, generator=g).to(v.dtype) * v.float().std())

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
        for name, tensor in named.items():
            if name not in targets:
                raise KeyError(f"update_weights: the engine has no tensor named {name!r}")
            if targets[name].shape != tensor.shape:
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                                 f"the engine expects {tuple(targets[name].shape)}")
            targets[name].copy_(tensor)

    def shutdown(self) -> None:
        self.params.clear()

    # -- forward -----------------------------------------------------------------------
    def _forward(self, ids, positions, cache, start, mask):
        """Logits at the last position of `ids`; writes K/V into cache[start:start+T]."""
        p, B, T = self.params, ids.shape[0], ids.shape[1]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(ids, p["model.embed_tokens.weight"])
        cos, sin = self.rotary(x, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        end = start + T
        for i in range(self.num_layers):
            pre = f"model.layers.{i}."
            lin = lambda h, name: F.linear(h, p[pre + name + ".weight"], p.get(pre + name + ".bias"))  # noqa: E731
            h = rms_norm(x, p[pre + "input_layernorm.weight"], self.eps)
            q = lin(h, "self_attn.q_proj").view(B, T, H, D).transpose(1, 2)
            k = lin(h, "self_attn.k_proj").view(B, T, Hkv, D).transpose(1, 2)
            v = lin(h, "self_attn.v_proj").view(B, T, Hkv, D).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            keys, values = cache[i]
            keys[:, :, start:end], values[:, :, start:end] = k, v
            a = F.scaled_dot_product_attention(
                q, keys[:, :, :end], values[:, :, :end], attn_mask=mask,
                is_causal=mask is None and T > 1, enable_gqa=True)
            x = x + lin(a.transpose(1, 2).reshape(B, T, H * D), "self_attn.o_proj")
            h = rms_norm(x, p[pre + "post_attention_layernorm.weight"], self.eps)
            x = x + lin(F.silu(lin(h, "mlp.gate_proj")) * lin(h, "mlp.up_proj"), "mlp.down_proj")
        x = rms_norm(x[:, -1], p["model.norm.weight"], self.eps)
        return F.linear(x, p["lm_head.weight"]).float()

    @staticmethod
    def _sample(logits, sp: SamplingParams, generator):
        if sp.temperature == 0:
            token = logits.argmax(-1)
            return token, logits.log_softmax(-1).gather(-1, token[:, None])[:, 0]
        logp = (logits / sp.temperature).log_softmax(-1)
        probs = logp.exp()
        if sp.top_p < 1.0:
            sorted_p, order = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > sp.top_p
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0))
        token = torch.multinomial(probs, 1, generator=generator)[:, 0]
        return token, logp.gather(-1, token[:, None])[:, 0]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sp: SamplingParams, seed: int) -> list[Generation]:
        B, P, N = len(prompts), max(map(len, prompts)), sp.max_new_tokens
        ids = torch.full((B, P), self.pad_token_id, dtype=torch.long)
        valid = torch.zeros(B, P + N, dtype=torch.bool)
        for b, prompt in enumerate(prompts):  # left padding: every prompt ends at P-1
            ids[b, P - len(prompt):] = torch.tensor(prompt)
            valid[b, P - len(prompt):] = True
        padded = not bool(valid[:, :P].all())
        positions = (valid[:, :P].long().cumsum(-1) - 1).clamp(min=0)
        cache = [(torch.empty(B, self.num_kv_heads, P + N, self.head_dim, dtype=self.dtype),
                  torch.empty(B, self.num_kv_heads, P + N, self.head_dim, dtype=self.dtype))
                 for _ in range(self.num_layers)]
        mask = None
        if padded:  # causal + key padding; a pad query attends to itself to stay finite
            causal = torch.ones(P, P, dtype=torch.bool).tril()
            mask = (causal & valid[:, None, None, :P]) | torch.eye(P, dtype=torch.bool)
        logits = self._forward(ids, positions, cache, 0, mask)
        generator = torch.Generator().manual_seed(seed)
        out_tokens = torch.full((B, N), self.pad_token_id, dtype=torch.long)
        out_logp = torch.zeros(B, N)
        lengths = torch.zeros(B, dtype=torch.long)
        finished = torch.zeros(B, dtype=torch.bool)
        next_pos = positions[:, -1:] + 1
        for t in tqdm(range(N), desc="generate", leave=False, delay=2):
            token, logp = self._sample(logits, sp, generator)
            out_tokens[:, t] = token.masked_fill(finished, self.pad_token_id)
            out_logp[:, t] = logp.masked_fill(finished, 0.0)
            lengths += ~finished
            finished |= torch.isin(token, self.eos)
            if finished.all() or t == N - 1:
                break
            step_mask = valid[:, None, None, :P + t + 1] if padded else None
            logits = self._forward(out_tokens[:, t:t + 1], next_pos, cache, P + t, step_mask)
            next_pos = next_pos + 1
        return [
            Generation(out_tokens[b, :n].tolist(), out_logp[b, :n].tolist(),
                       "completed" if finished[b] else "truncated")
            for b, n in enumerate(lengths.tolist())
        ]
