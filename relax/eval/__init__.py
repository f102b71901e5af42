"""Evaluation during training: the `eval` config section.

How it works in detail: docs/rollouts.md, "Inside `relax/eval/__init__.py`".
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

from relax.config import ArithmeticTaskGroup
from relax.errors import ConfigError
from relax.rollout import SamplingParams, rollout_seed
from relax.rollout.agent import AgentSpec
from relax.rollout.generate import generate_samples
from relax.task import load_jsonl
from relax.task.arithmetic import make_problem

log = logging.getLogger(__name__)
SEED_OFFSET = 500_000  # eval sampling seeds: past every training rollout's (rollout_seed)


BUILT_IN = ("arithmetic", "task")


def dataset_name(entry: str) -> str:
    return entry if entry in BUILT_IN else Path(entry).stem


def questions(entry: str, eval, seed: int, task) -> list[tuple]:
    """Dataset `entry` of eval.datasets: its first eval.num_prompts questions."""
    if entry == "task":  # the run's own task, on questions training never draws
        held_out = task.held_out(random.Random(f"{seed}-eval-task"), eval.num_prompts)
        if held_out is None:
            raise ConfigError(f"eval.datasets entry 'task': task={type(task).__name__} has no held-out "
                              f"questions (task=word_problems has); use arithmetic or a JSONL file")
        return held_out
    if entry == "arithmetic":  # in the run's task's operand range, where it has one
        low = getattr(task, "min_operand", ArithmeticTaskGroup.min_operand)
        high = getattr(task, "max_operand", ArithmeticTaskGroup.max_operand)
        rng = random.Random(f"{seed}-eval-arithmetic")  # the same problems at every evaluation
        return [make_problem(rng, low, high) for _ in range(eval.num_prompts)]
    try:
        return load_jsonl(entry)[:eval.num_prompts]
    except ConfigError as error:
        raise ConfigError(f"eval.datasets entry {entry!r}: {error} (expected arithmetic, task or a JSONL "
                          f"file of {{\"prompt\", \"label\"}} rows)") from None


MAX_PROMPTS = 10**5


class Evaluator:
    """The run's evaluation: `due(rollout_id)`, then `evaluate(engine, rollout_id)` -> metrics."""

    def __init__(self, eval, rollout, seed: int, task, tokenizer, last_rollout_id: int):
        e = eval
        if e.interval is not None and e.interval < 1:
            raise ConfigError(f"eval.interval={e.interval}: expected a positive number of rollouts, or null "
                              f"(no evaluation)")
        for key in ("num_prompts", "n_samples_per_prompt"):
            if e[key] < 1:
                raise ConfigError(f"eval.{key}={e[key]}: expected a positive integer")
        if e.num_prompts > MAX_PROMPTS:
            raise ConfigError(f"eval.num_prompts={e.num_prompts}: expected at most {MAX_PROMPTS} (each "
                              f"dataset's prompts are made and encoded at start-up)")
        if e.temperature < 0:
            raise ConfigError(f"eval.temperature={e.temperature}: expected a number >= 0 (0: greedy)")
        names = [dataset_name(d) for d in e.datasets]
        if len(set(names)) < len(names) or not names:
            raise ConfigError(f"eval.datasets={list(e.datasets)}: expected one or more datasets with "
                              f"distinct names (arithmetic, or JSONL files named after their stem)")
        self.eval, self.rollout, self.seed = eval, rollout, seed
        self.task, self.tokenizer, self.last = task, tokenizer, last_rollout_id
        self.prompts = {name: task.to_prompts(questions(entry, eval, seed, task), tokenizer,
                                              f"eval.datasets {entry!r}")
                        for name, entry in zip(names, e.datasets, strict=True)}

    def due(self, rollout_id: int) -> bool:
        return rollout_id % self.eval.interval == 0 or rollout_id == self.last

    def evaluate(self, engine, rollout_id: int) -> dict:
        e, r, t0 = self.eval, self.rollout, time.perf_counter()
        sp = SamplingParams(e.temperature, r.top_p, r.max_new_tokens)
        out = {}
        for name, prompts in self.prompts.items():
            seed = rollout_seed(self.seed, rollout_id) + SEED_OFFSET
            samples = generate_samples(engine, self.task, self.tokenizer, prompts, e.n_samples_per_prompt, sp,
                                       seed, r.generate_fn, f"in eval/{name} at rollout {rollout_id}",
                                       agent=AgentSpec.of(r))
            out[f"eval/{name}/reward"] = sum(s.reward for s in samples) / len(samples)
            out[f"eval/{name}/response_len"] = sum(s.response_length for s in samples) / len(samples)
        log.info("Eval at rollout %d: %s", rollout_id, ", ".join(f"{k}={v:.3f}" for k, v in out.items()))
        return {**out, "perf/eval_time": time.perf_counter() - t0}


def build_evaluator(eval, rollout, seed: int, task, tokenizer, plan) -> Evaluator | None:
    """The run's Evaluator, or None: eval.interval is null, or the run builds no engine."""
    if eval.interval is None:
        return None
    if not plan.builds_rollout:
        log.info("eval.interval=%s: evaluation skipped, debug=train_only builds no rollout engine",
                 eval.interval)
        return None
    return Evaluator(eval, rollout, seed, task, tokenizer, plan.rollout_ids[-1])
