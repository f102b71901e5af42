"""Metrics sinks (conf/logger/): metrics.jsonl always, plus logger.backends, and plots.

metrics.jsonl has one JSON object per line: a rollout record (`rollout_id`, `rollout/*`,
`perf/*`, `eval/*`) or a train-step record (`rollout_id`, `step`, `train/*`). Each backend
gets the same numbers, at step `rollout_id`: `tensorboard` (event files in <run dir>/tensorboard)
and `wandb` (a Weights & Biases run named after the run dir, with the composed config as its
config, under <run dir>/wandb; WANDB_MODE=offline writes it there only). Any of them, together:
logger.backends=[tensorboard,wandb].
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from functools import partial
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from torch.utils.tensorboard import SummaryWriter

from relax.errors import ConfigError, ReplayError
from relax.files import append_jsonl, is_disk_full, read_jsonl, save_figure

METRICS_FILE = "metrics.jsonl"
ROLLOUT_KEYS = ("rollout/raw_reward",)  # in every rollout record: what readers rely on
STEP_KEYS = ("train/loss", "train/grad_norm")  # in every train-step record
BACKENDS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # backend -> the module it needs


def check_backends(backends) -> None:
    """Start-up refusal: an unknown backend, or one whose library is not installed."""
    for name in backends:
        if name not in BACKENDS:
            raise ConfigError(f"logger.backends has {name!r}: expected any of {', '.join(BACKENDS)}")
        if importlib.util.find_spec(BACKENDS[name]) is None:
            raise ConfigError(f"logger.backends has {name!r}, but {BACKENDS[name]} is not installed: "
                              f"pip install -e '.[{name}]'")


class TensorBoard:
    def __init__(self, run_dir: Path, resume_from: int):
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_from or None)

    def log(self, scalars: dict, step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, run_dir: Path, config: dict | None, project: str, entity: str | None):
        # optional: wandb (relax[wandb])
        import wandb

        self.run = wandb.init(project=project, entity=entity, name=run_dir.name, dir=str(run_dir),
                              config=config)

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """logger._target_'s default; called with the logger group's keys, run_dir=, resume_from=
    and run_config= (the composed config, resolved; Hydra's instantiate). A custom logger takes
    the same arguments and implements log(record, x_key) and close()."""

    def __init__(self, run_dir: Path, backends=(), resume_from: int = 0, run_config: dict | None = None,
                 wandb_project: str = "relax", wandb_entity: str | None = None):
        check_backends(backends)
        run_dir = Path(run_dir)
        self.path = run_dir / METRICS_FILE
        self.path.touch()
        self.sinks = [TensorBoard(run_dir, resume_from) if name == "tensorboard" else
                      Wandb(run_dir, run_config, wandb_project, wandb_entity) for name in backends]

    def log(self, record: dict, x_key: str) -> None:
        append_jsonl(self.path, record)  # (a full disk: DiskFull, the file as it was, no half line)
        scalars = {k: v for k, v in record.items() if "/" in k and isinstance(v, (int, float))}
        for sink in self.sinks:
            sink.log(scalars, record[x_key])

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def lose_log_lines_on_a_full_disk() -> None:
    """The root logger's files (relax.log) on a full disk: their lines are lost, with one note on
    stderr, instead of logging's traceback for every line. The run itself ends with DiskFull at
    its next write of data (metrics, samples, a checkpoint)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handleError = partial(_lose_line, handler)


def _lose_line(handler: logging.FileHandler, record: logging.LogRecord) -> None:
    if not is_disk_full(sys.exc_info()[1]):
        logging.FileHandler.handleError(handler, record)
    elif not getattr(handler, "disk_full", False):
        handler.disk_full = True
        print(f"relax: {handler.baseFilename}: disk full, log lines from here on are not in it",
              file=sys.stderr)


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


REFERENCE_RUNS = "where the reference ran (the first step, algo.use_kl_loss, train.ref_log_probs_interval)"


def reward_plot_title(run_name: str, rollouts: list[dict]) -> str:
    """What reward.png shows: KL only exists for rollouts that ran the reference pass."""
    with_kl = sum("rollout/kl" in r for r in rollouts)
    if not with_kl:
        return f"{run_name}: mean raw reward per rollout\nno KL: it is measured {REFERENCE_RUNS}"
    where = "every rollout" if with_kl == len(rollouts) else \
        f"{with_kl} of {len(rollouts)} rollouts, only {REFERENCE_RUNS}"
    return f"{run_name}: mean raw reward (blue) and KL(actor || reference) (red) per rollout\nKL at {where}"


def plot_run(run_dir: Path) -> Path | None:
    """reward.png: mean raw reward per rollout, and KL to the reference where it was measured."""
    rollouts, _ = read_metrics(run_dir)
    if not rollouts:
        return None

    matplotlib.use("Agg")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [r["rollout_id"] for r in rollouts]
    lines = ax.plot(x, [r["rollout/raw_reward"] for r in rollouts], color="tab:blue", label="raw reward")
    ax.set_xlabel("rollout_id")
    ax.set_ylabel("mean raw reward", color="tab:blue")
    with_kl = [r for r in rollouts if "rollout/kl" in r]  # rollouts that ran the reference pass
    if with_kl:
        ax2 = ax.twinx()
        lines += ax2.plot([r["rollout_id"] for r in with_kl], [r["rollout/kl"] for r in with_kl],
                          color="tab:red", marker="." if len(with_kl) < len(rollouts) else None,
                          label="KL(actor || ref), where measured", alpha=0.7)
        ax2.set_ylabel("rollout/kl", color="tab:red")
    ax.legend(handles=lines, loc="best", fontsize="small")
    ax.set_title(reward_plot_title(Path(run_dir).name, rollouts), fontsize="medium")
    fig.tight_layout()
    out = Path(run_dir) / "reward.png"
    save_figure(fig, out, dpi=100)
    plt.close(fig)
    return out
