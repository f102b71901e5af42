"""Megatron's parallel layout on a rank (train=megatron): `init_layout` sets up
`parallel_state` and reads this rank's place in every dimension into a `Layout`, once;
the trainer, its weights and its CP slicing read only that. Layouts a model cannot take
are refused earlier, at plan time (relax/train/megatron/checks.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from relax.distributed import free_port


@dataclass
class Layout:
    """This rank's place in each parallel dimension, and the process groups it talks over."""
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    tp_group: Any
    sequence_parallel: bool
    pp_rank: int
    pp_size: int
    pp_group: Any
    pp_last_rank: int          # global rank of the last stage of this rank's pipeline
    vpp: int                   # model chunks (virtual pipeline stages) on this rank
    cp_rank: int
    cp_size: int
    cp_group: Any
    dp_rank: int               # which share of the samples this rank trains on
    dp_size: int
    dp_group: Any
    dp_cp_rank: int            # data x context parallel: replicas of the same weights
    dp_cp_group: Any
    ep_rank: int
    ep_size: int
    etp_rank: int              # expert weights are split over the expert-TP group
    etp_size: int
    etp_group: Any
    expert_dp_rank: int

    @property
    def is_last_stage(self) -> bool:
        """The pipeline stage that computes the logits, hence every result."""
        return self.pp_rank == self.pp_size - 1

    def pre_process(self, chunk: int) -> bool:
        """Model chunk `chunk` of this rank holds the embedding."""
        return self.pp_rank == 0 and chunk == 0

    def post_process(self, chunk: int) -> bool:
        """Model chunk `chunk` of this rank holds the final norm and the output layer."""
        return self.is_last_stage and chunk == self.vpp - 1

    @property
    def writes_data(self) -> bool:
        """One writer per DP shard: TP and CP ranks hold the same samples."""
        return self.tp_rank == 0 and self.cp_rank == 0

    @property
    def length_multiple(self) -> int:
        """Sequence lengths must split over TP (sequence parallel) and into 2·cp chunks."""
        return max(self.tp_size if self.sequence_parallel else 1, 2 * self.cp_size if self.cp_size > 1 else 1)

    def tp_of(self, param) -> tuple[int, int, Any]:
        """(rank, size, group) of the tensor-parallel group a parameter is split over."""
        if not getattr(param, "allreduce", True):  # an expert parameter: expert-TP group
            return self.etp_rank, self.etp_size, self.etp_group
        return self.tp_rank, self.tp_size, self.tp_group

    def owns(self, param) -> bool:
        """Whether this rank contributes the (TP-gathered) parameter to the full weights:
        one rank per replica group."""
        if not getattr(param, "allreduce", True):
            return self.expert_dp_rank == 0 and self.etp_rank == 0
        return self.dp_cp_rank == 0 and self.tp_rank == 0


def init_layout(p, seed: int, rank: int, world_size: int) -> Layout:
    """Set up Megatron's parallel state for `parallel=p` on this rank."""
    # optional: megatron-core (relax[megatron])
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank,
                                world_size=world_size)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp if p.vpp > 1 else None,
        context_parallel_size=p.cp, expert_model_parallel_size=p.ep, expert_tensor_parallel_size=p.etp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return Layout(
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=p.tp,
        tp_group=ps.get_tensor_model_parallel_group(), sequence_parallel=p.sequence_parallel,
        pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=p.pp,
        pp_group=ps.get_pipeline_model_parallel_group(),
        pp_last_rank=ps.get_pipeline_model_parallel_last_rank(), vpp=p.vpp,
        cp_rank=ps.get_context_parallel_rank(), cp_size=p.cp, cp_group=ps.get_context_parallel_group(),
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        dp_group=ps.get_data_parallel_group(),
        dp_cp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=p.ep,
        etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
        etp_group=ps.get_expert_tensor_parallel_group(),
        expert_dp_rank=ps.get_expert_data_parallel_rank())
