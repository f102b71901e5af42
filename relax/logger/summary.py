"""The lines a finished run ends with: where it is, how its reward moved, what to run next."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

from relax.logger import read_metrics

log = logging.getLogger("relax")

REWARD = "rollout/raw_reward"


def ends(rollouts: list[dict]) -> tuple[tuple[str, float], tuple[str, float]]:
    """The reward at the start and the end: the mean of the first and the last k rollouts, k a
    tenth of the run, 1 to 10 (one rollout's mean reward is noisy), each with the rollouts it
    averages (`rollout 0`, `rollouts 0-9`)."""
    k = max(1, min(10, len(rollouts) // 10))

    def mean(part: list[dict]) -> tuple[str, float]:
        ids = [r["rollout_id"] for r in part]
        which = f"rollout {ids[0]}" if k == 1 else f"rollouts {ids[0]}-{ids[-1]}"
        return which, sum(r[REWARD] for r in part) / k
    return mean(rollouts[:k]), mean(rollouts[-k:])


def shown(path: Path) -> str:
    """A path as a command takes it: relative to the working directory when inside it, quoted."""
    path = Path(path).resolve()
    try:
        path = path.relative_to(Path.cwd())
    except ValueError:
        pass
    return shlex.quote(str(path))


def reward_line(rollouts: list[dict], mode: str) -> str:
    if not rollouts:
        return "reward: no rollout finished"
    (first, start), (last, end) = ends(rollouts)
    moved = f"{start:.3f} ({first}) -> {end:.3f} ({last})"
    if mode == "train_only":
        return (f"reward: not this run's (debug=train_only trains on replayed rollouts, scored when "
                f"they were made: {moved})")
    moved = f"reward ({REWARD}): {moved}, {end - start:+.3f}"
    if mode == "rollout_only":
        return moved + " (debug=rollout_only trains nothing: the policy never changed, the change is noise)"
    return moved


def log_summary(run_dir: Path, mode: str, dump_dir: Path | None, saved_rollouts: str | None,
                plot: Path | None) -> list[str]:
    """Logs the summary, a log line each, and returns its lines. mode: full, rollout_only or
    train_only; dump_dir: debug.dump_details; saved_rollouts: where the run's rollouts went
    (debug.save_rollout_data's template); plot: reward.png."""
    rollouts, _ = read_metrics(run_dir)
    lines = [f"Done: {len(rollouts)} rollouts in {shown(run_dir)}", reward_line(rollouts, mode)]
    if plot:
        lines.append(f"plot: {shown(plot)}")
    lines.append(f"next: relax doctor {shown(run_dir)}   (the run's health: what went wrong, if anything)")
    if dump_dir:
        lines.append(f"next: relax inspect {shown(dump_dir)}   (the dumped rollouts and train data, "
                     f"sample by sample)")
    if saved_rollouts and mode != "train_only":
        lines.append(f"next: relax debug=train_only debug.load_rollout_data={shown(saved_rollouts)}   "
                     f"(the trainer alone on the saved rollouts; add the run's own overrides)")
    for line in lines:
        log.info("%s", line)
    return lines
