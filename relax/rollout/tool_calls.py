"""Tool calls in a model's text, as the OpenAI-compatible endpoint (relax/rollout/agent.py) returns
them: the Hermes format that the Qwen2, Qwen2.5, Qwen3 and SmolLM3 chat templates teach,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call."""

from __future__ import annotations

import json
import logging
import re

log = logging.getLogger(__name__)
BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
PROBE = {"type": "function", "function": {"name": "relax_tool_probe", "description": "a probe",
                                          "parameters": {"type": "object", "properties": {}}}}
TEMPLATES_CHECKED: set[str] = set()  # chat templates already probed for rendering tools


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


def warn_if_tools_unseen(tokenizer, tools) -> None:
    """Once per chat template: a request's tools that the template does not render (SmolLM2's, the
    tiny model's) never reach the model, which then cannot know them; said, not left silent."""
    template = getattr(tokenizer, "chat_template", None)
    if not tools or not isinstance(template, str) or template in TEMPLATES_CHECKED:
        return
    TEMPLATES_CHECKED.add(template)
    try:
        probe = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tools=[PROBE], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that fails is the request's own rendering's to report
        return
    if PROBE["function"]["name"] not in probe:
        log.warning("rollout.agent: the requests carry tools, but the model's chat template renders none, so "
                    "the model never sees their definitions: describe them in a message, or use a model whose "
                    "template renders tools (Qwen2, Qwen2.5, Qwen3, SmolLM3). Tool calls it writes in the "
                    "Hermes format are parsed either way")
