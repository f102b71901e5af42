"""The doctor's checks inside a run, at its first step and after its first weight sync.

With `debug.strict_checks=true` a FAIL of check 3, 4, 5 or 7 at the first step, or of check 6
after the first sync, stops the run with the doctor's explanation. Without it, the first step
still runs checks 1 (garbage responses) and 5 (train vs rollout mismatch): engine and trainer
disagreeing by nats per token, or an engine that samples garbage, is a broken run that would
otherwise end with exit 0, so it is a WARNING naming `relax doctor`. The levels are the doctor's
own (verdicts.Thresholds), judged by the same check functions.
"""

from __future__ import annotations

import logging
from pathlib import Path

from relax.debug.checks import (FAIL, Check, Thresholds, as_text, check_engine_weights, check_finite,
                                check_first_responses, check_first_step, check_logprobs_vs_ref,
                                check_train_rollout_diff)
from relax.debug.run_data import RunData, chat_template_parts
from relax.errors import CheckFailed

log = logging.getLogger("relax")

# what debug.strict_checks asserts at the first step (3, 4, 5, 7)
STRICT = (check_logprobs_vs_ref, check_first_step, check_train_rollout_diff, check_finite)
# what a run without it warns about (1, 5): garbage responses, train vs rollout mismatch
WARNED = (check_first_responses, check_train_rollout_diff)


def first_step_run(record: dict, steps: list[dict], train, algo, rollout, prompts: list[str], tokenizer,
                   vocab_size: int | None) -> RunData:
    """The run's first step as `relax doctor` will read it (`vocab_size`: the model's output
    rows, the softmax's support)."""
    return RunData(path=Path("."), rollouts=[record], steps=steps, prompts=prompts,
                   num_steps_per_rollout=train.num_steps_per_rollout, backend=train._target_,
                   use_rollout_log_probs=algo.use_rollout_log_probs,
                   chat_template_parts=chat_template_parts(tokenizer), lr=train.lr,
                   top_p=rollout.top_p, samples_per_rollout=len(prompts) or None, vocab_size=vocab_size)


def failed(run: RunData, checks) -> list[Check]:
    found = [check(run, Thresholds()) for check in checks]
    return [c for c in found if c.verdict == FAIL]


def strict_first_step(run: RunData) -> None:
    if found := failed(run, STRICT):
        raise CheckFailed("debug.strict_checks: stopping at the first step\n"
                          + "\n".join(map(as_text, found)))


def first_step_warning(run: RunData, run_dir: Path) -> str | None:
    """The one-line warning for a first step far outside the healthy range (checks 1 or 5
    FAIL), or None."""
    if not (found := failed(run, WARNED)):
        return None
    what = "; ".join(f"check {c.id} ({c.name}): {c.summary}" for c in found)
    return (f"the first step is far outside the healthy range: {what}. The run goes on; run "
            f"`relax doctor {run_dir}` for the causes and the next command (debug.strict_checks=true "
            f"stops a run here)")


def judge_first_step(run: RunData, strict_checks: bool, run_dir: Path) -> None:
    """debug.strict_checks: a FAIL stops the run; without it, garbage or a mismatch is a warning."""
    if strict_checks:
        strict_first_step(run)
    elif warning := first_step_warning(run, run_dir):
        log.warning("%s", warning)


def strict_weights(report: dict) -> None:
    run = RunData(path=Path("."), rollouts=[], steps=[], weight_check=report)
    check = check_engine_weights(run, Thresholds())
    if check.verdict == FAIL:
        raise CheckFailed("debug.strict_checks: stopping before the first rollout\n" + as_text(check))
