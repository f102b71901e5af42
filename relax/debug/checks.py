"""The guide's precision checklist as pure functions of what a run left behind.

Each check (1-7, listed in `relax doctor --help`) returns PASS / WARN / FAIL / SKIP with
the evidence, the likely causes and the next command, in the guide's terms. `relax doctor`
(relax/debug/doctor.py) runs them on a finished run; with `debug.strict_checks=true` the
loop runs 3-5 and 7 at the first step (`strict_first_step`) and 6 after the first sync
(`strict_weights`) and stops the run with the same explanation. A NaN never passes: every
threshold is tested with `over` (`not value <= limit`) or `below` (`not value >= limit`), as
`nan > limit` and `nan < limit` are both False; `relax compare` uses them too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from relax.debug.run_data import RunData, chat_template_parts
from relax.errors import CheckFailed

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
SEVERITY = {PASS: 0, SKIP: 0, WARN: 1, FAIL: 2}


@dataclass
class Thresholds:
    kl_tol: float = 1e-8                  # first-step KL and |log_probs - ref_log_probs|
    logprob_magnitude: float = 1.0        # mean |log_prob| above this is suspicious (WARN)
    logprob_config_error: float = 5.0     # ... and above this a configuration error (FAIL)
    grad_norm_max: float = 10.0           # first-step grad_norm
    train_rollout_diff_max: float = 0.1   # train/train_rollout_logprob_abs_diff
    drift_ratio: float = 2.0              # last third vs first third of that diff
    drift_floor: float = 1e-3             # ... once it is at least this large
    invalid_token_ratio: float = 0.2      # garbage: undecodable / special tokens mid-response
    repetition_ratio: float = 0.5         # garbage: responses dominated by one token
    format_ok_min: float = 0.2            # garbage: share of responses in the task's format
    collapse_fraction: float = 0.25       # reward falling below this share of its start


@dataclass
class Check:
    id: int
    name: str
    verdict: str
    summary: str
    evidence: dict = field(default_factory=dict)
    causes: list[str] = field(default_factory=list)
    next_steps: list[str] = field(default_factory=list)


# -- the checks -----------------------------------------------------------------------------

def over(value: float, limit: float) -> bool:
    """value beyond limit, NaN included (a plain `value > limit` passes NaN)."""
    return not value <= limit


def below(value: float, limit: float) -> bool:
    """value under limit, NaN included (a plain `value < limit` passes NaN)."""
    return not value >= limit


def worst(values: Iterable[float], default: float = 0.0) -> float:
    """The largest value, NaN if any is NaN: max() keeps a NaN only when it comes first."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values, default=default)


def example_sample(run: RunData, rollout_id: int) -> dict | str | None:
    """The rollout's example sample, or why there is none."""
    if rollout_id in run.samples:
        return run.samples[rollout_id]
    return f"not recorded: {run.samples_missing}" if run.samples_missing else None


def garbage_signals(record: dict, th: Thresholds) -> list[str]:
    signals = []
    if over(record.get("rollout/invalid_token_ratio", 0), th.invalid_token_ratio):
        signals.append(f"{record['rollout/invalid_token_ratio']:.0%} of tokens undecodable or "
                       f"special mid-response")
    if over(record.get("rollout/repetition_ratio", 0), th.repetition_ratio):
        signals.append(f"{record['rollout/repetition_ratio']:.0%} of responses repeat one token")
    if below(record.get("rollout/format_ok_ratio", 1), th.format_ok_min):
        signals.append(f"only {record['rollout/format_ok_ratio']:.0%} of responses in the task's format")
    return signals


