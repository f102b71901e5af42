"""The calculator example as an agent written against the OpenAI client (rollout.agent):

    relax rollout.agent=relax.rollout.calculator_agent.agent

It offers the model a `calculator` tool; a tool call is answered by a `tool` message, and the
model answers again (at most MAX_TURNS completions). A model that writes no tool call (the
built-in tiny model cannot) is given the calculator's answer to the question as a user turn
and answers again. The reward is the share of its answers that equal the label.
"""

from __future__ import annotations

import json

from relax.rollout.calculator import calculate

MAX_TURNS = 3
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluates one operation on two integers, e.g. 12+34.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


async def agent(client, row) -> dict:
    messages = [{"role": "user", "content": row["prompt"]}]
    answers, tool_used = [], False
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                expression = json.loads(call.function.arguments).get("expression", "")
                result = calculate(str(expression)) or f"cannot evaluate {expression!r}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            tool_used = True
            continue
        answers.append((message.content or "").strip())
        if tool_used or not calculate(row["prompt"]):
            break
        messages.append({"role": "user", "content": calculate(row["prompt"])})  # the call, made for it
        tool_used = True
    reward = sum(a == row["label"] for a in answers) / max(len(answers), 1)
    return {"reward": reward, "answers": answers}
