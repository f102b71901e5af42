"""The guide's precision checklist as pure functions of what a run left behind.

How it works in detail: docs/debugging.md, "Inside `relax/debug/checks.py`".
"""

from __future__ import annotations

import math

from relax.debug.collapse import garbage_signals, find_collapse, find_fast_collapse, lower_lr
from relax.debug.layers import compare_runs
from relax.debug.routing import check_routing
from relax.debug.run_data import RunData, samples_of
from relax.debug.staleness import check_staleness
from relax.debug.verdicts import PASS, WARN, FAIL, SKIP, SEVERITY, Thresholds, Check, Tolerances, over, below, worst
from relax.debug.weights import describe


# -- the checks -----------------------------------------------------------------------------

def example_sample(run: RunData, rollout_id: int) -> dict | str | None:
    """The rollout's example sample, or why there is none."""
    if rollout_id in run.samples:
        return run.samples[rollout_id]
    return f"not recorded: {run.samples_missing}" if run.samples_missing else None


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


def check_later_responses(run: RunData, th: Thresholds) -> Check:
    name = "training collapse (reward, entropy, KL; garbage later)"
    if len(run.rollouts) < 2:
        return Check(2, name, SKIP, f"{len(run.rollouts)} rollout: too few to see a trend")
    if garbage_signals(run.rollouts[0], th):
        return Check(2, name, SKIP, "the first rollout is already garbage (check 1)")
    rewards = [r["rollout/raw_reward"] for r in run.rollouts]
    nonfinite = next((i for i, x in enumerate(rewards) if not math.isfinite(x)), None)
    found = [f for f in (find_fast_collapse(run, th), find_collapse(run.rollouts, th)) if f]
    if nonfinite is not None:  # before any mean, which a NaN would make NaN
        found = [(nonfinite, f"the mean reward is {rewards[nonfinite]}")]
    turn, why = min(found) if found else (None, "")
    keys = ("rollout_id", "rollout/raw_reward", "rollout/entropy", "rollout/kl", "rollout/format_ok_ratio",
            "rollout/truncated_ratio")
    trajectory = [{k: r.get(k) for k in keys}
                  for r in run.rollouts[max(0, (turn or 0) - 3):(turn or 0) + 4]]
    if turn is None:
        entropy = [r["rollout/entropy"] for r in run.rollouts if "rollout/entropy" in r]
        trend = f", entropy {entropy[0]:.2f} -> {entropy[-1]:.2f}" if entropy else ""
        head, tail = rewards[:3], rewards[-3:]
        return Check(2, name, PASS, f"no collapse over {len(run.rollouts)} rollouts (reward "
                     f"{sum(head) / len(head):.3f} -> {sum(tail) / len(tail):.3f}{trend})")
    rid = run.rollouts[turn]["rollout_id"]
    lr = f"train.lr={run.lr:g}" if run.lr else "train.lr"
    return Check(
        2, name, FAIL, f"training collapsed at rollout {rid}: {why}",
        {"turn_rollout_id": rid, "trajectory": trajectory, "sample": example_sample(run, rid),
         "train.lr": run.lr},
        causes=[f"the learning rate is too high for this model ({lr}): one update moves the policy "
                f"further than its reward justifies (3e-4 suits the 134k-parameter tiny model; "
                f"SmolLM2-135M collapses at it in two rollouts and learns at 1e-5)",
                "a reward computation that is not what you expect at some step"],
        next_steps=[f"relax <your overrides> {lower_lr(run)}  # a tenth of the learning rate; then "
                    f"compare the reward, rollout/entropy and rollout/kl curves",
                    f"relax inspect <dump dir> --rollout {rid}  # look at rewards around the turn "
                    f"(run with debug=dump)"])


