"""HF weights in and out of this rank's Megatron shards, and the per-rank optimizer state.

`Weights.load` converts an HF directory's tensors (relax/train/megatron/convert.py), cuts
this rank's tensor-parallel part and copies it in; `Weights.gather` is the inverse over
every rank (what weight sync and checkpoints take). Names are "global": absolute layer and
expert indices, whichever pipeline chunk or expert-parallel rank holds them.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from relax.distributed import gather_tensors
from relax.files import atomic_save, safe_load
from relax.model import families, load_safetensors_dir
from relax.train.megatron import convert
from relax.train.megatron.layout import Layout
from relax.train.megatron.model import num_experts


class Weights:
    """Where each HF tensor lives on this rank, for models built from one HF config."""

    def __init__(self, hf_config, layout: Layout):
        self.hf_config, self.layout = hf_config, layout
        family = families.layer_family(hf_config.to_dict())
        self.heads = convert.Heads(hf_config, gated=family.gated_mlp)
        # the conversion speaks Llama's names: the checkpoint's own, renamed in and out
        self.names = convert.CheckpointNames(family, self.heads)
        self.partition_dims: dict[str, int | None] = {}  # global name -> TP split dim
        self.passthrough: dict[str, torch.Tensor] = {}

    def global_names(self, chunk) -> dict[str, str]:
        """Local parameter name -> global Megatron name (absolute layer/expert indices)."""
        local_experts = num_experts(self.hf_config) // self.layout.ep_size
        out = {}
        for name, _ in chunk.named_parameters():
            name = name.removeprefix("module.")
            m = convert.LAYER.match(name)
            if m:
                layer = chunk.decoder.layers[int(m.group(1))].layer_number - 1
                rest = m.group(2)
                e = convert.EXPERT.match(rest)
                if e:
                    first = self.layout.ep_rank * local_experts
                    rest = rest.replace(f"local_experts.{e.group(1)}.",
                                        f"local_experts.{first + int(e.group(1))}.")
                out[name] = f"decoder.layers.{layer}.{rest}"
            else:
                out[name] = name
        return out

    @torch.no_grad()
    def load(self, chunks: list, path: str) -> list:
        """Copy this rank's shard of the HF directory `path` into `chunks`; records each
        tensor's TP split dimension (where full and local shapes differ) for `gather`."""
        hf = self.names.to_llama(load_safetensors_dir(Path(path)))
        for chunk in chunks:
            names = self.global_names(chunk)
            for name, param in chunk.named_parameters():
                global_name = names[name.removeprefix("module.")]
                full = convert.hf_to_megatron(global_name, hf, self.heads)
                split = [d for d in range(full.dim()) if full.shape[d] != param.shape[d]]
                dim = self.partition_dims[global_name] = split[0] if split else None
                rank, size, _ = self.layout.tp_of(param)
                part = convert.shard(global_name, full, dim, rank, size, self.heads.gated)
                if part.shape != param.shape:
                    raise ValueError(f"{global_name}: converted shape {tuple(part.shape)} != "
                                     f"Megatron's {tuple(param.shape)}")
                param.copy_(part)
        # HF tensors no Megatron parameter stands for (a zero-width Qwen2-MoE shared expert
        # and its gate) are carried through unchanged, so weight sync and checkpoints stay whole.
        zero_width = not getattr(self.hf_config, "shared_expert_intermediate_size", 0)
        self.passthrough = self.names.to_checkpoint({k: v for k, v in hf.items() if "shared_expert" in k}) \
            if zero_width else {}
        return chunks

    def gather(self, chunks: list, read=torch.Tensor.detach) -> dict[str, torch.Tensor]:
        """Full HF-named tensors of every parameter, gathered over TP/PP/EP (a collective; rank
        0 returns them): `read(param)` of each, its value by default (`main_grad`: its gradient
        in Megatron DDP's buffer). The passthrough tensors are no parameters: not among them."""
        mine: dict[str, torch.Tensor] = {}
        for chunk in chunks:
            names = self.global_names(chunk.module)
            for name, param in chunk.module.named_parameters():
                global_name = names[name.removeprefix("module.")]
                dim = self.partition_dims[global_name]
                data = read(param)
                if dim is not None:
                    _, size, group = self.layout.tp_of(param)
                    parts = [torch.empty_like(data) for _ in range(size)]
                    dist.all_gather(parts, data.contiguous(), group=group)
                    data = convert.unshard(global_name, parts, dim, self.heads.gated)
                if self.layout.owns(param):
                    mine.update(convert.megatron_to_hf(global_name, data.clone(), self.heads))
        weights = gather_tensors(self.names.to_checkpoint(mine), self.layout.rank, self.layout.world_size)
        if self.layout.rank != 0:
            return {}
        if self.hf_config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights


# -- optimizer state, saved and restored per rank ------------------------------------------

def inner_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside Megatron's (chained, distributed, mixed-precision) ones.
    Megatron's own parameter-state loaders expect TE/Apex Adam's state layout (no per-param
    `step`), so Relax saves and restores the torch optimizers directly."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _main_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _state_file(path: str, rank: int) -> Path:
    return Path(path) / f"trainer_state_rank{rank:03d}.pt"


def save_optimizer_state(optimizer, path: str, rank: int, counters: dict) -> None:
    """The state of each torch optimizer that Megatron wraps (Adam's step and moments) with
    the params it steps: its main params, i.e. this rank's shard under the distributed
    optimizer, fp32 copies under bf16; the RNG state; the trainer's `counters` (ints)."""
    state = {"torch_rng": torch.get_rng_state(), "counters": counters,
             "optimizers": [{"state": inner.state_dict(),
                             "main_params": [p.detach().clone() for p in _main_params(inner)]}
                            for inner in inner_optimizers(optimizer)]}
    atomic_save(state, _state_file(path, rank))


@torch.no_grad()
def load_optimizer_state(optimizer, path: str, rank: int) -> dict:
    """Restore what `save_optimizer_state` saved; returns its counters. The files are per
    rank, so the layout must be the one saved (checked at start-up)."""
    state = safe_load(_state_file(path, rank))
    for inner, saved in zip(inner_optimizers(optimizer), state["optimizers"], strict=True):
        inner.load_state_dict(saved["state"])
        for param, value in zip(_main_params(inner), saved["main_params"], strict=True):
            param.copy_(value)
    torch.set_rng_state(state["torch_rng"])
    return state.get("counters", {})
