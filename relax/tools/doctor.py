"""`relax doctor <run dir | dump dir>`: the guide's precision checklist, run for you.

Reads what a run left behind and reports PASS / WARN / FAIL / SKIP per check, with the
evidence, the likely causes and the next command; writes doctor.md with curves next to the
run. The checklist, a check a line: DESCRIPTION below (`relax doctor --help`) and
docs/debugging.md, "`relax doctor`: the precision checklist, automated".
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, fields
from pathlib import Path

from rich.console import Console

from relax.debug.checks import FAIL, PASS, SKIP, WARN, Check, Thresholds, as_text, diagnose
from relax.debug.run_data import RunData, load_run
from relax.errors import ConfigError, ReplayError
from relax.files import atomic_write_text, save_figure
from relax.logger import METRICS_FILE
from relax.process import describe, read_status
from relax.tools.mismatch import explain
from relax.tools.plots import figure_dir, out_dir, pyplot

DESCRIPTION = """`relax doctor <run dir | dump dir>`: the guide's precision checklist, run for you.

Reads what a run left behind (metrics.jsonl, samples.jsonl, built.json, weight_check.json,
dumps) and reports PASS / WARN / FAIL / SKIP per check, with the evidence, the likely
causes and the next command:

1. responses at the first rollout: coherent or garbage?
2. training collapse: within 1-2 rollouts the entropy halves, the KL to the reference or a
   step's ppo_kl jumps while the reward does not rise, or the reward falls to 0 with grad_norm
   0 (names train.lr=<a tenth of yours>); later, garbage or the reward below 25% of its start
3. first-rollout log_probs vs ref_log_probs: exactly equal? mean |log_prob| within sampling
   noise of the policy's mean entropy (what it is for its own samples), under log(vocab_size)?
   chat template?
4. first-step KL and grad_norm (with num_steps_per_rollout == 1)
5. train vs rollout log-prob mismatch: level and drift
6. engine weights vs checkpoint (when the run recorded debug.check_weight_update_equal)
7. non-finite metrics: any NaN or Inf in a rollout or step record (NaN fails every check)
8. batch invariance: the first step's log-probs recomputed one sample per micro-batch with
   extra padding (when the run recorded debug.check_batch_invariance)
9. MoE routing: the trainer's experts vs the engine's (train/routing_agreement), its trend,
   and routing replay's plumbing; names R3 (algo.routing_replay=rollout) where agreement is
   low and the mismatch high

