"""A base model (a tokenizer without a chat template) runs end to end with
task.apply_chat_template=false: prompts go as they are, to the engine and the trainer, and
rollout.generate_fn's get `Prompt.chat_template=False` (the calculator example's tool turns are
then plain text, not a chat turn the tokenizer cannot write)."""

from __future__ import annotations

import json

from relax.files import safe_load
from relax.model import load_tokenizer
from relax.rollout.calculator import CALL, calculate, tool_turn

from .conftest import make_cfg, make_task, run_loop
from .test_model_inputs import model_copy, without_chat_template

BASE = ["task.apply_chat_template=false", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
        "checkpoint.save_interval=null"]
CALC = ["rollout.generate_fn=relax.rollout.calculator.generate", "task.reward_fn=relax.rollout.calculator.reward"]


def test_a_base_model_trains_with_its_prompts_as_they_are(tiny_path, tmp_path):
    model = model_copy(tiny_path, tmp_path / "base", without_chat_template)
    rollouts, steps = run_loop(tmp_path / "run", "model=hf", f"model.path={model}", *BASE, "rollout.num_rollout=2")
    assert [r["rollout_id"] for r in rollouts] == [0, 1] and len(steps) == 2
    assert all(0 <= s["train/grad_norm"] < 10 and s["train/train_rollout_logprob_abs_diff"] < 1e-4 for s in steps)
    tokenizer = load_tokenizer(model)
    (expected,) = make_task(*BASE).prompts(0, 1, tokenizer)
    first = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert first["prompt"] == expected.text and "<|" not in first["prompt"] and "+" in first["prompt"]


def test_the_calculator_writes_plain_tool_turns_for_a_base_model(tiny_path, tmp_path):
    """Before, every sample raised in tool_turn (the tokenizer has no chat template to write a
    user turn with): the calculator ignored task.apply_chat_template."""
    model = model_copy(tiny_path, tmp_path / "base", without_chat_template)
    tokenizer = load_tokenizer(model)
    assert tool_turn(tokenizer, "1+2=3", chat_template=False) == tokenizer("\n1+2=3\n",
                                                                           add_special_tokens=False)["input_ids"]
    chat = load_tokenizer(tiny_path)
    assert tool_turn(chat, "1+2=3") != tool_turn(chat, "1+2=3", chat_template=False)  # the template's turn
    (prompt,) = make_task(*BASE).prompts(0, 1, tokenizer)
    assert prompt.chat_template is False
    assert make_task().prompts(0, 1, chat)[0].chat_template is True
    run_loop(tmp_path / "run", "model=hf", f"model.path={model}", *BASE, *CALC, "rollout.num_rollout=1",
             f"debug.dump_details={tmp_path / 'dump'}")
    samples = safe_load(tmp_path / "dump" / "rollout_data" / "0.pt")["samples"]
    assert len(samples) == 16
    for s in samples:
        mask, response = s["loss_mask"], s["tokens"][-s["response_length"]:]
        first = mask.index(0)
        tool = tool_turn(tokenizer, calculate(CALL.search(s["prompt"]).group(0)), chat_template=False)
        assert response[first:first + len(tool)] == tool and mask[first:first + len(tool)] == [0] * len(tool)
        assert [t["role"] for t in s["metadata"]["turns"]][:2] == ["assistant", "tool"]
