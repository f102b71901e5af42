"""Make megatron-core 0.16.1 run on CPU with gloo, for layout checks without a GPU.

How it works in detail: docs/backends.md, "Inside `relax/train/megatron/cpu_compat.py`".
"""

from __future__ import annotations

import contextlib
import importlib.metadata

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from relax.targets import require_extra
from relax.errors import ConfigError

MEGATRON_VERSION = "0.16.1"
_applied = False


def check_version() -> None:
    """megatron-core is installed (the [megatron] extra) and, on CPU, is the version this layer
    was written against."""
    require_extra("train=megatron", "megatron.core")
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:  # megatron.core imports from a source tree
        version = "megatron.core without an installed megatron-core distribution"
    if version != MEGATRON_VERSION and not torch.cuda.is_available():
        raise ConfigError(
            f"train=megatron on CPU needs megatron-core=={MEGATRON_VERSION} (its CPU compatibility "
            f"layer was written against that version); found {version}. "
            f"pip install -c constraints.txt 'megatron-core=={MEGATRON_VERSION}'")


def _cpu(device):
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int):  # a CUDA ordinal
        return torch.device("cpu")
    return device


class _Event:
    """Stand-in for torch.cuda.Event: CPU work is already ordered."""

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass


class _Stream(_Event):
    """Stand-in for torch.cuda.Stream (MoE token dispatch overlaps copies on a side stream)."""

    def wait_stream(self, other):
        pass

    def record_event(self, event=None):
        return event or _Event()


class CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        kwargs.pop("pin_memory", None)  # no pinned-memory allocator without an accelerator
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], torch.dtype):
            args = (args[0], _cpu(args[1]), *args[2:])
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return result.replace("torch.", "torch.cuda.", 1)
        return result


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """The local spec's norm refuses sequence parallelism; this one marks its weight so
    that `finalize_model_grads` all-reduces its gradient over the TP group."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _all_to_all_single_lists(original):
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *a, **kw):
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return original(output, input, output_split_sizes, input_split_sizes, *a, **kw)
    return all_to_all_single


def _even_all_gather_into_tensor(original):
    def all_gather_into_tensor(output, input, group=None, async_op=False):
        world = dist.get_world_size(group)
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([input.shape[0]]), group=group)
        sizes = [int(s) for s in sizes]
        if len(set(sizes)) == 1:
            return original(output, input, group=group, async_op=async_op)
        padded = input.new_zeros((max(sizes), *input.shape[1:]))
        padded[:input.shape[0]] = input
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        torch.cat([p[:n] for p, n in zip(parts, sizes)], out=output)
        return None
    return all_gather_into_tensor


def apply() -> None:
    """Install the layer (idempotent). Call before building Megatron models."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    check_version()
    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    torch.cuda.get_rng_state = lambda device=None: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.device_count = lambda: 0
    default_stream = _Stream()
    torch.cuda.Stream, torch.cuda.Event = _Stream, _Event
    torch.cuda.current_stream = lambda device=None: default_stream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.nvtx.range_push = lambda *a, **k: None
    torch.cuda.nvtx.range_pop = lambda *a, **k: None
    # optional: megatron-core (relax[megatron])
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils

    # the model-parallel RNG tracker swaps "CUDA" RNG states: on CPU, the CPU generator's
    megatron_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    dist.all_to_all_single = _all_to_all_single_lists(dist.all_to_all_single)
    dist.all_gather_into_tensor = _even_all_gather_into_tensor(dist.all_gather_into_tensor)
    CudaToCpu().__enter__()  # for the life of the process: Megatron allocates anywhere
    _applied = True
