"""GPU weight sync by NCCL broadcast (rollout=sglang rollout.weight_update_mode=distributed).

Trainer rank 0 joins one extra process group per SGLang engine (rank 0 = trainer, ranks
1..tp = the engine's workers) and broadcasts every HF-named tensor in the order
`weight_metadata()` gave (what `synced_weights()` holds: with LoRA, only the merged
projections); the engine receives them with `update_weights_from_distributed`.
The driver starts the broadcast on the trainer's ranks (`send`, relax/cluster/ranks.py) and then
asks the engine to receive, since both sides block until the other arrives. Needs CUDA
and NCCL: on CPU this mode is refused at start-up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class DistributedWeightSync:
    """Mixed into the trainers; every rank runs these (gathering weights is collective)."""

    def _is_rank0(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def synced_weights(self) -> dict:
        """What a weight sync sends: all of named_weights(), unless a trainer changes only part of it."""
        return self.named_weights()

    def weight_metadata(self) -> list[tuple[str, str, list[int]]]:
        weights = self.synced_weights()
        return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in weights.items()]

    def init_weight_sync_group(self, address: str, port: int, world_size: int, group_name: str) -> None:
        if not self._is_rank0():
            return
        # optional: sglang (its own environment: scripts/setup_sglang_cpu.sh)
        from sglang.srt.utils import init_custom_process_group

        groups = self.__dict__.setdefault("_weight_sync_groups", {})
        groups[group_name] = init_custom_process_group(
            backend="nccl", init_method=f"tcp://{address}:{port}", world_size=world_size, rank=0,
            group_name=group_name)

    def broadcast_weights(self, group_name: str) -> None:
        weights = self.synced_weights()
        if self._is_rank0():
            group = self._weight_sync_groups[group_name]
            for tensor in weights.values():
                dist.broadcast(tensor.to("cuda", non_blocking=True), src=0, group=group)
            torch.cuda.synchronize()
