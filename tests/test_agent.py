"""Agents through the OpenAI-compatible endpoint (rollout.agent, relax/rollout/agent.py): tool calls
parsed and rendered, the trained sample made of exactly the tokens used and generated, the
re-tokenization drift measured, and failing agents (raising, malformed tool call, hanging) masked
and counted while the run goes on."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from relax.errors import ConfigError
from relax.files import safe_load
from relax.rollout import Generation, SamplingParams, check_functions, sample_seeds
from relax.rollout.agent import AgentSpec, agent_metrics
from relax.rollout.calculator import calculate
from relax.rollout.calculator_agent import TOOLS
from relax.rollout.generate import generate_samples
from relax.rollout.tool_calls import MalformedToolCall, parse_tool_calls
from relax.task import Prompt

from . import agents, extras
from .conftest import make_cfg, run_loop

openai = extras.needs("openai", extras.AGENT, "openai")

SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
QWEN_LIKE = (  # the Qwen2.5 template's shape: tool calls rendered from the structured field
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+34"}}\n</tool_call>'
TIGHT_CALL = '<tool_call>\n{"name":"calculator","arguments":{"expression":"12+34"}}\n</tool_call>'
BAD_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": }\n</tool_call>'


@pytest.fixture(scope="module")
def qwen_tok():
    """A character-level tokenizer with Qwen's special tokens and a tool-rendering chat template."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + chars)}, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS[:3])
    tok.add_tokens(SPECIALS[3:])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
                                   chat_template=QWEN_LIKE)


