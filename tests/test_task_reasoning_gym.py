"""task=reasoning_gym: prompts and labels are the reasoning-gym library's items on seeds from the
run's seed (the same seed, the same prompts), rewards are the library's score_answer, eval draws
seeds training never does, bad datasets, weights and kwargs are refused naming the key, and a
short run goes end to end through the CLI on the tiny model."""

from __future__ import annotations

import json
import random
import re

import pytest

from relax.errors import ConfigError
from relax.files import safe_load
from relax.sample import Sample
from relax.task import build_task

from . import extras
from .conftest import make_cfg, make_task, only_run_dir, relax_cli

rg = extras.needs("reasoning_gym", extras.RGYM, name="rg")

TWO = ["task=reasoning_gym", "task.datasets=[basic_arithmetic,leg_counting]"]


def entries(prompts) -> list[dict]:
    return [p.metadata["reasoning_gym"]["entry"] for p in prompts]


def test_prompts_are_the_librarys_items_and_the_same_seed_gives_the_same_prompts(tokenizer, rg):
    task = make_task(*TWO, "seed=1")
    first = task.prompts(0, 32, tokenizer)
    again = make_task(*TWO, "seed=1").prompts(0, 32, tokenizer)
    assert [(p.text, p.label) for p in first] == [(p.text, p.label) for p in again]
    other_seed = make_task(*TWO, "seed=2").prompts(0, 32, tokenizer)
    next_rollout = task.prompts(1, 32, tokenizer)
    assert len({p.text for p in first} & {p.text for p in other_seed + next_rollout}) <= 1
    assert {e["metadata"]["source_dataset"] for e in entries(first)} == {"basic_arithmetic", "leg_counting"}
    for prompt, entry in zip(first, entries(first), strict=True):
        name, index = entry["metadata"]["source_dataset"], entry["metadata"]["source_index"]
        assert 0 <= index < task.size
        # item `index` of the library's dataset on the task's training seed, as the library makes it
        assert rg.create_dataset(name, seed=task.base, size=task.size)[index] == entry
        assert entry["question"].strip() in prompt.text and prompt.label == entry["answer"]


def test_weights_and_dataset_kwargs_reach_the_library(tokenizer):
    task = make_task(*TWO, "task.weights=[0,1]")
    assert {e["metadata"]["source_dataset"] for e in entries(task.prompts(0, 16, tokenizer))} == {"leg_counting"}
    task = make_task("task=reasoning_gym", "+task.dataset_kwargs.basic_arithmetic.max_terms=2",
                               "+task.dataset_kwargs.basic_arithmetic.operators=[+]")
    for entry in entries(task.prompts(0, 16, tokenizer)):
        assert entry["metadata"]["num_terms"] == 2 and {
            t for t in entry["metadata"]["expression"].split() if t in "+-*/"} == {"+"}


def scored(task, responses: list[str], prompt) -> list[float]:
    samples = [Sample(i, 0, prompt.text, [1], 1, response=r, label=prompt.label, metadata=dict(prompt.metadata))
               for i, r in enumerate(responses)]
    task.score(samples, len(samples))
    return [s.reward for s in samples]


def test_the_reward_is_the_librarys_score_answer(tokenizer, rg):
    task = make_task(*TWO)
    for prompt in task.prompts(0, 8, tokenizer):
        entry = prompt.metadata["reasoning_gym"]["entry"]
        library = rg.get_score_answer_fn(entry["metadata"]["source_dataset"])
        right, wrong = prompt.label, str(int(prompt.label) + 1)
        rewards = scored(task, [right, f" {right}\n", wrong, f"about {right}"], prompt)
        assert rewards[:3] == [1.0, 1.0, 0.0]
        assert rewards[3] == library(f"about {right}", entry) == len(right) / len(f"about {right}")  # partial
    # with answer_tag, score_answer gets the text of the last <answer>...</answer>, or None
    task = make_task(*TWO, "task.answer_tag=answer", "task.instruction='Answer in <answer> tags.'")
    prompt = task.prompts(0, 1, tokenizer)[0]
    assert prompt.text.count("Answer in <answer> tags.") == 1
    label = prompt.label
    assert scored(task, [f"Thinking... <answer>{label}</answer>", f"<answer>1</answer> <answer>{label}</answer>",
                         label, f"<answer>{int(label) + 1}</answer>"], prompt) == [1.0, 1.0, 0.0, 0.0]
    # with answer_regex, score_answer gets the regex's last match, or None
    task = make_task(*TWO, r"task.answer_regex='-?\d+'")
    prompt = task.prompts(0, 1, tokenizer)[0]
    label = prompt.label
    assert scored(task, [f"2 + 3 = {label}.", f"{label}", f"{label} or {int(label) + 1}", "no number",
                         f"<answer>{label}</answer> and 1"], prompt) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_the_rgym_v2_recipe_asks_sums_and_reads_the_answer_as_its_last_number(tokenizer):
    """experiment=smollm2_rgym_v2 as docs/real-model.md measures it: the library's own question,
    two terms of 1-2 digits added, and "a + b = c." scored as c (the form the model learns)."""
    task = make_task("experiment=smollm2_rgym_v2")
    prompts = task.prompts(0, 16, tokenizer)
    for prompt, entry in zip(prompts, entries(prompts), strict=True):
        terms = re.fullmatch(r"Calculate (\d+) \+ (\d+)\.", entry["question"].strip()).groups()
        assert all(1 <= len(t) <= 2 for t in terms) and prompt.label == str(sum(map(int, terms)))
        explained, wrong = f"{terms[0]} + {terms[1]} = {prompt.label}.", f"{prompt.label} + 1 = {int(prompt.label) + 1}"
        assert scored(task, [explained, wrong, "I cannot add."], prompt) == [1.0, 0.0, 0.0]


