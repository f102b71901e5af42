"""Where the tools' figures go (`figure_dir`: `--out`, else next to the run when it can be
written, else nowhere, with a note), and the figures `relax compare` draws: loss and grad_norm
per step by job (`plot_steps`), and with `--layers` each job's relative difference per module
and per gradient against its floor (`plot_layers`)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from relax.debug.layers import Departure
from relax.files import save_figure
from relax.tools.jobs import EQUIVALENT, Job


def pyplot():
    """matplotlib's pyplot, drawing to files only (no display here or in CI)."""
    matplotlib.use("Agg")

    return plt


def out_dir(path: str) -> Path:
    """--out DIR (argparse's type): made if missing, refused at once where a file cannot be
    written in it."""
    folder = Path(path)
    why = cannot_write(folder)
    if why:
        raise argparse.ArgumentTypeError(f"{folder}: cannot write there ({why})")
    return folder


def cannot_write(folder: Path) -> str | None:
    """Why a file cannot be made in `folder` (made if missing), or None. A file made, not
    os.access: permission bits do not bind root, a read-only mount does."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as e:
        return e.strerror


def figure_dir(out: Path | None, beside: Path, tool: str,
               what: str = "plots") -> tuple[Path | None, str | None]:
    """(the folder a tool's figures go into, None), or (None, the note to print instead): `out`
    (the user's --out), else `beside` (next to the run) where a file can be made. A run that
    cannot be written (a read-only results disk) gets its report all the same."""
    why = None if out else cannot_write(beside)
    if why:
        return None, (f"note: no {what}: {beside} cannot be written ({why}); "
                      f"relax {tool} ... --out DIR writes them there")
    return out or beside, None


def draw(plot, data, folder: Path | None, name: str) -> Path | None:
    """`plot(data, folder / name)`, where there is a folder (`figure_dir`); the file, or None."""
    if folder is None:
        return None
    plot(data, folder / name)
    return folder / name


def plot_steps(jobs: list[Job], out: Path) -> None:
    """train/loss and train/grad_norm per step, one line per job (dashed: not equivalent)."""
    plt = pyplot()
    fig, (ax_loss, ax_gn) = plt.subplots(1, 2, figsize=(11, 4.5))
    for job in jobs:
        if job.loss:
            style = "-" if job.verdict == EQUIVALENT else "--"
            label = f"{job.name} ({job.verdict})"
            ax_loss.plot(job.loss, style, marker="o", label=label)
            ax_gn.plot(job.grad_norm, style, marker="o", label=label)
    ax_loss.set(title="train/loss per step", xlabel="step")
    ax_gn.set(title="train/grad_norm per step", xlabel="step")
    ax_gn.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out, dpi=100)
    plt.close(fig)


def plot_layers(departures: list[Departure], out: Path) -> None:
    """Relative difference per module (forward order) and per gradient (backward order), one
    line per job, each job's floor shaded."""
    plt = pyplot()
    parts = [p for p in ("forward", "grads") if any(d.diffs.get(p) for d in departures)]
    fig, axes = plt.subplots(1, len(parts), figsize=(7 * len(parts), 4.8), squeeze=False)
    for ax, part in zip(axes[0], parts, strict=True):
        for dep in departures:
            names = list(dep.diffs[part])
            if not names:
                continue
            tiny = 1e-12  # log axis: an exact match is drawn at the bottom
            values = [max(dep.diffs[part][n], tiny) for n in names]
            (line,) = ax.plot(range(len(names)), values, marker=".", label=dep.job)
            ax.fill_between(range(len(names)), tiny, [dep.floors[part][n] for n in names],
                            color=line.get_color(), alpha=0.12)
        ax.set_yscale("log")
        labels = list(next(d.diffs[part] for d in departures if d.diffs.get(part)))
        step = max(1, len(labels) // 24)
        ax.set_xticks(range(0, len(labels), step),
                      [labels[i].replace("model.", "") for i in range(0, len(labels), step)],
                      rotation=70, fontsize=6)
        what = "module outputs (forward order)" if part == "forward" else "gradients (backward order)"
        ax.set(title=f"{what}: rel Δ, floor shaded", ylabel="||a - b|| / ||b||")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out, dpi=100)
    plt.close(fig)
