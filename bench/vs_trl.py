"""Relax against Hugging Face TRL's GRPOTrainer on the same job: step time, process time, reward.

    python bench/vs_trl.py            # both jobs, 400 rollouts, 3 interleaved repeats (~25 min, busy 2 cores)
    python bench/vs_trl.py --quick    # smoke run: 20 rollouts, 1 repeat (~3 min)
    python bench/vs_trl.py --jobs default --variants sync,trl --rollouts 100 --repeats 5

Variants, run one after another inside each repeat (sync, trl, async; repeat; ...):
  sync   `relax <job>` (the Relax CLI of this checkout, .venv/bin/relax)
  async  `relax <job> train.async=true`; skipped with a note while `relax --cfg job` has no
         train.async key
  trl    TRL 1.16.0's GRPOTrainer matched to the job (bench/trl_runner.py), in its own venv
         bench/.venv-trl that this script builds on first use (~2 min; reused, stamp file)
Jobs (--jobs): `real` (SmolLM2-135M-Instruct: see JOBS; sync and trl, 6 rollouts; not in the
default --jobs, ~10 min a repeat), `default` (the default config: 32 prompts x 8 samples, 8 new tokens, 1
optimizer step per rollout; all three variants) and `gen_heavy` (an untrained tiny model,
warm-up cut to 1 step, writing long random answers: 2 prompts x 8 samples, up to 64 new
tokens, about 17 on average, 100 rollouts; Relax sync and async only, for the overlap goal).
Repeat r runs with seed = the config's seed + r, so the reward gain's spread across repeats
measures the learning-curve noise. Each variant and job runs once untimed first (1 rollout:
builds a tiny-model variant, fills the file cache).

Per run: per-step time = median interval between consecutive steps in the loop (Relax: the
timestamps of `Finish rollout` in relax.log; TRL: on_step_end), so it holds for async too;
loop time = mean interval x rollouts; whole-process = wall clock of the subprocess (and its
CPU seconds, user + system, which other jobs on a shared machine disturb less); reward
first-3 -> last-3 = mean raw reward of the first and last 3 rollouts. The summary gives
medians [min..max] over repeats and the goals of the Throughput issue with verdicts.

TRL settings (GRPOConfig; details and reasons in docs/benchmarks.md): same model directory
(Relax's loader, fp32, sdpa), same prompts in rollout order (Relax's Task, chat template,
shuffle_dataset=False) and reward (task.reward_fn), num_generations=8, per-device batch 64 x
gradient accumulation 4 = one 256-completion generation batch per optimizer step,
num_iterations=1, max_completion_length=8, temperature 1, top_p 1, top_k 0, no vLLM,
loss_type="dapo" (token mean over the step, as Relax), epsilon 0.2, beta 0, scale_rewards=
"group", entropy_coef 0, AdamW (torch) lr 3e-4 constant, betas (0.9, 0.999), eps 1e-8,
weight decay 0, max_grad_norm 1.0, bf16/fp16 off, gradient checkpointing off, CPU, 1 thread,
seed as Relax's, log every step, no checkpoints.
Mismatches left: different sampling random streams (same prompts, different responses);
TRL's generate() prefills each of the 256 rows and Relax each prompt once; advantage
denominator std + 1e-4 (TRL) vs + 1e-6 (Relax); TRL has no reference model (beta 0) and no
separate old-log-prob pass, Relax (today) runs both; Relax also writes checkpoints every 100
rollouts, reward.png and first_step_log_probs.pt (in its whole-process time).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRL_VENV = REPO / "bench" / ".venv-trl"
# -c constraints.txt pins transformers/tokenizers/safetensors/hydra to Relax's versions and
# torch to the local CPU wheel (an unpinned torch pulls a multi-GB CUDA build).
TRL_REQUIREMENTS = ["torch==2.13.0", "trl==1.16.0", "hydra-core", "omegaconf",
                    "math-verify[antlr4-9-3]==0.9.0"]  # the real job's reward (relax.task.answers)
LOG_LINE = re.compile(  # relax.log's per-rollout line, with Hydra's millisecond timestamp
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[[^\]]*\]\[INFO\] - Finish rollout (\d+):")


@dataclass
class Job:
    about: str
    overrides: list[str]
    variants: tuple[str, ...]   # which variants this job is meant for
    rollouts: int | None        # fixed rollout count (None: --rollouts)


JOBS = {
    "default": Job("the default job: 32 prompts x 8 samples, 8 new tokens", [],
                   ("sync", "trl", "async"), None),
    "gen_heavy": Job("generation-heavy: untrained tiny model, 2 prompts x 8 samples, up to 64 new tokens",
                     ["model.tiny.warmup_max_steps=1", "rollout.rollout_batch_size=2",
                      "rollout.max_new_tokens=64"], ("sync", "async"), 100),
    "real": Job("the real model: SmolLM2-135M-Instruct on experiment=smollm2_arith_v1's task, 4 prompts x 4 "
                "samples, 24 new tokens, 2 threads, without the recipe's KL term and evaluation (TRL runs "
                "beta 0 and no eval here)",
                ["experiment=smollm2_arith_v1", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=24",
                 "train.micro_batch_size=16", "algo.use_kl_loss=false", "eval.interval=null"],
                ("sync", "trl"), 6),
}


# relax sync against TRL (the speed issue): (per optimizer step, whole process; None: no goal), x TRL's
GOALS = {"default": (2, 1.5), "real": (1.5, None)}


@dataclass
class Run:
    job: str
    variant: str
    step_s: float                # median interval between consecutive steps
    loop_s: float                # mean interval x steps
    whole_s: float               # subprocess wall clock
    cpu_s: float                 # subprocess user + system CPU seconds
    rewards: list[float]
    gen_s: float | None = None   # Relax: median perf/rollout_time
    train_s: float | None = None  # Relax: median perf/train_time
    extra: dict = field(default_factory=dict)

    @property
    def first3(self) -> float:
        return statistics.fmean(self.rewards[:3])

    @property
    def last3(self) -> float:
        return statistics.fmean(self.rewards[-3:])


def intervals(times: list[float]) -> tuple[float, float]:
    """(median, mean x count) of the gaps between consecutive step times."""
    if len(times) < 2:
        raise SystemExit(f"vs_trl: need at least 2 steps to time a loop, got {len(times)}")
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps), statistics.fmean(gaps) * len(times)


def run_logged(cmd: list[str], log: Path) -> tuple[float, float]:
    """Run `cmd` with its output in `log`; its (wall-clock, CPU) seconds; exit on failure."""
    t0, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    seconds, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if rc:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise SystemExit(f"vs_trl: {' '.join(cmd)} failed (exit {rc}); the end of {log}:\n{tail}")
    return seconds, cpu


def relax_config(relax: str, overrides: list[str]) -> str:
    out = subprocess.run([relax, "--cfg", "job", *overrides], capture_output=True, text=True, cwd=REPO)
    if out.returncode:
        raise SystemExit(f"vs_trl: `relax --cfg job {' '.join(overrides)}` failed:\n{out.stderr}")
    return out.stdout


def has_key(config_yaml: str, group: str, key: str) -> bool:
    """Whether the composed config (relax --cfg job) has top-level `group` with `key` in it."""
    section = re.search(rf"^{group}:\n((?:[ ].*\n?)*)", config_yaml, re.M)
    return bool(section and re.search(rf"^  {key}:", section.group(1), re.M))


def ensure_trl_venv() -> Path:
    """bench/.venv-trl with TRL and its dependencies; rebuilt only when the recipe changes."""
    recipe = json.dumps({"python": sys.version.split()[0], "requirements": TRL_REQUIREMENTS,
                         "constraints": hashlib.sha256((REPO / "constraints.txt").read_bytes()).hexdigest()})
    stamp, python = TRL_VENV / "relax-bench.stamp", TRL_VENV / "bin" / "python"
    if stamp.is_file() and stamp.read_text() == recipe and python.is_file():
        return python
    print(f"Building {TRL_VENV} (once, ~2 min; log: build.log there) ...", flush=True)
    shutil.rmtree(TRL_VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    run_logged([str(TRL_VENV / "bin" / "pip"), "install", "-q", "-c", str(REPO / "constraints.txt"),
                *TRL_REQUIREMENTS], TRL_VENV / "build.log")
    stamp.write_text(recipe)
    return python


def command(variant: str, overrides: list[str], out: Path, tag: str, relax: str, trl_python) -> list[str]:
    """The command line of one run; it writes into out/<tag> (Relax) or out/<tag>.json (TRL)."""
    if variant == "trl":
        return [str(trl_python), str(REPO / "bench" / "trl_runner.py"), "--out", str(out / f"{tag}.json"),
                *overrides]
    return [relax, *overrides, *(["train.async=true"] if variant == "async" else []),
            f"hydra.run.dir={out / tag}"]


def read_relax(run_dir: Path) -> tuple[list[float], list[dict]]:
    """(`Finish rollout` log times, rollout records of metrics.jsonl) of a Relax run."""
    stamps = [datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
              for m in map(LOG_LINE.match, (run_dir / "relax.log").read_text().splitlines()) if m]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return stamps, [r for r in records if "step" not in r]


def measure(job: str, variant: str, out: Path, tag: str, whole: tuple[float, float]) -> Run:
    if variant == "trl":
        result = json.loads((out / f"{tag}.json").read_text())
        return Run(job, variant, *intervals(result["step_ends"]), *whole, result["rewards"],
                   extra={"settings": result["settings"], "dataset_s": result["dataset_s"]})
    stamps, rollouts = read_relax(out / tag)
    return Run(job, variant, *intervals(stamps), *whole, [r["rollout/raw_reward"] for r in rollouts],
               gen_s=statistics.median(r["perf/rollout_time"] for r in rollouts),
               train_s=statistics.median(r["perf/train_time"] for r in rollouts))


def spread(values: list[float], fmt: str) -> str:
    text = format(statistics.median(values), fmt)
    return text if len(values) < 2 else f"{text} [{format(min(values), fmt)}..{format(max(values), fmt)}]"


def ideal_overlap(run: Run) -> float:
    return (run.gen_s + run.train_s) / max(run.gen_s, run.train_s)


def summary(runs: list[Run], job: str, n_rollouts: int, repeats: int) -> dict[str, list[Run]]:
    """Print one job's table; its runs by variant."""
    by = {v: [r for r in runs if r.job == job and r.variant == v] for v in ("sync", "trl", "async")}
    by = {v: rs for v, rs in by.items() if rs}
    print(f"\n== {job}: {JOBS[job].about}; {n_rollouts} rollouts, {repeats} repeat(s): median [min..max] ==")
    header = ["per-step ms", "loop s", "whole-process s", "whole-process CPU s"]
    print(f"{'variant':<12}" + "".join(f" {h:>20}" for h in header) + "   reward first-3 -> last-3")
    for variant, rs in by.items():
        columns = [spread([getattr(r, key) * scale for r in rs], fmt) for key, scale, fmt in (
            ("step_s", 1e3, ".0f"), ("loop_s", 1, ".1f"), ("whole_s", 1, ".1f"), ("cpu_s", 1, ".1f"))]
        first, last = statistics.median(r.first3 for r in rs), statistics.median(r.last3 for r in rs)
        name = "trl" if variant == "trl" else f"relax {variant}"
        gain = spread([r.last3 - r.first3 for r in rs], "+.3f")
        print(f"{name:<12}" + "".join(f" {c:>20}" for c in columns)
              + f"   {first:.3f} -> {last:.3f} (gain {gain})")
    if "sync" in by:
        rs = by["sync"]
        print(f"relax sync per rollout: generation {spread([r.gen_s * 1e3 for r in rs], '.0f')} ms, "
              f"train + weight sync {spread([r.train_s * 1e3 for r in rs], '.0f')} ms "
              f"-> ideal overlap speed-up {spread([ideal_overlap(r) for r in rs], '.2f')}x")
    return by


