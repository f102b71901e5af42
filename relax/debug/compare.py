"""`relax compare <multirun dir> | <run A> <run B> ...`: layout against layout, a verdict each.

Every job is compared with a baseline job (`--baseline NAME`, else the first `single` job,
else the first job; a job that completed with training steps, or the tool exits 2 saying
why none is): the per-token log_probs of the first training step on a fixed sample set (a
sample missing, extra or with another token count is a divergence), and per-step loss and
grad_norm. The first `--strict-steps` steps (same weights, same data: only the reduction
order differs) must agree within the fixed tolerances. Later steps are judged against the
baseline's own noise envelope when the sweep holds a noise twin of it (`parallel=twin`: the
baseline with each initial weight moved by one ulp): fp32 rounding differences grow over a
long run however correct the layout is, so a step diverges only when it is
`--envelope-margin` times further from the baseline than the twin got by then. Without a
twin every step is held to the fixed tolerances. NaN or Inf is always a divergence. A job
is `equivalent`, `DIVERGED` (with the first step that left the tolerance or envelope) or
`FAILED` (did not complete, or has no training steps). The exit code is 1 if any job
diverged or failed, so a layout sweep can gate CI (2: bad input). A plot of loss and
grad_norm per step by layout is written next to the runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from relax.debug.checks import over, worst
from relax.debug.run_data import read_config
from relax.errors import ConfigError, ReplayError
from relax.files import safe_load
from relax.logger import read_metrics
from relax.process import describe, read_status

EQUIVALENT, DIVERGED, FAILED = "equivalent", "DIVERGED", "FAILED"


@dataclass
class Job:
    path: Path
    name: str
    backend: str = "?"
    layout: str = "?"
    noise_ulp: int = 0
    status: str = "missing"
    error: str | None = None
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    step_time: float | None = None
    peak_memory_mb: float | None = None
    log_probs: dict[int, list[float]] = field(default_factory=dict)
    verdict: str = FAILED
    reasons: list[str] = field(default_factory=list)
    max_logprob_diff: float | None = None
    max_grad_norm_rel_diff: float | None = None
    max_loss_diff: float | None = None
    diverged_at_step: int | None = None
    envelope: str | None = None  # the twin whose distance from the baseline bounded later steps


def load_job(path: Path) -> Job:
    job = Job(path=path, name=path.name)
    config = path / ".hydra" / "config.yaml"
    if config.is_file():
        cfg = read_config(config)
        job.backend, job.layout = cfg["train._target_"], cfg["parallel.name"]
        job.noise_ulp = cfg["parallel.noise_ulp"]
    status = read_status(path)
    if status:
        job.status = status["status"]
    # a run killed with SIGKILL still says running: describe() tells it is dead
    job.error = describe(status) if job.status != "completed" else None
    _, steps = read_metrics(path)
    job.loss = [s["train/loss"] for s in steps]
    job.grad_norm = [s["train/grad_norm"] for s in steps]
    step_times, memory = logged(steps, "perf/step_time"), logged(steps, "perf/peak_memory_mb")
    job.step_time = sum(step_times) / len(step_times) if step_times else None
    job.peak_memory_mb = max(memory) if memory else None
    if (path / "first_step_log_probs.pt").is_file():
        job.log_probs = read_log_probs(path / "first_step_log_probs.pt")
    return job


def logged(steps: list[dict], key: str) -> list[float]:
    """A metric read_metrics does not require (perf/*: a custom trainer may log none), from the
    steps that logged it as a number."""
    return [s[key] for s in steps if isinstance(s.get(key), (int, float))]


def read_log_probs(path: Path) -> dict[int, list[float]]:
    """first_step_log_probs.pt: sample index -> that sample's per-token log_probs."""
    data = safe_load(path)
    if not all(isinstance(i, int) and isinstance(lps, list) and all(isinstance(x, (int, float)) for x in lps)
               for i, lps in data.items()):
        raise ReplayError(f"{path}: not first-step log_probs (a dict of sample index -> list of numbers)")
    return data


def is_run(path: Path) -> bool:
    return (path / ".hydra").is_dir()  # Hydra writes it before the job starts


def find_jobs(paths: list[Path]) -> list[Job]:
    if len(paths) == 1 and not is_run(paths[0]):  # a multirun dir
        multirun, paths = paths[0], [p for p in paths[0].iterdir() if is_run(p)]
        if not paths:
            raise ConfigError(f"{multirun}: neither a run dir nor a multirun dir (no subdir with .hydra/)")
        paths.sort(key=lambda p: (p / ".hydra").stat().st_mtime)  # launch order
    for p in paths:
        if not is_run(p):
            raise ConfigError(f"{p} is not a run dir (no .hydra/ in it): expected a multirun dir, or "
                              f"two or more run dirs")
    return [load_job(p) for p in paths]


def unusable(job: Job) -> str | None:
    """Why `job` can be neither judged nor the baseline the others are judged against (None:
    it can): it did not complete, or it has no training steps."""
    if job.status != "completed":
        return job.error or f"status {job.status}"
    if not job.loss:
        return "no training steps in its metrics.jsonl (a debug=rollout_only run?)"
    return None


def pick_baseline(jobs: list[Job], name: str | None) -> Job:
    """`--baseline NAME`, else the first `single` job, else the first job; a completed one with
    training steps, or a ConfigError saying why none can be."""
    if name is not None:
        matches = [j for j in jobs if name in (j.name, j.layout)]
        if not matches:
            raise ConfigError(f"--baseline {name!r}: no such job (jobs: {', '.join(j.name for j in jobs)})")
        why = unusable(matches[0])
        if why:
            raise ConfigError(f"--baseline {name!r}: {matches[0].name} cannot be the baseline: {why}")
        return matches[0]
    fit = [j for j in jobs if unusable(j) is None]
    if not fit:
        raise ConfigError("no job can be the baseline (a completed run with training steps): "
                          + "; ".join(f"{j.name}: {unusable(j)}" for j in jobs))
    return next((j for j in fit if j.layout == "single"), fit[0])


@dataclass
class Tolerances:
    logprob_atol: float = 1e-5
    grad_norm_rtol: float = 1e-4
    loss_atol: float = 1e-5
    strict_steps: int = 2
    envelope_margin: float = 10.0


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def find_twin(jobs: list[Job], base: Job) -> Job | None:
    """A completed noise twin of the baseline (same backend, initial weights nudged)."""
    return next((j for j in jobs if j.noise_ulp > 0 and j.status == "completed" and j is not base
                 and j.backend == base.backend and len(j.loss) == len(base.loss)), None)


def envelope(twin: Job, base: Job) -> list[tuple[float, float]]:
    """Per step, the largest |Δ loss| and grad_norm rel Δ the twin reached by then."""
    out, loss_max, gn_max = [], 0.0, 0.0
    for t_loss, b_loss, t_gn, b_gn in zip(twin.loss, base.loss, twin.grad_norm, base.grad_norm):
        loss_max, gn_max = max(loss_max, abs(t_loss - b_loss)), max(gn_max, rel(t_gn, b_gn))
        out.append((loss_max, gn_max))
    return out


def first_divergence(job: Job, base: Job, tol: Tolerances, env) -> tuple[int, str] | None:
    """The first step outside the strict tolerances (or, past the strict steps, the envelope)."""
    for step, (loss, b_loss, gn, b_gn) in enumerate(zip(job.loss, base.loss, job.grad_norm, base.grad_norm)):
        for name, value in (("train/loss", loss), ("train/grad_norm", gn)):
            if not math.isfinite(value):
                return step, f"step {step}: {name} is {value}"
        d_loss, d_gn = abs(loss - b_loss), rel(gn, b_gn)
        if env is not None and step >= tol.strict_steps:
            env_loss, env_gn = env[step]
            loss_limit = tol.envelope_margin * env_loss + tol.loss_atol
            gn_limit = tol.envelope_margin * env_gn + tol.grad_norm_rtol
            where = f"the noise envelope ({tol.envelope_margin:g} x twin)"
        else:
            loss_limit, gn_limit, where = tol.loss_atol, tol.grad_norm_rtol, "tolerance"
        if over(d_gn, gn_limit):
            return step, f"step {step}: grad_norm rel Δ {d_gn:.2e} > {gn_limit:.2e} ({where})"
        if over(d_loss, loss_limit):
            return step, f"step {step}: |Δ loss| {d_loss:.2e} > {loss_limit:.2e} ({where})"
    return None


def logprob_mismatches(job: Job, base: Job) -> list[str]:
    """Where the first-step log_probs do not have the baseline's shape, sample by sample: a
    sample missing, extra or with other token counts cannot be judged on the overlap."""
    lacking = list(dict.fromkeys(j.name for j in (job, base) if not j.log_probs))  # job may be base
    if lacking:
        return [f"no first-step log_probs to compare ({' and '.join(lacking)}: no first_step_log_probs.pt)"]
    ours, theirs = set(job.log_probs), set(base.log_probs)
    out = []
    if theirs - ours:
        out.append(f"first-step log_probs missing for baseline sample(s) "
                   f"{fmt_series(sorted(theirs - ours), 8, 'd')}")
    if ours - theirs:
        out.append(f"first-step log_probs for sample(s) {fmt_series(sorted(ours - theirs), 8, 'd')} "
                   f"that the baseline lacks")
    for i in sorted(ours & theirs):
        if len(job.log_probs[i]) != len(base.log_probs[i]):
            out.append(f"sample {i}: {len(job.log_probs[i])} first-step log_probs vs "
                       f"{len(base.log_probs[i])} in the baseline")
    return out


def judge(job: Job, base: Job, tol: Tolerances, twin: Job | None = None) -> None:
    why = unusable(job)
    if why:
        job.verdict, job.reasons = FAILED, [why]
        return
    reasons = []
    if len(job.loss) != len(base.loss):
        reasons.append(f"{len(job.loss)} steps vs {len(base.loss)} in the baseline")
    job.max_loss_diff = worst(abs(a - b) for a, b in zip(job.loss, base.loss))
    job.max_grad_norm_rel_diff = worst(rel(a, b) for a, b in zip(job.grad_norm, base.grad_norm))
    reasons += logprob_mismatches(job, base)
    diffs = [abs(a - b) for i in sorted(set(job.log_probs) & set(base.log_probs))
             if len(job.log_probs[i]) == len(base.log_probs[i])
             for a, b in zip(job.log_probs[i], base.log_probs[i])]
    job.max_logprob_diff = worst(diffs) if diffs else None
    if diffs and over(job.max_logprob_diff, tol.logprob_atol):
        reasons.append(f"max |Δ log_prob| {job.max_logprob_diff:.2e} > {tol.logprob_atol:g} (first step)")
    env = envelope(twin, base) if twin is not None else None
    job.envelope = twin.name if twin is not None else None
    found = first_divergence(job, base, tol, env)
    if found:
        job.diverged_at_step = found[0]
        reasons.append(found[1])
    job.verdict, job.reasons = (DIVERGED, reasons) if reasons else (EQUIVALENT, [])


def plot(jobs: list[Job], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from relax.debug.doctor import save_figure

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


def fmt_series(xs: list[float], limit: int = 4, fmt: str = ".4g") -> str:
    shown = ", ".join(format(x, fmt) for x in xs[:limit])
    return shown + (f", … ({len(xs)})" if len(xs) > limit else "")


def render(jobs: list[Job], base: Job, console: Console) -> None:
    twin = next((j.envelope for j in jobs if j.envelope), None)
    table = Table("job", "backend", "layout", "status", "loss / step", "grad_norm / step",
                  "max |Δ logp|", "grad_norm rel Δ", "step s", "peak MB", "verdict", "diverged at",
                  title=f"relax compare (baseline: {base.name}; "
                        f"{f'later steps within the noise envelope of {twin}' if twin else 'no noise twin'})")
    color = {EQUIVALENT: "green", DIVERGED: "red", FAILED: "red"}
    num = lambda x: "-" if x is None else f"{x:.2e}"  # noqa: E731
    for j in jobs:
        table.add_row(j.name, j.backend, j.layout, j.status, fmt_series(j.loss),
                      fmt_series(j.grad_norm), num(j.max_logprob_diff),
                      num(j.max_grad_norm_rel_diff),
                      "-" if j.step_time is None else f"{j.step_time:.3f}",
                      "-" if j.peak_memory_mb is None else f"{j.peak_memory_mb:.0f}",
                      f"[{color[j.verdict]}]{j.verdict}[/]",
                      "-" if j.diverged_at_step is None else f"step {j.diverged_at_step}")
    console.print(table)
    for j in jobs:
        if j.reasons:
            console.print(f"[red]{j.name}[/]: " + "; ".join(j.reasons))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="relax compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path, help="a multirun dir, or two or more run dirs")
    ap.add_argument("--baseline", help="job (dir name or layout) to compare against (default: single)")
    ap.add_argument("--logprob-atol", type=float, default=1e-5, help="max |Δ| of per-token log_probs")
    ap.add_argument("--grad-norm-rtol", type=float, default=1e-4, help="max relative Δ of grad_norm")
    ap.add_argument("--loss-atol", type=float, default=1e-5, help="max |Δ| of the per-step loss")
    ap.add_argument("--strict-steps", type=int, default=2,
                    help="steps held to the fixed tolerances; later ones to the twin's envelope")
    ap.add_argument("--envelope-margin", type=float, default=10.0,
                    help="how many times the twin's distance from the baseline a later step may be")
    ap.add_argument("--plot", type=Path, help="where to write the plot (default: next to the runs)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(argv)
    for p in args.paths:
        if not p.is_dir():
            print(f"relax compare: error: {p} is not a directory", file=sys.stderr)
            return 2
    try:
        jobs = find_jobs(args.paths)
        if len(jobs) < 2:
            raise ConfigError(f"need at least two runs, found {len(jobs)}")
        base = pick_baseline(jobs, args.baseline)
    except (ConfigError, ReplayError) as e:
        print(f"relax compare: error: {e}", file=sys.stderr)
        return 2
    tol = Tolerances(args.logprob_atol, args.grad_norm_rtol, args.loss_atol, args.strict_steps,
                     args.envelope_margin)
    twin = find_twin(jobs, base)
    for job in jobs:
        judge(job, base, tol, twin)
    out = args.plot or (args.paths[0] / "compare.png")
    plot(jobs, out)
    if args.json:
        print(json.dumps({"baseline": base.name, "plot": str(out), "jobs": [
            {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(j).items() if k != "log_probs"}
            for j in jobs]}))
    else:
        render(jobs, base, Console(width=200))
        print(f"plot: {out}")
    return 0 if all(j.verdict == EQUIVALENT for j in jobs) else 1
