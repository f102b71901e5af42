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


def jsonl_record(row, where: str) -> tuple[str, str]:
    """One dataset record: {"prompt": non-empty text, "label": text or number}."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object with 'prompt' and 'label', found "
                          f"{type(row).__name__}")
    prompt, label = row.get("prompt"), row.get("label")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"{where}: 'prompt' must be a non-empty string, found {prompt!r}")
    if "label" not in row:
        raise ConfigError(f"{where}: no 'label' (the reference answer task.reward_fn compares each "
                          f"response with); write \"label\": \"\" if your reward needs none")
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise ConfigError(f"{where}: 'label' must be a string or a number, found {label!r}")
    return prompt, str(label)


def load_jsonl(path: str | None) -> list[tuple[str, str, str]]:
    """(prompt, label, file:line) of every record."""
    if path is None:
        raise ConfigError("task=jsonl needs task.data_path=/path/to/prompts.jsonl")
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"task.data_path={path!r}: no such file")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{p}:{line}: not UTF-8 text (byte {e.start}: {e.reason}); save the "
                          f"dataset as UTF-8") from None
    rows = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}:{line_no}: not a JSON line ({e})") from None
        rows.append((*jsonl_record(row, f"{p}:{line_no}"), f"{p}:{line_no}"))
    if not rows:
        raise ConfigError(f"task.data_path={path!r}: the dataset is empty")
    return rows


class Task:
    """Prompts for each rollout, and the reward."""

    def __init__(self, seed: int, reward_fn: str, apply_chat_template: bool, answer_format: str | None):
        self.seed, self.apply_chat_template = seed, apply_chat_template
        self.reward_fn_name, self.reward_fn = reward_fn, load_reward_fn(reward_fn)
        self.max_prompt_tokens: int | None = None  # set by check_prompts at start-up
        # What a well-formed response matches; the health metrics read it from the config,
        # since a replaying run builds no task.
        self.answer_format = answer_format

    def questions(self, rng: random.Random, n: int) -> list[tuple[str, str]]:
        """`n` (question, label) pairs drawn with `rng`."""
        raise NotImplementedError

    def dataset(self) -> list[tuple[str, str, str]] | None:
        """Every (question, label, where) the task can draw, if it holds a fixed set (checked at
        start-up); None for generated questions (checked as they are made)."""
        return None

    def check_prompts(self, tokenizer, max_positions: int | None, max_new_tokens: int) -> None:
        """Start-up: each prompt plus rollout.max_new_tokens must fit the model's positions
        (config.json max_position_embeddings); beyond them engines fail or crawl."""
        if not max_positions:
            return
        self.max_prompt_tokens = max_positions - max_new_tokens
        if self.max_prompt_tokens < 1:
            raise ConfigError(f"rollout.max_new_tokens={max_new_tokens} leaves no room for a prompt "
                              f"within the model's max_position_embeddings={max_positions}")
        rows = self.dataset() or []
        lengths = tokenizer([self.format(q, tokenizer) for q, _, _ in rows],
                            add_special_tokens=False)["input_ids"] if rows else []
        for (question, _, where), ids in zip(rows, lengths, strict=True):
            self.check_length(len(ids), where)

    def check_length(self, num_tokens: int, where: str) -> None:
        if self.max_prompt_tokens is not None and num_tokens > self.max_prompt_tokens:
            raise ConfigError(f"{where}: the prompt has {num_tokens} tokens, more than the "
                              f"{self.max_prompt_tokens} the model's max_position_embeddings leaves "
                              f"after rollout.max_new_tokens: shorten it or lower max_new_tokens")

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
            self.check_length(len(tokens), f"rollout {rollout_id}, question {question[:80]!r}")
            out.append(Prompt(text, tokens, label))
        return out

    def reward(self, response: str, label: str) -> float:
        value = self.reward_fn(response, label)
        if hasattr(value, "__float__"):  # int, float, bool, numpy and torch scalars; not str or None
            try:
                return float(value)
            except (TypeError, ValueError):  # a tensor of several numbers
                pass
        raise ConfigError(f"task.reward_fn={self.reward_fn_name} returned {value!r} ({type(value).__name__}) "
                          f"for response={response!r}, label={label!r}: expected a number")


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
        return [self.rows[rng.randrange(len(self.rows))][:2] for _ in range(n)]

    def dataset(self):
        return self.rows


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
