"""How far a run is, for people: a progress bar on a terminal, log lines elsewhere.

A tqdm bar redraws itself with carriage returns; where stderr is a pipe or a file (CI,
`nohup`, `relax 2>&1 | tee run.txt`) every redraw stays in the output, cut into the log lines.
There the bar is off and a log line takes its place every tenth of the run or every
EVERY_S seconds, whichever comes first:
`rollouts 40/400: reward 0.312 (mean of rollouts 30-39), 0.31 s/rollout, 1m52s left`.
"""

from __future__ import annotations

import logging
import time

from tqdm.auto import tqdm

log = logging.getLogger("relax")

EVERY_S = 30.0


def duration(seconds: float) -> str:
    """`1h02m`, `3m05s`, `12s`."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """One update() per finished rollout, with its mean raw reward; close() at the end."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.bar = tqdm(total=total, desc="rollouts", unit="rollout", disable=None)  # None: off unless a TTY
        self.every = max(1, total // 10)
        self.start = self.last = time.monotonic()
        self.rewards: dict[int, float] = {}  # rollout_id -> reward, since the last line

    def update(self, rollout_id: int, reward: float) -> None:
        self.done += 1
        if not self.bar.disable:
            self.bar.update()
            self.bar.set_postfix(reward=f"{reward:.3f}")
            return
        self.rewards[rollout_id] = reward
        now = time.monotonic()
        if self.done % self.every and now - self.last < EVERY_S and self.done < self.total:
            return
        ids = list(self.rewards)
        span = f"rollout {ids[0]}" if len(ids) == 1 else f"mean of rollouts {ids[0]}-{ids[-1]}"
        per = (now - self.start) / self.done
        log.info("rollouts %d/%d: reward %.3f (%s), %.2f s/rollout, %s left", self.done, self.total,
                 sum(self.rewards.values()) / len(ids), span, per, duration(per * (self.total - self.done)))
        self.rewards, self.last = {}, now

    def close(self) -> None:
        self.bar.close()
