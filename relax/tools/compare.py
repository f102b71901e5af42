"""`relax compare <multirun dir> | <run A> <run B> ...`: layout against layout, a verdict each.

Every job is compared with a baseline job (`--baseline NAME`, else the first `single` job,
else the first job; a job that completed with training steps, or the tool exits 2 saying
why none is): the per-token log_probs of the first training step on a fixed sample set (a
sample missing, extra or with another token count is a divergence), and per-step loss and
grad_norm. A job "departs" at the first step whose difference leaves the step-0 tolerances.

How it works in detail: docs/debugging.md, "Inside `relax/tools/compare.py`".
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

from relax.tools.jobs import DIVERGED, EQUIVALENT, FAILED, Job, find_jobs, pick_baseline, same_model, unusable
from relax.tools.layers import compare_layers
from relax.tools.plots import draw, figure_dir, out_dir, plot_steps
from relax.debug.verdicts import Tolerances, over, scaled_floor, worst
from relax.errors import ConfigError, ReplayError

def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def finite(job: Job) -> bool:
    return all(math.isfinite(x) for x in (*job.loss, *job.grad_norm))


def find_twins(jobs: list[Job], base: Job) -> list[Job]:
    """The completed noise twins of the baseline (same backend, weights nudged) with as many
    steps and finite metrics (a NaN twin measures no noise; it is DIVERGED itself)."""
    return [j for j in jobs if j.nudged and j.status == "completed" and j is not base
            and j.backend == base.backend and len(j.loss) == len(base.loss) and finite(j)]


# the per-step metrics, each with its name in the reasons and its fixed tolerance
STEP_METRICS = (("grad_norm", "grad_norm rel Δ", "grad_norm_rtol"), ("loss", "|Δ loss|", "loss_atol"))


def step_diffs(job: Job, base: Job) -> list[dict[str, float]]:
    """Per step, the grad_norm rel Δ and |Δ loss| against the baseline."""
    return [{"grad_norm": rel(gn, b_gn), "loss": abs(loss - b_loss)}
            for loss, b_loss, gn, b_gn in zip(job.loss, base.loss, job.grad_norm, base.grad_norm)]


def envelope(twins: list[Job], base: Job) -> list[tuple[float, float]]:
    """Per step, the largest |Δ loss| and grad_norm rel Δ any twin reached by then."""
    out, loss_max, gn_max = [], 0.0, 0.0
    for step in zip(*(step_diffs(twin, base) for twin in twins)):
        loss_max = max(loss_max, *(d["loss"] for d in step))
        gn_max = max(gn_max, *(d["grad_norm"] for d in step))
        out.append((loss_max, gn_max))
    return out


def departure(diffs: list[dict[str, float]], floor: dict[str, float]) -> int | None:
    """The first step whose difference from the baseline leaves `floor` (None: none does)."""
    return next((t for t, d in enumerate(diffs) if any(over(d[m], floor[m]) for m, _, _ in STEP_METRICS)),
                None)


def max_logprob_diff(job: Job, base: Job) -> float | None:
    """max |Δ| of the first-step per-token log_probs over the samples of the baseline's shape."""
    diffs = [abs(a - b) for i in sorted(set(job.log_probs) & set(base.log_probs))
             if len(job.log_probs[i]) == len(base.log_probs[i])
             for a, b in zip(job.log_probs[i], base.log_probs[i])]
    return worst(diffs) if diffs else None


