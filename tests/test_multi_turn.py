"""Custom and multi-turn rollouts (rollout.generate_fn): the calculator example's masks and
log-probs through a real run, its replay, `relax inspect`, the engine batching, and bad input."""

import asyncio
from dataclasses import replace

import pytest
import torch

from relax.errors import RolloutError
from relax.files import safe_load
from relax.rollout import Generation, SamplingParams, build_engine, sample_seeds
from relax.rollout.calculator import CALL, calculate, tool_turn
from relax.rollout.client import Batcher
from relax.rollout.generate import generate_samples, single_turn
from relax.sample import Sample
from relax.task import Prompt, build_task

from .conftest import engine_spec, make_cfg, run_loop

CALC = ["rollout.generate_fn=relax.rollout.calculator.generate",
        "task.reward_fn=relax.rollout.calculator.reward", "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4", "checkpoint.save_interval=null"]


@pytest.fixture(scope="module")
def calc_run(tmp_path_factory, tiny_path):
    """The calculator example: 3 rollouts with rollout=torch, trained, every detail dumped."""
    root = tmp_path_factory.mktemp("calc")
    rollouts, steps = run_loop(root / "run", *CALC, "rollout.num_rollout=3",
                               f"debug.dump_details={root / 'dump'}")
    return root / "dump", rollouts, steps


def test_the_calculator_example_trains_for_three_rollouts(calc_run):
    _, rollouts, steps = calc_run
    assert [r["rollout_id"] for r in rollouts] == [0, 1, 2] and len(steps) == 3
    assert all(0 < s["train/grad_norm"] < 10 for s in steps)
    assert steps[1]["train/ppo_kl"] == 0.0 and rollouts[2]["rollout/kl"] > 0  # the policy moved


def test_tool_tokens_are_masked_between_two_model_turns(calc_run, tokenizer):
    check_tool_masks(calc_run[0], tokenizer, 3)


def check_tool_masks(dump, tokenizer, num_rollout: int) -> None:
    for rollout_id in range(num_rollout):
        for s in safe_load(dump / "rollout_data" / f"{rollout_id}.pt")["samples"]:
            mask, response = s["loss_mask"], s["tokens"][-s["response_length"]:]
            first = mask.index(0)
            tool = tool_turn(tokenizer, calculate(CALL.search(s["prompt"]).group(0)))
            # model turn, then exactly the calculator's answer (masked), then the model again
            assert mask == [1] * first + [0] * len(tool) + [1] * (len(mask) - first - len(tool))
            assert response[first:first + len(tool)] == tool and len(mask) > first + len(tool)
            assert response[first - 1] == tokenizer.eos_token_id  # the first turn ended
            assert all(lp == 0.0 for lp, m in zip(s["rollout_log_probs"], mask, strict=True) if not m)
            assert all(lp < 0 for lp, m in zip(s["rollout_log_probs"], mask, strict=True) if m)
            assert s["response"] == s["metadata"]["turns"][-1]["text"]


def test_trainer_log_probs_of_model_tokens_equal_the_engines_across_turns(calc_run):
    dump, _, steps = calc_run
    check_model_token_log_probs(dump, steps)


@pytest.mark.sglang
def test_with_sglang_the_trainers_log_probs_of_model_tokens_equal_the_engines(tmp_path, tokenizer):
    """The same with rollout=sglang: SGLang's log-probs of both model turns are the trainer's,
    before and after a weight sync."""
    pytest.importorskip("sglang", reason="needs the SGLang environment (scripts/setup_sglang_cpu.sh)")
    rollouts, steps = run_loop(tmp_path / "run", *CALC, "rollout=sglang", "rollout.num_rollout=2",
                               f"debug.dump_details={tmp_path / 'dump'}")
    assert [r["rollout_id"] for r in rollouts] == [0, 1]
    check_tool_masks(tmp_path / "dump", tokenizer, 2)
    check_model_token_log_probs(tmp_path / "dump", steps)


def check_model_token_log_probs(dump, steps) -> None:
    for rollout_id in range(len(steps)):  # 0: the initial weights; then after weight syncs
        rows = safe_load(dump / "train_data" / f"{rollout_id}_0.pt")["samples"]
        assert len(rows) == 16
        for row in rows:
            assert len(row["log_probs"]) == len(row["rollout_log_probs"]) == sum(row["loss_mask"])
            diff = max(abs(a - b) for a, b in zip(row["log_probs"], row["rollout_log_probs"], strict=True))
            assert diff < 1e-4, (rollout_id, row["index"], diff)
        assert steps[rollout_id]["train/train_rollout_logprob_abs_diff"] < 1e-4


