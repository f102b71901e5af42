"""`relax replay-agent` (relax/tools/replay_agent.py, relax/rollout/agent_replay.py): an agent
run's recorded I/O (metadata["agent_io"]) regenerates its tokens at the recorded seeds, on the
initial model and on a checkpoint; a tampered recorded observation or saved token is named by
sample, turn and token, with exit code 1."""

from __future__ import annotations

import json
from operator import sub

import pytest
from omegaconf import OmegaConf

from relax.files import atomic_save, safe_load
from relax.rollout import sample_seeds
from relax.rollout.agent_replay import Difference, first_difference
from relax.rollout.calculator import calculate
from relax.rollout.calculator_agent import TOOLS
from relax.tools.replay_agent import main

from . import extras
from .conftest import make_cfg, run_loop

openai = extras.needs("openai", extras.AGENT, "openai")

RUN = ("rollout.agent=relax.rollout.calculator_agent.agent", "rollout.num_rollout=2",
       "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2", "checkpoint.save_interval=1")


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory):
    """A two-rollout calculator-agent run saving its rollouts (debug.save_rollout_data) and a
    checkpoint after each; its composed config where the CLI writes it."""
    run = tmp_path_factory.mktemp("agent_replay") / "run"
    overrides = (*RUN, f"debug.save_rollout_data={run}/rollouts/{{rollout_id}}.pt")
    run_loop(run, *overrides)
    (run / ".hydra").mkdir()
    OmegaConf.save(make_cfg(*overrides, run_dir=run), run / ".hydra" / "config.yaml")
    return run


