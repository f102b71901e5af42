"""Partial rollouts (rollout.partial, relax/rollout/partial.py): a rollout stops once
rollout_batch_size of its over_sampling_batch_size groups are complete; the rest go on in the
next rollout on the new weights (continue) or start over (abort). Every token records its
policy version; a resumed run and a replay of its saved data end with its weights, bit for bit;
what cannot be cut is refused before anything starts."""

import pytest
import torch
from rich.console import Console
from rich.text import Text

from relax.errors import ConfigError
from relax.files import safe_load
from relax.logger import read_metrics
from relax.rollout import SamplingParams, build_engine
from relax.rollout import partial
from relax.rollout.partial import IN_FLIGHT, generate_partial_rollout
from relax.rollout.torch_base import complete_groups
from relax.task import build_task
from relax.tools.inspect import inspect, render

from .conftest import engine_spec, make_cfg, run_loop
from .test_async import last_weights, same_run

PARTIAL = ["rollout.rollout_batch_size=8", "train.max_staleness=2", "rollout.partial=continue"]


@pytest.fixture(scope="module")
def engine(tiny_path, tokenizer):
    cfg = make_cfg()
    return build_engine(cfg.rollout, engine_spec(cfg, tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))


def test_complete_groups_counts_groups_with_every_row_finished():
    groups = torch.tensor([0, 0, 1, 1, 5])
    assert complete_groups(groups, torch.tensor([True, False, True, True, True])) == 2
    assert complete_groups(groups, torch.tensor([False, False, False, True, False])) == 0


def test_a_response_cut_and_continued_is_the_response_made_in_one_call(engine, tokenizer):
    """Token t of a response draws its seed's t-th uniform whichever call samples it: stopped
    after the first group finishes and continued from where it stopped (`done`), with the same
    weights, every response is the one a single call makes (its log-probs to rounding: the
    continuation recomputes the cut tokens' keys in a prefill)."""
    prompts = [tokenizer.encode(f"<|user|>{a}+{b}=<|assistant|>") for a, b in ((3, 4), (55, 66), (7, 80), (12, 9))]
    sp, seeds = SamplingParams(1.0, 1.0, 8), [11, 12, 13, 14]
    whole = engine.generate(prompts, sp, seeds)
    cut = engine.generate(prompts, sp, seeds, done=[0] * 4, until=([0, 1, 2, 3], 1))
    on = [i for i, g in enumerate(cut) if g.status == "aborted"]
    assert 0 < len(on) < 4
    rest = dict(zip(on, engine.generate([prompts[i] + cut[i].tokens for i in on], sp, [seeds[i] for i in on],
                                        done=[len(cut[i].tokens) for i in on])))
    for i, (w, c) in enumerate(zip(whole, cut, strict=True)):
        r = rest.get(i)
        if r is None:  # finished at the cut
            assert (c.tokens, c.status) == (w.tokens, w.status)
            continue
        assert c.tokens + r.tokens == w.tokens and r.status == w.status
        assert torch.allclose(torch.tensor(c.log_probs + r.log_probs), torch.tensor(w.log_probs), atol=1e-5)


def test_an_engine_that_decodes_each_call_to_its_end_is_cut_between_chunks(engine, tokenizer, monkeypatch):
    """in_chunks (rollout=sglang's partial decode) over the torch engine's plain calls: calls of
    CHUNK tokens (2 here: the tiny model's answers are short), the cut after the first chunk
    that completes `enough` groups; what is left goes on from its tokens in a later call."""
    monkeypatch.setattr(partial, "CHUNK", 2)
    prompts = [tokenizer.encode(f"<|user|>{a}+{b}=<|assistant|>") for a, b in ((3, 4), (55, 66), (7, 80), (12, 9))]
    sp, seeds = SamplingParams(1.0, 1.0, 8), [21, 22, 23, 24]
    plain = lambda p, s, seed: engine.generate(p, s, seed)  # noqa: E731  (no done/until: to the end)
    cut = partial.in_chunks(plain, prompts, sp, seeds, [0] * 4, ([0, 1, 1, 1], 1))
    left = [i for i, g in enumerate(cut) if g.status == IN_FLIGHT]
    finished = [i for i in range(4) if i not in left]
    assert left and finished and all(len(cut[i].tokens) % 2 == 0 for i in left)
    rest = partial.in_chunks(plain, [prompts[i] + cut[i].tokens for i in left], sp, [seeds[i] for i in left],
                             [len(cut[i].tokens) for i in left], None)
    for i, r in zip(left, rest, strict=True):
        total = len(cut[i].tokens) + len(r.tokens)
        assert r.status == "completed" and total <= 8 or r.status == "truncated" and total == 8
    again = partial.in_chunks(plain, prompts, sp, seeds, [0] * 4, ([0, 1, 1, 1], 1))
    assert [g.tokens for g in again] == [g.tokens for g in cut]  # seeded by position: the same every time


