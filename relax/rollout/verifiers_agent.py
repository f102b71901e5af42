"""A `verifiers` (v1) environment as an agent written against the OpenAI client (rollout.agent):

    relax rollout.agent=relax.rollout.verifiers_agent.agent

Each sample is one verifiers episode: a SingleAgentEnv over a taskset of the row (the question,
the label as the answer), its harness a chat loop offering an `add` tool, its model calls going
through verifiers' interception server to Relax's endpoint. A reply without a tool call on the
first turn is given the tool's result as a user turn and answered again (the built-in tiny model
writes no tool calls). The reward is the task's @vf.reward rubric: the last reply equals the
answer. The package is optional; how to install it: docs/rollouts.md, "Environment libraries".
"""

from __future__ import annotations

import functools
import json
import re
import sys
import types

from relax.rollout.calculator import calculate

MAX_TURNS = 3
ENV_ID = "relax_verifiers_add"  # the taskset/harness plugin id verifiers imports (registered below)
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "The sum of two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


def add(a: int, b: int) -> str:
    return str(int(a) + int(b))


def operands(question: str) -> tuple[int, int] | None:
    found = re.fullmatch(r"\s*(-?\d+)\s*\+\s*(-?\d+)\s*=?\s*", question)
    return (int(found[1]), int(found[2])) if found else None


@functools.cache
def plugin() -> types.ModuleType:
    """The verifiers plugin (taskset, task with its rubric, harness), as the module verifiers
    loads plugins from by id: its loader imports a module and takes what its __all__ exports."""
    import verifiers.v1 as vf  # optional dependency: verifiers (docs/rollouts.md, "Environment libraries")
    from openai import AsyncOpenAI  # optional dependency: the [agent] extra

    class AddData(vf.TaskData):
        answer: str = ""

    class AddTask(vf.Task[AddData]):
        @vf.reward(weight=1.0)
        async def correct(self, trace: vf.Trace) -> float:
            return float(trace.last_reply.strip() == self.data.answer)

    class AddTaskset(vf.Taskset[AddTask, vf.TasksetConfig]):
        def load(self) -> list:
            return []  # tasks come from Relax's rows, one per episode

    class AddHarness(vf.Harness[vf.HarnessConfig]):
        NEEDS_CONTAINER = EXECUTES_CODE = False  # an in-process chat loop, nothing run in the runtime

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data,
                         tool_interception_url=None) -> vf.ProgramResult:
            client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
            messages, pair = [{"role": "user", "content": data.prompt}], operands(data.prompt)
            try:
                for turn in range(MAX_TURNS):
                    reply = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
                    message = reply.choices[0].message
                    messages.append(message.model_dump(exclude_none=True))
                    for call in message.tool_calls or []:
                        result = add(**json.loads(call.function.arguments))
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
                    if not message.tool_calls and (turn or pair is None):
                        break
                    if not message.tool_calls:  # the tool's answer, given to a model that called none
                        messages.append({"role": "user", "content": f"add({pair[0]}, {pair[1]}) = {add(*pair)}"})
            finally:
                await client.close()
            return vf.ProgramResult(0, "", "")

    module = types.ModuleType(ENV_ID)
    module.__dict__.update(AddTask=AddTask, AddTaskset=AddTaskset, AddHarness=AddHarness,
                           __all__=["AddTaskset", "AddHarness"])
    sys.modules[ENV_ID] = module
    return module


def environment():
    """A SingleAgentEnv of the plugin, its agent's harness in the subprocess runtime (no
    container: the harness runs nothing in it). One per sample: an env serves one interception
    server at a time, and samples run concurrently."""
    import verifiers.v1 as vf  # optional dependency: verifiers

    plugin()
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(
        taskset={"id": ENV_ID}, agent={"harness": {"id": ENV_ID}, "runtime": {"type": "subprocess"}}))


async def agent(client, row) -> dict:
    import verifiers.v1 as vf  # optional dependency: verifiers

    env, module = environment(), plugin()
    task = module.AddTask(module.AddTask.data_type()(prompt=row["prompt"], answer=str(row["label"])))
    ctx = vf.ModelContext(model="policy", client=vf.EvalClientConfig(base_url=str(client.base_url)))
    async with env.serving():
        episode = await env.run_episode(task, ctx)
    errors = [e.message for e in episode.errors] + [t.last_error.message for t in episode.traces if t.has_error]
    if errors or not episode.ok:  # a failed episode is the sample's failure (masked, counted)
        raise RuntimeError(f"the verifiers episode failed: {'; '.join(errors) or 'not ok'}")
    (trace,) = episode.traces
    return {"reward": trace.reward, "rubric": {k: r.value for k, r in trace.rewards.items() if r is not None},
            "answers": [m.content for m in trace.assistant_messages]}
