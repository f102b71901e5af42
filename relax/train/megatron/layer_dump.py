"""The layer dump (debug.dump_layers, relax/train/layer_dump.py) for train=megatron: Megatron's
module outputs under the HF module names of `module_names`, whole sequences on rank 0, so that
a dump lines up name by name with train=torch's.

Megatron's outputs are [s, b, h] and this rank's part of the sequence: its sequence-parallel
shard of the CP-local sequence; a pipeline stage holds only its own layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from relax.model import modules
from relax.train import layer_dump
from relax.train.megatron.context_parallel import cp_gather
from relax.train.megatron.layout import Layout


def hf_modules(model) -> dict[str, torch.nn.Module]:
    """A GPTModel chunk's modules of `module_names`, by HF name (global layer index)."""
    out = {"model.embed_tokens": model.embedding} if model.pre_process else {}
    for layer in model.decoder.layers:
        name = f"model.layers.{layer.layer_number - 1}"
        out |= {f"{name}.self_attn": layer.self_attention, f"{name}.mlp": layer.mlp, name: layer}
    if model.post_process:
        out["model.norm"] = model.decoder.final_layernorm
    return out


def recording(chunks: list):
    """relax.model.modules.recording on the chunks' (DDP-wrapped or not) modules of `hf_modules`:
    this rank's part of each output, copied (a later in-place op must not reach it)."""
    named = {name: module for chunk in chunks
             for name, module in hf_modules(getattr(chunk, "module", chunk)).items()}
    return modules.recording(named, take=lambda out: out.detach().clone())


def save_on_rank0(path: str, rollout_id: int, source: str, recorded: dict[str, torch.Tensor],
                  log_probs: dict | None, *, manifest: dict, indices: list[int], lengths: list[int],
                  layout: Layout, num_layers: int, grads: dict | None = None,
                  params: dict | None = None) -> None:
    """Rank 0 saves every module's output, whole in forward order, the last stage's `log_probs`
    (per sample, from common.per_sample) and rank 0's `grads` and `params`, all fp32; a
    collective over every rank."""
    # optional: megatron-core (relax[megatron])
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    whole = {}
    for name in sorted(recorded):  # a stage's TP and CP ranks record the same modules
        x = recorded[name]
        if layout.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        whole[name] = cp_gather(x, layout).transpose(0, 1).float()  # [b, T, h]
    writer = layout.writes_data and layout.dp_rank == 0  # one rank per pipeline stage
    gathered = [None] * layout.world_size if layout.rank == 0 else None
    dist.gather_object((whole, log_probs) if writer else None, gathered, dst=0)
    if layout.rank != 0:
        return
    parts = [part for part in gathered if part is not None]
    merged = {name: t for outputs, _ in parts for name, t in outputs.items()}
    forward = {name: merged[name] for name in layer_dump.module_names(num_layers)}
    log_probs = next(lp for _, lp in parts if lp is not None)
    layer_dump.save_dump(path, rollout_id, source, manifest, indices, layer_dump.per_sample(forward, lengths),
                         [torch.tensor(lp) for lp in log_probs.values()],
                         *({k: v.float() for k, v in (part or {}).items()} for part in (grads, params)))