@dataclass
class Noise:
    """What every job's difference from the baseline is judged against: one noise model.

    Without a twin: the fixed tolerances, on the first `strict_steps` steps only. With a twin
    (the baseline with every weight moved by one ulp at the start and after every step) the
    twin's own distance from the baseline is the measured rounding noise: the step-0
    tolerances are max(fixed, margin x the twin's step-0 difference) (`floor`), a step's
    limit is max(floor, margin x the twin's running-max difference by then), and steps are
    judged by size only up to the twin's departure (its first step beyond `floor`): past it
    fp32 rounding differences have grown chaotic, so their size says nothing about a layout. The departure counts loss and
    grad_norm only: the twin's step-0 log_probs set their tolerance's scale (on a deep model
    they alone can exceed the fixed tolerance: docs/results.md), they cannot leave it.
    Several twins (twin, twin2, twin3: independent nudges) are several samples of that noise:
    the largest difference of any of them counts, and the earliest departure."""
    floor: dict[str, float]  # logprob, grad_norm, loss: the step-0 tolerances
    judged_steps: int  # steps 0..judged_steps-1 are judged by size (all: NaN/Inf)
    twins: list[Job] = field(default_factory=list)
    env: list[tuple[float, float]] = field(default_factory=list)
    twin_departed_at_step: int | None = None
    margin: float = 10.0
    departure_ratio: float = 4.0

    @property
    def twin(self) -> str | None:
        """The twins' names, as the messages name the envelope (None without a twin)."""
        return ", ".join(t.name for t in self.twins) or None

    def limit(self, step: int, metric: str) -> float:
        if self.twin is None:
            return self.floor[metric]
        reached = self.env[step][0 if metric == "loss" else 1]
        return max(self.floor[metric], self.margin * reached)

    def early(self, steps: int) -> float | None:
        """Departing before this step is departing too early (None without a twin): a correct
        layout departs about when the twin does, a broken one at once. A twin that never departs
        in the run departs after its last step, so its step count is a lower bound."""
        if self.twin is None:
            return None
        d = self.twin_departed_at_step if self.twin_departed_at_step is not None else steps
        return d / self.departure_ratio

    def notes(self, steps: int) -> list[str]:
        if self.judged_steps >= steps:
            return []
        if self.twin is None:
            return [f"steps >= {self.judged_steps} not judged: add parallel=twin to the sweep to judge "
                    f"them against the baseline's rounding noise (NaN/Inf checked at every step)"]
        first = "the first of " * (len(self.twins) > 1)
        return [f"steps >= {self.judged_steps} not judged by size: {first}{self.twin} departed from the "
                f"baseline at step {self.twin_departed_at_step}, past which fp32 rounding differences "
                f"grow chaotically (NaN/Inf checked at every step)"]


def notes(base: Job, noise: Noise) -> list[str]:
    """What the verdicts could not judge: steps past the judged ones, and judged steps the
    baseline took without a gradient, where only the jobs' forwards were compared."""
    idle = [t for t, gn in enumerate(base.grad_norm[:noise.judged_steps]) if gn == 0]
    untrained = [f"baseline step(s) {fmt_series(idle, 8, 'd')} had no gradient (grad_norm 0: in every GRPO "
                 f"group the rewards were equal, rollout/zero_std_ratio 1, so every advantage was 0): there "
                 f"only the jobs' forwards were compared, not their backward passes or optimizer steps. "
                 f"Replay rollouts whose groups' rewards differ (a reward that varies with every response: "
                 f"task.reward_fn=relax.task.rewards.response_length)"] if idle else []
    return noise.notes(len(base.loss)) + untrained


def noise_model(base: Job, tol: Tolerances, twins: list[Job] = ()) -> Noise:
    fixed = {"logprob": tol.logprob_atol, "grad_norm": tol.grad_norm_rtol, "loss": tol.loss_atol}
    steps = len(base.loss)
    if not twins:
        return Noise(fixed, min(tol.strict_steps, steps), margin=tol.envelope_margin,
                     departure_ratio=tol.departure_ratio)
    diffs = [step_diffs(twin, base) for twin in twins]
    step0 = {"logprob": max(max_logprob_diff(twin, base) or 0.0 for twin in twins),
             **({m: max(d[0][m] for d in diffs) for m, _, _ in STEP_METRICS} if steps else {})}
    floor = {k: scaled_floor(v, step0.get(k), tol.envelope_margin) for k, v in fixed.items()}
    departed = min((t for t in (departure(d, floor) for d in diffs) if t is not None), default=None)
    judged = min(steps, max(tol.strict_steps, steps if departed is None else departed))
    return Noise(floor, judged, list(twins), envelope(twins, base), departed, tol.envelope_margin,
                 tol.departure_ratio)


def maybe_noise(value: float, limit: float, noise: Noise) -> str:
    """Without a twin, a difference within `margin` times the fixed tolerance may be plain
    rounding noise (a deep model's exceeds tolerances set on a 2-layer one); a broken layout's
    is orders of magnitude larger."""
    if noise.twin is not None or not value <= noise.margin * limit:
        return ""
    return (f"; within {noise.margin:g}x the tolerance: may be rounding noise (of a deep model, or "
            f"grown over many steps), add parallel=twin to the sweep to measure it")


def after_the_first_update(step: int) -> str:
    """Step 1 (step 0 agreed) is the first after an optimizer step, and Adam's first update moves
    every weight by about the learning rate in its gradient's sign, also where rounding decides
    that sign: a correct layout can part there in a handful of elements (docs/debugging.md)."""
    if step != 1:
        return ""
    return ("; step 0 agreed: Adam's first update may have turned a gradient element that rounding "
            "left near 0 into a whole learning-rate step. Dump the weights it left "
            "(debug.dump_layers_rollouts=[1]) and compare them (relax compare --layers --rollout-id 1): "
            "a few elements is that, a whole tensor a bug")


