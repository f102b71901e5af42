"""MoE routing: which experts the engine chose, which the trainer chooses, and routing replay.

How it works in detail: docs/algorithms.md, "Inside `relax/train/routing.py`".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from relax.errors import ConfigError
from relax.model import families

METRICS = ("train/routing_agreement", "train/routing_agreement_min_layer", "train/routing_replayed",
           "train/routing_replay_agreement")


def check_config(algo, hf_config: dict, num_steps_per_rollout: int) -> None:
    """Start-up refusals for algo.routing_replay."""
    mode = algo.routing_replay
    if mode:
        families.check(hf_config).refuse_unless_fast(f"algo.routing_replay={mode}", "routing replay (its "
                                                     "hooks and the engine's recorded experts)",
                                                     "leave algo.routing_replay null")
    if mode and not families.num_experts(hf_config):
        raise ConfigError(f"algo.routing_replay={mode}: the model is dense (no MoE layer routes tokens); "
                          f"leave it null")
    if mode == "train" and num_steps_per_rollout < 2:
        raise ConfigError(f"algo.routing_replay=train (R2) replays the old-log-prob pass's routing in later "
                          f"optimizer steps; with train.num_steps_per_rollout={num_steps_per_rollout} there "
                          f"is no such pass to replay: use rollout (R3), or num_steps_per_rollout >= 2")
    if mode == "train" and algo.use_rollout_log_probs:
        raise ConfigError("algo.routing_replay=train (R2) replays the old-log-prob pass's routing, which "
                          "algo.use_rollout_log_probs=True skips (the engine's log-probs are the old "
                          "policy's): use rollout (R3), or use_rollout_log_probs=false")


def engine_experts(samples, length: int) -> torch.Tensor | None:
    """The samples' recorded experts as [rows, length, layers x top_k] (-1: not recorded: the
    last token, padding, a sample without them); None when no sample has any."""
    widths = {len(s.routed_experts) // (len(s.tokens) - 1) for s in samples if s.routed_experts}
    if not widths:
        return None
    if len(widths) > 1:
        raise ValueError(f"samples record routing of different widths {sorted(widths)} (layers x top_k)")
    out = torch.full((len(samples), length, widths.pop()), -1, dtype=torch.long)
    for b, s in enumerate(samples):
        if s.routed_experts:
            out[b, :len(s.tokens) - 1] = torch.tensor(s.routed_experts).view(len(s.tokens) - 1, -1)
    return out


def hf_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers of a transformers model, in layer order (none for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


@dataclass
class Record:
    """One forward's routing over a micro-batch's [rows x positions] (flattened), -1 where the
    forward fed no such token: its routers' own top-k and the experts it ran on."""
    own: torch.Tensor   # [rows * T, layers, top_k]
    used: torch.Tensor  # [rows * T, layers, top_k]


@contextlib.contextmanager
def routed(model: torch.nn.Module, fed: tuple[torch.Tensor, torch.Tensor], size: int,
           replay: torch.Tensor | None = None):
    """Hooks the model's routers for one forward. `fed`: (router row, micro-batch position)
    pairs, position = row * T + t (a shared prompt's router row serves every row of its
    group); `size` = rows * T. `replay` ([size, layers * top_k], -1 where unknown): the
    experts to route to instead of the router's own. Yields the forward's Record."""
    routers = hf_routers(model)
    if not routers:
        yield None
        return
    rows, positions = fed
    top_k = routers[0].top_k
    record = Record(*(torch.full((size, len(routers), top_k), -1, dtype=torch.long) for _ in range(2)))
    targets = None if replay is None else replay.view(size, len(routers), top_k)

    def hook(layer: int):
        def replace(router, args, output):
            logits, weights, chosen = output
            record.own[positions, layer] = chosen[rows]
            if targets is None:
                record.used[positions, layer] = chosen[rows]
                return None
            target = targets[positions, layer]
            known = target[:, 0] >= 0
            chosen = chosen.clone()
            chosen[rows[known]] = target[known]
            record.used[positions, layer] = chosen[rows]
            weights = logits.float().softmax(-1).gather(-1, chosen)
            if router.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen
        return replace

    handles = [router.register_forward_hook(hook(i)) for i, router in enumerate(routers)]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


