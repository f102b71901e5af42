"""debug.profile_dir: where a training step's time goes, by phase and by operator.

A trainer's `train()` of the rollouts in debug.profile_rollouts runs under torch.profiler on
every rank. Each rank writes `rollout_<id>_rank<r>.json`, a Chrome trace (open it in
ui.perfetto.dev or chrome://tracing), and `rollout_<id>_rank<r>.txt`: the phases the trainers
mark (`step:reference`, `step:old_log_probs`, `step:forward_backward`, `step:optimizer`)
with their share of the call, then the operators by self time. Rank 0 logs the phases.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, record_function

from relax.files import atomic_write_text

log = logging.getLogger(__name__)
PHASES = ("step:reference", "step:old_log_probs", "step:forward_backward", "step:optimizer")
TOP_OPS = 30


def phase(name: str):
    """A marked range of a trainer's step (a no-op unless the profiler runs)."""
    assert name in PHASES, name
    return record_function(name)


def profiled(train):
    """Decorates a trainer's `train(rollout_id, samples)`: profiled when debug.profile_dir is set
    and rollout_id is one of debug.profile_rollouts (both resolved by relax/debug/plan.py, and
    given to the trainer in its `spec`, relax/train/spec.py)."""
    @functools.wraps(train)
    def wrapper(self, rollout_id: int, samples):
        spec = self.spec
        if spec.profile_dir is None or rollout_id not in spec.profile_rollouts:
            return train(self, rollout_id, samples)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=activities) as prof:
            out = train(self, rollout_id, samples)
        write(prof, Path(spec.profile_dir) / f"rollout_{rollout_id}_rank{self.layout.rank}", rollout_id,
              self.layout.rank, time.perf_counter() - t0)
        return out
    wrapper.profiled = True  # relax/debug/plan.py refuses debug.profile_dir for a trainer without it
    return wrapper


def phase_seconds(events) -> dict[str, float]:
    """Total wall seconds of each marked phase (summed over its calls)."""
    return {e.key: e.cpu_time_total / 1e6 for e in events if e.key in PHASES}


def write(prof, stem: Path, rollout_id: int, rank: int, seconds: float) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    events = prof.key_averages()
    phases = phase_seconds(events)
    lines = [f"train() of rollout {rollout_id}, rank {rank}: {seconds:.2f} s under the profiler", "",
             f"{'phase':<26} {'seconds':>9} {'share':>7}"]
    lines += [f"{name:<26} {phases.get(name, 0.0):9.4f} {phases.get(name, 0.0) / seconds:7.1%}"
              for name in PHASES]
    other = seconds - sum(phases.values())
    lines += [f"{'(rest of train())':<26} {other:9.4f} {other / seconds:7.1%}", "",
              events.table(sort_by="self_cpu_time_total", row_limit=TOP_OPS)]
    atomic_write_text(stem.with_suffix(".txt"), "\n".join(lines) + "\n")
    tmp = stem.with_suffix(".json.tmp")
    prof.export_chrome_trace(str(tmp))
    tmp.replace(stem.with_suffix(".json"))
    if rank == 0:
        log.info("profile of rollout %d (rank 0, %.1f s): %s; %s.{txt,json}", rollout_id, seconds,
                 ", ".join(f"{k.split(':')[1]} {v:.2f} s" for k, v in phases.items()), stem)
