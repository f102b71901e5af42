"""train=megatron's side of MoE routing (relax/train/routing.py): agreement with the engine,
and routing replay through Megatron-core's RouterReplay.

How it works in detail: docs/backends.md, "Inside `relax/train/megatron/routing.py`".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from relax.train.routing import agreement_sums, replay_source


@dataclass
class _Forward:
    mb: object                  # the whole micro-batch (MicroBatch)
    positions: torch.Tensor     # [s] the sequence positions this rank's routers see, in order
    forward: str                # "ref", "old" or "train"
    replay: str | None          # "rollout": the engine's experts; "train": this rank's R2 record
    replayed: dict = field(default_factory=dict)  # layer -> (experts set, own, known) until used


class Routing:
    def __init__(self, models: list[list], layout, num_layers: int, top_k: int, mode: str | None):
        self.layout, self.top_k, self.mode = layout, top_k, mode
        self.agreement, self.replayed = torch.zeros(2, num_layers), torch.zeros(3)
        self.recorded: dict[tuple[int, int], torch.Tensor] = {}  # (id(mb), layer) -> own [rows, top_k]
        self.measured: set[tuple[int, int]] = set()  # (id(mb), layer) of the rollout's first forwards
        self.current: _Forward | None = None
        for chunks in models:
            for chunk in chunks:
                for module in chunk.modules():
                    router = getattr(getattr(module, "mlp", None), "router", None)
                    if router is not None and hasattr(module, "layer_number"):
                        layer = module.layer_number - 1
                        router.register_forward_pre_hook(
                            lambda r, args, layer=layer: self._before(layer, r, args[0]))
                        router.register_forward_hook(
                            lambda r, args, out, layer=layer: self._after(layer, out[1]))

    @contextlib.contextmanager
    def forward(self, mb, positions: torch.Tensor, forward: str):
        """One micro-batch's forward ("ref", "old" or "train"); `positions`: cp_local's [b, t]."""
        pos = positions[0]
        if self.layout.sequence_parallel and self.layout.tp_size > 1:
            share = len(pos) // self.layout.tp_size
            pos = pos[self.layout.tp_rank * share:(self.layout.tp_rank + 1) * share]
        self.current = _Forward(mb, pos, forward, replay_source(self.mode, forward))
        try:
            yield
        finally:
            self.current = None

    def _engine(self, layer: int) -> torch.Tensor | None:
        """The engine's experts for this rank's tokens of `layer`, [s * b, top_k] (-1: unknown)."""
        c = self.current
        if c.mb.routed_experts is None:
            return None
        rows, length = c.mb.routed_experts.shape[:2]
        experts = c.mb.routed_experts.view(rows, length, -1, self.top_k)[:, c.positions, layer]
        return experts.transpose(0, 1).reshape(-1, self.top_k)

    def _before(self, layer: int, router, hidden: torch.Tensor) -> None:
        c = self.current
        if c is None:
            return
        key = (id(c.mb), layer)
        measuring = c.forward != "ref" and key not in self.measured  # first forward at the rollout's weights
        replay = router.router_replay
        if replay is not None:
            replay.clear_indices()
        if not measuring and c.replay is None:  # nothing to measure or replay: no second gating matmul
            if replay is not None:
                replay.clear_router_replay_action()
            return
        with torch.no_grad():
            own = router.gating(hidden).view(-1, router.config.num_moe_experts).topk(self.top_k).indices
        engine = self._engine(layer)
        if measuring:
            self.measured.add(key)
            if engine is not None:
                self.agreement[:, layer] += agreement_sums(own[:, None], engine[:, None])[:, 0]
            if self.mode == "train":
                self.recorded[key] = own
        target = engine if c.replay == "rollout" else self.recorded.get(key) if c.replay == "train" else None
        if replay is None:
            return
        if target is None:
            replay.clear_router_replay_action()
            return
        # optional: megatron-core (relax[megatron])
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        known = target[:, 0] >= 0  # (padding and last tokens: the router's own choice)
        experts = torch.where(known[:, None], target, own)
        replay.set_target_indices(experts)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        c.replayed[layer] = (experts, own, known)

    def _after(self, layer: int, routing_map: torch.Tensor) -> None:
        c = self.current
        if c is None or layer not in c.replayed:
            return
        experts, own, known = c.replayed.pop(layer)
        wanted = torch.zeros_like(routing_map).scatter_(1, experts, True)
        chose = torch.zeros_like(routing_map).scatter_(1, own, True)
        self.replayed += torch.stack([((routing_map == wanted).all(-1) & known).sum(),
                                      ((chose == wanted).all(-1) & known).sum(), known.sum()]).float()

    def rollout_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rollout's agreement and replay sums over every rank (a collective); resets them."""
        sums = torch.cat([self.agreement.flatten(), self.replayed])
        dist.all_reduce(sums)
        L = self.agreement.shape[1]
        self.agreement.zero_()
        self.replayed.zero_()
        self.recorded.clear()
        self.measured.clear()
        return sums[:2 * L].view(2, L), sums[2 * L:]