def verdict(ok: bool | None, text: str) -> None:
    print(f"  [{'skip' if ok is None else 'ok' if ok else 'MISS'}] {text}")


def versus_trl(job: str, sync: list[Run], trl: list[Run]) -> None:
    med = statistics.median
    step = med(r.step_s for r in trl) / med(r.step_s for r in sync)
    whole = med(r.whole_s for r in trl) / med(r.whole_s for r in sync)
    cpu = med(r.cpu_s for r in trl) / med(r.cpu_s for r in sync)
    step_goal, whole_goal = GOALS[job]
    verdict(step >= step_goal,
            f"{job}: relax sync >= {step_goal}x TRL per optimizer step in-loop: {step:.2f}x")
    whole_text = f"TRL whole-process: {whole:.2f}x (in CPU seconds: {cpu:.2f}x)"
    if whole_goal is None:
        print(f"  [info] {job}: relax sync vs {whole_text}")
    else:
        verdict(whole >= whole_goal, f"{job}: relax sync >= {whole_goal}x {whole_text}")
    relax_gain, trl_gain = ([r.last3 - r.first3 for r in rs] for rs in (sync, trl))
    if len(sync) > 1 and len(trl) > 1:
        noise = max(max(relax_gain) - min(relax_gain), max(trl_gain) - min(trl_gain))
        how = "the larger spread over repeats"
    else:
        noise, how = 0.10, "assumed; >= 2 repeats measure it"
    diff = med(relax_gain) - med(trl_gain)
    verdict(abs(diff) <= noise, f"same learning curve: reward gain relax {med(relax_gain):+.3f}, TRL "
            f"{med(trl_gain):+.3f}: difference {diff:+.3f} within noise {noise:.3f} ({how})")


