"""task=reasoning_gym: prompts, labels and rewards from the reasoning-gym library (the [rgym] extra).

Each of task.datasets is a procedural reasoning-gym dataset: item i of a dataset made with seed s
is generated from seed s + i. Training draws items with seeds base .. base + task.size - 1 (base
from the run's seed), eval.datasets=[task] the items after them, so evaluation never sees a
training seed. The reward is the dataset's own `score_answer` (the `score` reward function).
Details and the hand-written tasks this covers: docs/tasks.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import random
import re

from relax.errors import ConfigError
from relax.task import Task

INSTALL = "pip install -c constraints.txt -e '.[rgym]'"
MAX_SIZE = 2**30  # seeds stay below 2**32 (some datasets seed numpy with seed + index)
PROBE = 16  # items of each dataset whose prompts are checked at start-up
REFUSED = {"composite": "task.datasets and task.weights are Relax's way to mix datasets"}


def library():
    try:
        # optional: reasoning-gym (relax[rgym])
        import reasoning_gym
    except ImportError as e:
        raise ConfigError(f"task=reasoning_gym needs the reasoning-gym library, the [rgym] extra: {INSTALL} "
                          f"({e})") from None
    return reasoning_gym


def registry() -> dict:
    """Every dataset name the installed library has -> (dataset class, config class)."""
    return library().factory.DATASETS


def check_datasets(datasets) -> list[str]:
    names = list(datasets)
    if not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"task.datasets={names}: expected one or more reasoning-gym dataset names, "
                          f"e.g. task.datasets=[basic_arithmetic,leg_counting]")
    known = registry()
    for name in names:
        if name in REFUSED:
            raise ConfigError(f"task.datasets: {name!r} is refused here: {REFUSED[name]} (list the datasets "
                              f"it would combine)")
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=3)
            raise ConfigError(f"task.datasets: {name!r} is not a reasoning-gym dataset"
                              + (f" (did you mean {', '.join(close)}?)" if close else "")
                              + f"; the library has {len(known)}: python -c \"import reasoning_gym; "
                                f"print(sorted(reasoning_gym.factory.DATASETS))\"")
    if len(set(names)) < len(names):
        raise ConfigError(f"task.datasets={names}: a dataset is listed twice (task.weights weights them)")
    return names


def check_weights(weights, names: list[str]) -> list[float]:
    if weights is None:
        return [1.0] * len(names)
    weights = list(weights)
    if len(weights) != len(names):
        raise ConfigError(f"task.weights={weights}: expected one weight per dataset of task.datasets={names} "
                          f"({len(names)}), or null (equal weights)")
    for name, w in zip(names, weights, strict=True):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ConfigError(f"task.weights={weights}: the weight of {name} is {w}: expected a finite "
                              f"number >= 0")
    if sum(weights) <= 0:
        raise ConfigError(f"task.weights={weights}: expected a weight > 0 for at least one dataset")
    return [float(w) for w in weights]


def check_kwargs(dataset_kwargs, names: list[str]) -> dict[str, dict]:
    if not isinstance(dataset_kwargs, dict):
        raise ConfigError(f"task.dataset_kwargs={dataset_kwargs!r}: expected a mapping of dataset name to "
                          f"its config, e.g. {{basic_arithmetic: {{max_terms: 3}}}}")
    out = {}
    for name, kwargs in dataset_kwargs.items():
        key = f"task.dataset_kwargs.{name}"
        if name not in names:
            raise ConfigError(f"{key}: {name!r} is not one of task.datasets={names}")
        if not isinstance(kwargs, dict):
            raise ConfigError(f"{key}={kwargs!r}: expected a mapping of {name}'s config keys to values")
        fields = {f.name for f in dataclasses.fields(registry()[name][1])}
        for k in kwargs:
            if k in ("seed", "size"):
                raise ConfigError(f"{key}.{k}: set by Relax (the run's seed and task.size), not per dataset")
            if k not in fields:
                close = difflib.get_close_matches(k, sorted(fields - {"seed", "size"}), n=3)
                raise ConfigError(f"{key}.{k}: {name} has no such config key"
                                  + (f" (did you mean {', '.join(close)}?)" if close else "")
                                  + f"; it has: {', '.join(sorted(fields - {'seed', 'size'}))}")
        out[name] = dict(kwargs)
    return out


def make(name: str, kwargs: dict, seed: int, size: int):
    """The library's dataset `name` with `kwargs`; a config it refuses is a ConfigError naming the key,
    and so is one whose first item fails to generate (some configs fail only then)."""
    try:
        dataset = library().create_dataset(name, **kwargs, seed=seed, size=size)
        dataset[0]
    except Exception as e:  # the library validates with assert, ValueError, TypeError... anything goes
        shown = json.dumps(kwargs) if kwargs else "{} (the library's defaults)"
        raise ConfigError(f"task.dataset_kwargs.{name}={shown}: reasoning-gym refuses {name}'s config "
                          f"(size={size}): {type(e).__name__}: {e}") from None
    return dataset


def check_answer_source(answer_tag, answer_regex) -> None:
    """task.answer_tag and task.answer_regex: a tag name, or a regex that finds an answer; one of them."""
    if answer_tag is not None and not re.fullmatch(r"[A-Za-z_][\w.-]*", answer_tag):
        raise ConfigError(f"task.answer_tag={answer_tag!r}: expected a tag name (answer: "
                          f"<answer>...</answer>), or null (the whole response is the answer)")
    if answer_regex is None:
        return
    if answer_tag is not None:
        raise ConfigError(f"task.answer_regex={answer_regex!r} and task.answer_tag={answer_tag!r}: set one "
                          f"(the answer is the last match of the regex, or the text of the last tag)")
    try:
        compiled = re.compile(answer_regex)
    except (re.error, TypeError) as e:
        raise ConfigError(f"task.answer_regex={answer_regex!r}: expected a regular expression ({e})") from None
    if compiled.match(""):
        raise ConfigError(f"task.answer_regex={answer_regex!r}: it matches the empty string, so every "
                          f"response would have an answer: expected one that matches an answer ('-?\\d+')")


SCORERS: dict[tuple[str, str], object] = {}  # (name, its kwargs as JSON) -> a dataset of that config


def scorer(name: str, kwargs: dict):
    """The dataset object whose score_answer scores `name`'s items: the task's own, or one made
    once per config (seeds do not score)."""
    key = (name, json.dumps(kwargs, sort_keys=True))
    if key not in SCORERS:
        SCORERS[key] = make(name, kwargs, seed=0, size=1)
    return SCORERS[key]


def extract(response: str, tag: str | None, regex: str | None = None) -> str | None:
    """What score_answer gets: the last <tag>...</tag> of the response (None without one; the
    library's extract_answer), the last match of `regex` (None without one), or the whole
    response, stripped, without either."""
    if regex is not None:
        found = [m.group(0) for m in re.finditer(regex, response)]
        return found[-1] if found else None
    if tag is None:
        return response.strip()
    # optional: reasoning-gym (relax[rgym])
    from reasoning_gym.utils import extract_answer

    return extract_answer(response, tag_name=tag)


def score(sample) -> float:
    """task.reward_fn of task=reasoning_gym: the item's dataset's own score_answer(answer, entry)."""
    item = sample.metadata.get("reasoning_gym")
    if not isinstance(item, dict):
        raise ValueError("the sample carries no reasoning-gym item (metadata 'reasoning_gym'): "
                         "relax.task.reasoning_gym.score scores task=reasoning_gym's samples only")
    answer = extract(sample.response, item["answer_tag"], item.get("answer_regex"))
    return float(scorer(item["dataset"], item["kwargs"]).score_answer(answer, item["entry"]))


class ReasoningGymTask(Task):
    """task=reasoning_gym: items of task.datasets (drawn by task.weights), scored by the library."""

    def __init__(self, datasets: list[str], weights: list[float] | None, dataset_kwargs: dict, size: int,
                 answer_tag: str | None, answer_regex: str | None, instruction: str, **common):
        super().__init__(**common)
        self.names = check_datasets(datasets)
        self.weights = check_weights(weights, self.names)
        self.kwargs = check_kwargs(dataset_kwargs, self.names)
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_SIZE:
            raise ConfigError(f"task.size={size}: expected a number of items per dataset in [1, {MAX_SIZE}]")
        check_answer_source(answer_tag, answer_regex)
        self.size, self.answer_tag, self.answer_regex, self.instruction = size, answer_tag, answer_regex, instruction
        # The first training seed: from the run's seed, below 2**31 (with size and eval's items, < 2**32)
        self.base = random.Random(f"{self.seed}-reasoning-gym").randrange(2**31)
        self.train = {n: make(n, self.kwargs.get(n, {}), self.base, size) for n in self.names}
        self.eval: dict = {}  # made on first use, on the seeds after training's
        for name, dataset in self.train.items():
            SCORERS[(name, json.dumps(self.kwargs.get(name, {}), sort_keys=True))] = dataset

    def check_prompts(self, tokenizer, max_positions, max_new_tokens):
        """Start-up: besides the base checks, the first PROBE items of each dataset fit the model
        (a dataset whose prompts are too long is named now, not at the rollout that draws one)."""
        super().check_prompts(tokenizer, max_positions, max_new_tokens)
        for name, dataset in self.train.items():
            questions = [self.item(name, dataset[i])[0] for i in range(min(PROBE, self.size))]
            for i, ids in enumerate(self.encode(self.texts(questions, tokenizer), tokenizer)):
                self.check_tokens(ids, f"task.datasets {name}, item {i} ({questions[i][:80]!r})")

    def item(self, name: str, entry: dict) -> tuple[str, str, dict]:
        question = f"{entry['question'].rstrip()} {self.instruction}".strip()
        label = "" if entry["answer"] is None else str(entry["answer"])
        return question, label, {"reasoning_gym": {"dataset": name, "kwargs": self.kwargs.get(name, {}),
                                                   "answer_tag": self.answer_tag,
                                                   "answer_regex": self.answer_regex, "entry": entry}}

    def questions(self, rng, n):
        names = rng.choices(self.names, weights=self.weights, k=n)
        return [self.item(name, self.train[name][rng.randrange(self.size)]) for name in names]

    def held_out(self, rng, n):
        """Items 0..n-1 of each dataset made on the seeds after training's (base + task.size on)."""
        names = rng.choices(self.names, weights=self.weights, k=n)
        out = []
        for i, name in enumerate(names):
            if name not in self.eval:
                self.eval[name] = make(name, self.kwargs.get(name, {}), self.base + self.size, n)
            out.append(self.item(name, self.eval[name][i]))
        return out