def unpacked_fed(lengths: list[int], T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(router row, position) pairs of a forward over the rows as they are: row b's tokens
    0..lengths[b] - 2 (the last feeds nothing the engine recorded)."""
    positions = torch.tensor([b * T + t for b, n in enumerate(lengths) for t in range(max(n - 1, 0))],
                             dtype=torch.long)
    return positions, positions


def replay_source(mode: str | None, forward: str) -> str | None:
    """Whose experts a forward ("ref", "old" or "train") routes to: R3 the engine's ("rollout")
    in every forward, R2 the old-log-prob pass's ("train") in the training forwards, else none."""
    if mode == "rollout":
        return "rollout"
    return "train" if mode == "train" and forward == "train" else None


def replay_for(mb, mode: str | None, forward: str) -> torch.Tensor | None:
    """The experts a forward of `mb` routes to (replay_source), [b * T, layers x top_k]."""
    source = replay_source(mode, forward)
    return mb.routed_experts if source == "rollout" else mb.replay_experts if source == "train" else None


def measured(mb, record: Record | None, mode: str | None) -> None:
    """Keep the routing of `mb`'s first forward at the rollout's weights (R2 replays it)."""
    if record is not None and mb.trainer_experts is None:
        mb.trainer_experts = record.own
        if mode == "train":
            mb.replay_experts = record.own.flatten(1)


def rollout_agreement(micro_batches) -> torch.Tensor:
    """agreement_sums over the micro-batches (zeros: a dense model, or no recorded experts)."""
    sums = [agreement_sums(mb.trainer_experts, mb.routed_experts if mb.routed_experts is not None
                           else torch.full_like(mb.trainer_experts, -1))
            for mb in micro_batches if mb.trainer_experts is not None]
    return sum(sums) if sums else torch.zeros(2, 1)


def agreement_sums(own: torch.Tensor, engine: torch.Tensor) -> torch.Tensor:
    """[2, layers]: per MoE layer, the (token, layer) pairs whose top-k sets agree and the
    pairs compared (positions both recorded)."""
    engine = engine.reshape(own.shape)
    known = (own[..., 0] >= 0) & (engine[..., 0] >= 0)  # [positions, layers]
    same = (own.sort(-1).values == engine.sort(-1).values).all(-1) & known
    return torch.stack([same.sum(0), known.sum(0)]).float()


def replayed_sums(record: Record, replay: torch.Tensor) -> torch.Tensor:
    """[3]: of the (token, layer) pairs a forward replayed, those that ran on the replayed
    experts, those whose router chose that top-k set itself, and all of them."""
    replay = replay.reshape(record.used.shape)
    known = (replay[..., 0] >= 0) & (record.used[..., 0] >= 0)
    same = (record.own.sort(-1).values == replay.sort(-1).values).all(-1)
    return torch.stack([((record.used == replay).all(-1) & known).sum(), (same & known).sum(),
                        known.sum()]).float()


def per_layer(agreement: torch.Tensor | None) -> list | None:
    """Per MoE layer, the agreement of DP-summed agreement_sums (None: a layer nothing compared)."""
    if agreement is None or agreement[1].sum() == 0:
        return None
    return [(a / n).item() if n else None for a, n in zip(agreement[0], agreement[1])]


def metrics(agreement: torch.Tensor | None, replayed: torch.Tensor | None) -> dict:
    """The rollout's routing metrics from DP-summed agreement_sums / replayed_sums."""
    out = {}
    if agreement is not None and agreement[1].sum() > 0:
        per_layer = agreement[0] / agreement[1].clamp(min=1)
        out["train/routing_agreement"] = (agreement[0].sum() / agreement[1].sum()).item()
        out["train/routing_agreement_min_layer"] = per_layer[agreement[1] > 0].min().item()
    if replayed is not None and replayed[2] > 0:
        out["train/routing_replayed"] = (replayed[0] / replayed[2]).item()
        out["train/routing_replay_agreement"] = (replayed[1] / replayed[2]).item()
    return out
