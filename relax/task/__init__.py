"""Prompt sources and rewards (conf/task/): the class `task._target_` names.

A task turns `rollout_id` into a deterministic batch of prompts, so a resumed run and an
uninterrupted one see the same prompts, and scores samples (relax/task/rewards.py:
task.reward_fn, task.group_reward_fn or task.reward_url). The class is called with the task
group's keys and `seed=` (Hydra's instantiate); a new prompt source subclasses `Task` and
implements `questions`.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from relax.targets import instantiate
from relax.errors import ConfigError, NonFiniteError
from relax.task import word_problems
from relax.task.arithmetic import make_problem
from relax.task.rewards import Rewards


@dataclass
class Prompt:
    """One prompt record, as a rollout.generate_fn receives it."""
    text: str          # the prompt as sent, chat template applied
    tokens: list[int]  # its token ids (engines generate from ids, never from text)
    label: str         # what the reward function compares against
    metadata: dict = field(default_factory=dict)  # anything else the dataset row carries
    index: int = 0        # the sample this record is for (its position in the rollout)
    group_index: int = 0  # its GRPO group (the prompt's position)
    chat_template: bool = True  # the text went through the chat template (task.apply_chat_template)
    question: str = ""  # the question as the dataset has it (before the chat template)


def jsonl_record(row, where: str) -> tuple[str, str, dict]:
    """One dataset record: {"prompt": non-empty text, "label": text or number, "metadata": an
    optional object handed to rollout and reward functions}."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object with 'prompt' and 'label', found "
                          f"{type(row).__name__}")
    prompt, label, metadata = row.get("prompt"), row.get("label"), row.get("metadata")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"{where}: 'prompt' must be a non-empty string, found {prompt!r}")
    if "label" not in row:
        raise ConfigError(f"{where}: no 'label' (the reference answer task.reward_fn compares each "
                          f"response with); write \"label\": \"\" if your reward needs none")
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise ConfigError(f"{where}: 'label' must be a string or a number, found {label!r}")
    if metadata is not None and not isinstance(metadata, dict):
        raise ConfigError(f"{where}: 'metadata' must be a JSON object, found {metadata!r}")
    return prompt, str(label), dict(metadata or {})


def load_jsonl(path: str | None) -> list[tuple[str, str, dict, str]]:
    """(prompt, label, metadata, file:line) of every record."""
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


MAX_REWARD = 1e18  # its square still a float32


class Task:
    """Prompts for each rollout, and the rewards."""

    def __init__(self, seed: int, reward_fn: str, apply_chat_template: bool, answer_format: str | None,
                 format_reward: float = 0.0, **reward_keys):
        self.seed, self.apply_chat_template = seed, apply_chat_template
        self.rewards = Rewards(reward_fn, **reward_keys)  # task.reward_fn, group_reward_fn, reward_url...
        try:
            re.compile(answer_format or "")
        except re.error as e:
            raise ConfigError(f"task.answer_format={answer_format!r}: not a regular expression "
                              f"({e})") from None
        if abs(format_reward) > MAX_REWARD:
            raise ConfigError(f"task.format_reward={format_reward}: expected at most {MAX_REWARD:.0e} in size "
                              f"(rewards are float32, and a group's std squares them)")
        if format_reward and not answer_format:
            raise ConfigError(f"task.format_reward={format_reward} needs task.answer_format (the regex a "
                              f"well-formed response matches)")
        self.format_reward = format_reward
        self.max_prompt_tokens: int | None = None  # set by check_prompts at start-up...
        self.template_tokens: list[int] | None = None  # ...and the tokens of an empty question's prompt
        # What a well-formed response matches; the health metrics read it from the config,
        # since a replaying run builds no task.
        self.answer_format = answer_format

    def score(self, samples, group_size: int) -> None:
        """Set every sample's reward (a rollout's samples, in GRPO groups of `group_size`), plus
        task.format_reward for a response that matches task.answer_format."""
        self.rewards.score(samples, group_size)
        if self.format_reward:
            pattern = re.compile(self.answer_format)
            for s in samples:
                s.reward += self.format_reward * bool(pattern.fullmatch(s.response.strip()))

    def held_out(self, rng: random.Random, n: int) -> list[tuple] | None:
        """`n` questions that training never draws (eval.datasets entry `task`), if the task has such."""
        return None

    def questions(self, rng: random.Random, n: int) -> list[tuple]:
        """`n` (question, label) or (question, label, metadata) tuples drawn with `rng`."""
        raise NotImplementedError

    def dataset(self) -> list[tuple[str, str, dict, str]] | None:
        """Every (question, label, metadata, where) the task can draw, if it holds a fixed set (checked at
        start-up); None for generated questions (checked as they are made)."""
        return None

    def check_prompts(self, tokenizer, max_positions: int | None, max_new_tokens: int) -> None:
        """Start-up: the tokenizer has the chat template prompts go through (task.apply_chat_template),
        and every prompt of the dataset passes check_tokens: it adds a token to the prompt, and with
        rollout.max_new_tokens fits the model's positions (config.json max_position_embeddings;
        beyond them engines fail or crawl)."""
        if self.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{tokenizer.name_or_path}: the tokenizer has no chat template (a base "
                              f"model's has none), which task.apply_chat_template=true wraps every prompt "
                              f"in: set task.apply_chat_template=false to send the prompts as they are")
        if max_positions:
            self.max_prompt_tokens = max_positions - max_new_tokens
            if self.max_prompt_tokens < 1:
                raise ConfigError(f"rollout.max_new_tokens={max_new_tokens} leaves no room for a prompt "
                                  f"within the model's max_position_embeddings={max_positions}")
        self.template_tokens = self.encode(self.texts([""], tokenizer), tokenizer)[0]
        rows = self.dataset() or []
        texts = self.texts([row[0] for row in rows], tokenizer)
        for (*_, where), ids in zip(rows, self.encode(texts, tokenizer), strict=True):
            self.check_tokens(ids, where)

    def check_tokens(self, tokens: list[int], where: str) -> None:
        """A prompt's tokens: more than its template's alone (a question the tokenizer drops
        whole would be scored 0 every time), and within the model's positions."""
        if tokens == self.template_tokens:
            raise ConfigError(f"{where}: the tokenizer encodes the prompt to no token (it drops every "
                              f"character): every response would be scored without a question; fix or "
                              f"remove it")
        if self.max_prompt_tokens is not None and len(tokens) > self.max_prompt_tokens:
            raise ConfigError(f"{where}: the prompt has {len(tokens)} tokens, more than the "
                              f"{self.max_prompt_tokens} the model's max_position_embeddings leaves "
                              f"after rollout.max_new_tokens: shorten it or lower max_new_tokens")

    def texts(self, questions: list[str], tokenizer) -> list[str]:
        """The prompts' texts: each question as the user's turn of the chat template (or as it
        is), rendered as one batch."""
        if not self.apply_chat_template or not questions:
            return list(questions)
        return tokenizer.apply_chat_template([[{"role": "user", "content": q}] for q in questions],
                                             add_generation_prompt=True, tokenize=False)

    @staticmethod
    def encode(texts: list[str], tokenizer) -> list[list[int]]:
        """Token ids of each text, in one call (the fast tokenizer encodes the batch at once)."""
        return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    def to_prompts(self, questions: list[tuple], tokenizer, where: str) -> list[Prompt]:
        texts = self.texts([q[0] for q in questions], tokenizer)
        out = []
        for (question, label, *metadata), text, tokens in zip(questions, texts, self.encode(texts, tokenizer),
                                                             strict=True):
            self.check_tokens(tokens, f"{where}, question {question[:80]!r}")
            out.append(Prompt(text, tokens, label, dict(metadata[0]) if metadata else {},
                              chat_template=self.apply_chat_template, question=question))
        return out

    def prompts(self, rollout_id: int, batch_size: int, tokenizer, round: int = 0) -> list[Prompt]:
        """The prompts of a rollout's generation round (rounds after the first: dynamic sampling)."""
        rng = random.Random(f"{self.seed}-{rollout_id}" + (f"-{round}" if round else ""))
        return self.to_prompts(self.questions(rng, batch_size), tokenizer, f"rollout {rollout_id}")


