"""A verifiers environment through Relax's OpenAI-compatible endpoint (relax/rollout/verifiers_agent.py):
the episode's model calls are engine calls whose tokens make the sample (tool and environment turns
masked), its reward is the environment's rubric, and a failing episode is a masked, counted sample."""

from __future__ import annotations

import pytest

from relax.files import safe_load

from . import agents, extras
from .conftest import run_loop
from .test_agent import ScriptedEngine, agent_samples, encode, qwen_tok  # noqa: F401 - qwen_tok: a fixture

pytestmark = pytest.mark.slow
ENVS = ("the [envs] extra and verifiers (pip install -c constraints.txt -e '.[agent,envs]', then "
        "pip install --no-deps -c constraints.txt verifiers==0.4.0)")
verifiers = extras.needs("verifiers.v1", ENVS, "verifiers")
AGENT = "relax.rollout.verifiers_agent.agent"
ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 34}}\n</tool_call>'


@pytest.mark.parametrize("answer, reward", [("46", 1.0), ("45", 0.0)])
def test_a_tool_call_is_answered_by_the_tool_and_the_rubric_scores_the_last_reply(qwen_tok, answer, reward):
    (sample,), calls = agent_samples(qwen_tok, [ADD_CALL, answer], path=AGENT)
    assert sample.metadata.get("agent_error") is None and len(calls) == 2
    (first_in, first), (second_in, second) = calls
    context = encode(qwen_tok, "\n<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n")
    assert second_in == first_in + first.tokens + context  # the tool's result, as a tool turn
    assert sample.tokens == second_in + second.tokens and sample.prompt_length == len(first_in)
    assert sample.loss_mask == [1] * len(first.tokens) + [0] * len(context) + [1] * len(second.tokens)
    assert sample.reward == reward and sample.metadata["rubric"] == {"correct": reward}


def run(tmp_path, *overrides):
    return run_loop(tmp_path / "run", f"rollout.agent={AGENT}", "rollout.num_rollout=2",
                    "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2", "checkpoint.save_interval=null",
                    f"debug.save_rollout_data={tmp_path}/data/{{rollout_id}}.pt", *overrides)


def test_a_relax_run_trains_on_the_episodes_engine_tokens(tmp_path, tokenizer):
    agents.CALLS.clear()
    rollouts, steps = run(tmp_path, "rollout._target_=tests.agents.RecordingEngine")
    assert [r["rollout/agent_errors"] for r in rollouts] == [0, 0] and len(steps) == 2
    assert all(s["train/train_rollout_logprob_abs_diff"] < 1e-5 for s in steps)
    assert len(agents.CALLS) == 16  # 2 rollouts x 4 samples x 2 turns (the tiny model writes no tool call)
    for rollout_id in range(2):
        for s in safe_load(tmp_path / "data" / f"{rollout_id}.pt")["samples"]:
            tokens, plen = s["tokens"], len(s["tokens"]) - s["response_length"]
            second_in, second = next((p, g) for p, g in agents.CALLS if p + g.tokens == tokens)
            first = next(g for p, g in agents.CALLS if p == tokens[:plen] and g.tokens == tokens[plen:plen + len(g.tokens)])
            question = s["prompt"].removeprefix("<|user|>").removesuffix("<|assistant|>")
            a, b = (int(x) for x in question.removesuffix("=").split("+"))
            context = second_in[plen + len(first.tokens):]  # the tool's result, given as a user turn
            assert context == encode(tokenizer, f"<|user|>add({a}, {b}) = {a + b}<|assistant|>")
            assert s["loss_mask"] == [1] * len(first.tokens) + [0] * len(context) + [1] * len(second.tokens)
            assert s["rollout_log_probs"] == first.log_probs + [0.0] * len(context) + second.log_probs
            last = tokenizer.decode(second.tokens, skip_special_tokens=True).strip()
            assert s["reward"] == float(last == s["label"]) == s["metadata"]["rubric"]["correct"]


def test_a_failing_tool_masks_the_episode_and_the_run_goes_on(tmp_path, monkeypatch):
    calls = []

    def broken(a, b):  # every other call raises: 2 of the 4 episodes of a rollout
        calls.append((a, b))
        if len(calls) % 2:
            raise ValueError("the tool broke")
        return str(a + b)

    monkeypatch.setattr("relax.rollout.verifiers_agent.add", broken)
    rollouts, steps = run(tmp_path)
    assert [r["rollout/agent_errors"] for r in rollouts] == [2, 2] and len(steps) == 2 and len(calls) == 8
    for rollout_id in range(2):
        samples = safe_load(tmp_path / "data" / f"{rollout_id}.pt")["samples"]
        errors = [s["metadata"].get("agent_error") for s in samples]
        assert sorted(map(bool, errors)) == [False, False, True, True]
        for s, error in zip(samples, errors):
            assert error is None or error.startswith("raised RuntimeError: the verifiers episode failed: harness "
                                                     "'relax_verifiers_add': ValueError: the tool broke")
            assert (sum(s["loss_mask"]) == 0) == bool(error) and (s["reward"] == 0.0 or not error)
