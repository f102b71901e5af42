"""Agents written against the OpenAI client (`rollout.agent`): `async def agent(client, row) ->
float | dict`, called once per sample with an `openai.AsyncOpenAI` whose base URL is an
OpenAI-compatible endpoint on loopback (model `policy`) over the run's engine, and the task row.

Each chat completion is one engine call through the rollout's batched client, at the run's
sampling settings and seeds; the sample is made of the token ids actually used and generated.
An agent that raises, times out (rollout.agent_timeout) or gets a malformed tool call makes a
masked sample, counted in rollout/agent_errors. How it works: docs/rollouts.md, "Agents through
an OpenAI-compatible endpoint".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import traceback

from relax.rollout import AGENT_FN, SamplingParams
from relax.rollout.client import Batcher
from relax.rollout.tool_calls import MalformedToolCall, parse_tool_calls, warn_if_tools_unseen
from relax.sample import Sample

log = logging.getLogger(__name__)
MODEL = "policy"  # the model name the endpoint serves


@dataclasses.dataclass(frozen=True)
class AgentSpec:
    path: str        # rollout.agent
    timeout: float   # rollout.agent_timeout, seconds per sample

    @classmethod
    def of(cls, rollout_cfg) -> "AgentSpec | None":
        return cls(rollout_cfg.agent, float(rollout_cfg.agent_timeout)) if rollout_cfg.agent else None


class RequestError(ValueError):
    """A chat completion the endpoint refuses (HTTP 400): the sample fails with this message."""


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # content parts: their text
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def normalized(messages) -> list[dict]:
    """The request's messages as chat templates take them: text content, tool-call arguments
    as objects (what Hugging Face templates render), no null fields."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise RequestError(f"'messages' must be a non-empty list of objects, found {messages!r:.200}")
    out = []
    for m in messages:
        msg = {"role": m.get("role"), "content": _text(m.get("content"))}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                msg[key] = m[key]
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                function = dict(call.get("function") or {})
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except json.JSONDecodeError:
                        pass
                calls.append({"id": call.get("id"), "type": "function", "function": function})
            msg["tool_calls"] = calls
        out.append(msg)
    return out