def check_first_responses(run: RunData, th: Thresholds) -> Check:
    name = "responses at the first rollout"
    if not run.rollouts or "rollout/invalid_token_ratio" not in run.rollouts[0]:
        return Check(1, name, SKIP, "no rollout metrics with response-health signals")
    first = run.rollouts[0]
    rid = first["rollout_id"]
    evidence = {k: first[k] for k in first if k.split("/")[-1] in (
        "invalid_token_ratio", "repetition_ratio", "distinct_2", "format_ok_ratio",
        "truncated_ratio", "raw_reward", "response_len")}
    evidence["rollout_id"] = rid
    evidence["sample"] = example_sample(run, rid)
    signals = garbage_signals(first, th)
    if not signals:
        return Check(1, name, PASS, f"rollout {rid}: responses look coherent", evidence)
    load_failed = run.weight_check and not run.weight_check["checks"][0]["passed"]
    return Check(
        1, name, FAIL, f"rollout {rid}: garbage responses ({'; '.join(signals)})", evidence,
        causes=["a faulty checkpoint load or model conversion into the inference engine"
                + (" (confirmed: the engine-weights check found mismatches at load)" if load_failed else ""),
                "an engine buffer freed by release_memory_occupation",
                "a base (pretrained) model: try the instruct variant of the same architecture"],
        next_steps=["relax debug=rollout_only rollout.num_rollout=1 debug.check_weight_update_equal=true "
                    "<your model/rollout overrides>  # compares every engine tensor with the checkpoint"])


def find_collapse(rollouts: list[dict], th: Thresholds) -> tuple[int, str] | None:
    """(index, why) of the first rollout whose reward is not a number, whose responses turn to
    garbage, or from which the reward collapses; None if there is none."""
    rewards = [r["rollout/raw_reward"] for r in rollouts]
    for i, reward in enumerate(rewards):
        if not math.isfinite(reward):  # before the mean below, which a NaN would make NaN
            return i, f"the mean reward is {reward}"
    early = sum(rewards[:3]) / 3
    for i in range(3, len(rollouts)):
        signals = garbage_signals(rollouts[i], th)
        window = rewards[i:i + 3]
        if signals:
            return i, "; ".join(signals)
        if early >= 0.05 and len(window) == 3 and below(sum(window) / 3, th.collapse_fraction * early):
            return i, f"mean reward {sum(window) / 3:.3f} vs {early:.3f} at the start"
    return None


def check_later_responses(run: RunData, th: Thresholds) -> Check:
    name = "responses turning to garbage later"
    if len(run.rollouts) < 4:
        return Check(2, name, SKIP, f"{len(run.rollouts)} rollouts: too few to see a trend")
    if garbage_signals(run.rollouts[0], th):
        return Check(2, name, SKIP, "the first rollout is already garbage (check 1)")
    turn, why = find_collapse(run.rollouts, th) or (None, "")
    trajectory = [{k: r.get(k) for k in ("rollout_id", "rollout/raw_reward", "rollout/kl",
                                         "rollout/format_ok_ratio", "rollout/truncated_ratio")}
                  for r in run.rollouts[max(0, (turn or 0) - 3):(turn or 0) + 4]]
    if turn is None:
        rewards = [r["rollout/raw_reward"] for r in run.rollouts]
        return Check(2, name, PASS, f"no collapse over {len(run.rollouts)} rollouts "
                     f"(reward {sum(rewards[:3]) / 3:.3f} -> {sum(rewards[-3:]) / 3:.3f})")
    rid = run.rollouts[turn]["rollout_id"]
    return Check(
        2, name, FAIL, f"training collapsed at rollout {rid}: {why}",
        {"turn_rollout_id": rid, "trajectory": trajectory, "sample": example_sample(run, rid)},
        causes=["the policy update is too large (learning rate, clip range, KL coefficient)",
                "a reward computation that is not what you expect at some step"],
        next_steps=[f"relax inspect <dump dir> --rollout {rid}  # look at rewards around the turn "
                    f"(run with debug=dump)", "lower train.lr or raise algo.kl_loss_coef "
                    "(algo.use_kl_loss=true) and compare the reward/KL curves"])


