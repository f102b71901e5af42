"""HF <-> Megatron-core parameter conversion for every family of relax/model/families/
(Llama, Qwen2, Qwen3, Mistral, SmolLM3 dense; Qwen2-MoE with its gated shared expert, Qwen3-MoE;
Mixtral and Phi-3 under Llama's names through `CheckpointNames`).

How it works in detail: docs/backends.md, "Inside `relax/train/megatron/convert.py`".
"""

from __future__ import annotations

import re

import torch

from relax import faults

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
RENAMES = {  # Megatron (within a layer) -> HF (within a layer)
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",  # LayerNorm's (StarCoder2), as the biases below
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "pre_mlp_layernorm.bias": "post_attention_layernorm.bias",
    "mlp.linear_fc1.weight": "mlp.up_proj.weight",  # a non-gated MLP's (gated: FC1)
    "mlp.linear_fc1.bias": "mlp.up_proj.bias",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",  # Qwen3's per-head q/k norm
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
FC1 = {"mlp.linear_fc1.weight": "mlp.", "mlp.shared_experts.linear_fc1.weight": "mlp.shared_expert."}
TOP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
       "decoder.final_layernorm.weight": "model.norm.weight",
       "decoder.final_layernorm.bias": "model.norm.bias",
       "output_layer.weight": "lm_head.weight"}


def checkpoint_renames(family) -> tuple[list, list]:
    """(to Llama's names, to the checkpoint's): (pattern, replacement) pairs over a layer's
    checkpoint names, from `family.checkpoint_names` (Llama's -> the checkpoint's, `{e}` an
    expert's index). The conversion below speaks Llama's names; Weights renames on the way in
    and out."""
    def pattern(template: str) -> str:
        return r"^(model\.layers\.\d+\.)" + re.escape(template).replace(r"\{e\}", r"(?P<e>\d+)") + "$"

    def replacement(template: str) -> str:
        return r"\g<1>" + template.replace("{e}", r"\g<e>")

    names = family.checkpoint_names.items()
    return ([(re.compile(pattern(theirs)), replacement(ours)) for ours, theirs in names],
            [(re.compile(pattern(ours)), replacement(theirs)) for ours, theirs in names])


def rename(tensors: dict[str, torch.Tensor], renames: list) -> dict[str, torch.Tensor]:
    """`tensors` under the names `renames` (from checkpoint_renames) gives them."""
    out = {}
    for name, tensor in tensors.items():
        for regex, replacement in renames:
            name, hits = regex.subn(replacement, name)
            if hits:
                break
        out[name] = tensor
    return out


# a fused checkpoint tensor (within a layer) -> the Llama tensors it stacks along dim 0
FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                       "self_attn.v_proj.weight"),
         "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