def check_operands(min_operand: int, max_operand: int) -> None:
    """The operand range of the generated tasks: [task.min_operand, task.max_operand], not negative."""
    if min_operand < 0:
        raise ConfigError(f"task.min_operand={min_operand}: expected an integer >= 0")
    if max_operand < min_operand:
        raise ConfigError(f"task.min_operand={min_operand} is above task.max_operand={max_operand}: expected "
                          f"min_operand <= max_operand")


class ArithmeticTask(Task):
    """task=arithmetic: "a+b=" with operands in [min_operand, max_operand]."""

    def __init__(self, min_operand: int, max_operand: int, **common):
        super().__init__(**common)
        check_operands(min_operand, max_operand)
        self.min_operand, self.max_operand = min_operand, max_operand

    def questions(self, rng, n):
        return [make_problem(rng, self.min_operand, self.max_operand) for _ in range(n)]


class WordProblemsTask(Task):
    """task=word_problems: generated arithmetic word problems (relax/task/word_problems.py)."""

    def __init__(self, operations: list[str], min_operand: int, max_operand: int, instruction: str, **common):
        super().__init__(**common)
        unknown = sorted(set(operations) - set(word_problems.TEMPLATES))
        if unknown or not operations:
            raise ConfigError(f"task.operations={list(operations)}: expected one or more of "
                              f"{', '.join(sorted(word_problems.TEMPLATES))}")
        check_operands(min_operand, max_operand)
        self.min_operand, self.max_operand = min_operand, max_operand  # (eval's arithmetic uses them too)
        self.problem = dict(operations=list(operations), min_operand=min_operand, max_operand=max_operand,
                            instruction=instruction)

    def questions(self, rng, n):
        return word_problems.draw(rng, n, want_held_out=False, **self.problem)

    def held_out(self, rng, n):
        return word_problems.draw(rng, n, want_held_out=True, **self.problem)


class JsonlTask(Task):
    """task=jsonl: prompts drawn from task.data_path."""

    def __init__(self, data_path: str | None, **common):
        super().__init__(**common)
        self.rows = load_jsonl(data_path)

    def questions(self, rng, n):
        return [self.rows[rng.randrange(len(self.rows))][:3] for _ in range(n)]

    def dataset(self):
        return self.rows


def build_task(task, seed: int) -> Task:
    """The class `task._target_` names, with the group's other keys and the run's seed."""
    return instantiate(task, "task", seed=seed)


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