class ScriptedEngine:
    """Answers a prompt's k-th assistant turn with script[k] (+ <|im_end|>); log-probs -0.01 * (i + 1)."""

    def __init__(self, tokenizer, script: list[str]):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate(self, prompts, sp, seeds, first_index=0):
        out = []
        for p in prompts:
            turn = self.tokenizer.decode(p).count("<|im_start|>assistant") - 1
            ids = self.tokenizer(self.script[turn], add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            out.append(Generation(ids, [-0.01 * (i + 1) for i in range(len(ids))], "completed"))
            self.calls.append((list(p), out[-1]))
        return out


def agent_samples(tokenizer, script: list[str], path: str = "relax.rollout.calculator_agent.agent", n: int = 1):
    engine = ScriptedEngine(tokenizer, script)
    prompt = Prompt("12+34=", tokenizer("12+34=")["input_ids"], "46", {"source": "test"}, question="12+34=")
    samples = generate_samples(engine, SimpleNamespace(max_prompt_tokens=None), tokenizer, [prompt], n,
                               SamplingParams(1.0, 1.0, 64), 7, "relax.rollout.generate.single_turn", "in a test",
                               agent=AgentSpec(path, 30.0))
    return samples, engine.calls


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_tool_calls_are_parsed_in_the_hermes_format():
    assert parse_tool_calls("46") == ("46", [])
    assert parse_tool_calls(f"Let me compute.{CALL}{TIGHT_CALL.replace('12+34', '5*6')}") == (
        "Let me compute.", [{"name": "calculator", "arguments": {"expression": "12+34"}},
                            {"name": "calculator", "arguments": {"expression": "5*6"}}])
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[1] == [
        {"name": "f", "arguments": {"x": 1}}]  # arguments written as a JSON string
    for bad, why in [(BAD_CALL, "not JSON"), ('<tool_call>{"name": "f", "arguments": {}', "not closed"),
                     ('<tool_call>{"arguments": {}}</tool_call>', "is not {")]:
        with pytest.raises(MalformedToolCall, match=why):
            parse_tool_calls(bad)


def test_two_turns_with_a_tool_call_are_exactly_the_tokens_used_and_generated(qwen_tok):
    (sample,), calls = agent_samples(qwen_tok, [CALL, "46"])
    assert len(calls) == 2
    (first_in, first), (second_in, second) = calls
    assert first_in == encode(qwen_tok, qwen_tok.apply_chat_template(
        [{"role": "user", "content": "12+34="}], tools=TOOLS, add_generation_prompt=True, tokenize=False))
    context = encode(qwen_tok, "\n<|im_start|>tool\n12+34=46<|im_end|>\n<|im_start|>assistant\n")
    assert second_in == first_in + first.tokens + context  # the tool call as generated, the tool result
    assert sample.tokens == second_in + second.tokens and sample.prompt_length == len(first_in)
    assert sample.loss_mask == [1] * len(first.tokens) + [0] * len(context) + [1] * len(second.tokens)
    assert sample.rollout_log_probs == first.log_probs + [0.0] * len(context) + second.log_probs
    assert sample.reward == 1.0 and sample.response == "46"
    io = sample.metadata.pop("agent_io")  # what `relax replay-agent` feeds back (tests/test_agent_replay.py)
    assert sample.metadata == {"source": "test", "answers": ["46"], "agent_turns": 2, "agent_drifted_turns": 0}
    reply = {"role": "assistant", "tool_calls": [{"id": "call_0_1_0", "type": "function", "function": {
        "name": "calculator", "arguments": '{"expression": "12+34"}'}}]}
    assert io == [
        {"messages": [{"role": "user", "content": "12+34="}], "tools": TOOLS, "tokens": [len(first_in), len(
            first_in) + len(first.tokens)], "seed": sample_seeds(7, [0])[0], "max_new_tokens": 64,
         "tool_calls": [{"name": "calculator", "arguments": {"expression": "12+34"}}]},
        {"messages": [reply, {"role": "tool", "tool_call_id": "call_0_1_0", "content": "12+34=46"}],
         "tokens": [len(second_in), len(sample.tokens)], "seed": sample_seeds(7, [0], [1])[0],
         "max_new_tokens": 64, "tool_calls": []}]
    assert agent_metrics([sample], "test") == {"rollout/agent_errors": 0, "rollout/retokenization_drift": 0.0}


def test_a_tool_call_the_template_renders_otherwise_is_drift_and_the_tokens_stay_the_generated_ones(qwen_tok):
    (sample,), calls = agent_samples(qwen_tok, [TIGHT_CALL, "46"])
    (first_in, first), (second_in, _) = calls
    assert qwen_tok.decode(first.tokens) == TIGHT_CALL + "<|im_end|>"
    context = encode(qwen_tok, "\n<|im_start|>tool\n12+34=46<|im_end|>\n<|im_start|>assistant\n")
    assert second_in == first_in + first.tokens + context  # not the re-rendered (spaced) call
    assert CALL in qwen_tok.decode(encode(qwen_tok, qwen_tok.apply_chat_template(
        [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12+34"}}}]}],
        tokenize=False)))  # what the template re-encodes the turn to instead
    assert sample.metadata["agent_drifted_turns"] == 1 and sample.loss_mask.count(1) == len(first.tokens) + 3
    assert agent_metrics([sample], "test") == {"rollout/agent_errors": 0, "rollout/retokenization_drift": 0.5}


def test_tools_the_chat_template_does_not_render_are_warned_of_once(qwen_tok, caplog, monkeypatch):
    """QWEN_LIKE renders tool calls but not the tools' definitions (nor do SmolLM2's and the tiny
    model's templates): the model never sees them, which the run says once per template."""
    from relax.rollout import tool_calls

    monkeypatch.setattr(tool_calls, "TEMPLATES_CHECKED", set())
    unseen = "renders none, so the model never sees their definitions"
    with caplog.at_level(logging.WARNING, logger="relax.rollout.tool_calls"):
        samples, _ = agent_samples(qwen_tok, [CALL, "46"], n=2)
        assert [s.reward for s in samples] == [1.0, 1.0]  # only said: the run goes on
        assert sum(unseen in r.getMessage() for r in caplog.records) == 1
        rendering = copy.deepcopy(qwen_tok)
        rendering.chat_template = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}"
                                   "{% endfor %}<|im_end|>\n{% endif %}" + QWEN_LIKE)
        caplog.clear()
        agent_samples(rendering, [CALL, "46"])
        assert not [r for r in caplog.records if unseen in r.getMessage()]
    assert qwen_tok.chat_template in tool_calls.TEMPLATES_CHECKED and len(tool_calls.TEMPLATES_CHECKED) == 2


def test_a_malformed_tool_call_masks_the_sample_and_counts(qwen_tok, caplog):
    samples, calls = agent_samples(qwen_tok, [BAD_CALL, "46"], n=2)
    assert len(calls) == 2  # one turn each: the endpoint answered 400, the agent raised
    for s in samples:
        assert s.loss_mask == [0] * s.response_length and s.reward == 0.0
        assert s.tokens == calls[0][0] + calls[0][1].tokens
        assert "turn 1: malformed tool call: a <tool_call> block is not JSON" in s.metadata["agent_error"]
    assert agent_metrics(samples, "test") == {"rollout/agent_errors": 2, "rollout/retokenization_drift": 0.0}
    logged = [r.getMessage() for r in caplog.records if r.name == "relax.rollout.agent"]
    assert len(logged) == 1 and logged[0].startswith("test: 2 of 2 agent samples failed (masked); the first, "
                                                     "sample 0: turn 1: malformed tool call")


