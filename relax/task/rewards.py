"""Rewards: a rollout's samples scored by task.reward_fn, task.group_reward_fn or task.reward_url.

How it works in detail: docs/rollouts.md, "Inside `relax/task/rewards.py`".
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
import traceback

import httpx2

from relax.errors import ConfigError, RolloutError
from relax.sample import Sample
from relax.targets import load_function

BACKOFF_S = 0.5  # the first reward_url retry's wait; doubled for each further one


def response_length(response: str, label: str) -> float:
    """Not a task's reward, one for numerics work (layout sweeps, replays, `relax compare`): the
    response's length in characters / 100, so a GRPO group's rewards differ whenever its
    responses do and every step has a gradient, which a task's 0/1 reward on an untrained
    model's short answers often leaves at 0."""
    return len(response) / 100


def describe(sample: Sample) -> str:
    return (f"sample {sample.index} (prompt={sample.prompt!r}, response={sample.response!r}, "
            f"label={sample.label!r})")


def raised(what: str, sample: Sample, error: BaseException) -> RolloutError:
    """The error for a user's function that raised on a sample: its name, the sample, the traceback."""
    trace = "".join(traceback.format_exception(error)).rstrip()
    return RolloutError(f"{what} raised on {describe(sample)}:\n{trace}")


def takes_sample(fn, key: str, path: str) -> bool:
    """Whether a reward function takes the Sample (one parameter) or (response, label) (two)."""
    required = [p for p in inspect.signature(fn).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) not in (1, 2):
        raise ConfigError(f"{key}={path!r} takes {len(required)} required arguments; expected "
                          f"reward(response, label) or reward(sample)")
    return len(required) == 1


def as_reward(value, sample: Sample, source: str) -> float:
    if type(value) is not float and not isinstance(value, numbers.Real):
        raise RolloutError(f"{source} returned {value!r} (a {type(value).__name__}) for {describe(sample)}: "
                           f"a reward must be a number (int or float)")
    return float(value)


class Rewards:
    """The task's scorer; `score(samples, group_size)` sets each sample's reward."""

    def __init__(self, reward_fn: str, group_reward_fn: str | None = None, reward_url: str | None = None,
                 reward_batch_size: int = 64, reward_timeout_s: float = 30.0, reward_retries: int = 3):
        if group_reward_fn and reward_url:
            raise ConfigError(f"task.group_reward_fn={group_reward_fn!r} and task.reward_url={reward_url!r} "
                              f"are both set: a rollout is scored by one of them")
        if reward_batch_size < 1:
            raise ConfigError(f"task.reward_batch_size={reward_batch_size}: expected a positive number "
                              f"of samples")
        if reward_retries < 0:
            raise ConfigError(f"task.reward_retries={reward_retries}: expected a number of retries >= 0")
        if not reward_timeout_s > 0:
            raise ConfigError(f"task.reward_timeout_s={reward_timeout_s}: expected a number of seconds > 0")
        if reward_url and not reward_url.startswith(("http://", "https://")):
            raise ConfigError(f"task.reward_url={reward_url!r}: expected an http:// or https:// URL")
        self.url, self.batch_size = reward_url, reward_batch_size
        self.timeout_s, self.retries = reward_timeout_s, reward_retries
        if group_reward_fn:
            self.source = f"task.group_reward_fn={group_reward_fn}"
            self.group_fn = load_function(group_reward_fn, "task.group_reward_fn",
                                          "rewards(samples: list[Sample]) -> list[float]")
        elif reward_url:
            self.source = f"task.reward_url={reward_url}"
        else:
            self.source = f"task.reward_fn={reward_fn}"
            self.fn = load_function(reward_fn, "task.reward_fn",
                                    "reward(response: str, label: str) -> float, or reward(sample: Sample)")
            self.whole_sample = takes_sample(self.fn, "task.reward_fn", reward_fn)
        self.kind = "group" if group_reward_fn else "remote" if reward_url else "sample"

    def score(self, samples: list[Sample], group_size: int) -> None:
        """Set every sample's reward (the samples come in GRPO groups of `group_size`). Plain
        functions are called in turn; the awaitables `async def` ones return, awaited together."""
        if self.kind == "remote":
            rewards = asyncio.run(self._remote(samples))
        elif self.kind == "group":
            groups = [samples[i:i + group_size] for i in range(0, len(samples), group_size)]
            parts = _resolve([self._call(self.group_fn, (g,), g[0]) for g in groups])
            rewards = [r for g, part in zip(groups, parts, strict=True) for r in self._check_group(g, part)]
        else:
            rewards = _resolve([self._call(self.fn, (s,) if self.whole_sample else (s.response, s.label), s)
                                for s in samples])
        for sample, reward in zip(samples, rewards, strict=True):
            sample.reward = as_reward(reward, sample, self.source)

    def _call(self, fn, args, sample: Sample):
        try:
            out = fn(*args)
        except Exception as e:
            raise raised(self.source, sample, e) from None
        return self._awaited(out, sample) if inspect.isawaitable(out) else out

    async def _awaited(self, awaitable, sample: Sample):
        try:
            return await awaitable
        except Exception as e:
            raise raised(self.source, sample, e) from None

    def _check_group(self, group: list[Sample], rewards) -> list:
        if not isinstance(rewards, (list, tuple)) or len(rewards) != len(group):
            raise RolloutError(f"{self.source} returned {rewards!r} for the {len(group)} samples of group "
                               f"{group[0].group_index}: expected a list of {len(group)} rewards")
        return list(rewards)

    async def _remote(self, samples: list[Sample]) -> list:
        async with httpx2.AsyncClient(timeout=self.timeout_s) as client:
            parts = await asyncio.gather(*(self._post(client, samples[i:i + self.batch_size])
                                           for i in range(0, len(samples), self.batch_size)))
        return [r for part in parts for r in part]

    async def _post(self, client, batch: list[Sample]) -> list:
        payload = {"samples": [{"index": s.index, "prompt": s.prompt, "response": s.response,
                                "label": s.label, "metadata": s.metadata, "tokens": s.tokens,
                                "response_length": s.response_length} for s in batch]}
        for attempt in range(self.retries + 1):
            try:
                answer = await client.post(self.url, json=payload)
                answer.raise_for_status()
                rewards = answer.json()["rewards"]
                if not isinstance(rewards, list) or len(rewards) != len(batch):
                    raise ValueError(f"'rewards' is {rewards!r}, not a list of {len(batch)} numbers")
                return rewards
            except (httpx2.HTTPError, ValueError, KeyError, TypeError) as e:
                error = e
                if attempt < self.retries:
                    await asyncio.sleep(BACKOFF_S * 2 ** attempt)
        raise RolloutError(
            f"{self.source}: no usable answer for samples {batch[0].index}..{batch[-1].index} after "
            f"{self.retries + 1} attempts (timeout {self.timeout_s} s each); last error: "
            f"{type(error).__name__}: {error}. The service must answer a POST of {{\"samples\": [...]}} "
            f"with {{\"rewards\": [one number per sample]}}")


def _resolve(values: list) -> list:
    """`values` with its awaitables (from `async def` reward functions) awaited concurrently."""
    if not any(inspect.iscoroutine(v) for v in values):
        return values

    async def gather():
        return await asyncio.gather(*(v if inspect.iscoroutine(v) else _value(v) for v in values))
    return asyncio.run(gather())


async def _value(v):
    return v