def test_a_partial_run_carries_responses_across_syncs_and_bounds_their_staleness(tmp_path):
    rollouts, steps = run_loop(tmp_path, *PARTIAL, "rollout.num_rollout=4", "checkpoint.save_interval=null",
                               f"debug.save_rollout_data={tmp_path}/data/{{rollout_id}}.pt")
    assert [s["rollout_id"] for s in steps] == [0, 1, 2, 3]
    assert all(r["rollout/staleness"] <= 2 for r in rollouts)
    for r in rollouts:  # the tokens' staleness histogram: shares that add up to 1
        shares = {int(k.rsplit("_", 1)[1]): v for k, v in r.items() if k.startswith("rollout/token_share_at_staleness_")}
        assert max(shares) == r["rollout/staleness"] and abs(sum(shares.values()) - 1) < 1e-9
        assert abs(sum(k * v for k, v in shares.items()) - r["rollout/token_staleness_mean"]) < 1e-9
        assert 0 <= r["rollout/sample_staleness_mean"] <= r["rollout/staleness"]
    assert [r["rollout/partial_carried_groups"] for r in rollouts][0] == 0
    assert all(r["rollout/partial_carried_groups"] > 0 for r in rollouts[1:])
    # rollout.over_sampling_batch_size=null: 1.5 x 8 groups decoded, 8 taken, 4 left in flight
    assert all(r["rollout/partial_in_flight_groups"] == 4 for r in rollouts)
    mixed = []
    for rollout_id in range(4):
        samples = safe_load(tmp_path / "data" / f"{rollout_id}.pt")["samples"]
        assert len(samples) == 8 * 8
        for s in samples:
            versions = s["token_versions"]
            assert len(versions) == s["response_length"] and versions == sorted(versions)
            assert rollout_id - 2 <= versions[0] and versions[-1] <= max(0, rollout_id - 1)  # lag k - 1 = 1
            assert s["metadata"]["policy_version"] == versions[0]
            if len(set(versions)) > 1:
                mixed.append((rollout_id, s["index"], versions))
    assert mixed  # responses that one policy began and the next one finished
    # relax inspect colours such a response's tokens by version
    rollout_id, index, versions = mixed[0]
    console = Console(record=True, width=200, force_terminal=True, color_system="standard")
    render(inspect(tmp_path / "data", rollout_id, index, worst=0), console)
    text = console.export_text(styles=True)
    assert f"by policy version (v{versions[0]}, v{versions[-1]})" in Text.from_ansi(text).plain
    assert "\x1b[36m" in text and "\x1b[35m" in text  # cyan for the first version, magenta the next


def test_a_resumed_partial_run_is_the_uninterrupted_run_and_its_data_replays_to_the_bit(tmp_path):
    """The checkpoint after rollout 2 keeps what is in flight: the resumed run goes on from it
    and ends with the uninterrupted run's weights; debug=train_only on the saved rollouts too."""
    common = [*PARTIAL, "rollout.num_rollout=5", "checkpoint.save_interval=3", "checkpoint.keep_last=null"]
    run_loop(tmp_path / "full", *common, f"debug.save_rollout_data={tmp_path}/data/{{rollout_id}}.pt")
    checkpoint = tmp_path / "full" / "checkpoints" / "rollout_000002"
    assert sorted(p.name for p in (checkpoint / "rollouts_ahead").iterdir()) == [
        "3.pt", "in_flight_2.pt", "in_flight_3.pt"]
    run_loop(tmp_path / "resumed", *common, f"resume={checkpoint}")
    same_run(tmp_path / "full", tmp_path / "resumed", 4)
    replay = ["rollout.rollout_batch_size=8", "rollout.num_rollout=5", "checkpoint.save_interval=5", "debug=train_only",
              f"debug.load_rollout_data={tmp_path}/data/{{rollout_id}}.pt"]
    run_loop(tmp_path / "replay", *replay)
    (_, steps), (_, replayed) = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "replay")
    assert [(s["train/loss"], s["train/grad_norm"]) for s in steps] == \
        [(s["train/loss"], s["train/grad_norm"]) for s in replayed]
    a, b = last_weights(tmp_path / "full", 4), last_weights(tmp_path / "replay", 4)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_abort_starts_the_unfinished_responses_over_on_the_new_weights(tmp_path):
    rollouts, _ = run_loop(tmp_path, *PARTIAL[:-1], "rollout.partial=abort", "rollout.num_rollout=3",
                           "checkpoint.save_interval=null", f"debug.save_rollout_data={tmp_path}/data/{{rollout_id}}.pt")
    assert sum(r["rollout/partial_aborted_tokens"] for r in rollouts) > 0
    for rollout_id in range(3):
        for s in safe_load(tmp_path / "data" / f"{rollout_id}.pt")["samples"]:
            assert len(set(s["token_versions"])) == 1  # one policy made each response