def overlap(job: str, res: dict[str, list[Run]], async_note: str | None) -> None:
    med = statistics.median
    ideal = med(ideal_overlap(r) for r in res["sync"])
    heavy = "" if job == "default" else \
        f"; generation-heavy (ideal >= 1.6x): {'yes' if ideal >= 1.6 else 'NO'}"
    if "async" not in res:
        verdict(None, f"{job}: async >= 90% of the ideal overlap speed-up {ideal:.2f}x{heavy}: {async_note}")
        return
    got = med(r.step_s for r in res["sync"]) / med(r.step_s for r in res["async"])
    verdict(got >= 0.9 * ideal, f"{job}: async speed-up {got:.2f}x = {got / ideal:.0%} of the ideal "
            f"{ideal:.2f}x (>= 90%; of the possible gain: {(got - 1) / (ideal - 1):.0%}){heavy}")


def goals(results: dict[str, dict[str, list[Run]]], n_rollouts: int, async_note: str | None) -> None:
    """The Throughput issue's goals, each with the measured number."""
    print("\nGoals (a shared, noisy machine: ratios are of runs interleaved in this same invocation)")
    default = results.get("default", {})
    for job in GOALS:
        if "sync" in results.get(job, {}) and "trl" in results.get(job, {}):
            versus_trl(job, results[job]["sync"], results[job]["trl"])
        else:
            verdict(None, f"{job}: relax sync vs TRL: needs --jobs {job} --variants sync,trl")
    if "sync" in default:
        loop = statistics.median(r.loop_s for r in default["sync"]) * 400 / n_rollouts
        scaled = "" if n_rollouts == 400 else f" (scaled from {n_rollouts} rollouts)"
        verdict(loop <= 45, f"default relax run (400 rollouts) <= 45 s of loop time: {loop:.1f} s{scaled}")
    for job, res in results.items():
        if "sync" in res:
            overlap(job, res, async_note or "async not run")
    if "async" in default:
        gain = statistics.median(r.last3 - r.first3 for r in default["async"])
        note = "" if n_rollouts == 400 else f" (stated for 400 rollouts; this ran {n_rollouts})"
        verdict(gain >= 0.15, f"reward rises with async: last-3 - first-3 = {gain:+.3f} >= +0.15{note}")
    else:
        verdict(None, f"reward rises with async: {async_note or 'async not run'}")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Settings, mismatches and how to read the output: docs/benchmarks.md")
    ap.add_argument("--rollouts", type=int, default=400, help="rollouts per run of the default job")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every run")
    ap.add_argument("--variants", default="sync,trl,async", help="comma list of sync, trl, async")
    ap.add_argument("--jobs", default="default,gen_heavy", help=f"comma list of {', '.join(JOBS)}")
    ap.add_argument("--quick", action="store_true", help="smoke run: --rollouts 20 --repeats 1")
    ap.add_argument("--relax", default=str(REPO / ".venv" / "bin" / "relax"), help="the relax executable")
    ap.add_argument("--out", type=Path, help="run folders and logs (default outputs/bench/vs_trl-<time>)")
    args = ap.parse_args()
    if args.quick:
        args.rollouts, args.repeats = 20, 1
    args.variants, args.jobs = args.variants.split(","), args.jobs.split(",")
    unknown = [v for v in args.variants if v not in ("sync", "trl", "async")]
    unknown += [j for j in args.jobs if j not in JOBS]
    if unknown:
        ap.error(f"unknown variant or job: {', '.join(unknown)}")
    if args.rollouts < 6 or args.repeats < 1:
        ap.error("--rollouts must be >= 6 (reward first-3 and last-3) and --repeats >= 1")
    if not Path(args.relax).is_file():
        ap.error(f"{args.relax}: no relax executable (install Relax as the README says, or pass --relax)")
    args.relax = str(Path(args.relax).absolute())
    return args


