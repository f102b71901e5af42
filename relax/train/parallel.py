"""Parallel layouts for the torch trainer (conf/parallel/): device mesh, TP, DDP and FSDP2.

All of it is stock PyTorch on gloo: DTensor tensor parallelism (`parallelize_module`),
FSDP2 (`fully_shard`), DDP, and the 2-D FSDP x TP mesh. Pipeline, context and expert
parallelism are Megatron's job (train=megatron); `check_torch_layout` refuses them here.
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from relax import faults
from relax.errors import ConfigError
from relax.model import families
from relax.model.modules import decoder_layers

ADAPTER = "default"  # peft's name for the one adapter (relax/train/lora.py)

@dataclass
class Layout:
    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    fsdp: bool = False
    mesh: Any = None
    dp_group: Any = None

    @property
    def writes_data(self) -> bool:
        """One writer per DP shard: TP replicas hold the same samples."""
        return self.tp_rank == 0


def check_divides(p, size: str, hf: dict, keys: tuple[str, ...]) -> None:
    """parallel.<size> must split each of these config.json counts into equal parts."""
    n = p[size]
    uneven = {k: hf[k] for k in keys if hf.get(k) and hf[k] % n}
    if uneven:
        counts = ", ".join(f"{k}={v}" for k, v in uneven.items())
        raise ConfigError(f"parallel={p.name}: parallel.{size}={n} must divide the model's {counts} "
                          f"(config.json); choose a {size} that divides them")


def check_torch_layout(p, hf: dict) -> None:
    unsupported = [k for k in ("pp", "cp", "ep", "etp", "vpp") if p[k] > 1]
    if unsupported:
        key = unsupported[0]
        raise ConfigError(f"parallel={p.name}: parallel.{key}={p[key]} is not supported by train=torch "
                          f"(tp, dp and fsdp are); use train=megatron for pipeline, context "
                          f"and expert parallelism")
    if p.sequence_parallel:
        raise ConfigError(f"parallel={p.name}: sequence_parallel needs train=megatron")
    if p.tp > 1 and p.dp > 1 and not p.fsdp:
        raise ConfigError(f"parallel={p.name}: dp x tp on train=torch runs as 2-D FSDP x TP; "
                          f"set parallel.fsdp=true")
    if p.tp > 1:
        families.check(hf).refuse_unless_fast(f"parallel={p.name}", "train=torch's tensor parallelism (its "
                                              "plan names the families' projections)",
                                              "use a layout without tp (single, dp2, fsdp2)")
    # TP splits q/k/v by heads (each rank attends with whole heads) and the MLP by width
    check_divides(p, "tp", hf, ("num_attention_heads", "num_key_value_heads", "intermediate_size"))


def init_layout(p, rank: int, world_size: int) -> Layout:
    if world_size != p.world_size:
        raise ConfigError(f"parallel={p.name} implies world_size {p.world_size}, got {world_size}")
    if world_size == 1:
        return Layout()

    mesh = init_device_mesh("cpu", (p.dp, p.tp), mesh_dim_names=("dp", "tp"))
    return Layout(rank=rank, world_size=world_size,
                  dp_rank=mesh["dp"].get_local_rank(), dp_size=p.dp,
                  tp_rank=mesh["tp"].get_local_rank(), tp_size=p.tp, fsdp=p.fsdp,
                  mesh=mesh, dp_group=mesh["dp"].get_group())


def tp_plan(layer: torch.nn.Module, plan: dict) -> dict:
    """A decoder layer's TP plan for the projections peft wrapped (relax.train.lora): the base layer
    sharded like the projection, and the adapter factor that meets the sharded dimension sharded the
    same way (colwise: B, whose rows are outputs; rowwise: A, whose columns are inputs); the other,
    rank-wide factor is replicated. Unadapted projections keep their plan."""
    modules, out = dict(layer.named_modules()), {}
    for path, style in plan.items():
        if path not in modules or not hasattr(modules[path], "base_layer"):
            out[path] = style
            continue
        factor = "lora_B" if isinstance(style, ColwiseParallel) else "lora_A"
        out |= {f"{path}.base_layer": style, f"{path}.{factor}.{ADAPTER}": style}
    return out


def apply_layout(model: torch.nn.Module, layout: Layout, trainable: bool) -> torch.nn.Module:
    """Shard `model` in place as the layout says; returns the module to call forward on."""
    if layout.tp_size > 1:
        plan = {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        for layer in model.model.layers:
            parallelize_module(layer, layout.mesh["tp"], tp_plan(layer, plan))
        if faults.active("tp_no_allreduce:1") and trainable:  # layer 1's attention output: a partial sum
            model.model.layers[1].self_attn.o_proj.register_forward_hook(
                lambda m, args, out: F.linear(args[0].to_local(), m.weight.to_local()))
    if layout.fsdp:
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=layout.mesh["dp"])
        fully_shard(model, mesh=layout.mesh["dp"])
    elif layout.dp_size > 1 and trainable:
        return DistributedDataParallel(model, process_group=layout.dp_group)
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor from a DTensor shard (a collective: every rank must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def clip_grad_norm(params, max_norm: float) -> float:
    """Global grad norm over plain and DTensor grads, then clip in place (a non-finite
    norm is returned as is, grads untouched: the caller must not step on it).

    torch's clip_grad_norm_ refuses a mix of DTensor (TP-sharded) and plain (replicated)
    grads; a DTensor's norm resolves its shards with one reduction.
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = math.sqrt(sum(full_tensor(g.detach().norm()).item() ** 2 for g in grads))
    if max_norm > 0 and math.isfinite(total) and total > max_norm:
        for g in grads:
            g.mul_(max_norm / (total + 1e-6))
    return total


def peak_memory_mb() -> float:
    """Peak memory of the busiest rank: CUDA allocator peak on GPU, max RSS on CPU."""
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    if dist.is_initialized():
        t = torch.tensor(peak, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        peak = t.item()
    return peak


def dp_all_reduce(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    if layout.dp_size > 1:
        dist.all_reduce(t, group=layout.dp_group)
    return t


def dp_all_gather(obj, layout: Layout) -> list:
    if layout.dp_size == 1:
        return [obj]
    out = [None] * layout.dp_size
    dist.all_gather_object(out, obj, group=layout.dp_group)
    return out