def check_logprobs_vs_ref(run: RunData, th: Thresholds) -> Check:
    name = "first-rollout log_probs vs ref_log_probs"
    first = next((r for r in run.rollouts if "rollout/log_probs" in r), None)
    if first is None:
        return Check(3, name, SKIP, "no trainer metrics (rollout-only run?)")
    if "rollout/ref_log_probs" not in first:  # runs since the reference pass became on-demand have it
        return Check(3, name, SKIP, f"rollout {first['rollout_id']} has no ref_log_probs (the trainer runs "
                     f"the reference at the run's first step, every train.ref_log_probs_interval rollouts "
                     f"and with a KL loss; a resumed run's history starts at its checkpoint)")
    lp, ref = first["rollout/log_probs"], first["rollout/ref_log_probs"]
    evidence = {"rollout_id": first["rollout_id"], "log_probs": lp, "ref_log_probs": ref,
                "abs_diff": abs(lp - ref)}
    if run.first_train_data:
        evidence["max_token_abs_diff"] = worst(abs(a - b) for row in run.first_train_data
                                               for a, b in zip(row["log_probs"], row["ref_log_probs"]))
    findings: list[tuple[str, str, list[str]]] = []
    largest = worst([evidence["abs_diff"], evidence.get("max_token_abs_diff", 0.0)])
    if over(largest, th.kl_tol):
        findings.append((FAIL, f"log_probs differ from ref_log_probs by {largest:.3g} (KL != 0)", [
            "a non-deterministic kernel, e.g. Transformer Engine fused attention under CP: on "
            "train=megatron set train.attention_backend=flash and train.deterministic=true",
            "dropout or another random op left on in the trainer's forward"]))
    magnitude = abs(lp)
    evidence["mean_abs_log_prob"] = magnitude
    if over(magnitude, th.logprob_config_error):
        findings.append((FAIL, f"mean |log_prob| {magnitude:.2f} is very large", [
            "a training configuration error (wrong model, tokenizer or temperature)"]))
    elif over(magnitude, th.logprob_magnitude):
        findings.append((WARN, f"mean |log_prob| {magnitude:.2f} is above the SFT regime", [
            "data not in the model's chat template, or off its cold-start distribution"]))
    if run.chat_template_parts and run.prompts:
        prefix, suffix = run.chat_template_parts
        ok = sum(p.startswith(prefix) and p.endswith(suffix) for p in run.prompts) / len(run.prompts)
        evidence["prompts_in_chat_template"] = ok
        if below(ok, 0.5):
            findings.append((FAIL, f"only {ok:.0%} of prompts follow the tokenizer's chat template", [
                "prompts are not formatted with the chat template the model was trained on "
                "(task.apply_chat_template)"]))
    not_checked = []
    if run.chat_template_parts and not run.prompts and run.samples_missing:
        not_checked = [f"chat template not checked: {run.samples_missing} and no rollout dump"]
        evidence["prompts_in_chat_template"] = not_checked[0]
    if not findings:
        return Check(3, name, PASS, "; ".join([f"equal (|Δ| {largest:.1e}), mean |log_prob| "
                                               f"{magnitude:.3f}", *not_checked]), evidence)
    verdict = max((f[0] for f in findings), key=SEVERITY.get)
    return Check(3, name, verdict, "; ".join([*(f[1] for f in findings), *not_checked]), evidence,
                 causes=[c for f in findings for c in f[2]],
                 next_steps=["relax -m debug=train_only debug.load_rollout_data=<dump>/rollout_data/"
                             "{rollout_id}.pt parallel=single,<layout>  # then relax compare"])