class Conversation:
    """One sample's chat completions: the token sequence so far (the first request's rendering,
    then per turn the model's tokens and the masked context that follows them), its loss mask
    and log-probs, and the turns whose conversation re-encodes to other tokens than those used."""

    def __init__(self, client, record, sp: SamplingParams, max_context: int | None):
        self.client, self.record, self.sp, self.max_context = client, record, sp, max_context
        self.tokenizer = client.tokenizer
        self.tokens: list[int] = []
        self.loss_mask: list[int] = []
        self.log_probs: list[float] = []
        self.prompt_length, self.prompt_text, self.text = 0, "", ""
        self.messages = self.rendered = self.last = self.error = self.tools = None
        self.turns = self.drifted = 0
        self.io: list[dict] = []  # per completion, what `relax replay-agent` feeds back (record_turn)

    def fail(self, message: str) -> None:
        if self.error is None:  # the first error is the sample's
            self.error = message

    def render(self, messages, tools, generation_prompt: bool) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("the model's tokenizer has no chat template to render a conversation with")
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as e:  # noqa: BLE001 - the template's own error, as the request's
            raise RequestError(f"the chat template cannot render the conversation: {type(e).__name__}: {e}")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def complete(self, body) -> dict:
        """One chat completion: render, record, generate, parse the tool calls."""
        if self.error is not None:
            raise RequestError(f"this sample already failed: {self.error}")
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        if body.get("stream") or body.get("n", 1) != 1:
            raise RequestError("the endpoint answers n=1 without streaming")
        messages, tools = normalized(body.get("messages")), body.get("tools")
        sp, cap = self.sp, body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(cap, int) and 0 < cap < sp.max_new_tokens:
            sp = dataclasses.replace(sp, max_new_tokens=cap)
        warn_if_tools_unseen(self.tokenizer, tools)
        text = self.render(messages, tools, True)
        rendered = self.encode(text)
        if self.turns == 0:
            self.tokens, self.prompt_length, self.prompt_text = list(rendered), len(rendered), text
        else:
            context = self.context(messages, tools)
            self.extend(context, [0.0] * len(context), 0)
        self.turns += 1
        self.drifted += self.tokens != rendered
        if self.max_context is not None and len(self.tokens) > self.max_context:
            raise RequestError(f"turn {self.turns}: the conversation has {len(self.tokens)} tokens, more than "
                               f"the {self.max_context} the model's positions leave after rollout.max_new_tokens")
        gen = await self.client.generate(self.tokens, sp)
        turn = self.record_turn(body, tools, gen, sp)
        self.extend(gen.tokens, gen.log_probs, 1)
        self.messages, self.rendered, self.last = messages, rendered, gen
        eos = self.tokenizer.eos_token_id
        ids = gen.tokens[:-1] if gen.status == "completed" and gen.tokens[-1:] == [eos] else gen.tokens
        try:
            content, calls = parse_tool_calls(self.tokenizer.decode(ids, skip_special_tokens=False))
        except MalformedToolCall as e:
            turn["malformed_tool_call"] = str(e)
            raise RequestError(f"turn {self.turns}: malformed tool call: {e}") from None
        turn["tool_calls"] = calls
        self.text = content
        return self.answer(content, calls, gen)

    def record_turn(self, body: dict, tools, gen, sp: SamplingParams) -> dict:
        """The completion's record in metadata["agent_io"], plain JSON data: the request's messages
        new since the previous request (the agent's copy of the model's reply first, then tool
        results and observations), its tools when they changed, the span of the generated tokens
        in the sample's tokens, the engine seed and max_new_tokens; tool_calls once parsed."""
        new = body["messages"][len(self.messages):] if self.messages else body["messages"]
        turn = {"messages": json.loads(json.dumps(new)),
                "tokens": [len(self.tokens), len(self.tokens) + len(gen.tokens)],
                "seed": int(self.client.seed(self.client.calls - 1)), "max_new_tokens": sp.max_new_tokens}
        if tools != self.tools:
            turn["tools"] = json.loads(json.dumps(tools))
        self.tools = tools
        self.io.append(turn)
        return turn

    def extend(self, tokens: list[int], log_probs: list[float], mask: int) -> None:
        self.tokens += tokens
        self.log_probs += log_probs
        self.loss_mask += [mask] * len(tokens)

    def context(self, messages: list[dict], tools) -> list[int]:
        """The tokens between the model's last turn and this one: what the chat template puts
        after the model's reply (its end-of-turn, when the model did not write it, and what
        follows it), then the new messages and the generation prompt."""
        k = len(self.messages)
        if len(messages) <= k or messages[k]["role"] != "assistant" or \
                [m["role"] for m in messages[:k]] != [m["role"] for m in self.messages]:
            raise RequestError(f"turn {self.turns + 1}: the messages do not continue the previous request's "
                               f"with its reply (one sample is one conversation)")
        head = self.render(messages[:k + 1], tools, False)
        full = self.render(messages, tools, True)
        if not full.startswith(head):
            raise RequestError(f"turn {self.turns + 1}: the chat template renders the conversation up to "
                               f"the model's last reply differently once more messages follow")
        reply, trailer = self.encode(head), []
        if reply[:len(self.rendered)] == self.rendered:
            reply = reply[len(self.rendered):]
            completed = self.last.status == "completed" and self.last.tokens
            stop = self.last.tokens[-1] if completed else self.tokenizer.eos_token_id
            if stop in reply:
                end = len(reply) - 1 - reply[::-1].index(stop)
                trailer = reply[end + 1:] if completed else reply[end:]
        return trailer + self.encode(full[len(head):])

    def answer(self, content: str, calls: list[dict], gen) -> dict:
        n, i = self.record.index, self.turns
        tool_calls = [{"id": f"call_{n}_{i}_{j}", "type": "function",
                       "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                      for j, c in enumerate(calls)]
        finish = "tool_calls" if calls else "length" if gen.status == "truncated" else "stop"
        message = {"role": "assistant", "content": content or (None if calls else "")}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"id": f"chatcmpl-{n}-{i}", "object": "chat.completion", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": len(self.tokens) - len(gen.tokens), "completion_tokens": len(gen.tokens),
                          "total_tokens": len(self.tokens)}}

    def sample(self, outcome) -> Sample:
        """The trained sample: the tokens used and generated; all masked (reward 0) if it failed."""
        r, reward, extra = self.record, 0.0, {}
        if self.error is None:
            reward, extra = reward_of(outcome)
            if reward is None:
                self.fail(f"returned {outcome!r:.200}: expected a finite number or a dict with a finite "
                          f"'reward'")
        if self.error is None and not self.turns:
            self.fail("returned without a chat completion: nothing to train on")
        if self.turns:
            tokens, plen = self.tokens, self.prompt_length
            mask, log_probs = self.loss_mask, self.log_probs
        else:  # one masked token after the task's prompt: a sample the trainer takes and ignores
            tokens, plen = r.tokens + [self.tokenizer.eos_token_id], len(r.tokens)
            mask, log_probs = [0], [0.0]
        metadata = {**r.metadata, **extra, "agent_turns": self.turns, "agent_drifted_turns": self.drifted,
                    "agent_io": self.io}
        if self.error is not None:
            metadata["agent_error"] = self.error
            mask, reward = [0] * len(mask), 0.0
        return Sample(r.index, r.group_index, self.prompt_text or r.text, list(tokens), len(tokens) - plen,
                      response=self.text, label=r.label, reward=float(reward or 0.0), loss_mask=list(mask),
                      rollout_log_probs=list(log_probs), status=self.last.status if self.last else "aborted",
                      metadata=metadata)