def test_a_replay_of_multi_turn_samples_trains_identically(tmp_path, calc_run):
    dump, rollouts, steps = calc_run
    replay_rollouts, replay_steps = run_loop(tmp_path, *CALC, "rollout.num_rollout=3",
                                             f"debug.load_rollout_data={dump}/rollout_data/{{rollout_id}}.pt")
    for a, b in zip(steps, replay_steps, strict=True):
        assert a["train/loss"] == b["train/loss"] and a["train/grad_norm"] == b["train/grad_norm"]
        assert a["train/entropy_loss"] == b["train/entropy_loss"]
    for a, b in zip(rollouts, replay_rollouts, strict=True):
        assert a["rollout/log_probs"] == b["rollout/log_probs"]
    # the reference pass runs at the first step (and, in calc_run, for its dump) only: KL there
    assert rollouts[0]["rollout/kl"] == replay_rollouts[0]["rollout/kl"]


def test_inspect_shows_the_tool_tokens_as_masked(calc_run):
    from rich.console import Console

    from relax.tools.inspect import inspect, render

    dump, _, _ = calc_run
    report = inspect(dump, 1, 2)
    sample = report["sample"]
    masked = sample["response_length"] - sum(sample["loss_mask"])
    rollout = safe_load(dump / "rollout_data" / "1.pt")["samples"]
    every = [s["response_length"] - sum(s["loss_mask"]) for s in rollout]
    assert masked > 0 and all(every) and report["rollouts"][1]["masked_tokens"] == sum(every)
    assert len(sample["train"]["log_probs"]) == sum(sample["loss_mask"])
    console = Console(record=True, width=160)
    render(report, console)
    text = console.export_text()
    assert "loss_mask" in text and text.count("0 masked") == masked


# -- the engine client ---------------------------------------------------------------------------

class CountingEngine:
    """The torch engine, recording each batched call's size."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, sp, seed):
        self.calls.append(len(prompts))
        return self.engine.generate(prompts, sp, seed)


@pytest.fixture(scope="module")
def engine(tiny_path, tokenizer):
    return build_engine(make_cfg().rollout, engine_spec(make_cfg(), tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))


def samples_of(engine, fn, tokenizer, *overrides, n=4):
    cfg = make_cfg(*overrides)
    task = build_task(cfg.task, cfg.seed)
    return generate_samples(engine, task, tokenizer, task.prompts(0, 4, tokenizer), n,
                            SamplingParams.of(cfg.rollout), 7, fn, "in a test")


def plain_single_turn(client, prompt, sampling_params):
    """single_turn as a plain function: it runs in a worker thread, and its client blocks."""
    gen = client.generate(prompt.tokens, sampling_params)
    return Sample(prompt.index, prompt.group_index, prompt.text, prompt.tokens + gen.tokens, len(gen.tokens),
                  loss_mask=[1] * len(gen.tokens), rollout_log_probs=gen.log_probs)


def test_concurrent_requests_go_out_as_one_batch_per_turn(engine, tokenizer):
    counting = CountingEngine(engine)
    default = samples_of(counting, "relax.rollout.generate.single_turn", tokenizer)
    assert counting.calls == [16]  # one batched call: the torch engine prefills each prompt once
    counting.calls.clear()
    multi = samples_of(counting, "relax.rollout.calculator.generate", tokenizer)
    assert counting.calls == [16, 16]  # one per turn
    plain = samples_of(engine, "tests.test_multi_turn.plain_single_turn", tokenizer)
    # per-sample seeds: the same draws whatever the batching or the kind of function
    assert [s.tokens for s in plain] == [s.tokens for s in default]
    assert [s.tokens[:s.prompt_length + s.loss_mask.index(0)] for s in multi] == \
        [s.tokens for s in default]  # the first turn is the single-turn sample


async def coroutine_single_turn(client, prompt, sampling_params):
    return await single_turn(client, prompt, sampling_params)


def test_the_default_generate_fns_batched_path_makes_the_coroutines_samples(engine, tokenizer):
    """single_turn, the default, runs as one engine call and one batch decode, without a coroutine
    per sample: every field of every sample is what the coroutine path makes of it."""
    counting = CountingEngine(engine)
    fast = samples_of(counting, "relax.rollout.generate.single_turn", tokenizer, n=8)
    slow = samples_of(counting, "tests.test_multi_turn.coroutine_single_turn", tokenizer, n=8)
    assert counting.calls == [32, 32] and fast == slow
    assert len({s.response for s in fast}) > 4 and all(s.reward is not None for s in fast)


def test_a_single_turn_sample_is_its_engine_generation_whole(engine, tokenizer):
    """Every response token is trained, with the engine's own log-probs and status, drawn with its
    sample's seed: at max_new_tokens=3 some responses stop (completed) and others are cut (truncated)."""
    samples = samples_of(engine, "relax.rollout.generate.single_turn", tokenizer, "rollout.max_new_tokens=3")
    gens = engine.generate([s.tokens[:s.prompt_length] for s in samples],
                           SamplingParams.of(make_cfg("rollout.max_new_tokens=3").rollout),
                           sample_seeds(7, range(16)))
    assert {s.status for s in samples} == {"completed", "truncated"}
    for s, g in zip(samples, gens, strict=True):
        assert s.tokens[s.prompt_length:] == g.tokens and s.response_length == len(g.tokens)
        assert s.loss_mask == [1] * len(g.tokens)
        assert s.rollout_log_probs == g.log_probs and s.status == g.status