def check_first_step(run: RunData, th: Thresholds) -> Check:
    name = "first-step KL and grad_norm"
    if not run.steps:
        return Check(4, name, SKIP, "no train steps")
    if run.num_steps_per_rollout not in (None, 1):
        return Check(4, name, SKIP, f"num_steps_per_rollout={run.num_steps_per_rollout}: the guide's "
                     f"check needs 1 (later steps are off-policy by design)")
    step = run.steps[0]
    # with algo.use_rollout_log_probs the ratio's old policy is the engine's: ppo_kl is then the
    # rollout/train mismatch (check 5), not a KL between two trainer forwards
    kls = [k for k in ("train/ppo_kl", "train/kl_loss") if k in step
           and not (k == "train/ppo_kl" and run.use_rollout_log_probs)]
    evidence = {k: step[k] for k in ("train/ppo_kl", "train/kl_loss", "train/grad_norm") if k in step}
    problems = [f"{k} = {step[k]:.3g}" for k in kls if over(abs(step[k]), th.kl_tol)]
    if over(step["train/grad_norm"], th.grad_norm_max):
        problems.append(f"grad_norm {step['train/grad_norm']:.3g} > {th.grad_norm_max:g}")
    if not problems:
        return Check(4, name, PASS, f"KL 0 ({', '.join(kls) or 'none recorded'}), grad_norm "
                     f"{step['train/grad_norm']:.3g}", evidence)
    causes = ["a trainer backend bug (Megatron / Transformer Engine) or a non-deterministic forward"]
    if "megatron" in run.backend:
        causes.append("MoE on Megatron: set train.moe_permute_fusion=true")
    return Check(4, name, FAIL, "; ".join(problems), evidence, causes=causes,
                 next_steps=["compare layouts on fixed data: relax -m debug=train_only "
                             "debug.load_rollout_data=... parallel=single,<yours>; relax compare"])


