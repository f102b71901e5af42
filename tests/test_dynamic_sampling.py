"""Dynamic sampling (DAPO, rollout.dynamic_sampling_filter): trained groups all teach something,
the metrics count the dropped groups and the rounds, and the round cap fails clearly."""

import pytest

from relax.errors import ConfigError, RolloutError
from relax.files import safe_load

from .conftest import engine_spec, run_loop

N = 4  # samples per prompt
DYNAMIC = ["rollout.dynamic_sampling_filter=relax.rollout.generate.rewards_differ",
           "rollout.rollout_batch_size=2", f"rollout.n_samples_per_prompt={N}",
           "checkpoint.save_interval=null"]


def never(group):
    return False


def odd_groups(group):
    return group[0].group_index % 2 == 1


@pytest.fixture(scope="module")
def filtered_run(tmp_path_factory):
    """Two trained rollouts, one prompt per generation round, every detail dumped."""
    root = tmp_path_factory.mktemp("dynamic")
    rollouts, _ = run_loop(root / "run", *DYNAMIC, "rollout.over_sampling_batch_size=1",
                           "rollout.num_rollout=2", f"debug.dump_details={root / 'dump'}")
    return root / "dump", rollouts


def test_every_trained_group_has_rewards_that_differ(filtered_run):
    dump, rollouts = filtered_run
    for rollout_id in (0, 1):
        rows = safe_load(dump / "train_data" / f"{rollout_id}_0.pt")["samples"]
        rows.sort(key=lambda r: r["index"])
        assert len(rows) == 2 * N
        for g in range(2):
            group = rows[g * N:(g + 1) * N]
            assert len({r["reward"] for r in group}) > 1
            advantages = [r["advantage"] for r in group]
            assert max(advantages) - min(advantages) > 0.5  # GRPO: rewards 0/1 normalised per group
            assert abs(sum(advantages)) < 1e-5


def test_the_metrics_count_the_dropped_groups_and_the_rounds(filtered_run):
    dump, rollouts = filtered_run
    assert sum(r["rollout/filtered_groups"] for r in rollouts) > 0  # this seed drops some
    for r in rollouts:
        samples = safe_load(dump / "rollout_data" / f"{r['rollout_id']}.pt")["samples"]
        # one prompt a round: each round is a kept group or a dropped one, the last one kept
        kept_rounds = sorted({s["metadata"]["generation_index"] // N for s in samples})
        assert r["rollout/generation_rounds"] == 2 + r["rollout/filtered_groups"]
        assert len(kept_rounds) == 2 and kept_rounds[-1] == r["rollout/generation_rounds"] - 1
        assert [s["index"] for s in samples] == list(range(2 * N))  # re-numbered for training
        assert [s["metadata"]["generation_index"] % N for s in samples] == list(range(N)) * 2


def test_a_round_with_more_passing_groups_than_needed_keeps_the_first_and_renumbers(tiny_path, tokenizer):
    """Rounds of 3 prompts, generation groups 0, 1, 2 then 3, 4, 5, of which the odd ones pass:
    groups 1 and 3 are trained (5 passed too, one more than rollout_batch_size), numbered 0 and 1."""
    from relax.rollout import build_engine
    from relax.rollout.generate import generate_rollout
    from relax.task import build_task

    from .conftest import make_cfg

    cfg = make_cfg(*DYNAMIC, "rollout.dynamic_sampling_filter=tests.test_dynamic_sampling.odd_groups",
                   "rollout.over_sampling_batch_size=3", "rollout.max_new_tokens=2")
    samples, metrics = generate_rollout(build_engine(cfg.rollout, engine_spec(cfg, tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id)), build_task(cfg.task, cfg.seed), tokenizer,
                                        cfg.rollout, 4, seed=1)
    assert metrics == {"rollout/filtered_groups": 3, "rollout/generation_rounds": 2}
    assert [s.metadata["generation_index"] for s in samples] == [*range(4, 8), *range(12, 16)]
    assert [s.index for s in samples] == list(range(2 * N))
    assert [s.group_index for s in samples] == [0] * N + [1] * N
    assert all(s.metadata["rollout_id"] == 4 for s in samples)


def test_the_round_cap_stops_the_rollout_naming_it(tmp_path):
    with pytest.raises(RolloutError) as e:
        run_loop(tmp_path, *DYNAMIC, "rollout.dynamic_sampling_filter=tests.test_dynamic_sampling.never",
                 "rollout.over_sampling_batch_size=1", "rollout.max_generation_rounds=3",
                 "rollout.num_rollout=1")
    assert ("rollout 0: only 0 of rollout_batch_size=2 groups passed rollout.dynamic_sampling_filter="
            "tests.test_dynamic_sampling.never in rollout.max_generation_rounds=3 rounds of 1 prompts "
            "(3 dropped)") in str(e.value)
    assert not (tmp_path / "metrics.jsonl").read_text()  # nothing trained, nothing logged


@pytest.mark.parametrize("overrides,message", [
    (["rollout.dynamic_sampling_filter=no.such.filter"], r"rollout.dynamic_sampling_filter"),
    (["rollout.over_sampling_batch_size=0"], r"rollout.over_sampling_batch_size=0: expected a positive number"),
    (["rollout.max_generation_rounds=0"], r"rollout.max_generation_rounds=0: expected a positive integer"),
])
def test_bad_dynamic_sampling_keys_are_config_errors(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_loop(tmp_path, *DYNAMIC, "rollout.num_rollout=1", *overrides)
    assert not (tmp_path / "built.json").exists()
