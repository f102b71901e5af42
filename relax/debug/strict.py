"""The doctor's checks inside a run, at its first step and after its first weight sync.

With `debug.strict_checks=true` a FAIL of check 3, 4, 5 or 7 at the first step, or of check 6
after the first sync, stops the run with the doctor's explanation. Without it, the first step
still runs checks 1 (garbage responses) and 5 (train vs rollout mismatch): engine and trainer
disagreeing by nats per token, or an engine that samples garbage, is a broken run that would
otherwise end with exit 0, so it is a WARNING naming `relax doctor`. The levels are the doctor's
own (verdicts.Thresholds), judged by the same check functions.
"""

from __future__ import annotations

from pathlib import Path

from relax.debug.checks import (FAIL, Check, Thresholds, as_text, check_engine_weights, check_finite,
                                check_first_responses, check_first_step, check_logprobs_vs_ref,
                                check_train_rollout_diff)
from relax.debug.run_data import RunData, chat_template_parts
from relax.errors import CheckFailed

# what debug.strict_checks asserts at the first step (3, 4, 5, 7)
STRICT = (check_logprobs_vs_ref, check_first_step, check_train_rollout_diff, check_finite)
# what a run without it warns about (1, 5): garbage responses, train vs rollout mismatch
WARNED = (check_first_responses, check_train_rollout_diff)


def first_step_checks(record: dict, steps: list[dict], cfg, prompts: list[str], tokenizer,
                      vocab_size: int | None, checks) -> list[Check]:
    """`checks` of the first step, as `relax doctor` will judge them (`vocab_size`: the model's
    output rows, the softmax's support, as the doctor reads it)."""
    run = RunData(path=Path("."), rollouts=[record], steps=steps, prompts=prompts,
                  num_steps_per_rollout=cfg.train.num_steps_per_rollout, backend=cfg.train._target_,
                  use_rollout_log_probs=cfg.algo.use_rollout_log_probs,
                  chat_template_parts=chat_template_parts(tokenizer), lr=cfg.train.lr,
                  top_p=cfg.rollout.top_p, samples_per_rollout=len(prompts) or None,
                  vocab_size=vocab_size)
    return [check(run, Thresholds()) for check in checks]


def strict_first_step(record: dict, steps: list[dict], cfg, prompts: list[str], tokenizer,
                      vocab_size: int | None) -> None:
    found = first_step_checks(record, steps, cfg, prompts, tokenizer, vocab_size, STRICT)
    failed = [c for c in found if c.verdict == FAIL]
    if failed:
        raise CheckFailed("debug.strict_checks: stopping at the first step\n"
                          + "\n".join(map(as_text, failed)))


def first_step_warning(record: dict, steps: list[dict], cfg, prompts: list[str], tokenizer,
                       vocab_size: int | None, run_dir: Path) -> str | None:
    """The one-line warning for a first step far outside the healthy range (checks 1 or 5
    FAIL), or None."""
    found = first_step_checks(record, steps, cfg, prompts, tokenizer, vocab_size, WARNED)
    failed = [c for c in found if c.verdict == FAIL]
    if not failed:
        return None
    what = "; ".join(f"check {c.id} ({c.name}): {c.summary}" for c in failed)
    return (f"the first step is far outside the healthy range: {what}. The run goes on; run "
            f"`relax doctor {run_dir}` for the causes and the next command (debug.strict_checks=true "
            f"stops a run here)")


def strict_weights(report: dict) -> None:
    run = RunData(path=Path("."), rollouts=[], steps=[], weight_check=report)
    check = check_engine_weights(run, Thresholds())
    if check.verdict == FAIL:
        raise CheckFailed("debug.strict_checks: stopping before the first rollout\n" + as_text(check))
