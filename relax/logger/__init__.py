"""Metrics sinks (conf/logger/): metrics.jsonl always, TensorBoard on request, and plots.

metrics.jsonl has one JSON object per line: a rollout record (`rollout_id`, `rollout/*`,
`perf/*`) or a train-step record (`rollout_id`, `step`, `train/*`).
"""

from __future__ import annotations

import json
from pathlib import Path

from relax.errors import ReplayError
from relax.files import read_jsonl

METRICS_FILE = "metrics.jsonl"
ROLLOUT_KEYS = ("rollout/raw_reward",)  # in every rollout record: what readers rely on
STEP_KEYS = ("train/loss", "train/grad_norm")  # in every train-step record


class MetricsLogger:
    """logger._target_'s default; called with the logger group's keys, run_dir= and resume_from=
    (Hydra's instantiate). A custom logger implements log(record, x_key) and close()."""

    def __init__(self, run_dir: Path, tensorboard: bool, resume_from: int = 0):
        self.path = Path(run_dir) / METRICS_FILE
        self.file = self.path.open("a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=resume_from or None)

    def log(self, record: dict, x_key: str) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb:
            for k, v in record.items():
                if "/" in k and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record[x_key])

    def close(self) -> None:
        self.file.close()
        if self.tb:
            self.tb.close()


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(rollout records, train-step records) of a run; a ReplayError naming metrics.jsonl if it
    is not one."""
    path = Path(run_dir) / METRICS_FILE
    records = read_jsonl(path) if path.is_file() else []
    for r in records:
        needed = STEP_KEYS if "step" in r else ROLLOUT_KEYS
        numbers = all(isinstance(r.get(k), (int, float)) for k in needed)
        if not isinstance(r.get("rollout_id"), int) or not numbers:
            raise ReplayError(f"{path}: not a metrics record (an integer rollout_id, numbers for "
                              f"{', '.join(needed)}): {r!r:.200}")
    return [r for r in records if "step" not in r], [r for r in records if "step" in r]


def plot_run(run_dir: Path) -> Path | None:
    """reward.png: mean raw reward and KL to the reference, per rollout."""
    rollouts, _ = read_metrics(run_dir)
    if not rollouts:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [r["rollout_id"] for r in rollouts]
    ax.plot(x, [r["rollout/raw_reward"] for r in rollouts], color="tab:blue", label="raw reward")
    ax.set_xlabel("rollout_id")
    ax.set_ylabel("mean raw reward", color="tab:blue")
    with_kl = [r for r in rollouts if "rollout/kl" in r]  # rollouts that ran the reference pass
    if with_kl:
        ax2 = ax.twinx()
        ax2.plot([r["rollout_id"] for r in with_kl], [r["rollout/kl"] for r in with_kl], color="tab:red",
                 marker="." if len(with_kl) < len(rollouts) else None, label="KL(actor || ref)", alpha=0.7)
        ax2.set_ylabel("rollout/kl", color="tab:red")
    ax.set_title(f"{Path(run_dir).name}: reward and KL per rollout")
    fig.tight_layout()
    out = Path(run_dir) / "reward.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
