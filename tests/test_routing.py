"""MoE routing: the engine records it, the trainer measures agreement with it, and routing
replay (algo.routing_replay: R3 the engine's experts, R2 the old-log-prob pass's) makes the
trainer route as recorded (relax/train/routing.py)."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relax.errors import ConfigError
from relax.model import families, load_causal_lm, read_hf_config
from relax.replay import read_rollout, save_rollout
from relax.rollout import SamplingParams
from relax.sample import Sample
from relax.train import routing
from relax.train.common import make_micro_batch

from .conftest import build_trainer, engine_spec, make_cfg, relax_cli, run_loop, trainer_checks
from .test_engine import chat_prompts, engine_for

MOE = ["model.tiny.num_experts=4", "model.tiny.warmup_max_steps=0",
       "model.tiny.shared_expert_intermediate_size=64"]
SHORT = ["rollout.num_rollout=1", "rollout.rollout_batch_size=8", "checkpoint.save_interval=null"]


@pytest.fixture(scope="module")
def moe_path():
    from relax.model import resolve_model_path

    return resolve_model_path(make_cfg(*MOE).model)


def hf_routing(model, tokens: list[int]) -> torch.Tensor:
    """A transformers forward's own top-k per fed token: [len(tokens) - 1, layers, top_k]."""
    with torch.no_grad(), routing.routed(model, routing.unpacked_fed([len(tokens)], len(tokens)),
                                         len(tokens)) as record:
        model(input_ids=torch.tensor([tokens]))
    return record.own[:len(tokens) - 1]


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def test_agreement_and_replay_sums_by_hand():
    """Top-k choices compare as sets, where both sides recorded the token (-1: not recorded); a
    replayed pair ran on the replayed experts when every one of its top-k did; the rollout's
    agreement is over all compared pairs, its worst layer among the layers compared at all."""
    own = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[-1, -1], [-1, -1]]])  # [positions, layers, k]
    engine = torch.tensor([[[1, 0], [2, 3]], [[1, 3], [-1, -1]], [[0, 1], [0, 1]]])
    sums = routing.agreement_sums(own, engine.flatten(1))
    assert sums.tolist() == [[1, 1], [2, 1]]  # layer 0: 1 of 2 (other order, same set); layer 1: 1 of 1
    assert routing.metrics(sums, None) == {"train/routing_agreement": pytest.approx(2 / 3),
                                           "train/routing_agreement_min_layer": 0.5}
    unseen = torch.tensor([[1.0, 0.0], [2.0, 0.0]])  # layer 1 compared nowhere
    assert routing.metrics(unseen, None)["train/routing_agreement_min_layer"] == 0.5
    assert routing.per_layer(unseen) == [0.5, None]

    replay = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[-1, -1], [-1, -1]]])
    used = torch.tensor([[[0, 1], [2, 3]], [[1, 3], [0, 3]], [[4, 5], [4, 5]]])  # one slot lost at (1, 0)
    chose = torch.tensor([[[1, 0], [2, 4]], [[1, 3], [3, 0]], [[4, 5], [4, 5]]])
    replayed = routing.replayed_sums(routing.Record(chose, used), replay.flatten(1))
    assert replayed.tolist() == [3, 2, 4]
    assert routing.metrics(None, replayed) == {"train/routing_replayed": 0.75,
                                               "train/routing_replay_agreement": 0.5}