def logprob_slack(run: RunData, first: dict, th: Thresholds) -> tuple[float, dict]:
    """The sampling noise check 3 allows around the entropy: the floor, or 4 standard errors
    of the mean of -log p(x_t) - H_t, sqrt(varentropy / tokens). The varentropy is the first
    rollout's own when its train data was dumped, else VARENTROPY (the largest measured)."""
    rows = [r for r in run.first_train_data if isinstance(r.get("entropy"), list)
            and len(r["entropy"]) == len(r["log_probs"])]
    terms = [-a - h for r in rows for a, h in zip(r["log_probs"], r["entropy"])]
    n_samples = samples_of(run, first["rollout_id"])
    tokens = len(terms) if len(terms) > 1 else (
        first.get("rollout/response_len", 0) * n_samples if n_samples else 0)
    if len(terms) > 1:
        mean = sum(terms) / len(terms)
        varentropy = sum((x - mean) ** 2 for x in terms) / (len(terms) - 1)
    else:
        varentropy = VARENTROPY
    noise = 4 * math.sqrt(varentropy / tokens) if tokens >= 1 else 0.0
    return max(th.logprob_entropy_slack, noise), {"tokens": tokens, "varentropy": varentropy}


# Var[-log p(x)] at a sampled position, above what first rollouts of the tiny model and
# SmolLM2-135M showed (docs/debugging.md, "How the thresholds were set"); used when the run
# dumped no train data
VARENTROPY = 4.0


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
    not_checked: list[str] = []
    largest = worst([evidence["abs_diff"], evidence.get("max_token_abs_diff", 0.0)])
    if over(largest, th.kl_tol):
        findings.append((FAIL, f"log_probs differ from ref_log_probs by {largest:.3g} (KL != 0)", [
            "a non-deterministic kernel, e.g. Transformer Engine fused attention under CP: on "
            "train=megatron set train.attention_backend=flash and train.deterministic=true",
            "dropout or another random op left on in the trainer's forward"]))
    magnitude = abs(lp)
    slack, noise = logprob_slack(run, first, th)
    limit = th.logprob_config_error
    if limit is None:
        limit = math.log(run.vocab_size) if run.vocab_size else 5.0
    evidence |= {"mean_abs_log_prob": magnitude, "slack": slack, **noise,
                 "config_error_limit": limit, "vocab_size": run.vocab_size}
    rescore = ("the engine samples with another tokenizer or temperature than the trainer scores with "
               "(check 5's train/train_rollout_logprob_abs_diff shows it too)")
    if over(magnitude, limit + slack):
        what = f"log(vocab_size {run.vocab_size})" if th.logprob_config_error is None and run.vocab_size \
            else "the limit"
        findings.append((FAIL, f"mean |log_prob| {magnitude:.2f} exceeds {what} = {limit:.2f}: more than "
                         f"a uniform guess, so the trained tokens are not this policy's samples", [
                             "a training configuration error (wrong model, tokenizer or temperature)",
                             rescore]))
    if "rollout/entropy" in first:  # runs since the trainer logged it
        entropy = first["rollout/entropy"]
        evidence["mean_entropy"] = entropy
        high = th.logprob_entropy_ratio * entropy + slack
        low = entropy / th.logprob_entropy_ratio - slack
        if not math.isfinite(entropy):
            findings.append((FAIL, f"the mean entropy is {entropy}", ["a non-finite forward (check 7)"]))
        elif over(magnitude, high) and not over(magnitude, limit + slack):
            findings.append((WARN, f"mean |log_prob| {magnitude:.2f} is above the policy's mean entropy "
                             f"{entropy:.2f} (at most {high:.2f} for its own samples): the trained tokens "
                             f"are not what this policy samples", [
                                 rescore,
                                 "data the policy did not sample: rollouts replayed from another model or "
                                 "run, or SFT-style data not in the model's chat template or off its "
                                 "cold-start distribution"]))
        elif below(magnitude, low) and run.top_p >= 1:
            findings.append((WARN, f"mean |log_prob| {magnitude:.2f} is below the policy's mean entropy "
                             f"{entropy:.2f} (at least {low:.2f} for its own samples): the engine samples "
                             f"more sharply than the trainer scores", [
                                 "the engine samples at a lower temperature, greedily, or from a truncated "
                                 "distribution (top-k / top-p) that rollout.temperature and rollout.top_p "
                                 "do not tell the trainer", rescore]))
        elif below(magnitude, low):
            not_checked = [f"below the entropy {entropy:.2f} by design: rollout.top_p={run.top_p:g}"]
    else:
        not_checked = ["no rollout/entropy (runs before the trainer logged it): magnitude not compared"]
    if run.chat_template_parts and run.prompts:
        prefix, suffix = run.chat_template_parts
        ok = sum(p.startswith(prefix) and p.endswith(suffix) for p in run.prompts) / len(run.prompts)
        evidence["prompts_in_chat_template"] = ok
        if below(ok, 0.5):
            findings.append((FAIL, f"only {ok:.0%} of prompts follow the tokenizer's chat template", [
                "prompts are not formatted with the chat template the model was trained on "
                "(task.apply_chat_template)"]))
    if run.chat_template_parts and not run.prompts and run.samples_missing:
        not_checked.append(f"chat template not checked: {run.samples_missing} and no rollout dump")
        evidence["prompts_in_chat_template"] = not_checked[-1]
    if not findings:
        versus = f" vs mean entropy {evidence['mean_entropy']:.3f}" if "mean_entropy" in evidence else ""
        return Check(3, name, PASS, "; ".join([f"equal (|Δ| {largest:.1e}), mean |log_prob| "
                                               f"{magnitude:.3f}{versus}", *not_checked]), evidence)
    verdict = max((f[0] for f in findings), key=SEVERITY.get)
    next_steps = []
    if over(largest, th.kl_tol):
        next_steps.append("relax -m debug=train_only debug.load_rollout_data=<dump>/rollout_data/"
                          "{rollout_id}.pt parallel=single,<layout>  # then relax compare")
    if any(cause == rescore for f in findings for cause in f[2]):
        next_steps.append("relax debug=dump rollout.num_rollout=1 <your overrides>; relax inspect <run dir>  "
                          "# per-token log_probs against rollout_log_probs and entropy: which tokens")
    if any("chat template" in f[1] for f in findings):
        next_steps.append("relax task.apply_chat_template=true <your overrides>")
    return Check(3, name, verdict, "; ".join([*(f[1] for f in findings), *not_checked]), evidence,
                 causes=[c for f in findings for c in f[2]], next_steps=next_steps)


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
                 next_steps=[*layer_hint(run, "ref"),
                             "compare layouts on fixed data: relax -m debug=train_only "
                             "debug.load_rollout_data=... parallel=single,<yours>; relax compare"])