def main() -> None:
    args = parse_args()
    config_yaml = relax_config(args.relax, [])
    seed = int(re.search(r"^seed: (\d+)", config_yaml, re.M).group(1))
    variants = [v for v in ("sync", "trl", "async") if v in args.variants]
    async_note = None
    if "async" in variants and not has_key(config_yaml, "train", "async"):
        async_note = "skipped: train.async is not a config key yet (relax --cfg job)"
        print(f"note: async {async_note}")
        variants.remove("async")
    trl_python = ensure_trl_venv() if "trl" in variants else None
    out = (args.out or REPO / "outputs" / "bench" / f"vs_trl-{datetime.now():%Y-%m-%d_%H-%M-%S}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"Run folders and logs: {out}")

    def rollouts(job: str) -> int:
        fixed = JOBS[job].rollouts
        return args.rollouts if fixed is None else min(fixed, args.rollouts)

    def run(job: str, variant: str, tag: str, overrides: list[str]) -> tuple[float, float]:
        cmd = command(variant, [*JOBS[job].overrides, *overrides], out, tag, args.relax, trl_python)
        return run_logged(cmd, out / f"{tag}.out")

    plan = [(job, v) for job in args.jobs for v in variants if v in JOBS[job].variants]
    for job, variant in plan:  # untimed: builds a tiny-model variant, fills the file cache
        print(f"warm-up: {variant} on {job} (1 rollout)", flush=True)
        run(job, variant, f"warmup-{job}-{variant}", ["rollout.num_rollout=1"])
    runs, total, t0 = [], args.repeats * len(plan), time.perf_counter()
    for rep in range(args.repeats):
        for job, variant in plan:
            tag = f"{job}-{variant}-rep{rep}"
            seconds = run(job, variant, tag, [f"rollout.num_rollout={rollouts(job)}", f"seed={seed + rep}"])
            r = measure(job, variant, out, tag, seconds)
            runs.append(r)
            eta = (time.perf_counter() - t0) / len(runs) * (total - len(runs))
            print(f"[{len(runs)}/{total}] {job:<9} {variant:<5} rep {rep}: {r.step_s * 1e3:6.1f} ms/step, "
                  f"loop {r.loop_s:6.1f} s, whole {r.whole_s:6.1f} s ({r.cpu_s:.1f} s CPU), "
                  f"reward {r.first3:.3f} -> {r.last3:.3f}"
                  + (f" (prompt dataset {r.extra['dataset_s']:.1f} s)" if "dataset_s" in r.extra else "")
                  + f"  (eta {eta / 60:.1f} min)", flush=True)
    trl_runs = [r for r in runs if r.variant == "trl"]
    if trl_runs:
        settings = trl_runs[0].extra["settings"]
        print("\nTRL GRPOConfig (matched):", ", ".join(f"{k}={v}" for k, v in settings.items()))
    results = {job: summary(runs, job, rollouts(job), args.repeats) for job in args.jobs}
    goals(results, rollouts("default"), async_note)


if __name__ == "__main__":
    main()
