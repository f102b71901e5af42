"""An agent sample's recorded conversation (metadata["agent_io"], relax/rollout/agent.py) run
again on an engine: each turn's recorded messages (tool results, observations) fed back as the
endpoint got them, no agent or tool code run, each completion generated with its recorded seed;
the regenerated tokens compared to the saved ones, naming the first that differs. `relax
replay-agent` (relax/tools/replay_agent.py) runs it on a saved rollout.
"""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

from relax.rollout import SamplingParams
from relax.rollout.agent import Conversation, RequestError
from relax.sample import Sample


@dataclasses.dataclass
class Difference:
    position: int          # in the sample's tokens
    turn: int              # the chat completion it belongs to, from 1
    generated: bool        # in the model's reply; else in the context before it (prompt, recorded messages)
    offset: int            # its index within that reply or context
    saved: int | None      # the saved token id (None: the saved sample ends before it)
    replayed: int | None   # the regenerated one (None: the replay ends before it)


@dataclasses.dataclass
class Replayed:
    index: int                        # the sample's index in the rollout
    turns: int                        # completions replayed
    tokens: list[int]                 # the replayed sample's tokens
    difference: Difference | None
    stopped: str | None = None        # why the replay ended before the recorded turns did


class RecordedSeeds:
    """The engine as a replayed Conversation sees it: one call per turn, at the recorded seed."""

    def __init__(self, engine, tokenizer, io: list[dict]):
        self.engine, self.tokenizer, self.io, self.calls = engine, tokenizer, io, 0

    async def generate(self, tokens: list[int], sp: SamplingParams):
        self.calls += 1
        return self.engine.generate([list(tokens)], sp, [self.seed(self.calls - 1)])[0]

    def seed(self, call: int) -> int:
        return int(self.io[call]["seed"])


def recorded_turns(sample: Sample) -> list[dict]:
    io = sample.metadata.get("agent_io")
    return io if isinstance(io, list) else []


def replay_sample(engine, tokenizer, sample: Sample, sp: SamplingParams) -> Replayed:
    """Sample `sample`'s recorded turns regenerated on `engine` (sampling settings `sp`, each
    turn's max_new_tokens as recorded), compared token for token with its saved tokens."""
    io = recorded_turns(sample)
    record = SimpleNamespace(index=sample.index, group_index=sample.group_index, text=sample.prompt,
                             tokens=sample.tokens[:sample.prompt_length], label=sample.label, metadata={})
    conv = Conversation(RecordedSeeds(engine, tokenizer, io), record, sp, None)
    stopped = asyncio.run(_feed(conv, io))
    difference = first_difference(sample.tokens, conv.tokens, io, conv.io)
    return Replayed(sample.index, conv.turns, list(conv.tokens), difference, stopped)


async def _feed(conv: Conversation, io: list[dict]) -> str | None:
    messages, tools = [], None
    for k, turn in enumerate(io, 1):
        messages = messages + list(turn["messages"])
        tools = turn.get("tools", tools)
        try:
            await conv.complete({"messages": messages, "tools": tools, "max_tokens": turn["max_new_tokens"]})
        except RequestError as e:
            if "malformed_tool_call" not in turn or k < len(io):  # not as recorded
                return f"turn {k}: {e}"
            return None
    return None


def first_difference(saved: list[int], replayed: list[int], saved_io: list[dict],
                     replayed_io: list[dict]) -> Difference | None:
    """The first position where the two token lists differ (or one ends), located in its turn."""
    n = min(len(saved), len(replayed))
    p = next((i for i in range(n) if saved[i] != replayed[i]), n)
    if p == len(saved) == len(replayed):
        return None
    spans = [t["tokens"] for t in saved_io] if p < len(saved) else [t["tokens"] for t in replayed_io]
    # past every span: the context of a turn after the last
    turn, context_start = len(spans) + 1, spans[-1][1] if spans else 0
    start = max(len(saved), len(replayed)) + 1
    for k, (a, b) in enumerate(spans, 1):
        if p < b:
            turn, start, context_start = k, a, spans[k - 2][1] if k > 1 else 0
            break
    generated = start <= p
    return Difference(p, turn, generated, p - (start if generated else context_start),
                      saved[p] if p < len(saved) else None, replayed[p] if p < len(replayed) else None)
