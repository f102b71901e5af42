"""The jobs `relax compare` reads: a run dir's layout, status, per-step loss and grad_norm,
first-step log-probs and perf, and which of them can be the baseline."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from relax.debug.run_data import read_config
from relax.errors import ConfigError, ReplayError
from relax.files import read_json, safe_load
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
    step_noise_ulp: int = 0
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
    envelope: str | None = None  # the noise twin whose distance from the baseline set the limits
    departed_at_step: int | None = None  # first step beyond the step-0 tolerances (`tolerances`)
    judged_steps: int = 0  # steps 0..judged_steps-1 judged by size; every step for NaN/Inf
    tolerances: dict[str, float] = field(default_factory=dict)  # step 0's, after the twin's scaling
    notes: list[str] = field(default_factory=list)  # what was not judged, and why
    model: str | None = None  # the model it trained (built.json: its path), None before it built one
    model_fingerprint: str | None = None  # its architecture (relax.model.model_fingerprint)

    @property
    def nudged(self) -> bool:
        """A noise twin (parallel=twin*): weights nudged at the start, after every step, or both."""
        return self.noise_ulp > 0 or self.step_noise_ulp > 0


def load_job(path: Path) -> Job:
    job = Job(path=path, name=path.name)
    config = path / ".hydra" / "config.yaml"
    if config.is_file():
        cfg = read_config(config)
        job.backend, job.layout = cfg["train._target_"], cfg["parallel.name"]
        job.noise_ulp, job.step_noise_ulp = cfg["parallel.noise_ulp"], cfg["parallel.step_noise_ulp"]
    if (path / "built.json").is_file():
        built = read_json(path / "built.json")
        job.model, job.model_fingerprint = built.get("model_path"), built.get("model_fingerprint")
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


def same_model(jobs: list[Job], base: Job, allow: bool) -> Job:
    """`base`, once every job is known to have trained the baseline's model: between different
    models every step differs, and the verdicts would say nothing about a layout. A ConfigError
    naming the models, or with `allow` (--allow-different-models) a note on stderr, printed
    before any verdict."""
    def model(j: Job) -> str:
        return f"{j.model} (architecture {j.model_fingerprint or '?'})"

    def other(j: Job) -> bool:  # by the model folder's name (runs of other machines have other
        fingerprints = {j.model_fingerprint, base.model_fingerprint}  # caches) and architecture
        return None not in (j.model, base.model) and (
            Path(j.model).name != Path(base.model).name or len(fingerprints - {None}) > 1)
    others = [j for j in jobs if other(j)]
    if not others:
        return base
    what = (f"different models: the baseline {base.name} trained {model(base)}, "
            + "; ".join(f"{j.name} {model(j)}" for j in others)
            + ": their per-step differences are not a layout's, the verdicts compare different models")
    if not allow:
        raise ConfigError(f"{what} (--allow-different-models judges them anyway)")
    print(f"relax compare: note: {what}", file=sys.stderr)
    return base
