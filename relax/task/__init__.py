"""Prompt sources and reward functions (conf/task/).

A task turns `rollout_id` into a deterministic batch of prompts, so a resumed run and an
uninterrupted one see the same prompts, and scores responses with `task.reward_fn`.
"""

from __future__ import annotations

import importlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from relax.errors import ConfigError, NonFiniteError
from relax.task.arithmetic import make_problem

RewardFn = Callable[[str, str], float]


@dataclass
class Prompt:
    text: str          # the prompt as sent, chat template applied
    tokens: list[int]  # its token ids (engines generate from ids, never from text)
    label: str         # what the reward function compares against


def load_reward_fn(dotted: str) -> RewardFn:
    module_name, _, attr = dotted.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(
            f"task.reward_fn={dotted!r} does not import: {e}. Expected a dotted path to a "
            f"function reward(response: str, label: str) -> float, e.g. "
            f"relax.task.arithmetic.exact_match"
        ) from None
    if not callable(fn):
        raise ConfigError(f"task.reward_fn={dotted!r} is not callable")
    return fn


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

    def __init__(self, cfg, seed: int):
        self.cfg, self.seed = cfg, seed
        self.reward_fn = load_reward_fn(cfg.reward_fn)
        self.rows = load_jsonl(cfg.data_path) if cfg.name == "jsonl" else None
        if cfg.name not in ("arithmetic", "jsonl"):
            raise ConfigError(f"task.name={cfg.name!r}: expected 'arithmetic' or 'jsonl'")

    def format(self, question: str, tokenizer) -> str:
        if not self.cfg.apply_chat_template:
            return question
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )

    def prompts(self, rollout_id: int, batch_size: int, tokenizer) -> list[Prompt]:
        rng = random.Random(f"{self.seed}-{rollout_id}")
        if self.rows is None:
            pairs = [make_problem(rng, self.cfg.min_operand, self.cfg.max_operand)
                     for _ in range(batch_size)]
        else:
            pairs = [self.rows[rng.randrange(len(self.rows))] for _ in range(batch_size)]
        out = []
        for question, label in pairs:
            text = self.format(question, tokenizer)
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append(Prompt(text, tokens, label))
        return out

    def reward(self, response: str, label: str) -> float:
        return float(self.reward_fn(response, label))


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
