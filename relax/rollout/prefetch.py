"""The loop's rollouts, in order: made on demand, or (train.max_staleness=k > 0) up to k ahead,
each on the policy version its rollout_id pins, so that timing never changes what is generated.

How it works in detail: docs/rollouts.md, "Inside `relax/rollout/prefetch.py`".
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Callable

from relax.errors import ConfigError
from relax.sample import Sample

log = logging.getLogger(__name__)
Made = tuple[tuple[list[Sample], dict], float, int]  # (samples, metrics), seconds, policy version


def max_staleness(train) -> int:
    """train.max_staleness, or what train.async spells (1, else 0)."""
    k = train.max_staleness
    return (1 if train["async"] else 0) if k is None else k


def check_staleness(train, rollout, builds_rollout: bool, builds_train: bool) -> None:
    """train.max_staleness (and train.async) refusals, before anything is built: a bad value, the
    two keys disagreeing, and runs where nothing can overlap."""
    k = train.max_staleness
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ConfigError(f"train.max_staleness={k!r}: expected a whole number >= 0 (0: synchronous, "
                          f"k: rollouts generated up to k policy versions ahead of training)")
    if train["async"] and k == 0:
        raise ConfigError("train.async=true with train.max_staleness=0: train.async means "
                          "train.max_staleness=1; set one of them")
    if not max_staleness(train):
        return
    key = f"train.max_staleness={k}" if k is not None else "train.async=true"
    if not builds_train:
        raise ConfigError(f"{key} overlaps generating the next rollouts with training, but "
                          f"debug.rollout_only builds no trainer: drop it for a rollout-only run")
    if not builds_rollout:
        raise ConfigError(f"{key} overlaps generating the next rollouts with training, but a "
                          f"train-only run (debug.train_only / debug.load_rollout_data) replays saved "
                          f"rollouts and generates none: drop it to replay (the replay trains the saved "
                          f"samples exactly as the run did)")
    if rollout.colocate:
        raise ConfigError(f"{key} with rollout.colocate=true: a colocated engine gives up its memory "
                          f"while the trainer runs, so it cannot generate meanwhile; run the engine on "
                          f"devices of its own (rollout.colocate=false) or drop {key}")


class Rollouts:
    """`make(rollout_id, policy_version) -> (samples, metrics)`, called for each rollout_id in
    order. With `max_staleness` k > 0 a background thread makes rollout j on policy version
    max(first, j - k), the first one the run started from: j starts as soon as the engine holds
    that version, and that version's sync waits for it. `made`: rollouts a checkpoint kept."""

    def __init__(self, make: Callable[[int, int], tuple[list[Sample], dict]], rollout_ids: list[int],
                 max_staleness: int, made: dict[int, Made] | None = None):
        self.make, self.ids, self.k = make, rollout_ids, max_staleness
        self.version = rollout_ids[0] if rollout_ids else 0  # the engine's: rollouts trained into it
        made = made or {}
        self.made = {j: m for j, m in made.items() if j - m[2] <= self.k}
        if len(self.made) < len(made):  # a resume that lowered train.max_staleness (resume_allow_changes)
            log.warning("resume: the checkpoint's rollouts %s were made further behind than "
                        "train.max_staleness=%d allows; they are made again on the resumed weights",
                        sorted(made.keys() - self.made.keys()), self.k)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="relax-prefetch") if self.k else None
        self.pending: dict[int, Future] = {}  # rollout_id -> its making, in order
        self.generated_at: float | None = None  # when the background thread last finished a rollout
        self._start_due()

    def pinned(self, rollout_id: int) -> int:
        """The policy version rollout_id is generated on."""
        return max(self.ids[0], rollout_id - self.k)

    def _timed(self, rollout_id: int, policy_version: int) -> Made:
        t0 = time.perf_counter()
        samples, metrics = self.make(rollout_id, policy_version)
        if self.pool:  # the engine's idle time before it: waiting for the weights this rollout is pinned to
            metrics["perf/generation_idle_time"] = t0 - self.generated_at if self.generated_at else 0.0
            self.generated_at = time.perf_counter()
        return (samples, metrics), time.perf_counter() - t0, policy_version

    def _start_due(self) -> None:
        """Start each rollout pinned to the engine's version, unless made or started."""
        for j in self.ids if self.pool else ():
            if self.pinned(j) == self.version and j not in self.made and j not in self.pending:
                self.pending[j] = self.pool.submit(self._timed, j, self.version)

    def get(self, rollout_id: int) -> Made:
        """What `make` returned, the seconds their making took (ahead: in the background) and the
        policy version that made them; made ahead, its metrics also say how long the trainer
        waited for it and how many rollouts were ready beyond it."""
        if rollout_id in self.made:
            return self.made.pop(rollout_id)
        future = self.pending.pop(rollout_id, None)
        if future is None:
            return self._timed(rollout_id, self.version)
        t0 = time.perf_counter()
        made = future.result()
        made[0][1]["perf/train_idle_time"] = time.perf_counter() - t0
        made[0][1]["perf/rollouts_ready_ahead"] = len(self.made) + sum(f.done() for f in self.pending.values())
        return made

    def wait(self) -> None:
        """Before a weight sync: the generations in flight end on the weights they began with."""
        wait_for(list(self.pending.values()))

    def synced(self, rollout_id: int) -> None:
        """After rollout_id's weight sync: the rollouts pinned to the new version start."""
        self.version = rollout_id + 1
        self._start_due()

    def ahead(self) -> dict[int, Made]:
        """The rollouts made on older versions than the engine's and not trained yet: what a
        checkpoint keeps, since its weights cannot make them again (after wait(): all finished)."""
        done = {j: f.result() for j, f in self.pending.items() if self.pinned(j) < self.version}
        return {**self.made, **done}

    def close(self) -> None:
        """Let a generation in flight finish (its engine is shut down next); its result is dropped."""
        if self.pool:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.pending = {}
