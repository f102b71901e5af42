"""Free-form answer rewards (relax/task/answers.py), the tasks' prompts (arithmetic, word
problems and their held-out share, JSONL rows) and task.format_reward."""

import json
import random
import threading

import pytest

from relax.errors import ConfigError
from relax.sample import Sample
from relax.task import answers, build_task, word_problems

from . import extras
from .conftest import make_cfg, make_task

math_verify = extras.needs("math_verify", extras.REAL, name="math_verify")


@pytest.mark.parametrize("fn, response, label, expected", [
    (answers.last_number, "7 + 2 = 9.", "9", 1.0),
    (answers.last_number, "14 + 11 = 25", "25", 1.0),
    (answers.last_number, "The answer is 1,234 apples", "1234", 1.0),
    (answers.last_number, "She has 9.0 left", "9", 1.0),
    (answers.last_number, "25 or maybe 26", "25", 0.0),   # the last number counts
    (answers.last_number, "-3", "-3", 1.0),
    (answers.last_number, "no number here", "3", 0.0),
    (answers.last_number, "", "3", 0.0),
    (answers.boxed, r"so the answer is \boxed{\frac{18}{2}}", "9", 1.0),
    (answers.boxed, r"\boxed{3} then \boxed{4}", "4", 1.0),
    (answers.boxed, r"\boxed{3} then \boxed{4}", "3", 0.0),
    (answers.boxed, r"unclosed \boxed{4", "4", 0.0),
    (answers.boxed, "9 without a box", "9", 0.0),
    (answers.gsm8k, "She buys 3 then 4.\n#### 1,234", "1234", 1.0),
    (answers.gsm8k, "#### 12\n#### 13", "13", 1.0),
    (answers.gsm8k, "She owes 5.\n#### -5", "-5", 1.0),
    (answers.gsm8k, "the answer is 7", "7", 0.0),
    (answers.math_answer, r"The answer is $\boxed{0.5}$", "1/2", 1.0),
    (answers.math_answer, "The answer is 12", "13", 0.0),
])
def test_free_form_rewards_read_the_answer_out_of_the_text(fn, response, label, expected):
    assert fn(response, label) == expected


