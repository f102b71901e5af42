"""The loop's rollouts, in order: made on demand, or (train.async=true) one ahead.

How it works in detail: docs/rollouts.md, "Inside `relax/rollout/prefetch.py`".
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Callable

from relax.errors import ConfigError
from relax.sample import Sample


def check_async(rollout, builds_rollout: bool, builds_train: bool) -> None:
    """train.async=true refusals, before anything is built: where nothing can overlap."""
    if not builds_train:
        raise ConfigError("train.async=true overlaps generating the next rollout with training, but "
                          "debug.rollout_only builds no trainer: drop train.async for a rollout-only run")
    if not builds_rollout:
        raise ConfigError("train.async=true overlaps generating the next rollout with training, but a "
                          "train-only run (debug.train_only / debug.load_rollout_data) replays saved "
                          "rollouts and generates none: drop train.async to replay")
    if rollout.colocate:
        raise ConfigError("train.async=true with rollout.colocate=true: a colocated engine gives up its "
                          "memory while the trainer runs, so it cannot generate meanwhile; run the engine "
                          "on devices of its own (rollout.colocate=false) or drop train.async")


class Rollouts:
    """`make(rollout_id, policy_version) -> (samples, metrics)`, called for each rollout_id in order."""

    def __init__(self, make: Callable[[int, int], tuple[list[Sample], dict]], rollout_ids: list[int],
                 prefetch: bool):
        self.make, self.next_id = make, dict(zip(rollout_ids, rollout_ids[1:]))
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="relax-prefetch") if prefetch else None
        self.pending: dict[int, Future] = {}  # rollout_id -> its making, in order

    def _timed(self, rollout_id: int, policy_version: int) -> tuple[tuple, float, int]:
        t0 = time.perf_counter()
        made = self.make(rollout_id, policy_version)
        return made, time.perf_counter() - t0, policy_version

    def _start(self, rollout_id: int | None, policy_version: int) -> None:
        if self.pool and rollout_id is not None and rollout_id not in self.pending:
            self.pending[rollout_id] = self.pool.submit(self._timed, rollout_id, policy_version)

    def get(self, rollout_id: int) -> tuple[tuple, float, int]:
        """What `make` returned, the seconds their making took (prefetched: in the background)
        and the policy version that made them."""
        future = self.pending.pop(rollout_id, None)
        made = future.result() if future else self._timed(rollout_id, rollout_id)
        self._start(self.next_id.get(rollout_id), rollout_id)  # (unless synced() started it)
        return made

    def wait(self) -> None:
        """Before a weight sync: the generation in flight ends on the weights it began with."""
        wait_for(list(self.pending.values()))

    def synced(self, rollout_id: int) -> None:
        """After rollout_id's weight sync: the rollout after the next starts on those weights."""
        self._start(self.next_id.get(self.next_id.get(rollout_id)), rollout_id + 1)

    def close(self) -> None:
        """Let a generation in flight finish (its engine is shut down next); its result is dropped."""
        if self.pool:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.pending = {}