def reward_of(outcome) -> tuple[float | None, dict]:
    """(the reward, the metadata beside it) of an agent's return value; (None, {}) if it has none."""
    extra = {}
    if isinstance(outcome, dict):
        extra = {k: v for k, v in outcome.items() if k != "reward"}
        outcome = outcome.get("reward")
    if isinstance(outcome, bool) or not isinstance(outcome, (int, float)) or not math.isfinite(outcome):
        return None, {}
    return float(outcome), extra


class Endpoint:
    """The rollout's OpenAI-compatible endpoint on 127.0.0.1 (a free port) and its agents: sample i's
    client talks to /s/<i>/v1, whose requests go to that sample's Conversation."""

    def __init__(self, agent_fn, spec: AgentSpec, max_context: int | None):
        self.agent_fn, self.spec, self.max_context = agent_fn, spec, max_context
        self.conversations: dict[int, Conversation] = {}
        self.url = self.http = None

    def run(self, engine, records: list, sp: SamplingParams, tokenizer, seed: int, on_error) -> list[Sample]:
        return Batcher(engine, seed).run(self.job, records, sp, tokenizer, on_error, context=self.serving)

    @contextlib.asynccontextmanager
    async def serving(self):
        from aiohttp import web  # optional dependency: the [agent] extra
        import openai  # optional dependency: the [agent] extra

        app = web.Application()
        app.router.add_post("/s/{index}/v1/chat/completions", self.chat)
        app.router.add_get("/s/{index}/v1/models", self.models)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.url = "http://127.0.0.1:{}".format(runner.addresses[0][1])
        # one HTTP client for every sample's OpenAI client (making one per client costs more than
        # a completion on a small model); the agent as a whole is cut at rollout.agent_timeout
        self.http = openai.DefaultAsyncHttpxClient(timeout=None)
        try:
            yield
        finally:
            await self.http.aclose()
            await runner.cleanup()

    async def job(self, client, record, sp: SamplingParams) -> Sample:
        import openai  # optional dependency: the [agent] extra

        conv = self.conversations[record.index] = Conversation(client, record, sp, self.max_context)
        row = {"prompt": record.question or record.text, "label": record.label,
               "metadata": dict(record.metadata), "index": record.index}
        api = openai.AsyncOpenAI(base_url=f"{self.url}/s/{record.index}/v1", api_key="relax", max_retries=0,
                                 timeout=None, http_client=self.http)
        outcome = None
        try:
            outcome = await asyncio.wait_for(self.agent_fn(api, row), self.spec.timeout)
        except TimeoutError:
            conv.fail(f"timed out: still running after rollout.agent_timeout={self.spec.timeout:g} s")
        except Exception as e:  # noqa: BLE001 - a failed agent is a masked sample, not a failed run
            frame = traceback.extract_tb(e.__traceback__)[-1]
            conv.fail(f"raised {type(e).__name__}: {e} ({frame.filename}:{frame.lineno})")
        return conv.sample(outcome)

    async def chat(self, request):
        from aiohttp import web  # optional dependency: the [agent] extra

        conv = self.conversations.get(_int(request.match_info["index"]))
        if conv is None:
            return _error(web, 404, f"no sample {request.match_info['index']} in this rollout")
        try:
            body = await request.json()
        except ValueError as e:
            return _error(web, 400, f"the request body is not JSON: {e}")
        try:
            return web.json_response(await conv.complete(body))
        except RequestError as e:
            conv.fail(str(e))
            return _error(web, 400, str(e))

    async def models(self, request):
        from aiohttp import web  # optional dependency: the [agent] extra

        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                              "owned_by": "relax"}]})


def _int(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def _error(web, status: int, message: str):
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                        "code": None}}, status=status)


def agent_metrics(samples: list[Sample], where: str) -> dict:
    """rollout/agent_errors (failed samples) and rollout/retokenization_drift (the share of turns
    whose conversation re-encodes to other tokens than those used); the first error is logged."""
    failed = [s for s in samples if "agent_error" in s.metadata]
    turns = sum(s.metadata.get("agent_turns", 0) for s in samples)
    drifted = sum(s.metadata.get("agent_drifted_turns", 0) for s in samples)
    if failed:
        log.warning("%s: %d of %d agent samples failed (masked); the first, sample %d: %s", where, len(failed),
                    len(samples), failed[0].index, failed[0].metadata["agent_error"])
    return {"rollout/agent_errors": len(failed), "rollout/retokenization_drift": drifted / turns if turns else 0.0}