class CheckpointNames:
    """A family's checkpoint tensors under Llama's names (what the conversion reads) and back:
    renamed (`checkpoint_names`) and split or joined (`fused`)."""

    def __init__(self, family, heads: "Heads"):
        self.fused, self.heads = family.fused, heads
        self.renames_in, self.renames_out = checkpoint_renames(family)

    def to_llama(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, tensor in rename(tensors, self.renames_in).items():
            layer = re.match(r"^(model\.layers\.\d+\.)(.+)$", name)
            if layer and layer.group(2) in self.fused:
                parts = FUSED[layer.group(2)]
                h = self.heads
                sizes = [h.heads * h.head_dim, h.groups * h.head_dim, h.groups * h.head_dim] \
                    if len(parts) == 3 else [tensor.shape[0] // 2] * 2
                out.update({layer.group(1) + p: t for p, t in zip(parts, tensor.split(sizes))})
            else:
                out[name] = tensor
        return out

    def to_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors = dict(tensors)
        for fused in self.fused:
            first = FUSED[fused][0]
            for name in [n for n in tensors if n.endswith("." + first)]:
                pre = name.removesuffix(first)
                tensors[pre + fused] = torch.cat([tensors.pop(pre + p) for p in FUSED[fused]])
        return rename(tensors, self.renames_out)


class Heads:
    """Head geometry of one HF config, and whether its MLP is gated (fc1 = [gate; up])."""

    def __init__(self, hf_config, gated: bool = True):
        self.gated = gated
        self.heads = hf_config.num_attention_heads
        self.groups = hf_config.num_key_value_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // self.heads

    def fuse_qkv(self, q, k, v):
        rest = q.shape[1:]
        per_group = self.heads // self.groups * self.head_dim
        q = q.reshape(self.groups, per_group, *rest)
        k = k.reshape(self.groups, self.head_dim, *rest)
        v = v.reshape(self.groups, self.head_dim, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    def split_qkv(self, qkv):
        rest = qkv.shape[1:]
        per_group = self.heads // self.groups * self.head_dim
        q, k, v = qkv.reshape(self.groups, per_group + 2 * self.head_dim, *rest).split(
            [per_group, self.head_dim, self.head_dim], dim=1)
        return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(name: str, hf: dict[str, torch.Tensor], heads: Heads) -> torch.Tensor:
    """The full (unsharded) Megatron tensor `name` built from HF tensors."""
    if name in TOP:
        key = TOP[name]
        return hf[key] if key in hf else hf["model.embed_tokens.weight"]  # tied embeddings
    layer, rest = LAYER.match(name).groups()
    pre = f"model.layers.{layer}."
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = (hf[f"{pre}self_attn.{x}_proj.{kind}"] for x in "qkv")
        if kind == "weight" and faults.active(f"megatron_qkv_half_transposed:{layer}"):
            q = q.roll(q.shape[0] // 2, dims=0)  # a conversion that put q's two halves back swapped
        return heads.fuse_qkv(q, k, v)
    if rest in FC1 and heads.gated:
        mlp = pre + FC1[rest]
        return torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]])
    expert = EXPERT.match(rest)
    if expert:
        e, which = expert.groups()
        ex = f"{pre}mlp.experts.{e}."
        if which == "linear_fc1":
            return torch.cat([hf[ex + "gate_proj.weight"], hf[ex + "up_proj.weight"]])
        return hf[ex + "down_proj.weight"]
    return hf[pre + RENAMES[rest]]


def megatron_to_hf(name: str, tensor: torch.Tensor, heads: Heads) -> dict[str, torch.Tensor]:
    """HF tensors from the full Megatron tensor `name` (the inverse of hf_to_megatron)."""
    if name in TOP:
        return {TOP[name]: tensor}
    layer, rest = LAYER.match(name).groups()
    pre = f"model.layers.{layer}."
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = heads.split_qkv(tensor)
        return {f"{pre}self_attn.q_proj.{kind}": q, f"{pre}self_attn.k_proj.{kind}": k,
                f"{pre}self_attn.v_proj.{kind}": v}
    if rest in FC1 and heads.gated:
        gate, up = tensor.chunk(2)
        mlp = pre + FC1[rest]
        return {mlp + "gate_proj.weight": gate, mlp + "up_proj.weight": up}
    expert = EXPERT.match(rest)
    if expert:
        e, which = expert.groups()
        ex = f"{pre}mlp.experts.{e}."
        if which == "linear_fc1":
            gate, up = tensor.chunk(2)
            return {ex + "gate_proj.weight": gate, ex + "up_proj.weight": up}
        return {ex + "down_proj.weight": tensor}
    return {pre + RENAMES[rest]: tensor}


def is_gated_fc1(name: str, gated: bool) -> bool:
    return gated and name.endswith("linear_fc1.weight")


def shard(name: str, full: torch.Tensor, dim: int | None, rank: int, size: int,
          gated: bool = True) -> torch.Tensor:
    """This TP rank's part of a full Megatron tensor (gate/up split part by part)."""
    if dim is None or size == 1:
        return full
    if is_gated_fc1(name, gated):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
    return full.chunk(size, dim=dim)[rank]


def unshard(name: str, parts: list[torch.Tensor], dim: int | None, gated: bool = True) -> torch.Tensor:
    """The full Megatron tensor from every TP rank's part (inverse of `shard`)."""
    if dim is None or len(parts) == 1:
        return parts[0]
    if is_gated_fc1(name, gated):
        gates, ups = zip(*(p.chunk(2) for p in parts))
        return torch.cat([*gates, *ups])
    return torch.cat(parts, dim=dim)