def first_divergence(job: Job, base: Job, noise: Noise) -> tuple[int, str] | None:
    """The first step with a NaN/Inf, a difference beyond the noise model's limit (judged steps
    only), or a departure before `noise.early()`."""
    where = "tolerance" if noise.twin is None else f"noise envelope: {noise.margin:g} x {noise.twin}"
    early, departed = noise.early(len(base.loss)), False
    for step, d in enumerate(step_diffs(job, base)):
        for name, value in (("train/loss", job.loss[step]), ("train/grad_norm", job.grad_norm[step])):
            if not math.isfinite(value):
                return step, f"step {step}: {name} is {value}"
        for metric, label, _ in STEP_METRICS:
            if step < noise.judged_steps:
                limit = noise.limit(step, metric)
                if over(d[metric], limit):
                    return step, (f"step {step}: {label} {d[metric]:.2e} > {limit:.2e} ({where})"
                                  + maybe_noise(d[metric], limit, noise) + after_the_first_update(step))
            if early is not None and not departed and over(d[metric], noise.floor[metric]):
                departed = True
                if step < early:
                    return step, (f"step {step}: {label} {d[metric]:.2e} > {noise.floor[metric]:.2e}: "
                                  f"departs from the baseline before step {early:g}, 1/"
                                  f"{noise.departure_ratio:g} of the step {noise.twin} departs at "
                                  f"(a correct layout departs about when the twin does)"
                                  + after_the_first_update(step))
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


def judge(job: Job, base: Job, tol: Tolerances, twins: list[Job] = (), noise: Noise | None = None) -> None:
    noise = noise or noise_model(base, tol, twins)
    twin = noise.twin
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
    job.max_logprob_diff = max_logprob_diff(job, base)
    job.envelope = twin
    job.judged_steps = min(noise.judged_steps, len(job.loss))
    job.tolerances = {f"{k}_{'rtol' if k == 'grad_norm' else 'atol'}": v for k, v in noise.floor.items()}
    job.departed_at_step = departure(step_diffs(job, base), noise.floor)
    job.notes = noise.notes(len(job.loss))
    limit = noise.floor["logprob"]
    if job.max_logprob_diff is not None and over(job.max_logprob_diff, limit):
        job.departed_at_step = job.diverged_at_step = 0
        scaled = "" if twin is None else f" (max of {tol.logprob_atol:g} and {noise.margin:g} x {twin})"
        reasons.append(f"max |Δ log_prob| {job.max_logprob_diff:.2e} > {limit:.2e}{scaled} (first step)"
                       + maybe_noise(job.max_logprob_diff, limit, noise))
    found = first_divergence(job, base, noise)
    if found:
        step, why = found
        job.diverged_at_step = step if job.diverged_at_step is None else min(step, job.diverged_at_step)
        reasons.append(why)
    job.verdict, job.reasons = (DIVERGED, reasons) if reasons else (EQUIVALENT, [])


def fmt_series(xs: list[float], limit: int = 4, fmt: str = ".4g") -> str:
    shown = ", ".join(format(x, fmt) for x in xs[:limit])
    return shown + (f", … ({len(xs)})" if len(xs) > limit else "")


