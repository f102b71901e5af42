"""Tool calls in a model's text, as the OpenAI-compatible endpoint (relax/rollout/agent.py) returns
them: the Hermes format that the Qwen2, Qwen2.5, Qwen3 and SmolLM3 chat templates teach,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call."""

from __future__ import annotations

import json
import re

BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class MalformedToolCall(ValueError):
    """A `<tool_call>` block that is not a JSON object with a string `name` and object `arguments`."""


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(the text outside the tool-call blocks, stripped; the calls, each {"name", "arguments": dict}).
    A block left open at the end (a truncated turn) or with a body that is not a call is a
    MalformedToolCall naming it."""
    calls = []
    for match in BLOCK.finditer(text):
        body = match.group(1).strip()
        if not match.group(0).endswith("</tool_call>"):
            raise MalformedToolCall(f"a <tool_call> block is not closed: {body[:200]!r}")
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            raise MalformedToolCall(f"a <tool_call> block is not JSON ({e}): {body[:200]!r}") from None
        arguments = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            raise MalformedToolCall(f"a <tool_call> block is not {{\"name\": str, \"arguments\": object}}: "
                                    f"{body[:200]!r}")
        calls.append({"name": call["name"], "arguments": arguments})
    return BLOCK.sub("", text).strip() if calls else text, calls