async def numbered_by_hand(client, prompt, sampling_params):
    s = await single_turn(client, prompt, sampling_params)
    s.index = s.group_index = 0  # a generate_fn that numbers its samples wrong
    return s


def test_the_samples_are_numbered_by_their_prompt_records(engine, tokenizer):
    samples = samples_of(engine, "tests.test_multi_turn.numbered_by_hand", tokenizer)
    assert [s.index for s in samples] == list(range(16))
    assert [s.group_index for s in samples] == [i // 4 for i in range(16)]


def test_each_rollout_draws_its_own_samples(engine, tokenizer):
    """The rollout's seed mixes in the rollout id: the same prompts at another rollout are new draws,
    at the same rollout (a resumed run) the same ones."""
    from relax.rollout.generate import generate_rollout

    cfg = make_cfg("rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4")
    task = build_task(cfg.task, cfg.seed)
    prompts = task.prompts
    task.prompts = lambda rollout_id, *args: prompts(0, *args)  # every rollout asks the same questions

    def draws(rollout_id, seed=1):
        samples, _ = generate_rollout(engine, task, tokenizer, cfg.rollout, rollout_id, seed)
        return [s.tokens for s in samples]

    first = draws(0)
    assert draws(0) == first
    assert draws(1) != first and draws(0, seed=2) != first


class EngineDied(Exception):
    pass


class RecordingEngine:
    """An engine without a model: each prompt's response is [its first token, 1]; records every
    call's prompts, sampling params and seeds (or raises `error`)."""

    def __init__(self, error=None):
        self.calls, self.error = [], error

    def generate(self, prompts, sp, seeds):
        self.calls.append((prompts, sp, list(seeds)))
        if self.error:
            raise self.error
        return [Generation([p[0], 1], [-0.5, -0.5], "completed") for p in prompts]


async def late_evens(client, prompt, sampling_params):
    """Two engine calls; even samples ask for their first a loop turn late (a tool's await), odd
    samples take their second greedily."""
    if prompt.index % 2 == 0:
        await asyncio.sleep(0)
    first = await client.generate(prompt.tokens, sampling_params)
    sp = replace(sampling_params, temperature=0.0) if prompt.index % 2 else sampling_params
    return first, await client.generate(prompt.tokens + first.tokens, sp)


def batched(engine, n=6):
    records = [Prompt(f"p{i}", [10 + i], "", {}, i, i // 2) for i in range(n)]
    return Batcher(engine, 7).run(late_evens, records, SamplingParams(1.0, 1.0, 2), None,
                                  on_error=lambda record, e: RolloutError(f"sample {record.index}: {e!r}"))


def test_requests_go_out_in_sample_order_one_call_per_sampling_params_each_with_its_seed():
    """A request a few loop turns late still joins its turn's batch; a batch goes to the engine in
    sample order, split by sampling params; call k of sample i draws with sample_seeds(seed, [i], [k])."""
    engine = RecordingEngine()
    results = batched(engine)
    sp, greedy = SamplingParams(1.0, 1.0, 2), SamplingParams(0.0, 1.0, 2)
    evens, odds = [0, 2, 4], [1, 3, 5]
    assert engine.calls == [
        ([[10 + i] for i in range(6)], sp, sample_seeds(7, range(6))),
        ([[10 + i, 10 + i, 1] for i in evens], sp, sample_seeds(7, evens, [1] * 3)),
        ([[10 + i, 10 + i, 1] for i in odds], greedy, sample_seeds(7, odds, [1] * 3)),
    ]
    assert len(set(engine.calls[0][2]) | set(engine.calls[1][2]) | set(engine.calls[2][2])) == 12
    assert [second.tokens for _, second in results] == [[10 + i, 1] for i in range(6)]


def test_an_engine_error_stops_the_rollout_as_it_is():
    """Not as the generate_fn's: the engine failed, not the user's function."""
    with pytest.raises(EngineDied, match="out of memory"):
        batched(RecordingEngine(EngineDied("out of memory")))


class ScriptedClient:
    """A generate_fn's client whose model writes texts[k] (then its stop token) at turn k."""

    def __init__(self, tokenizer, texts, status="completed"):
        self.tokenizer, self.texts, self.status, self.prompts = tokenizer, texts, status, []

    async def generate(self, tokens, sampling_params):
        self.prompts.append(list(tokens))
        text = self.texts[min(len(self.prompts), len(self.texts)) - 1]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return Generation(ids, [-0.25] * len(ids), self.status)


def calculator_sample(tokenizer, texts, status="completed"):
    from relax.rollout import calculator

    prompt_ids = tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    client = ScriptedClient(tokenizer, texts, status)
    sample = asyncio.run(calculator.generate(client, Prompt("12+34=", prompt_ids, "46", {}, 3, 1),
                                             SamplingParams(1.0, 1.0, 8)))
    return sample, client


def test_the_calculator_stops_after_its_last_model_turn_and_at_a_cut_turn(tokenizer):
    """A model that calls the calculator every turn: three model turns with the tool's two answers
    between them (masked), the last turn the model's; a call cut at max_new_tokens is not run."""
    from relax.rollout.calculator import MAX_TURNS

    sample, client = calculator_sample(tokenizer, ["12+34"])
    turn = len(tokenizer("12+34", add_special_tokens=False)["input_ids"]) + 1
    tool = len(tool_turn(tokenizer, "12+34=46"))
    assert MAX_TURNS == 3 and len(client.prompts) == 3
    assert [t["role"] for t in sample.metadata["turns"]] == ["assistant", "tool"] * 2 + ["assistant"]
    assert sample.loss_mask == ([1] * turn + [0] * tool) * 2 + [1] * turn
    assert sample.rollout_log_probs == [-0.25 if m else 0.0 for m in sample.loss_mask]
    assert client.prompts[2] == sample.tokens[:-turn]  # each turn sees the whole conversation
    assert sample.status == "completed" and sample.reward == 0.0

    cut, client = calculator_sample(tokenizer, ["12+34"], status="truncated")
    assert len(client.prompts) == 1 and cut.loss_mask == [1] * turn and cut.status == "truncated"
    assert [t["role"] for t in cut.metadata["turns"]] == ["assistant"]


def test_the_calculator_reward_grades_the_answers_not_the_calls(tokenizer):
    from relax.rollout.calculator import reward

    sample, _ = calculator_sample(tokenizer, ["12+34", "46"])
    assert [t["text"] for t in sample.metadata["turns"]] == ["12+34", "12+34=46", "46"]
    assert sample.response == "46" and reward(sample) == 1.0
    wrong, _ = calculator_sample(tokenizer, ["12+34", "47"])
    assert reward(wrong) == 0.0


async def raising_generate(client, prompt, sampling_params):
    if prompt.index == 5:
        raise ValueError("the tool crashed")
    return await single_turn(client, prompt, sampling_params)


async def short_mask(client, prompt, sampling_params):
    s = await single_turn(client, prompt, sampling_params)
    s.loss_mask = s.loss_mask[:-1]
    return s


async def no_log_probs(client, prompt, sampling_params):
    s = await single_turn(client, prompt, sampling_params)
    s.rollout_log_probs = [0.0] * (s.response_length - 1) + [float("nan")]
    return s


async def routed_by_response(client, prompt, sampling_params):
    s = await single_turn(client, prompt, sampling_params)
    s.routed_experts = [0, 1] * (s.response_length * 7 + 1)  # not [tokens - 1, layers, top_k]
    return s


async def not_a_sample(client, prompt, sampling_params):
    return {"tokens": prompt.tokens}


async def no_prompt(client, prompt, sampling_params):
    s = await single_turn(client, prompt, sampling_params)
    s.tokens = s.tokens[s.prompt_length:]  # the response alone: nothing it answers
    return s


async def weighted_mask(client, prompt, sampling_params):
    s = await single_turn(client, prompt, sampling_params)
    s.loss_mask = [0.5] * s.response_length  # weights are not a mask
    return s


@pytest.mark.parametrize("fn,message", [
    ("short_mask", r"loss_mask has \d+ entries for \d+ response tokens"),
    ("no_log_probs", r"rollout_log_probs has no finite number at response tokens \[\d+\] \(e.g. nan"),
    ("not_a_sample", r"returned for sample 0 .* dict .*: expected a relax.sample.Sample"),
    ("no_prompt", r"response_length=(\d+) with \1 tokens \(the response is the tail of `tokens`, after at "
                  r"least one prompt token\)"),
    ("weighted_mask", r"loss_mask holds \[0.5\]: expected 0 or 1 a token"),
    ("routed_by_response", r"routed_experts has \d+ entries: expected \[len\(tokens\) - 1 = \d+, MoE layers"),
])
def test_a_sample_that_cannot_be_trained_on_is_named(engine, tokenizer, fn, message):
    with pytest.raises(RolloutError, match=rf"rollout.generate_fn=tests.test_multi_turn.{fn} in a test .*"
                                           + message):
        samples_of(engine, f"tests.test_multi_turn.{fn}", tokenizer)


def test_a_raising_generate_fn_stops_the_run_naming_it_before_training(tmp_path):
    with pytest.raises(RolloutError) as e:
        run_loop(tmp_path, "rollout.generate_fn=tests.test_multi_turn.raising_generate",
                 "rollout.num_rollout=2", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4",
                 "checkpoint.save_interval=1",
                 f"debug.save_rollout_data={tmp_path}/data/{{rollout_id}}.pt")
    message = str(e.value)
    assert "rollout.generate_fn=tests.test_multi_turn.raising_generate at rollout 0 raised on sample 5" \
        in message
    assert "prompt='<|user|>" in message and "Traceback" in message
    assert "ValueError: the tool crashed" in message
    assert 'raise ValueError("the tool crashed")' in message  # the function's own line
    assert not (tmp_path / "data").exists() and not (tmp_path / "checkpoints").exists()
    assert not (tmp_path / "metrics.jsonl").read_text()  # nothing trained, nothing logged


def test_the_trainer_ignores_masked_tokens_everywhere():
    """Whatever a tool token's log-probs, loss, KL, entropy and mismatch metrics do not move."""
    from relax.train.common import make_micro_batch, objective

    cfg = make_cfg("algo.use_kl_loss=true", "algo.kl_loss_coef=0.1", "algo.entropy_coef=0.01",
                   "algo.tis=token")
    s = Sample(0, 0, "p", [3, 4, 5, 6, 7, 8, 9], 5, loss_mask=[1, 0, 0, 1, 1],
               rollout_log_probs=[-0.5, 0.0, 0.0, -0.7, -0.2])
    mb = make_micro_batch([s], torch.tensor([1.5]), pad_id=0)
    assert mb.mask.tolist() == [[0, 1, 0, 0, 1, 1, 0]]  # position t predicts token t + 1
    g = torch.Generator().manual_seed(0)
    log_probs, entropy = -torch.rand(1, 7, generator=g), torch.rand(1, 7, generator=g)
    mb.old_log_probs, mb.ref_log_probs = log_probs + 0.01, log_probs - 0.02
    from relax.train.common import attach_is_weights

    attach_is_weights([mb], cfg.algo)
    _, sums = objective(log_probs, entropy, mb, cfg.algo)
    masked = mb.mask == 0
    for tensor in (log_probs, entropy, mb.old_log_probs, mb.ref_log_probs, mb.rollout_log_probs):
        tensor[masked] = -50.0  # garbage at the tool's (and prompt's) positions
    attach_is_weights([mb], cfg.algo)
    _, garbage = objective(log_probs, entropy, mb, cfg.algo)
    assert torch.equal(sums, garbage)
