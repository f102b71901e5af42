"""Free-form answer rewards (relax/task/answers.py), the word-problem task and its held-out
share, and task.format_reward."""

import random
import threading

import pytest

from relax.errors import ConfigError
from relax.sample import Sample
from relax.task import answers, build_task, word_problems

from . import extras
from .conftest import make_cfg

extras.require("math_verify", extras.REAL)


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
    task = build_task(make_cfg("task=word_problems", "task.operations=[add,sub,mul,plus,minus]"))
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
    (["task.min_operand=50", "task.max_operand=10"], "task.min_operand=50 <= task.max_operand=10"),
])
def test_bad_word_problem_keys_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_task(make_cfg("task=word_problems", *overrides))


def test_format_reward_adds_to_well_formed_responses_only():
    task = build_task(make_cfg("task=word_problems", "task.format_reward=0.1", "task.answer_format='\\d+'"))
    samples = [Sample(i, 0, "q", [1], 1, response=r, label="9") for i, r in enumerate(["9", "it is 9", "8"])]
    task.score(samples, 3)
    assert [s.reward for s in samples] == [1.1, 1.0, 0.1]
    with pytest.raises(ConfigError, match="task.format_reward=0.1 needs task.answer_format"):
        build_task(make_cfg("task=word_problems", "task.format_reward=0.1", "task.answer_format=null"))


def test_eval_on_the_task_needs_a_task_with_held_out_questions(tmp_path):
    from relax.eval import questions

    cfg = make_cfg("task=word_problems", "eval.datasets=[task]", "eval.num_prompts=7")
    assert len(questions("task", cfg, build_task(cfg))) == 7
    cfg = make_cfg("eval.datasets=[task]")
    with pytest.raises(ConfigError, match="eval.datasets entry 'task': task=ArithmeticTask has no held-out"):
        questions("task", cfg, build_task(cfg))