def test_eval_draws_seeds_training_never_draws(tokenizer, rg):
    from relax.eval import questions

    cfg = make_cfg(*TWO, "eval.datasets=[task]", "eval.num_prompts=40")
    task = build_task(cfg.task, cfg.seed)
    held = questions("task", cfg.eval, cfg.seed, task)
    again = questions("task", cfg.eval, cfg.seed, build_task(cfg.task, cfg.seed))
    assert len(held) == 40 and held == again  # the same at every eval
    for question, label, metadata in held:
        entry = metadata["reasoning_gym"]["entry"]
        name, index = entry["metadata"]["source_dataset"], entry["metadata"]["source_index"]
        # item `index` on seed base + size: generated from seed base + size + index, past every
        # training item's seed base + i (i < task.size)
        assert rg.create_dataset(name, seed=task.base + task.size, size=40)[index] == entry
    train = {q for q, *_ in task.questions(random.Random(0), 2000)}
    assert not train & {q for q, *_ in held}


@pytest.mark.parametrize("overrides, message", [
    (["task.datasets=[basic_arithmetc]"], r"task.datasets: 'basic_arithmetc' is not a reasoning-gym dataset "
                                          r"\(did you mean basic_arithmetic"),
    (["task.datasets=[]"], r"task.datasets=\[\]: expected one or more"),
    (["task.datasets=[gcd,gcd]"], r"task.datasets=\['gcd', 'gcd'\]: a dataset is listed twice"),
    (["task.datasets=[composite]"], r"task.datasets: 'composite' is refused here"),
    (["task.weights=[1]"], r"task.weights=\[1.0\]: expected one weight per dataset"),
    (["task.weights=[1,-1]"], r"task.weights=\[1.0, -1.0\]: the weight of leg_counting is -1.0"),
    (["task.weights=[1,nan]"], r"task.weights=\[1.0, nan\]: the weight of leg_counting is nan"),
    (["task.weights=[0,0]"], r"task.weights=\[0.0, 0.0\]: expected a weight > 0"),
    (["+task.dataset_kwargs.gcd.min_value=3"], r"task.dataset_kwargs.gcd: 'gcd' is not one of task.datasets"),
    (["+task.dataset_kwargs.leg_counting.max_animal=3"],
     r"task.dataset_kwargs.leg_counting.max_animal: leg_counting has no such config key \(did you mean "
     r"max_animals"),
    (["+task.dataset_kwargs.leg_counting.seed=3"], r"task.dataset_kwargs.leg_counting.seed: set by Relax"),
    (["+task.dataset_kwargs.basic_arithmetic=3"], r"task.dataset_kwargs.basic_arithmetic=3: expected a mapping"),
    (["+task.dataset_kwargs.basic_arithmetic.max_terms=1"],
     r"task.dataset_kwargs.basic_arithmetic=\{\"max_terms\": 1\}: reasoning-gym refuses basic_arithmetic's "
     r"config \(size=10000\): AssertionError: max_terms must be >= min_terms"),
    (["+task.dataset_kwargs.basic_arithmetic.operators=[%]"],
     r"task.dataset_kwargs.basic_arithmetic=.*unsupported operator: %"),
    (["task.size=0"], r"task.size=0: expected a number of items per dataset in \[1, 1073741824\]"),
    (["task.answer_tag='<a>'"], r"task.answer_tag='<a>': expected a tag name"),
    (["task.answer_regex='('"], r"task.answer_regex='\(': expected a regular expression"),
    ([r"task.answer_regex='\d*'"], r"task.answer_regex='\\\\d\*': it matches the empty string"),
    (["task.answer_regex=x", "task.answer_tag=answer"],
     r"task.answer_regex='x' and task.answer_tag='answer': set one"),
])
def test_bad_datasets_weights_and_kwargs_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_task(*TWO, *overrides)


def test_too_long_prompts_are_refused_at_start_up_naming_the_dataset(tmp_path):
    """The tiny model has 128 positions: five-term sums of 4-digit numbers with the tag instruction
    do not fit; the first items of each dataset are checked before anything is built."""
    proc = relax_cli("task=reasoning_gym", "+task.dataset_kwargs.basic_arithmetic.min_terms=6",
                     "task.instruction='Give your final answer between <answer> and </answer> tags.'",
                     cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    output = proc.stdout + proc.stderr
    assert re.search(r"task.datasets basic_arithmetic, item \d+ \('Calculate .* more than the 120", output) and "Traceback" not in output
    assert not list(tmp_path.glob("outputs/runs/*/metrics.jsonl"))  # refused before the run started


def test_a_short_run_end_to_end_with_eval_on_held_out_seeds(tmp_path, rg):
    proc = relax_cli("task=reasoning_gym", "task.datasets=[basic_arithmetic]", "rollout.num_rollout=2",
                     "eval.interval=1", "eval.datasets=[task]", "eval.num_prompts=4",
                     "debug.save_rollout_data=rollouts/{rollout_id}.pt", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run_dir(tmp_path)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {m["rollout_id"] for m in metrics if "rollout/raw_reward" in m} == {0, 1}
    assert sum("eval/task/reward" in m for m in metrics) == 2
    saved = safe_load(run / "rollouts" / "0.pt")["samples"]
    for s in saved[:8]:  # each sample carries its item, and its reward is the library's score
        item = s["metadata"]["reasoning_gym"]
        library = rg.get_score_answer_fn("basic_arithmetic")
        assert item["dataset"] == "basic_arithmetic" and s["label"] == item["entry"]["answer"]
        assert s["reward"] == library(s["response"].strip(), item["entry"])