def test_partial_rollouts_under_true_on_policy_are_exact_where_the_policy_is_the_trainers(tmp_path):
    """rollout.true_on_policy decodes every prompt length in one lock step, so partial rollouts
    take it: rollout 0 (nothing carried, sampled by the weights that train it) is exact."""
    _, steps = run_loop(tmp_path, *PARTIAL, "train.max_staleness=1", "rollout.true_on_policy=true",
                        "rollout.num_rollout=2", "checkpoint.save_interval=null")
    first = next(s for s in steps if s["rollout_id"] == 0 and s["step"] == 0)
    assert first["train/train_rollout_logprob_abs_diff"] == 0.0 and first["train/mismatch_kl"] == 0.0
    later = next(s for s in steps if s["rollout_id"] == 1 and s["step"] == 0)
    assert later["train/train_rollout_logprob_abs_diff"] > 0  # its carried tokens: the policy before


@pytest.mark.parametrize("stale,kept", [("drop", False), ("keep", True)])
def test_a_group_carried_past_max_staleness_is_dropped_or_kept(engine, tokenizer, stale, kept):
    """A carried group whose oldest token would train 3 versions late under max_staleness 2."""
    cfg = make_cfg(*PARTIAL, "rollout.rollout_batch_size=2", "rollout.over_sampling_batch_size=3",
                   "rollout.n_samples_per_prompt=2", f"rollout.partial_stale={stale}")
    task = build_task(cfg.task, cfg.seed)
    _, _, left = generate_partial_rollout(engine, task, tokenizer, cfg.rollout, 0, cfg.seed, 0, [], 2)
    old = [s for s in left][:2]
    for s in old:  # as if begun at version 0 and never finished
        s.status = IN_FLIGHT
        s.token_versions = [0] * s.response_length
        s.metadata["marker"] = "old"
    assert any(s.response_length for s in old)
    samples, stats, left = generate_partial_rollout(engine, task, tokenizer, cfg.rollout, 3, cfg.seed, 3, old, 2)
    assert stats["rollout/partial_stale_groups"] == 1 and stats["rollout/partial_carried_groups"] == 1
    present = [s for s in [*samples, *left] if s.metadata.get("marker") == "old"]
    assert len(present) == (2 if kept else 0)


@pytest.mark.parametrize("overrides,message", [
    (["rollout.partial=later"], r"^rollout.partial='later': expected null .* continue or abort"),
    (["rollout.partial_stale=never"], r"^rollout.partial_stale='never': expected drop or keep"),
    (["rollout.partial=continue", "rollout.over_sampling_batch_size=48"],
     "needs train.max_staleness >= 1"),
    (["rollout.partial=continue", "train.max_staleness=1", "rollout.over_sampling_batch_size=32"],
     r"needs rollout.over_sampling_batch_size > rollout.rollout_batch_size=32 \(it is 32; null: 1.5x"),
    ([*PARTIAL, "rollout.dynamic_sampling_filter=relax.rollout.generate.rewards_differ"],
     "dynamic_sampling_filter=.* is refused: the cut counts complete groups"),
    ([*PARTIAL, "rollout.generate_fn=relax.rollout.calculator.generate"], "rollout.generate_fn is refused"),
    ([*PARTIAL, "rollout.num_engines=2"], "with 2 engines is refused"),
    ([*PARTIAL, "debug=train_only", "train.max_staleness=0", "debug.load_rollout_data=/nowhere/{rollout_id}.pt"],
     "a train-only run replays saved rollouts"),
], ids=["mode", "stale", "sync", "over-sampling-too-small", "filter", "generate_fn", "engines",
        "train_only"])
def test_partial_is_refused_where_it_cannot_cut(overrides, message):
    from relax.debug.plan import resolve

    with pytest.raises(ConfigError, match=message):
        resolve(make_cfg(*overrides))