def render(jobs: list[Job], base: Job, noise: Noise, console: Console) -> None:
    if noise.twin is None:
        title = "no noise twin: fixed tolerances"
    else:
        departed = ("does not depart" if noise.twin_departed_at_step is None
                    else f"departs at step {noise.twin_departed_at_step}")
        title = f"noise twin {noise.twin}, {departed}"
    table = Table("job", "backend", "layout", "status", "loss / step", "grad_norm / step",
                  "max |Δ logp|", "grad_norm rel Δ", "step s", "peak MB", "verdict", "departs",
                  "diverged at", title=f"relax compare (baseline: {base.name}; {title})")
    color = {EQUIVALENT: "green", DIVERGED: "red", FAILED: "red"}
    num = lambda x: "-" if x is None else f"{x:.2e}"  # noqa: E731
    for j in jobs:
        table.add_row(j.name, j.backend, j.layout, j.status, fmt_series(j.loss),
                      fmt_series(j.grad_norm), num(j.max_logprob_diff),
                      num(j.max_grad_norm_rel_diff),
                      "-" if j.step_time is None else f"{j.step_time:.3f}",
                      "-" if j.peak_memory_mb is None else f"{j.peak_memory_mb:.0f}",
                      f"[{color[j.verdict]}]{j.verdict}[/]",
                      "-" if j.departed_at_step is None else f"step {j.departed_at_step}",
                      "-" if j.diverged_at_step is None else f"step {j.diverged_at_step}")
    console.print(table)
    for j in jobs:
        if j.reasons:
            console.print(f"[red]{j.name}[/]: " + "; ".join(j.reasons))
    tol = ", ".join(f"{k} {v:.2e}" for k, v in next((j.tolerances for j in jobs if j.tolerances), {}).items())
    if tol:
        console.print(f"step-0 tolerances: {tol}", highlight=False)
    for note in notes(base, noise):
        console.print(f"note: {note}", highlight=False)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="relax compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path, help="a multirun dir, or two or more run dirs")
    ap.add_argument("--baseline", help="job (dir name or layout) to compare against (default: single)")
    ap.add_argument("--logprob-atol", type=float, default=1e-5, help="max |Δ| of per-token log_probs")
    ap.add_argument("--grad-norm-rtol", type=float, default=1e-4, help="max relative Δ of grad_norm")
    ap.add_argument("--loss-atol", type=float, default=1e-5, help="max |Δ| of the per-step loss")
    ap.add_argument("--strict-steps", type=int, default=2,
                    help="steps always judged by size (without a twin, the only ones)")
    ap.add_argument("--envelope-margin", type=float, default=10.0,
                    help="how many times the twin's distance from the baseline a job's may be")
    ap.add_argument("--departure-ratio", type=float, default=4.0,
                    help="a job leaving the step-0 tolerances before the twin's departure step / "
                         "this is DIVERGED")
    ap.add_argument("--layers", action="store_true",
                    help="compare the layer dumps (debug.dump_layers): where the runs part, module by module")
    ap.add_argument("--rollout-id", type=int,
                    help="--layers: the dumped rollout to compare (default: the first)")
    ap.add_argument("--layer-eps-multiple", type=float, default=Tolerances.layer_eps_multiple,
                    help="--layers without a twin: the floor is this many times the dtype's epsilon")
    ap.add_argument("--out", type=out_dir, metavar="DIR", help="where the plot goes (default: beside the "
                    "first path, when it can be written; else it is skipped with a note)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--allow-different-models", action="store_true", help="judge runs of other models too")
    args = ap.parse_args(argv)
    bad = [f"--{k.replace('_', '-')} {v!r}" for k, v in vars(args).items()
           if k in ("logprob_atol", "grad_norm_rtol", "loss_atol", "envelope_margin", "departure_ratio",
                    "layer_eps_multiple")
           and not (math.isfinite(v) and v >= (1 if k in ("envelope_margin", "departure_ratio") else 0))]
    bad += [f"--strict-steps {args.strict_steps}"] if args.strict_steps < 0 else []
    if bad:
        print(f"relax compare: error: {', '.join(bad)}: tolerances must be finite and >= 0, "
              f"--envelope-margin and --departure-ratio >= 1, --strict-steps >= 0", file=sys.stderr)
        return 2
    for p in args.paths:
        if not p.is_dir():
            print(f"relax compare: error: {p} is not a directory", file=sys.stderr)
            return 2
    folder, note = figure_dir(args.out, args.paths[0], "compare")
    if args.layers:
        return compare_layers(args, folder, note)
    try:
        jobs = find_jobs(args.paths)
        if len(jobs) < 2:
            raise ConfigError(f"need at least two runs, found {len(jobs)}")
        base = same_model(jobs, pick_baseline(jobs, args.baseline), args.allow_different_models)
    except (ConfigError, ReplayError) as e:
        print(f"relax compare: error: {e}", file=sys.stderr)
        return 2
    tol = Tolerances(args.logprob_atol, args.grad_norm_rtol, args.loss_atol, args.strict_steps,
                     args.envelope_margin, args.departure_ratio)
    noise = noise_model(base, tol, find_twins(jobs, base))
    for job in jobs:
        judge(job, base, tol, noise=noise)
    plot = draw(plot_steps, jobs, folder, "compare.png")
    if args.json:
        print(json.dumps({"baseline": base.name, "plot": plot and str(plot), "note": note,
                          "twin": noise.twin, "twin_departed_at_step": noise.twin_departed_at_step,
                          "judged_steps": noise.judged_steps, "notes": notes(base, noise),
                          "jobs": [{k: (str(v) if isinstance(v, Path) else v)
                                    for k, v in vars(j).items() if k != "log_probs"} for j in jobs]}))
    else:
        render(jobs, base, noise, Console(width=200))
        print(f"plot: {plot}" if plot else note)
    return 0 if all(j.verdict == EQUIVALENT for j in jobs) else 1