def replay(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().out


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_recorded_io_is_each_turns_new_messages_span_and_seed(agent_run, tokenizer):
    data = safe_load(agent_run / "rollouts" / "0.pt")
    seed = make_cfg().seed * 1_000_003  # rollout 0's seed
    for s in data["samples"]:
        first, second = s["metadata"]["agent_io"]
        question = s["prompt"].removeprefix("<|user|>").removesuffix("<|assistant|>")
        assert first["messages"] == [{"role": "user", "content": question}] and first["tools"] == TOOLS
        assert second["messages"][0]["role"] == "assistant" and "tools" not in second
        assert second["messages"][1:] == [{"role": "user", "content": calculate(question)}]  # the observation
        assert first["tool_calls"] == second["tool_calls"] == []  # the tiny model writes none
        plen = len(s["tokens"]) - s["response_length"]
        (a1, b1), (a2, b2) = first["tokens"], second["tokens"]
        assert a1 == plen and b2 == len(s["tokens"]) and b1 < a2
        assert s["loss_mask"] == [1] * (b1 - a1) + [0] * (a2 - b1) + [1] * (b2 - a2)
        assert [first["seed"], second["seed"]] == sample_seeds(seed, [s["index"]] * 2, [0, 1])
        assert first["max_new_tokens"] == second["max_new_tokens"] == make_cfg().rollout.max_new_tokens


def test_a_saved_agent_rollout_regenerates_token_for_token(agent_run, capsys):
    code, out = replay(capsys, agent_run)
    assert code == 0, out
    assert out.strip() == "identical: rollout 0, 4 samples, 8 turns regenerated token for token"
    code, out = replay(capsys, agent_run, "--rollout", 1)  # on the checkpoint after rollout 0
    assert code == 0 and out.startswith("identical: rollout 1, 4 samples"), out
    code, out = replay(capsys, agent_run, "--rollout", 1, "--weights", agent_run / "checkpoints" /
                       "rollout_000001" / "hf", "--json")
    assert code == 1 and not json.loads(out)["identical"]  # other weights: other tokens


def test_the_default_weights_are_those_of_the_samples_policy_version(agent_run, tmp_path, capsys):
    """Rollout 1 was made on version 1 (the checkpoint after rollout 0). Had it been made ahead
    (train.max_staleness=1: version 0), the default weights would be the initial model's."""
    data = safe_load(agent_run / "rollouts" / "1.pt")
    assert {s["metadata"]["policy_version"] for s in data["samples"]} == {1}
    for version, expected in ((1, 0), (0, 1)):
        for s in data["samples"]:
            s["metadata"]["policy_version"] = version
        atomic_save(data, tmp_path / f"v{version}.pt")
        code, out = replay(capsys, agent_run, "--file", tmp_path / f"v{version}.pt", "--json")
        assert code == expected, out


def tampered(agent_run, tmp_path, change) -> tuple:
    data = safe_load(agent_run / "rollouts" / "0.pt")
    change(data["samples"])
    atomic_save(data, tmp_path / "0.pt")
    return data["samples"], tmp_path / "0.pt"


def test_a_changed_recorded_observation_is_named_by_turn_and_token(agent_run, tmp_path, tokenizer, capsys):
    def change(samples):
        samples[1]["metadata"]["agent_io"][1]["messages"][1]["content"] = "999"
    samples, path = tampered(agent_run, tmp_path, change)
    s = samples[1]
    question = s["prompt"].removeprefix("<|user|>").removesuffix("<|assistant|>")
    was, now = (encode(tokenizer, f"<|user|>{x}<|assistant|>") for x in (calculate(question), "999"))
    k = next(i for i, (a, b) in enumerate(zip(was, now)) if a != b)
    context = s["metadata"]["agent_io"][0]["tokens"][1]
    code, out = replay(capsys, agent_run, "--file", path)
    assert code == 1
    assert out.startswith(f"differs: rollout 0, sample 1, turn 2, token {context + k} (token {k} of the "
                          f"context before it (the recorded messages: tool results, observations)): saved "
                          f"{was[k]} vs regenerated {now[k]}\n"), out
    assert "1 of 4 samples differ" in out
    code, out = replay(capsys, agent_run, "--file", path, "--sample", 0)
    assert code == 0 and "1 samples, 2 turns" in out


def test_a_changed_saved_token_is_named_by_turn_and_token(agent_run, tmp_path, tokenizer, capsys):
    original = safe_load(agent_run / "rollouts" / "0.pt")["samples"]
    # the last sample's last reply of 2 tokens or more: its second token changed
    i, turn = next((i, t) for i in (3, 2, 1, 0) for t in (2, 1)
                   if -sub(*original[i]["metadata"]["agent_io"][t - 1]["tokens"]) >= 2)
    a, _ = original[i]["metadata"]["agent_io"][turn - 1]["tokens"]
    bad = (original[i]["tokens"][a + 1] + 1) % len(tokenizer)

    def change(samples):
        samples[i]["tokens"][a + 1] = bad
    _, path = tampered(agent_run, tmp_path, change)
    code, out = replay(capsys, agent_run, "--file", path)
    assert code == 1
    assert out.startswith(f"differs: rollout 0, sample {i}, turn {turn}, token {a + 1} (token 1 of the "
                          f"model's reply): saved {bad} vs regenerated {original[i]['tokens'][a + 1]}\n"), out
    saved_line, regenerated_line = out.splitlines()[1:3]
    shown = repr(tokenizer.decode(original[i]["tokens"][a + 1:a + 2], skip_special_tokens=False))
    assert saved_line.startswith("  saved:") and regenerated_line.endswith(f"[{shown}]")


def test_the_first_difference_is_located_in_its_turn():
    io = [{"tokens": [3, 5]}, {"tokens": [7, 9]}]
    assert first_difference([1] * 9, [1] * 9, io, io) is None
    assert first_difference([1] * 9, [1] * 4 + [2] * 5, io, io) == Difference(4, 1, True, 1, 1, 2)
    assert first_difference([1] * 9, [1] * 6 + [2] * 3, io, io) == Difference(6, 2, False, 1, 1, 2)
    shorter = io[:1] + [{"tokens": [7, 8]}]
    assert first_difference([1] * 9, [1] * 8, io, shorter) == Difference(8, 2, True, 1, 1, None)
    assert first_difference([1] * 9, [1] * 2 + [0] * 7, io, io) == Difference(2, 1, False, 2, 1, 0)