def check_train_rollout_diff(run: RunData, th: Thresholds) -> Check:
    name = "train vs rollout log-prob mismatch"
    # train.async: a rollout generated by an older policy differs from the trainer's by that
    # policy's updates too; only rollouts from the weights being trained show the mismatch
    stale = {r["rollout_id"] for r in run.rollouts if r.get("rollout/staleness", 0) > 0}
    diffs = [s["train/train_rollout_logprob_abs_diff"] for s in run.steps
             if "train/train_rollout_logprob_abs_diff" in s and s.get("rollout_id") not in stale]
    left_out = f" ({len(stale)} stale rollouts of train.async left out)" if stale else ""
    if not diffs:
        return Check(5, name, SKIP, "no train steps" + left_out)
    third = max(1, len(diffs) // 3)
    first, last = sum(diffs[:third]) / third, sum(diffs[-third:]) / third
    largest = next((d for d in diffs if not math.isfinite(d)), max(diffs))
    evidence = {"max": largest, "first_third_mean": first, "last_third_mean": last,
                "worst_step": diffs.index(largest), "stale_rollouts_left_out": len(stale)}
    causes = ["weight sync into the engine drops or corrupts a tensor",
              "engine and trainer compute differently (dtype, kernels, temperature)"]
    next_steps = ["relax debug.check_weight_update_equal=true debug.check_weight_update_every_sync=true "
                  "<your overrides>",
                  "a mismatch the engine really has (e.g. rollout.dtype=bfloat16 against an fp32 trainer): "
                  "correct for it with algo.tis=token (truncated IS) or algo.mis=token (masked IS) and "
                  "watch train/mismatch_kl, train/mismatch_residual, train/tis_weight_mean"]
    if over(largest, th.train_rollout_diff_max):
        return Check(5, name, FAIL, f"abs diff reaches {largest:.3g} > {th.train_rollout_diff_max:g}",
                     evidence, causes, next_steps)
    if len(diffs) >= 6 and over(last, th.drift_floor) and over(last, th.drift_ratio * first):
        return Check(5, name, WARN, f"steady upward drift: {first:.2e} -> {last:.2e}",
                     evidence, causes, next_steps)
    return Check(5, name, PASS, f"max {max(diffs):.2e}, no upward drift{left_out}", evidence)


def check_engine_weights(run: RunData, th: Thresholds) -> Check:
    name = "engine weights vs checkpoint"
    if run.weight_check is None:
        return Check(6, name, SKIP, "not recorded (run with debug.check_weight_update_equal=true)")
    from relax.debug.weights import describe

    failed = [c for c in run.weight_check["checks"] if not c["passed"]]
    if not failed:
        return Check(6, name, PASS, f"{len(run.weight_check['checks'])} comparisons, all equal")
    return Check(
        6, name, FAIL, "; ".join(f"{c['stage']}: {describe(c)}" for c in failed[:3]),
        {"failed": failed},
        causes=["the checkpoint load or the weight-sync path misses, corrupts or renames these tensors",
                "a buffer freed by release_memory_occupation and never restored"],
        next_steps=["fix the named tensors' conversion or sync, then rerun with "
                    "debug.check_weight_update_equal=true"])


def check_finite(run: RunData, th: Thresholds) -> Check:
    name = "non-finite metrics"
    bad = [(r.get("rollout_id"), r.get("step"), k, v) for r in run.rollouts + run.steps for k, v in r.items()
           if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return Check(7, name, PASS, f"{len(run.rollouts) + len(run.steps)} records, all finite")
    rid, step, key, value = bad[0]
    where = f"rollout {rid}" + (f" step {step}" if step is not None else "")
    return Check(
        7, name, FAIL, f"{key} = {value} at {where} ({len(bad)} non-finite values)",
        {"first": {"rollout_id": rid, "step": step, "metric": key}, "metrics": sorted({b[2] for b in bad})},
        causes=["a NaN/Inf reward, log-prob or loss (train.on_nonfinite=skip skipped such steps and wrote "
                "their samples to <run dir>/nonfinite/)", "a diverging update (learning rate, clip range)"],
        next_steps=["relax debug=train_only debug.load_rollout_data=<run dir>/nonfinite/{rollout_id}.pt "
                    "# replays the offending samples"])


CHECKS = [check_first_responses, check_later_responses, check_logprobs_vs_ref, check_first_step,
          check_train_rollout_diff, check_engine_weights, check_finite]


def diagnose(run: RunData, th: Thresholds | None = None) -> list[Check]:
    th = th or Thresholds()
    return [check(run, th) for check in CHECKS]


# -- fail fast inside a run (debug.strict_checks) --------------------------------------------

def strict_first_step(record: dict, steps: list[dict], cfg, prompts: list[str], tokenizer) -> None:
    run = RunData(path=Path("."), rollouts=[record], steps=steps, prompts=prompts,
                  num_steps_per_rollout=cfg.train.num_steps_per_rollout, backend=cfg.train._target_,
                  use_rollout_log_probs=cfg.algo.use_rollout_log_probs,
                  chat_template_parts=chat_template_parts(tokenizer))
    failed = [c for c in (check_logprobs_vs_ref(run, Thresholds()), check_first_step(run, Thresholds()),
                          check_train_rollout_diff(run, Thresholds()), check_finite(run, Thresholds()))
              if c.verdict == FAIL]
    if failed:
        raise CheckFailed("debug.strict_checks: stopping at the first step\n"
                          + "\n".join(map(as_text, failed)))


def strict_weights(report: dict) -> None:
    run = RunData(path=Path("."), rollouts=[], steps=[], weight_check=report)
    check = check_engine_weights(run, Thresholds())
    if check.verdict == FAIL:
        raise CheckFailed("debug.strict_checks: stopping before the first rollout\n" + as_text(check))


# -- as text ---------------------------------------------------------------------------------

def as_text(c: Check) -> str:
    lines = [f"[{c.verdict}] {c.id}. {c.name}: {c.summary}"]
    lines += [f"    likely cause: {x}" for x in c.causes]
    lines += [f"    next: {x}" for x in c.next_steps]
    return "\n".join(lines)