def layer_hint(run: RunData, source: str) -> list[str]:
    """Where the run's layer dump (debug.dump_layers) has `source` ("engine" or "ref") part from
    the trainer's forward: the first departing module, as a next step (none without a dump)."""
    tol = Tolerances()  # relax compare --layers' defaults
    try:
        departures, _ = compare_runs([run.path], None, None, tol.layer_eps_multiple, tol.envelope_margin)
    except (ValueError, OSError, KeyError, RuntimeError):  # no dump, or one that cannot be read
        return []
    dep = next((d for d in departures if d.job == source), None)
    if dep is None or not dep.diffs["forward"]:
        return []
    what = {"engine": "the engine's forward", "ref": "the reference model's forward"}[source]
    where = dep.first["forward"]
    found = (f"{what} departs from the trainer's at {where[0]} (rel {where[1]:.1e}, floor {where[2]:.1e})"
             if where else f"{what} matches the trainer's at every module (the difference is elsewhere)")
    return [f"relax compare --layers {run.path}  # layer dump: {found}"]


def check_train_rollout_diff(run: RunData, th: Thresholds) -> Check:
    name = "train vs rollout log-prob mismatch"
    # train.max_staleness: a rollout generated by an older policy differs from the trainer's by that
    # policy's updates too; only rollouts from the weights being trained show the mismatch
    stale = {r["rollout_id"] for r in run.rollouts if r.get("rollout/staleness", 0) > 0}
    # and only a rollout's first step: with train.num_steps_per_rollout > 1 the later steps' weights
    # have moved by this rollout's own updates (docs/results.md)
    read = [s for s in run.steps if "train/train_rollout_logprob_abs_diff" in s
            and s.get("rollout_id") not in stale and s.get("step", 0) == 0]
    diffs = [s["train/train_rollout_logprob_abs_diff"] for s in read]
    left_out = f" ({len(stale)} stale rollouts of train.max_staleness left out)" if stale else ""
    if not diffs:
        return Check(5, name, SKIP, "no train steps" + left_out)
    third = max(1, len(diffs) // 3)
    first, last = sum(diffs[:third]) / third, sum(diffs[-third:]) / third
    largest = next((d for d in diffs if not math.isfinite(d)), max(diffs))
    evidence = {"max": largest, "first_third_mean": first, "last_third_mean": last,
                "worst_step": diffs.index(largest), "stale_rollouts_left_out": len(stale)}
    causes = ["weight sync into the engine drops or corrupts a tensor",
              "engine and trainer compute differently (dtype, kernels, temperature)"]
    rid = read[diffs.index(largest)].get("rollout_id", 0)
    per_token = f"relax inspect {run.dump_dir or '<dump dir>'} --rollout {rid}"
    next_steps = [*layer_hint(run, "engine"),
                  f"{per_token}  # plots/token_logprobs_{rid}.png: the worst samples' per-token train vs "
                  f"rollout log-probs" + ("" if run.dump_dir else " (run with debug=dump)"),
                  "relax debug.check_weight_update_equal=true debug.check_weight_update_every_sync=true "
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
    worst_tokens = f"; worst tokens: {per_token}" if run.dump_dir else ""
    return Check(5, name, PASS, f"max {max(diffs):.2e}, no upward drift{left_out}{worst_tokens}", evidence)


def check_engine_weights(run: RunData, th: Thresholds) -> Check:
    name = "engine weights vs checkpoint"
    if run.weight_check is None:
        return Check(6, name, SKIP, "not recorded (run with debug.check_weight_update_equal=true)")
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


def check_batch_invariance(run: RunData, th: Thresholds) -> Check:
    name = "batch invariance of the first step's log-probs"
    key = "debug/batch_invariance_max_abs_diff"
    step = next((s for s in run.steps if key in s), None)
    if step is None:
        return Check(8, name, SKIP, "not recorded (run with debug.check_batch_invariance=true)")
    diff = step[key]
    evidence = {key: diff, "rollout_id": step.get("rollout_id"), "tolerance": th.batch_invariance_tol}
    if not over(diff, th.batch_invariance_tol):
        return Check(8, name, PASS, f"max |Δ| {diff:.2e} (tolerance {th.batch_invariance_tol:g}) with one "
                     f"sample per micro-batch and extra padding", evidence)
    return Check(
        8, name, WARN, f"max |Δ| {diff:.3g} > {th.batch_invariance_tol:g}: a sample's log-probs change "
        f"with the samples batched with it or with its padding", evidence,
        causes=["a forward that reads other rows or padding: an attention mask or position ids built "
                "from the batch, packing without sequence boundaries, a batch-wide normalisation",
                "batch-size-dependent kernels (split reductions, GEMM tiling): rounding, which bf16 makes "
                "large (see docs/debugging.md)"],
        next_steps=["relax debug.check_batch_invariance=true train.micro_batch_size=1 <your overrides>  "
                    "# a difference that stays comes from the padding, one that goes from the other rows"])


CHECKS = [check_first_responses, check_later_responses, check_logprobs_vs_ref, check_first_step,
          check_train_rollout_diff, check_engine_weights, check_finite, check_batch_invariance, check_routing,
          check_staleness]


def diagnose(run: RunData, th: Thresholds | None = None) -> list[Check]:
    th = th or Thresholds()
    return [check(run, th) for check in CHECKS]


# -- as text ---------------------------------------------------------------------------------

def as_text(c: Check) -> str:
    lines = [f"[{c.verdict}] {c.id}. {c.name}: {c.summary}"]
    lines += [f"    likely cause: {x}" for x in c.causes]
    lines += [f"    next: {x}" for x in c.next_steps]
    return "\n".join(lines)
