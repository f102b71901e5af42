"""parallel.step_noise_ulp: the noise twin's rounding noise at every optimizer step, not only
at the start (parallel.noise_ulp): after each step every weight the optimizer holds moves
exactly n ulps, in directions drawn from (seed, n, the run's step) alone, in both trainers."""

import pytest
import torch

from relax.sample import Sample
from relax.train.common import step_noise

from .conftest import build_trainer, make_cfg


def ulps_moved(after: torch.Tensor, before: torch.Tensor, n: int) -> torch.Tensor:
    """+1 where `after` is `before` moved n representable values up, -1 down, 0 otherwise."""
    up, down = before.clone(), before.clone()
    for _ in range(n):
        up = torch.nextafter(up, torch.tensor(torch.inf))
        down = torch.nextafter(down, torch.tensor(-torch.inf))
    return (after == up).int() - (after == down).int()


def test_step_noise_moves_every_element_n_ulps_in_directions_of_the_seed_and_step():
    weights = torch.randn(4000)
    moved = {}
    for seed, ulps, step in ((0, 2, 5), (0, 2, 5), (0, 2, 6), (1, 2, 5), (0, 1, 5)):
        nudged = weights.clone()
        step_noise([nudged], ulps, seed, step)
        signs = ulps_moved(nudged, weights, ulps)
        assert bool((signs != 0).all()), (seed, ulps, step)  # every element, exactly `ulps` away
        moved.setdefault((seed, ulps, step), []).append(signs)
    (first, again), = [v for v in moved.values() if len(v) == 2]
    assert torch.equal(first, again)  # the same draw: a rerun (or a resumed run) is bit-identical
    for other in ((0, 2, 6), (1, 2, 5), (0, 1, 5)):  # another step, seed or twin: directions of its own
        assert 0.45 < float((moved[other][0] == first).float().mean()) < 0.55, other
    untouched = weights.clone()
    step_noise([untouched], 0, 0, 5)
    assert torch.equal(untouched, weights)  # 0: not a twin


def rollout() -> list[Sample]:
    """Two GRPO groups of two, rewards that differ within each: every step has a gradient."""
    return [Sample(index=i, group_index=i // 2, prompt="", tokens=[5, 6, 7 + i, 8, 9], response_length=3,
                   reward=float(i % 2), loss_mask=[1, 1, 1], rollout_log_probs=[-1.0] * 3) for i in range(4)]


@pytest.mark.parametrize("backend", ["torch", pytest.param("megatron", marks=pytest.mark.slow)])
def test_the_trainer_nudges_every_weight_after_every_step(backend, tiny_path):
    """At learning rate 0 the optimizer leaves every weight as it is, bit for bit; a rollout of
    two steps with 2 ulps of step noise then leaves each weight 4 ulps up or down where both
    draws agree, where it was where they do not: about half and half."""
    cfg = make_cfg(f"train={backend}", "parallel.step_noise_ulp=2", "train.num_steps_per_rollout=2",
                   "train.micro_batch_size=2", "train.lr=0", "train.weight_decay=0", "seed=7")
    trainer = build_trainer(cfg, tiny_path)
    try:
        before = {k: v.clone() for k, v in trainer.named_weights().items()}
        held = [p.detach().clone() for p in trainer.trainable] if backend == "torch" else []
        trainer.train(3, rollout())
        after = trainer.named_weights()
        if backend == "torch":  # exactly the draws of the run's steps 6 and 7 (rollout 3 of 2 steps)
            for step in (6, 7):
                step_noise(held, 2, 7, step)
            assert all(torch.equal(p.detach(), e) for p, e in zip(trainer.trainable, held, strict=True))
    finally:
        trainer.shutdown()
    moved = torch.cat([ulps_moved(after[k], w, 4).flatten() for k, w in before.items()])
    still = torch.cat([(after[k] == w).flatten() for k, w in before.items()])
    assert bool(((moved != 0) | still).all())  # every weight: 4 ulps either way, or none
    assert 0.45 < float(still.float().mean()) < 0.55