Writes doctor.md with curves next to the run (--out DIR: into DIR; a run that cannot be written,
such as one on a read-only results disk, gets its report on the terminal and a note instead);
exit code 1 if a check FAILs. The checks
themselves are in relax/debug/checks.py (the run's `debug.strict_checks` uses them too).
"""


def write_plots(run: RunData, out_dir: Path) -> list[str]:
    plt = pyplot()
    written = []
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    x = [r["rollout_id"] for r in run.rollouts]
    with_kl = [r for r in run.rollouts if "rollout/kl" in r]  # rollouts that ran the reference pass
    series = [(axes[0][0], x, [r["rollout/raw_reward"] for r in run.rollouts], "rollout/raw_reward"),
              (axes[0][1], [r["rollout_id"] for r in with_kl], [r["rollout/kl"] for r in with_kl],
               "rollout/kl"),
              (axes[1][0], None, [s["train/grad_norm"] for s in run.steps], "train/grad_norm"),
              (axes[1][1], None, [s.get("train/train_rollout_logprob_abs_diff", float("nan"))
                                  for s in run.steps], "train/train_rollout_logprob_abs_diff")]
    for ax, xs, ys, title in series:
        ax.plot(xs if xs is not None else range(len(ys)), ys, marker="." if len(ys) < len(x) else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("rollout_id" if xs is not None else "step")
    fig.tight_layout()
    save_figure(fig, out_dir / "doctor_curves.png")
    plt.close(fig)
    written.append("doctor_curves.png")
    if run.first_train_data:
        fig, ax = plt.subplots(figsize=(7, 4))
        ref = [a - b for r in run.first_train_data for a, b in zip(r["log_probs"], r["ref_log_probs"])]
        eng = [a - b for r in run.first_train_data for a, b in zip(r["log_probs"], r["rollout_log_probs"])]
        ax.hist([ref, eng], bins=40, label=["log_probs - ref_log_probs", "log_probs - rollout_log_probs"])
        ax.set_title("per-token log-prob differences at the first rollout")
        ax.legend()
        fig.tight_layout()
        save_figure(fig, out_dir / "doctor_logprob_hist.png")
        plt.close(fig)
        written.append("doctor_logprob_hist.png")
    return written


def write_markdown(run: RunData, checks: list[Check], plots: list[str], out_dir: Path) -> Path:
    lines = [f"# relax doctor: {run.path.name}", "", "| # | check | verdict | summary |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {c.id} | {c.name} | **{c.verdict}** | {c.summary} |" for c in checks]
    for c in checks:
        if c.verdict in (FAIL, WARN):
            lines += ["", f"## {c.id}. {c.name}: {c.verdict}", "", c.summary, ""]
            lines += [f"- likely cause: {x}" for x in c.causes]
            lines += [f"- next: `{x}`" for x in c.next_steps]
            lines += ["", "```json", json.dumps(c.evidence, indent=2, default=str), "```"]
    lines += [""] + [f"![{p}]({p})" for p in plots]
    out = out_dir / "doctor.md"
    atomic_write_text(out, "\n".join(lines) + "\n")
    return out


def mismatch_top_factor(run: RunData, checks: list[Check]) -> str | None:
    """Where check 5 fails on a run with dumped train data: `relax mismatch`'s top factor, one line."""
    if not run.dump_dir or not any(c.id == 5 and c.verdict == FAIL for c in checks):
        return None

    try:
        report = explain(run.path)
    except Exception as e:  # noqa: BLE001 - the checklist stands without it
        return f"could not run ({type(e).__name__}: {e})"
    f = report.factors[0]
    if not f.share:
        return f"no factor explains the mismatch of rollout {report.rollout_id} (relax mismatch {run.path})"
    return (f"top factor at rollout {report.rollout_id}: {f.name}, {100 * f.share:.0f}% of it "
            f"({f.key}: engine {f.engine}, trainer {f.trainer}); relax mismatch {run.path}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="relax doctor", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path, help="a run dir (or a dump dir inside one)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--out", type=out_dir, metavar="DIR",
                    help="where doctor.md and its plots go (default: the run dir, when it can be written; "
                         "else they are skipped with a note, the report printed all the same)")
    for f in fields(Thresholds):  # each level's reason: the comments of Thresholds (relax/debug/checks.py)
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=f.default, metavar="X",
                        help="default: log(vocab_size) of the run's model (5 if unknown)"
                        if f.default is None else f"default: {f.default:g}")
    args = ap.parse_args(argv)
    if not args.path.is_dir():
        print(f"relax doctor: error: {args.path} is not a directory", file=sys.stderr)
        return 2
    try:
        run = load_run(args.path)
    except (ReplayError, ConfigError) as e:
        print(f"relax doctor: error: {e}", file=sys.stderr)
        return 2
    state = describe(read_status(args.path))  # a run killed with SIGKILL still says running: dead
    if not run.rollouts:
        metrics = args.path / METRICS_FILE
        why = (f"{metrics} holds no rollout record (the run stopped before its first rollout ended)"
               if metrics.is_file() else f"{args.path} has no {METRICS_FILE}: not a run dir, or a run "
               f"that stopped before its first rollout ended")
        print(f"relax doctor: error: {why}", file=sys.stderr)
        return 2
    folder, note = figure_dir(args.out, run.path, "doctor", "doctor.md or plots")
    th = Thresholds(**{f.name: getattr(args, f.name) for f in fields(Thresholds)})
    checks = diagnose(run, th)
    top = mismatch_top_factor(run, checks)
    report = write_markdown(run, checks, write_plots(run, folder), folder) if folder else None
    if args.json:
        print(json.dumps({"run": str(run.path), "run_status": state, "report": report and str(report),
                          "note": note, "checks": [asdict(c) for c in checks],
                          **({"mismatch": top} if top else {})}, default=str))
    else:
        console = Console(soft_wrap=True)
        console.print(f"run: {state}", style="red" if state.startswith("died") else None, highlight=False)
        color = {PASS: "green", WARN: "yellow", FAIL: "red", SKIP: "dim"}
        for c in checks:
            text = as_text(c)
            console.print(f"[{color[c.verdict]}]{text.splitlines()[0]}[/]", highlight=False)
            for line in text.splitlines()[1:]:
                console.print(line, highlight=False)
            if c.id == 5 and top:
                console.print(f"    relax mismatch: {top}", highlight=False)
        console.print(f"report: {report}" if report else note, highlight=False)
    return 1 if any(c.verdict == FAIL for c in checks) else 0
