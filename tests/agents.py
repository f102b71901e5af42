"""Agents and engines for tests/test_agent.py (`rollout.agent=tests.agents.X`,
`rollout._target_=tests.agents.RecordingEngine`)."""

from __future__ import annotations

import asyncio

from relax.rollout import Generation
from relax.rollout.calculator_agent import agent as calculator
from relax.rollout.torch_engine import TorchEngine

CALLS: list[tuple[list[int], Generation]] = []  # every (prompt, generation) a RecordingEngine answered


class RecordingEngine(TorchEngine):
    """The torch engine, recording each prompt it was sent and what it generated (in CALLS)."""

    def generate(self, prompts, sp, seed, first_index=0):
        generations = super().generate(prompts, sp, seed, first_index)
        CALLS.extend((list(p), g) for p, g in zip(prompts, generations, strict=True))
        return generations


async def faulty(client, row):
    """Sample 1 of every 4 raises, sample 2 hangs after its first completion, the others are the
    calculator agent."""
    if row["index"] % 4 == 1:
        raise RuntimeError("the agent broke")
    if row["index"] % 4 == 2:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        await asyncio.sleep(3600)
    return await calculator(client, row)


def not_async(client, row):
    return 0.0
