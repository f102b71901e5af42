"""Prompt sources and reward functions (conf/task/): the class `task._target_` names.

A task turns `rollout_id` into a deterministic batch of prompts, so a resumed run and an
uninterrupted one see the same prompts, and scores responses with `task.reward_fn`. The
class is called with the task group's keys and `seed=` (Hydra's instantiate); a new prompt
source subclasses `Task` and implements `questions`.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from relax.config import instantiate
from relax.errors import ConfigError, NonFiniteError
from relax.task.arithmetic import make_problem

RewardFn = Callable[[str, str], float]


@dataclass
class Prompt:
    text: str          # the prompt as sent, chat template applied
    tokens: list[int]  # its token ids (engines generate from ids, never from text)
    label: str         # what the reward function compares against


def load_reward_fn(dotted: str) -> RewardFn:
    from hydra.utils import get_method

    try:
        return get_method(dotted)
    except (ImportError, ValueError) as e:
        raise ConfigError(
            f"task.reward_fn={dotted!r} does not import: {e.__cause__ or e}. Expected a dotted path "
            f"to a function reward(response: str, label: str) -> float, e.g. "
            f"relax.task.arithmetic.exact_match"
        ) from None


def load_jsonl(path: str | None) -> list[tuple[str, str]]:
    if path is None:
        raise ConfigError("task=jsonl needs task.data_path=/path/to/prompts.jsonl")
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"task.data_path={path!r}: no such file")
    rows = []
    for line_no, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append((str(row["prompt"]), str(row.get("label", ""))))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(
                f"{p}:{line_no}: expected a JSON object with 'prompt' (and 'label'): {e}"
            ) from None
    if not rows:
        raise ConfigError(f"task.data_path={path!r}: the dataset is empty")
    return rows


class Task:
    """Prompts for each rollout, and the reward."""

    def __init__(self, seed: int, reward_fn: str, apply_chat_template: bool, answer_format: str | None):
        self.seed, self.apply_chat_template = seed, apply_chat_template
        self.reward_fn = load_reward_fn(reward_fn)
        # What a well-formed response matches; the health metrics read it from the config,
        # since a replaying run builds no task.
        self.answer_format = answer_format

    def questions(self, rng: random.Random, n: int) -> list[tuple[str, str]]:
        """`n` (question, label) pairs drawn with `rng`."""
        raise NotImplementedError

    def format(self, question: str, tokenizer) -> str:
        if not self.apply_chat_template:
            return question
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )

    def prompts(self, rollout_id: int, batch_size: int, tokenizer) -> list[Prompt]:
        out = []
        for question, label in self.questions(random.Random(f"{self.seed}-{rollout_id}"), batch_size):
            text = self.format(question, tokenizer)
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append(Prompt(text, tokens, label))
        return out

    def reward(self, response: str, label: str) -> float:
        return float(self.reward_fn(response, label))


class ArithmeticTask(Task):
    """task=arithmetic: "a+b=" with operands in [min_operand, max_operand]."""

    def __init__(self, min_operand: int, max_operand: int, **common):
        super().__init__(**common)
        self.min_operand, self.max_operand = min_operand, max_operand

    def questions(self, rng, n):
        return [make_problem(rng, self.min_operand, self.max_operand) for _ in range(n)]


class JsonlTask(Task):
    """task=jsonl: prompts drawn from task.data_path."""

    def __init__(self, data_path: str | None, **common):
        super().__init__(**common)
        self.rows = load_jsonl(data_path)

    def questions(self, rng, n):
        return [self.rows[rng.randrange(len(self.rows))] for _ in range(n)]


def build_task(cfg) -> Task:
    return instantiate(cfg, "task", seed=cfg.seed)


def check_rewards(samples, source: str) -> None:
    """Stop before anything trains on a NaN or Inf reward (it would turn every advantage of
    its group, then the weights, into NaN), naming the sample and where the reward came from."""
    bad = [s for s in samples if not math.isfinite(s.reward)]
    if bad:
        s = bad[0]
        raise NonFiniteError(
            f"{len(bad)} non-finite reward(s) from {source}; first: reward={s.reward} for sample "
            f"{s.index} (prompt={s.prompt!r}, response={s.response!r}, label={s.label!r}). Nothing "
            f"was trained on this rollout: make the reward function return a finite float")