def test_the_first_forward_at_the_rollouts_weights_is_the_one_measured_and_replayed_by_r2():
    """Later forwards (training steps that moved the weights) neither replace the routing measured
    against the engine's nor what R2 replays."""
    first, later = (routing.Record(torch.full((2, 1, 2), e), torch.full((2, 1, 2), e)) for e in (0, 3))
    for mode in (None, "rollout", "train"):
        mb = SimpleNamespace(trainer_experts=None, replay_experts=None)
        routing.measured(mb, first, mode)
        routing.measured(mb, later, mode)
        assert torch.equal(mb.trainer_experts, first.own)
        if mode == "train":
            assert torch.equal(mb.replay_experts, first.own.flatten(1))
        else:
            assert mb.replay_experts is None


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_the_engine_records_the_experts_of_every_fed_token_as_transformers_routes_them(family, family_model,
                                                                                      tokenizer):
    path = family_model(family)
    config = read_hf_config(path)
    layers, top_k = config["num_hidden_layers"], config["num_experts_per_tok"]
    # left-padded prompts of several lengths, in groups that share one prefill
    prompts = chat_prompts(tokenizer, 12, 1, 999, repeat=3)
    assert len({len(p) for p in prompts}) > 1
    gens = engine_for(path, tokenizer).generate(prompts, SamplingParams(1.0, 1.0, 6), seed=2)
    model = load_causal_lm(path, "float32")
    agree = total = 0
    for prompt, gen in zip(prompts, gens, strict=True):
        tokens = prompt + gen.tokens
        recorded = torch.tensor(gen.routed_experts).view(len(tokens) - 1, layers, top_k)
        assert recorded.min() >= 0 and recorded.max() < families.num_experts(config)
        same = same_sets(recorded, hf_routing(model, tokens))
        agree, total = agree + int(same.sum()), total + same.numel()
    # fp32 both sides: the kernels differ in rounding only, so a near-tie may flip, rarely; a
    # misaligned position or layer would agree on ~1/3 of the pairs (4 experts, top-2)
    assert agree / total > 0.98, (agree, total)


def test_a_dense_model_records_no_routing(tiny_path, tokenizer):
    engine = engine_for(tiny_path, tokenizer)
    gens = engine.generate(chat_prompts(tokenizer, 4), SamplingParams(1.0, 1.0, 4), seed=0)
    assert all(g.routed_experts is None for g in gens)


