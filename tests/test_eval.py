"""Evaluation during training (the eval section, relax/eval/): when it runs, what it logs, that
greedy eval numbers are the policy's, several datasets, the debug modes, and bad keys."""

import json
import logging

import pytest
import torch

from relax.errors import ConfigError
from relax.eval import questions
from relax.task import build_task

from .conftest import make_cfg, run_loop

SMALL = ["rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2", "eval.num_prompts=4",
         "checkpoint.save_interval=null"]
EVAL_KEYS = ("eval/arithmetic/reward", "eval/arithmetic/response_len")


def eval_rows(rollouts, name="arithmetic"):
    return {r["rollout_id"]: (r[f"eval/{name}/reward"], r[f"eval/{name}/response_len"])
            for r in rollouts if f"eval/{name}/reward" in r}


def eval_questions(entry: str, cfg) -> list[tuple]:
    """eval.datasets entry `entry` as a run of `cfg` asks it (with the run's task)."""
    return questions(entry, cfg.eval, cfg.seed, build_task(cfg.task, cfg.seed))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A trained run with eval.interval=2, and a rollout_only run (the initial weights
    throughout) that evaluates two datasets every 3 rollouts and saves its rollouts."""
    root = tmp_path_factory.mktemp("eval")
    trained = run_loop(root / "train", *SMALL, "eval.interval=2", "rollout.num_rollout=5", "train.lr=1e-2")[0]
    jsonl = root / "sums.jsonl"  # the arithmetic eval questions again, as a JSONL dataset
    jsonl.write_text("".join(json.dumps({"prompt": q, "label": a}) + "\n"
                             for q, a in eval_questions("arithmetic", make_cfg(*SMALL))))
    rollout_only = run_loop(root / "rollout_only", *SMALL, "debug=rollout_only", "eval.interval=3",
                            "rollout.num_rollout=5", f"eval.datasets=[arithmetic,{jsonl}]",
                            f"debug.save_rollout_data={root}/data/{{rollout_id}}.pt")[0]
    return root, trained, rollout_only


def test_eval_runs_at_rollout_zero_every_interval_and_at_the_last(runs):
    _, trained, rollout_only = runs
    assert [r["rollout_id"] for r in trained] == [0, 1, 2, 3, 4]
    assert sorted(eval_rows(trained)) == [0, 2, 4]
    assert all(not any(k in r for k in EVAL_KEYS) for r in trained if r["rollout_id"] in (1, 3))
    assert sorted(eval_rows(rollout_only)) == [0, 3, 4]  # 4: the last, though not a multiple of 3
    for reward, response_len in eval_rows(trained).values():
        assert reward in {0.0, 0.25, 0.5, 0.75, 1.0} and 1 <= response_len <= 8  # 4 prompts, 8 tokens
    assert all(r["perf/eval_time"] > 0 for r in trained if r["rollout_id"] in (0, 2, 4))


def test_greedy_eval_is_the_policys_answers(runs, tiny_path, tokenizer):
    """The same weights give the same eval numbers; and they are what greedy decoding of the
    eval prompts with transformers scores."""
    from transformers import AutoModelForCausalLM

    from relax.task.arithmetic import exact_match

    _, trained, rollout_only = runs
    initial = eval_rows(rollout_only)
    assert initial[0] == initial[3] == initial[4] == eval_rows(trained)[0]  # the initial weights
    cfg = make_cfg(*SMALL)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, torch_dtype=torch.float32).eval()
    rewards, lengths = [], []
    task = build_task(cfg.task, cfg.seed)
    for question in task.to_prompts(eval_questions("arithmetic", cfg), tokenizer, "test"):
        with torch.no_grad():
            out = model.generate(torch.tensor([question.tokens]), do_sample=False, max_new_tokens=8,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        response = out[0, len(question.tokens):].tolist()
        if tokenizer.eos_token_id in response:
            response = response[:response.index(tokenizer.eos_token_id) + 1]
        lengths.append(len(response))
        rewards.append(exact_match(tokenizer.decode(response, skip_special_tokens=True), question.label))
    assert initial[0] == pytest.approx((sum(rewards) / 4, sum(lengths) / 4), abs=1e-9)


def test_several_datasets_each_get_their_metrics(runs):
    _, _, rollout_only = runs
    # the JSONL file holds the arithmetic eval questions: the same numbers under its own name
    assert eval_rows(rollout_only, "sums") == eval_rows(rollout_only)
    assert all("eval/arithmetic/reward" in r and "eval/sums/response_len" in r
               for r in rollout_only if r["rollout_id"] in (0, 3, 4))


def test_train_only_skips_eval_with_a_log_line(runs, tmp_path, caplog):
    root, _, _ = runs
    with caplog.at_level(logging.INFO, logger="relax.eval"):
        rollouts, _ = run_loop(tmp_path, *SMALL, "debug=train_only", "eval.interval=1",
                               "rollout.num_rollout=2",
                               f"debug.load_rollout_data={root}/data/{{rollout_id}}.pt")
    assert [r["rollout_id"] for r in rollouts] == [0, 1]
    assert not any(k.startswith("eval/") for r in rollouts for k in r)
    assert "eval.interval=1: evaluation skipped, debug=train_only builds no rollout engine" in caplog.text


@pytest.mark.parametrize("overrides,message", [
    (["eval.interval=0"], r"eval.interval=0: expected a positive number of rollouts"),
    (["eval.temperature=-1"], r"eval.temperature=-1.0: expected a number >= 0"),
    (["eval.n_samples_per_prompt=0"], r"eval.n_samples_per_prompt=0: expected a positive integer"),
    (["eval.num_prompts=0"], r"eval.num_prompts=0: expected a positive integer"),
    (["eval.datasets=[]"], r"eval.datasets=\[\]: expected one or more datasets"),
    (["eval.datasets=[arithmetic,arithmetic]"], r"distinct names"),
    (["eval.datasets=[/no/such.jsonl]"], r"eval.datasets entry '/no/such.jsonl': .*no such file"),
])
def test_bad_eval_keys_are_config_errors_before_anything_is_built(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_loop(tmp_path, *SMALL, "eval.interval=1", *overrides)
    assert not (tmp_path / "built.json").exists()


def test_evaluate_samples_each_prompt_n_times_at_eval_temperature_with_its_own_seeds(monkeypatch, tokenizer):
    """What evaluate() asks of generation and how it averages: eval.n_samples_per_prompt samples
    per prompt at eval.temperature, seeds that are no training rollout's and new at each
    evaluation, and means over all samples (not per prompt)."""
    import relax.eval as ev
    from relax.rollout import SamplingParams
    from relax.sample import Sample

    cfg = make_cfg(*SMALL, "eval.interval=2", "eval.n_samples_per_prompt=3", "eval.temperature=0.5",
                   "rollout.num_rollout=10")
    calls = []

    def fake_generate(engine, task, tok, prompts, n, sp, seed, generate_fn, where, agent=None):
        calls.append((len(prompts), n, sp, seed))
        assert agent is None  # rollout.agent unset: the generate_fn
        return [Sample(index=k, group_index=k // n, prompt="", tokens=[1] * (5 + k), response_length=k,
                       reward=float(k == 0)) for k in range(len(prompts) * n)]

    monkeypatch.setattr(ev, "generate_samples", fake_generate)
    evaluator = ev.Evaluator(cfg.eval, cfg.rollout, cfg.seed, build_task(cfg.task, cfg.seed), tokenizer,
                             last_rollout_id=9)
    metrics = [evaluator.evaluate(None, rollout_id) for rollout_id in (2, 4)]
    (prompts, n, sp, seed2), (_, _, _, seed4) = calls
    assert (prompts, n) == (4, 3)
    assert sp == SamplingParams(0.5, cfg.rollout.top_p, cfg.rollout.max_new_tokens)
    training_seeds = {cfg.seed * 1_000_003 + r for r in range(10)}  # relax/rollout/generate.py
    assert seed2 != seed4 and not {seed2, seed4} & training_seeds
    assert metrics[0]["eval/arithmetic/reward"] == 1 / 12  # one right answer among 4 x 3 samples
    assert metrics[0]["eval/arithmetic/response_len"] == sum(range(12)) / 12


def test_eval_questions_are_the_jsonl_files_first_rows_and_the_tasks_operand_range(tmp_path):
    """A JSONL dataset gives its first eval.num_prompts rows; `arithmetic` asks problems in
    the run's task's operand range (both ends reachable), the same ones at every call."""
    jsonl = tmp_path / "six.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"{i}+0=", "label": str(i)}) + "\n" for i in range(6)))
    cfg = make_cfg("eval.num_prompts=4")
    assert [q[:2] for q in eval_questions(str(jsonl), cfg)] == [(f"{i}+0=", str(i)) for i in range(4)]
    cfg = make_cfg("eval.num_prompts=64", "task.min_operand=3", "task.max_operand=5")
    problems = eval_questions("arithmetic", cfg)
    operands = {int(x) for q, _ in problems for x in q.rstrip("=").split("+")}
    assert len(problems) == 64 and operands == {3, 4, 5}
    assert eval_questions("arithmetic", cfg) == problems
    word = make_cfg("task=word_problems", "eval.num_prompts=64", "task.min_operand=3", "task.max_operand=5")
    assert eval_questions("arithmetic", word) == problems  # task=word_problems' range too