def test_rewards_work_outside_the_main_thread():
    """math-verify's default timeouts use signal.alarm, which raises in a thread (train.async
    scores rewards in one)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(answers.last_number("so 7 + 2 = 9", "9")))
    thread.start()
    thread.join()
    assert out == [1.0]


def test_word_problems_have_exact_labels_and_a_held_out_share_training_never_draws():
    task = make_task("task=word_problems", "task.operations=[add,sub,mul,plus,minus]")
    train = task.questions(random.Random(0), 400)
    held = task.held_out(random.Random(1), 40)
    assert len(train) == 400 and len(held) == 40
    assert not any(word_problems.held_out(q) for q, _ in train)
    assert all(word_problems.held_out(q) for q, _ in held)
    for question, label in train + held:
        a, b = (int(w) for w in question.replace("?", " ").split() if w.isdigit())
        if "gets" in question or "+" in question:
            assert int(label) == a + b, question
        elif "gave" in question or " - " in question:
            assert int(label) == a - b >= 0, question
        else:  # "fills <bags> bags with <n> <items> each"
            assert int(label) == a * b and 2 <= a <= 9, question
    assert {q.split()[1] for q, _ in train} >= {"has", "had", "fills", "is"}  # every template drawn
    # the same rollout draws the same problems (resume, replay)
    assert task.questions(random.Random(0), 5) == train[:5]


@pytest.mark.parametrize("overrides, message", [
    (["task.operations=[divide]"], "task.operations=\\['divide'\\]"),
    (["task.operations=[]"], "task.operations=\\[\\]"),
    (["task.min_operand=50", "task.max_operand=10"], "task.min_operand=50 is above task.max_operand=10"),
    (["task.min_operand=-1"], r"task.min_operand=-1: expected an integer >= 0"),
])
def test_bad_word_problem_keys_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_task("task=word_problems", *overrides)


def test_format_reward_adds_to_well_formed_responses_only():
    task = make_task("task=word_problems", "task.format_reward=0.1", "task.answer_format='\\d+'")
    samples = [Sample(i, 0, "q", [1], 1, response=r, label="9") for i, r in enumerate(["9", "it is 9", "8"])]
    task.score(samples, 3)
    assert [s.reward for s in samples] == [1.1, 1.0, 0.1]
    padded = [Sample(0, 0, "q", [1], 1, response=" 9\n", label="9")]  # matched once stripped
    task.score(padded, 1)
    assert padded[0].reward == pytest.approx(1.1)
    with pytest.raises(ConfigError, match="task.format_reward=0.1 needs task.answer_format"):
        make_task("task=word_problems", "task.format_reward=0.1", "task.answer_format=null")


def test_eval_on_the_task_needs_a_task_with_held_out_questions(tmp_path):
    from relax.eval import questions

    cfg = make_cfg("task=word_problems", "eval.datasets=[task]", "eval.num_prompts=7")
    assert len(questions("task", cfg.eval, cfg.seed, build_task(cfg.task, cfg.seed))) == 7
    cfg = make_cfg("eval.datasets=[task]")
    with pytest.raises(ConfigError, match="eval.datasets entry 'task': task=ArithmeticTask has no held-out"):
        questions("task", cfg.eval, cfg.seed, build_task(cfg.task, cfg.seed))


def test_one_word_problem_in_ten_is_held_out_and_every_problem_ends_with_the_instruction():
    """The held-out share is HELD_OUT_BUCKETS' one in ten (eval measures on that share only), and
    task.instruction closes every problem (a chat model answers with just the number)."""
    rng = random.Random(0)
    problem = dict(operations=["add", "sub", "mul"], min_operand=10, max_operand=99, instruction="Say it.")
    questions = [word_problems.make_problem(rng, **problem)[0] for _ in range(3000)]
    share = sum(map(word_problems.held_out, questions)) / len(questions)
    assert 0.08 < share < 0.12, share
    assert all(q.endswith("? Say it.") for q in questions)


def test_arithmetic_labels_are_the_sum_and_operands_cover_the_whole_range():
    from relax.task.arithmetic import make_problem

    rng = random.Random(0)
    problems = [make_problem(rng, 1, 3) for _ in range(200)]
    operands = [tuple(map(int, q[:-1].split("+"))) for q, _ in problems]
    assert all(int(label) == a + b for (a, b), (_, label) in zip(operands, problems, strict=True))
    assert {a for a, _ in operands} == {b for _, b in operands} == {1, 2, 3}  # both ends, both operands


def test_prompts_depend_on_the_seed_the_rollout_and_the_round_and_end_with_the_assistant_turn(tokenizer):
    """A rollout's prompts are drawn from (seed, rollout_id, round): the same on a resume, new for
    the next rollout and for each dynamic-sampling round (else a round redraws the groups it
    just dropped)."""
    cfg = make_cfg()
    task = build_task(cfg.task, cfg.seed)

    def labels(rollout_id, round=0, seed=cfg.seed):
        task.seed = seed
        return [p.label for p in task.prompts(rollout_id, 8, tokenizer, round)]
    assert labels(0) == labels(0)
    assert len({tuple(labels(0)), tuple(labels(1)), tuple(labels(0, round=1)), tuple(labels(0, seed=7))}) == 4
    prompt = task.prompts(0, 1, tokenizer)[0]
    # the chat template, ending where the model takes its turn
    assert prompt.text.startswith("<|user|>") and prompt.text.endswith("=<|assistant|>")
    assert prompt.tokens == tokenizer(prompt.text, add_special_tokens=False)["input_ids"]


class WordCounter:
    """A tokenizer stand-in: one token per word."""

    def __call__(self, texts, add_special_tokens):
        return {"input_ids": [[0] * len(t.split()) for t in texts]}


def test_jsonl_task_draws_every_row_with_its_metadata_and_refuses_a_boolean_label(tmp_path):
    from relax.task import jsonl_record

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "label": i, "metadata": {"row": i}}) + "\n"
                            for i in range(3)))
    task = make_task("task=jsonl", f"task.data_path={data}", "task.apply_chat_template=false")
    prompts = [p for r in range(20) for p in task.prompts(r, 4, WordCounter())]
    assert {p.label for p in prompts} == {"0", "1", "2"}  # the last row too
    assert all(p.metadata == {"row": int(p.label)} and p.text == f"q{p.label}" for p in prompts)
    with pytest.raises(ConfigError, match="f.jsonl:3: 'label' must be a string or a number, found True"):
        jsonl_record({"prompt": "q", "label": True}, "f.jsonl:3")


def test_a_prompt_may_fill_exactly_the_positions_max_new_tokens_leaves(tmp_path):
    """max_position_embeddings=10, max_new_tokens=6: a 4-token prompt fits, a 5-token one is
    refused naming its line; max_new_tokens=9 leaves 1, 10 leaves none."""
    data = tmp_path / "data.jsonl"

    def check(words, max_new_tokens):
        data.write_text(json.dumps({"prompt": " ".join(["w"] * words), "label": ""}) + "\n")
        task = make_task("task=jsonl", f"task.data_path={data}", "task.apply_chat_template=false")
        task.check_prompts(WordCounter(), 10, max_new_tokens)
        return task.max_prompt_tokens
    assert check(4, 6) == 4 and check(1, 9) == 1
    with pytest.raises(ConfigError, match=r"data.jsonl:1: the prompt has 5 tokens, more than the 4 "):
        check(5, 6)
    with pytest.raises(ConfigError, match="rollout.max_new_tokens=10 leaves no room"):
        check(1, 10)