def sampled(moe_path, tokenizer, dtype: str, n: int = 16) -> list[Sample]:
    """`n` samples (groups of 4) from the torch engine in `dtype`, with their recorded routing."""
    cfg = make_cfg(*MOE, f"rollout.dtype={dtype}")
    from relax.rollout.torch_engine import TorchEngine

    engine = TorchEngine(cfg.rollout, engine_spec(cfg, moe_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    prompts = chat_prompts(tokenizer, n, 1, 999, seed=5, repeat=4)
    gens = engine.generate(prompts, SamplingParams(1.0, 1.0, 8), seed=7)
    return [Sample(i, i // 4, "", p + g.tokens, len(g.tokens), reward=float(i % 2),
                   loss_mask=[1] * len(g.tokens), rollout_log_probs=g.log_probs,
                   routed_experts=g.routed_experts)
            for i, (p, g) in enumerate(zip(prompts, gens, strict=True))]


@pytest.mark.parametrize("shared_prompt", [True, False], ids=["shared-prompt", "rows"])
def test_r3_the_trainer_runs_every_fed_token_on_the_engines_experts(moe_path, tokenizer, shared_prompt):
    samples = sampled(moe_path, tokenizer, "bfloat16")
    cfg = make_cfg(*MOE, "algo.routing_replay=rollout", f"train.shared_prompt={shared_prompt}")
    trainer = build_trainer(cfg, moe_path, pad_token_id=tokenizer.pad_token_id)
    mb = make_micro_batch(samples, torch.zeros(len(samples)), tokenizer.pad_token_id)
    engine = mb.routed_experts.flatten(0, 1).view(mb.tokens.numel(), 2, 2)  # [rows * T, layers, top_k]
    fed = engine[..., 0] >= 0
    assert int(fed[:, 0].sum()) == sum(len(s.tokens) - 1 for s in samples)
    with torch.no_grad():
        _, _, own = trainer._forward(trainer.actor, mb)
        _, _, replayed = trainer._forward(trainer.actor, mb, replay=mb.routed_experts)
    # the trainer routed (and reported) exactly the fed tokens; unreplayed, some differ (bf16 engine)
    assert torch.equal(own.own[..., 0] >= 0, fed)
    agreement = same_sets(own.own, engine)[fed].float().mean()
    assert 0.5 < agreement < 1.0, agreement
    # replayed: the experts of every fed token and layer are the engine's, its own choice unchanged
    assert torch.equal(replayed.used[fed], engine[fed])
    assert torch.equal(replayed.own, own.own)
    sums = routing.replayed_sums(replayed, mb.routed_experts)
    assert sums[0] == sums[2] == fed.sum() and sums[1] < sums[2]


def test_replay_recomputes_the_routing_weights_from_the_routers_logits(moe_path, tokenizer):
    """Replaying a forward's own routing changes nothing (weights from the same logits), and
    the router's weight still gets a gradient."""
    samples = sampled(moe_path, tokenizer, "float32", n=8)
    trainer = build_trainer(make_cfg(*MOE), moe_path, pad_token_id=tokenizer.pad_token_id)
    mb = make_micro_batch(samples, torch.zeros(len(samples)), tokenizer.pad_token_id)
    free, _, record = trainer._forward(trainer.actor, mb)
    replayed, _, _ = trainer._forward(trainer.actor, mb, replay=record.own.flatten(1))
    assert torch.equal(free, replayed)
    (replayed * mb.mask).sum().backward()
    gates = [m.weight.grad for m in routing.hf_routers(trainer.model)]
    assert all(g is not None and g.abs().sum() > 0 for g in gates)


@pytest.fixture(scope="module")
def near_tie(tmp_path_factory, moe_path):
    """The tiny MoE with a near-tie built in: in every layer expert 1's router row is expert 0's
    plus 1e-3 noise (wherever the two compete for a top-2 slot, rounding decides), and the
    experts' outputs 4x larger (a flip shows in the log-probs)."""
    from relax.model import load_tokenizer

    model = load_causal_lm(moe_path, "float32")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate[1] = gate[0] + 1e-3 * torch.randn(gate.shape[1], generator=generator)
            layer.mlp.experts.down_proj.mul_(4)
    path = tmp_path_factory.mktemp("near_tie") / "model"
    model.save_pretrained(path)
    load_tokenizer(moe_path).save_pretrained(path)
    return ["model=hf", f"model.path={path}"]


@pytest.fixture(scope="module")
def bf16_rollout(tmp_path_factory, near_tie):
    """One rollout of the near-tie model sampled by a bf16 engine, saved for replay."""
    root = tmp_path_factory.mktemp("bf16_rollout")
    run_loop(root / "run", *near_tie, *SHORT, "debug=rollout_only", "rollout.dtype=bfloat16",
             f"debug.save_rollout_data={root}/{{rollout_id}}.pt")
    return root / "0.pt"


@pytest.fixture
def replay(near_tie, bf16_rollout):
    def run(tmp_path, *overrides, data=bf16_rollout):
        rollouts, steps = run_loop(tmp_path, *near_tie, *SHORT, "debug=train_only",
                                   f"debug.load_rollout_data={data}", *overrides)
        return rollouts[0], steps
    return run


def test_replay_files_keep_the_engines_experts(bf16_rollout):
    _, samples = read_rollout(bf16_rollout)
    assert all(len(s.routed_experts) == (len(s.tokens) - 1) * 2 * 2 for s in samples)


def test_r3_removes_the_routing_mismatch_of_a_bf16_engine(tmp_path, replay):
    """The same replay trained with routing replay off and on. Off: the routers agree with the
    bf16 engine on most (token, layer) pairs, not all. On (R3): every replayed pair ran on the
    engine's experts, and the mismatch is what bf16 rounding leaves (measured: mismatch_kl
    5.5e-5 -> 6.7e-7, mean |Δ log p| 1.9e-3 -> 0.9e-3)."""
    off, off_steps = replay(tmp_path / "off")
    on, on_steps = replay(tmp_path / "on", "algo.routing_replay=rollout")
    assert 0.98 < off["train/routing_agreement"] < 1.0
    assert off["train/routing_agreement_min_layer"] <= off["train/routing_agreement"]
    assert "train/routing_replayed" not in off
    assert on["train/routing_replayed"] == 1.0
    # (the routers' own choice under R3: after earlier layers ran on the engine's experts)
    assert 0.98 < on["train/routing_replay_agreement"] < 1.0
    off_step, on_step = off_steps[0], on_steps[0]
    assert on_step["train/mismatch_kl"] < off_step["train/mismatch_kl"] / 20
    diff = "train/train_rollout_logprob_abs_diff"
    assert on_step[diff] < off_step[diff] / 1.5


def test_r2_replays_the_old_passs_routing_in_later_steps(tmp_path, replay):
    """num_steps_per_rollout=2 at a large learning rate (and an entropy bonus: the untrained
    model's rewards are mostly equal, so advantages alone hardly move it): step 2's routers would
    route some tokens elsewhere than the old-log-prob pass did, and run on its experts instead."""
    rollout, _ = replay(tmp_path, *R2)
    assert rollout["train/routing_replayed"] == 1.0
    assert rollout["train/routing_replay_agreement"] < 1.0


def test_routing_replay_is_refused_where_it_cannot_work(tmp_path, tiny_path, moe_path, near_tie,
                                                        bf16_rollout):
    from relax.startup import prepare

    moe = read_hf_config(moe_path)
    with pytest.raises(ConfigError, match="the model is dense"):
        trainer_checks(make_cfg("algo.routing_replay=rollout"), read_hf_config(tiny_path))
    with pytest.raises(ConfigError, match="num_steps_per_rollout=1 .* no such pass"):
        trainer_checks(make_cfg(*MOE, "algo.routing_replay=train"), moe)
    with pytest.raises(ConfigError, match="use_rollout_log_probs=True"):
        trainer_checks(make_cfg(*MOE, "algo.routing_replay=train", "train.num_steps_per_rollout=2",
                               "algo.use_rollout_log_probs=true"), moe)
    # rollout data without the engine's experts (saved before Relax recorded them): named at start-up
    data, samples = read_rollout(bf16_rollout)
    for s in samples:
        s.routed_experts = None
    save_rollout(tmp_path / "old" / "0.pt", 0, samples, data["manifest"])
    cfg = make_cfg(*near_tie, *SHORT, "debug=train_only", f"debug.load_rollout_data={tmp_path}/old/0.pt",
                   "algo.routing_replay=rollout", run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=r"samples \[0, 1, .* carry no routed_experts"):
        prepare(cfg, tmp_path / "run")


def test_r3_refuses_a_generate_fns_samples_without_experts_at_the_first_step(tmp_path, moe_path):
    """A generate_fn that builds its Sample without the engine's routed_experts (here the plain
    function of tests/test_multi_turn.py) cannot be known before it runs: R3 stops at the
    first step, naming the samples and the cause, before the trainer takes a step."""
    with pytest.raises(ConfigError, match=r"algo.routing_replay=rollout: samples \[0, 1, 2, 3, 4, 5, 6, 7\] "
                                          r"of rollout 0 carry no routed_experts .* a generate_fn"):
        run_loop(tmp_path, *MOE, *SHORT, "algo.routing_replay=rollout",
                 "rollout.generate_fn=tests.test_multi_turn.plain_single_turn")
    assert not any("train/loss" in line for line in (tmp_path / "metrics.jsonl").read_text().splitlines())


def test_format_1_replay_files_still_load(tmp_path, bf16_rollout):
    data = torch.load(bf16_rollout, weights_only=True)
    for s in data["samples"]:
        del s["routed_experts"]
    torch.save({**data, "format_version": 1}, tmp_path / "v1.pt")
    _, samples = read_rollout(tmp_path / "v1.pt")
    assert samples and all(s.routed_experts is None for s in samples)
    data["samples"][0]["routed_experts"] = [1, 2, 3]  # not a whole [tokens - 1, layers x top_k]
    torch.save(data, tmp_path / "bad.pt")
    from relax.errors import ReplayError

    with pytest.raises(ReplayError, match="routed_experts must be a list of"):
        read_rollout(tmp_path / "bad.pt")


R2 = ["algo.routing_replay=train", "train.num_steps_per_rollout=2", "train.lr=0.05", "algo.entropy_coef=0.1"]


def test_megatron_measures_and_replays_routing_as_the_torch_trainer_does(tmp_path, replay):
    """train=megatron (RouterReplay, fed from hooks on its TopKRouters) reports the torch
    trainer's numbers on the same replay: agreement, R3's replay and the mismatch it leaves;
    and R2's replay (its drift measured after a large step, where the trainers' rounding
    differs: 0.584 vs 0.590)."""
    def both(name, *overrides):
        return (replay(tmp_path / f"torch_{name}", *overrides),
                replay(tmp_path / f"megatron_{name}", "train=megatron", *overrides))

    runs = both("off"), both("r3", "algo.routing_replay=rollout")
    for (t_rollout, t_steps), (m_rollout, m_steps) in runs:
        assert {k for k in m_rollout if "routing" in k} == {k for k in t_rollout if "routing" in k}
        for key in (k for k in t_rollout if "routing" in k):
            assert abs(m_rollout[key] - t_rollout[key]) < 1e-3, key
        for key in ("train/mismatch_kl", "train/train_rollout_logprob_abs_diff"):
            assert m_steps[0][key] == pytest.approx(t_steps[0][key], rel=1e-3), key
    (t_rollout, _), (m_rollout, _) = both("r2", *R2)
    assert m_rollout["train/routing_replayed"] == t_rollout["train/routing_replayed"] == 1.0
    drift = "train/routing_replay_agreement"
    assert m_rollout[drift] == pytest.approx(t_rollout[drift], abs=0.03)
    assert m_rollout[drift] < 0.9


@pytest.mark.slow
def test_layout_sweeps_with_r3_are_equivalent_and_replay_every_token(tmp_path, near_tie, bf16_rollout):
    """R3 under every layout that splits tokens or layers (DP, TP, FSDP; Megatron's EP, TP with
    sequence parallelism, PP, CP): each job ran every replayed pair on the engine's experts and
    measured the same agreement, and `relax compare` finds every layout equivalent."""
    import json

    from .conftest import only_run_dir

    common = [*near_tie, *SHORT, "debug=train_only", f"debug.load_rollout_data={bf16_rollout}",
              "algo.routing_replay=rollout"]
    sweeps = {"torch": ["parallel=single,dp2,tp2,fsdp2"],
              "megatron": ["train=megatron", "parallel=single,ep2,tp2sp,pp2,cp2"]}
    agreements = set()
    for name, sweep in sweeps.items():
        cwd = tmp_path / name
        cwd.mkdir()
        proc = relax_cli("-m", *common, *sweep, cwd=cwd, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-3000:]
        multirun = only_run_dir(cwd, "multiruns")
        out = relax_cli("compare", str(multirun), "--json", cwd=cwd)
        report = json.loads(out.stdout)
        assert out.returncode == 0, report
        assert all(j["verdict"] == "equivalent" for j in report["jobs"][1:]), report["jobs"]
        for metrics in multirun.glob("*/metrics.jsonl"):
            rollout = next(r for r in map(json.loads, metrics.read_text().splitlines())
                           if "train/routing_replayed" in r)
            assert rollout["train/routing_replayed"] == 1.0, metrics
            agreements.add(round(rollout["train/routing_agreement"], 5))
    assert len(agreements) == 1, agreements


def test_doctor_names_r3_where_routing_disagrees_and_the_mismatch_is_high(tmp_path, replay, tiny_path):
    import json

    from relax.debug.checks import check_routing
    from relax.debug.run_data import load_run
    from relax.debug.verdicts import Thresholds

    def verdict(run_dir):
        return check_routing(load_run(run_dir), Thresholds())

    replay(tmp_path / "off")
    replay(tmp_path / "on", "algo.routing_replay=rollout")
    off, on = verdict(tmp_path / "off"), verdict(tmp_path / "on")
    assert off.verdict == "PASS" and "agreement 0.99" in off.summary, off
    assert on.verdict == "PASS" and "every replayed pair ran on the recorded experts" in on.summary, on
    dense = tmp_path / "dense"
    run_loop(dense, "rollout.num_rollout=1", "rollout.rollout_batch_size=4", "checkpoint.save_interval=null")
    assert verdict(dense).verdict == "SKIP"

    def edited(name, source, **values):
        """A copy of a run whose records say otherwise (`values`: metric -> value)."""
        run = tmp_path / name
        run.mkdir()
        lines = [json.loads(line) for line in (tmp_path / source / "metrics.jsonl").read_text().splitlines()]
        for record in lines:
            record.update({k: v for k, v in values.items() if k in record})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        return verdict(run)

    low = {"train/routing_agreement": 0.85, "train/routing_agreement_min_layer": 0.8}
    high = edited("high", "off", **low, **{"train/train_rollout_logprob_abs_diff": 0.05})
    assert high.verdict == "WARN" and "0.800 < 0.9" in high.summary and "mismatch of 0.05" in high.summary
    assert "algo.routing_replay=rollout" in high.next_steps[0]
    small = edited("small", "off", **low)
    assert small.verdict == "WARN" and "routing replay would change little" in small.next_steps[0]
    lost = edited("lost", "on", **{"train/routing_replayed": 0.75})
    assert lost.verdict == "FAIL" and "75.00%" in lost.summary


def test_check_9_by_hand():
    """Six rollouts make a trend (first third against last); the mismatch is the first step's of
    each rollout (later steps moved the weights); the worst layer is the recorded one; replay
    that ran 99.5% of its pairs on the recorded experts lost some."""
    from pathlib import Path

    from relax.debug.routing import check_routing
    from relax.debug.run_data import RunData
    from relax.debug.verdicts import Thresholds

    def check(agreement, diffs=(0.005, 0.5), **extra):
        """`extra`: metric -> one value for every rollout, or a list of one per rollout."""
        rollouts = [{"rollout_id": i, "train/routing_agreement": a,
                     **{k: v[i] if isinstance(v, list) else v for k, v in extra.items()}}
                    for i, a in enumerate(agreement)]
        steps = [{"rollout_id": 0, "step": n, "train/train_rollout_logprob_abs_diff": d}
                 for n, d in enumerate(diffs)]
        return check_routing(RunData(Path("."), rollouts, steps), Thresholds())

    falling = check([0.99, 0.99, 0.97, 0.95, 0.93, 0.93])
    assert falling.verdict == "WARN" and falling.summary == "agreement falls: 0.9900 -> 0.9300"
    assert falling.evidence["max_train_rollout_abs_diff"] == 0.005
    assert "routing replay would change little" in falling.next_steps[0]
    assert check([0.99, 0.99, 0.97, 0.95, 0.93]).verdict == "PASS"  # five: no trend yet
    worst = check([0.97] * 2, diffs=(0.05,), **{"train/routing_agreement_min_layer": 0.85})
    assert worst.verdict == "WARN" and worst.summary.startswith("the worst layer agrees on 0.850 < 0.9")
    assert "mismatch of 0.05" in worst.summary and "algo.routing_replay=rollout" in worst.next_steps[0]
    lost = check([0.97], **{"train/routing_replayed": 0.995})
    assert lost.verdict == "FAIL" and lost.summary.startswith("routing replay ran 99.50% of the replayed")
    # NaN never passes, wherever it stands (min() and max() keep a NaN only when it comes first)
    nan = float("nan")
    for pair in ([1.0, nan], [nan, 1.0]):
        replayed = check([0.97, 0.97], **{"train/routing_replayed": pair})
        assert replayed.verdict == "FAIL" and replayed.summary.startswith("routing replay ran nan%"), replayed
        agreement = check([0.97 if a == 1.0 else a for a in pair])
        assert agreement.verdict == "WARN" and agreement.summary.startswith("the worst layer agrees on nan")
        layer = check([0.97, 0.97], **{"train/routing_agreement_min_layer": pair})
        assert layer.verdict == "WARN" and layer.summary.startswith("the worst layer agrees on nan")
    rollouts = [{"rollout_id": i, "train/routing_agreement": 0.97, "train/routing_agreement_min_layer": 0.85}
                for i in (0, 1)]
    steps = [{"rollout_id": i, "step": 0, "train/train_rollout_logprob_abs_diff": d}
             for i, d in ((0, 0.005), (1, nan))]
    mismatch = check_routing(RunData(Path("."), rollouts, steps), Thresholds())  # each rollout's first step
    assert "algo.routing_replay=rollout" in mismatch.next_steps[0], mismatch.next_steps


def test_inspect_shows_routing_agreement_per_layer(tmp_path, replay, bf16_rollout):
    import shutil

    from relax.tools.inspect import inspect

    (tmp_path / "dump" / "rollout_data").mkdir(parents=True)
    shutil.copy(bf16_rollout, tmp_path / "dump" / "rollout_data" / "0.pt")
    train_data = f"{tmp_path}/dump/train_data/{{rollout_id}}_{{rank}}.pt"
    rollout, _ = replay(tmp_path / "run", f"debug.save_train_data={train_data}")
    report = inspect(tmp_path / "dump", 0, 0, worst=0)
    per_layer = report["routing_agreement_per_layer"]
    assert len(per_layer) == 2 and all(0.98 < a <= 1.0 for a in per_layer)
    assert min(per_layer) == pytest.approx(rollout["train/routing_agreement_min_layer"])
    assert "routed_experts" not in report["sample"]
    proc = relax_cli("inspect", str(tmp_path / "dump"), cwd=tmp_path)
    assert proc.returncode == 0 and "MoE layer" in proc.stdout, proc.stdout
    assert f"{per_layer[1]:.4f}" in proc.stdout


class FakeRouter(torch.nn.Module):
    """A TopKRouter as train=megatron's hooks see it: gating logits are the hidden states
    themselves ([s, b, experts]); the forward routes rows s * b + b_i to their own top-2."""
    config = SimpleNamespace(num_moe_experts=4)
    router_replay = None

    def gating(self, hidden):
        return hidden

    def forward(self, hidden):
        logits = hidden.reshape(-1, 4)
        return logits, torch.zeros_like(logits, dtype=torch.bool).scatter_(1, logits.topk(2).indices, True)


class FakeLayer(torch.nn.Module):
    def __init__(self, layer_number):
        super().__init__()
        self.layer_number, self.mlp = layer_number, torch.nn.Module()
        self.mlp.router = FakeRouter()


def _megatron_routing_on_tp_rank(rank: int, init_file: str) -> None:
    """Tensor-parallel rank `rank` of 2 with sequence parallelism: its routers see positions
    2·rank and 2·rank+1 of a 4-position micro-batch of 2 rows."""
    from relax.train.megatron.routing import Routing

    from .test_megatron_convert import layout

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        layers = [FakeLayer(1), FakeLayer(2)]
        tp_sp = layout(tp_size=2, tp_rank=rank, sequence_parallel=True)
        tracker = Routing([[torch.nn.ModuleList(layers)]], tp_sp, num_layers=2, top_k=2, mode=None)
        # logits [T=4, b=2, experts=4]: row b_i at position t picks experts t + 2b_i and t + 2b_i + 1 (mod 4)
        t, b = torch.arange(4)[:, None], torch.arange(2)[None, :]
        logits = sum(torch.nn.functional.one_hot((t + 2 * b + k) % 4, 4).float() * (2 - k) for k in (0, 1))
        engine = torch.stack([(t + 2 * b) % 4, (t + 2 * b + 1) % 4], -1).transpose(0, 1)  # [b, T, 2] alike
        engine = torch.cat([engine, engine], -1).clone()  # [b, T, layers x top_k]
        engine[1, 2, :2] = torch.tensor([0, 2])  # layer 0, row 1, position 2: not {0, 1}
        engine[0, 3, 2:] = -1  # layer 1: row 0, position 3 unknown
        mine = logits[2 * rank:2 * rank + 2]
        mbs = [SimpleNamespace(routed_experts=engine) for _ in range(2)]
        positions = torch.arange(4).expand(2, 4)

        def forward(mb, kind, hidden):
            with tracker.forward(mb, positions, kind):
                for layer in layers:
                    layer.mlp.router(hidden)

        for rollout in range(2):
            for mb in mbs:
                forward(mb, "ref", -mine)  # the reference's routing is not the actor's: not measured
                forward(mb, "old", mine)   # the first forward at the rollout's weights: measured
                forward(mb, "train", -mine)  # later forwards: not measured
            agreement, _ = tracker.rollout_sums()
            # per layer, summed over both micro-batches and both ranks: (agreeing, compared) pairs
            assert agreement.tolist() == [[14.0, 14.0], [16.0, 14.0]], (rank, rollout, agreement)
    finally:
        dist.destroy_process_group()


def test_megatron_routing_measures_the_first_actor_forward_of_each_rollout_on_each_ranks_tokens(tmp_path):
    """train=megatron's Routing by hand, on two sequence-parallel TP ranks: each rank compares
    the engine's experts at its own positions (rows in Megatron's sequence-major order), only in
    the first non-reference forward of a micro-batch in a rollout, and the sums add up over
    micro-batches and ranks, anew each rollout."""
    mp.start_processes(_megatron_routing_on_tp_rank, args=(str(tmp_path / "init"),), nprocs=2,
                       start_method="fork")