def test_bad_agent_settings_are_refused_at_start_up():
    for overrides, match in [
            (["rollout.agent=tests.agents.nowhere"], r"rollout.agent='tests.agents.nowhere' does not import"),
            (["rollout.agent=tests.agents.not_async"], "is not an async def function"),
            (["rollout.agent=tests.agents.faulty", "rollout.generate_fn=relax.rollout.calculator.generate"],
             "set one of them"),
            (["rollout.agent_timeout=0"], r"rollout.agent_timeout=0.0: expected a positive")]:
        with pytest.raises(ConfigError, match=match):
            check_functions(make_cfg(*overrides).rollout)


def test_the_calculator_agent_trains_on_the_engine_tokens(tmp_path, tokenizer):
    agents.CALLS.clear()
    rollouts, steps = run_loop(tmp_path / "run", "rollout.agent=relax.rollout.calculator_agent.agent",
                               "rollout._target_=tests.agents.RecordingEngine", "rollout.num_rollout=2",
                               "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
                               "checkpoint.save_interval=null", f"debug.save_rollout_data={tmp_path}/{{rollout_id}}.pt")
    assert [r["rollout/agent_errors"] for r in rollouts] == [0, 0] and len(steps) == 2
    assert [r["rollout/retokenization_drift"] for r in rollouts] == [0.0, 0.0]
    assert all(s["train/train_rollout_logprob_abs_diff"] < 1e-5 for s in steps)
    assert len(agents.CALLS) == 16  # 2 rollouts x 4 samples x 2 turns
    for rollout_id in range(2):
        for s in safe_load(tmp_path / f"{rollout_id}.pt")["samples"]:
            tokens, plen = s["tokens"], len(s["tokens"]) - s["response_length"]
            # the engine calls that made it: the last one ends it, the first starts from its prompt
            second_in, second = next((p, g) for p, g in agents.CALLS if p + g.tokens == tokens)
            first = next(g for p, g in agents.CALLS if p == tokens[:plen] and g.tokens == tokens[plen:plen + len(g.tokens)])
            context = len(second_in) - plen - len(first.tokens)
            question = s["prompt"].removeprefix("<|user|>").removesuffix("<|assistant|>")
            assert second_in[plen + len(first.tokens):] == encode(  # the calculator's answer as a user turn
                tokenizer, f"<|user|>{calculate(question)}<|assistant|>")
            assert s["loss_mask"] == [1] * len(first.tokens) + [0] * context + [1] * len(second.tokens)
            assert s["rollout_log_probs"] == first.log_probs + [0.0] * context + second.log_probs
            assert s["metadata"]["agent_turns"] == 2 and len(s["metadata"]["answers"]) == 2


def test_failing_agents_are_masked_and_counted_and_the_run_goes_on(tmp_path):
    rollouts, steps = run_loop(tmp_path / "run", "rollout.agent=tests.agents.faulty", "rollout.agent_timeout=2",
                               "rollout.num_rollout=2", "rollout.rollout_batch_size=2",
                               "rollout.n_samples_per_prompt=2", "checkpoint.save_interval=null",
                               f"debug.save_rollout_data={tmp_path}/{{rollout_id}}.pt")
    assert [r["rollout/agent_errors"] for r in rollouts] == [2, 2] and len(steps) == 2
    for rollout_id in range(2):
        samples = safe_load(tmp_path / f"{rollout_id}.pt")["samples"]
        errors = [s["metadata"].get("agent_error", "") for s in samples]
        assert errors[0] == errors[3] == ""
        assert errors[1].startswith("raised RuntimeError: the agent broke (") and "agents.py" in errors[1]
        assert errors[2] == "timed out: still running after rollout.agent_timeout=2 s"
        assert samples[1]["response_length"] == 1 and samples[1]["metadata"]["agent_turns"] == 0
        assert samples[2]["metadata"]["agent_turns"] == 1 and samples[2]["response_length"] > 1
        for s in samples:
            assert (sum(s["loss_mask"]) == 0) == bool(s["metadata"].get("agent_error"))
            assert s["reward"] == 0.0 or not s["metadata"].get("agent_error")
