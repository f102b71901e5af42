"""Layer dumps (debug.dump_layers) and `relax compare --layers`: each injected fault is named at
the module or parameter where it sits; a clean run departs nowhere."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from relax.debug import layers
from relax.model.modules import recording
from relax.train import layer_dump
from relax.files import safe_load
from relax.logger import read_metrics

from .conftest import make_cfg, relax_cli, run_loop

SMALL = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "checkpoint.save_interval=null"]
DUMP = "debug.dump_layers=${hydra:runtime.output_dir}/layers"  # (for the CLI: each job its own)


def dumped(run_dir, *overrides):
    """An in-process run with its layer dump in <run_dir>/layers."""
    run_loop(run_dir, *overrides, *SMALL, f"debug.dump_layers={run_dir}/layers")
    return run_dir


@pytest.fixture(scope="module")
def replay(tmp_path_factory, tiny_path):
    root = tmp_path_factory.mktemp("layers_replay")
    run_loop(
        root / "run",
        "debug=rollout_only",
        "rollout.num_rollout=1",
        *SMALL,
        f"debug.save_rollout_data={root}/rollout_data/{{rollout_id}}.pt",
    )
    return ["debug=train_only", f"debug.load_rollout_data={root}/rollout_data/{{rollout_id}}.pt"]


def compare_layers(*paths, args=()):
    proc = relax_cli("compare", "--layers", *map(str, paths), "--json", *args, cwd=paths[0].parent)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    return proc.returncode, {j["job"]: j for j in report["jobs"]}


def first(job: dict, part: str) -> str | None:
    return job["first"][part][0] if job["first"][part] else None


def test_a_dump_holds_every_module_gradient_and_weight_under_hf_names(tmp_path, tiny_path):
    dumped(tmp_path / "run", "rollout.num_rollout=2", "debug.dump_layers_samples=[1,5]")
    files = sorted(p.name for p in (tmp_path / "run" / "layers").iterdir())
    assert files == ["0_engine.pt", "0_ref.pt", "0_train.pt"]  # the run's first rollout only
    train, engine = (safe_load(tmp_path / "run" / "layers" / f) for f in ("0_train.pt", "0_engine.pt"))
    names = layer_dump.module_names(2)
    assert list(train["forward"]) == names and list(engine["forward"]) == names
    assert train["manifest"]["samples"] == [1, 5] and train["manifest"]["layout"] == "single"
    lengths = [t.shape[0] for t in train["forward"]["model.layers.1"]]
    assert lengths == [t.shape[0] for t in engine["forward"]["model.layers.1"]] and len(lengths) == 2
    assert train["forward"]["model.norm"][0].shape[1] == 64  # hidden size of the tiny model
    assert (
        set(train["grads"]) == set(train["params"])
        and "model.layers.0.self_attn.q_proj.weight" in train["grads"]
    )
    assert all(g.abs().sum() > 0 for g in train["grads"].values())
    # the engine's prefill (one sequence at a time) reproduces the trainer's padded batch to rounding
    for name in names:
        assert layers.rel_diff(engine["forward"][name], train["forward"][name]) < 1e-6, name


def test_the_dumped_gradients_are_the_first_steps(tmp_path, tiny_path):
    """All 16 samples in the dump are the step's one micro-batch: its gradients have the norm the
    step logged as grad_norm (the loss per trained token, not per sample; the step packs shared
    prompts, the dump does not: fp32 rounding apart)."""
    run = dumped(tmp_path / "run", "rollout.num_rollout=1", f"debug.dump_layers_samples={list(range(16))}")
    train = safe_load(run / "layers" / "0_train.pt")
    norm = torch.stack([g.double().norm() for g in train["grads"].values()]).norm().item()
    step = read_metrics(run)[1][0]
    assert norm == pytest.approx(step["train/grad_norm"], rel=1e-4)


def test_an_moe_dump_names_each_expert_as_the_checkpoint_does(tmp_path):
    """transformers 5 fuses an MoE layer's experts into 3-D parameters; the dump splits them back
    into the checkpoint's per-expert names (what train=megatron's dump and the engines use)."""
    moe = ["model.tiny.num_experts=4", "model.tiny.warmup_max_steps=0"]
    train = safe_load(dumped(tmp_path / "run", "rollout.num_rollout=1", *moe) / "layers" / "0_train.pt")
    experts = {n for n in train["grads"] if ".mlp.experts." in n}
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in experts and len(experts) == 2 * 4 * 3
    assert set(train["grads"]) == set(train["params"])


def test_a_clean_run_departs_nowhere_engine_against_trainer(tmp_path, tiny_path):
    code, jobs = compare_layers(dumped(tmp_path / "run", "rollout.num_rollout=1"))
    assert code == 0 and not jobs["engine"]["departs"] and not jobs["ref"]["departs"], jobs
    assert max(jobs["ref"]["diffs"]["forward"].values()) == 0.0  # actor and reference: one forward twice
    assert jobs["engine"]["diffs"]["forward"]["model.norm"] == 0.0
    assert 0 < jobs["engine"]["diffs"]["forward"]["log_probs"] < 1e-5  # decode vs prefill rounding
    assert (tmp_path / "run" / "compare_layers.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "fault, where",
    [
        ("engine_rope_theta", "model.layers.0.self_attn"),
        ("qkv_half_transposed:1", "model.layers.1.self_attn"),
    ],
)
def test_an_engine_fault_is_named_at_its_module(tmp_path, tiny_path, monkeypatch, fault, where):
    monkeypatch.setenv("RELAX_FAULT", fault)
    code, jobs = compare_layers(dumped(tmp_path / "run", "rollout.num_rollout=1"))
    assert code == 1 and first(jobs["engine"], "forward") == where, jobs["engine"]["first"]


def test_a_bf16_engine_departs_at_the_embedding(tmp_path, tiny_path):
    code, jobs = compare_layers(dumped(tmp_path / "run", "rollout.num_rollout=1", "rollout.dtype=bfloat16"))
    assert code == 1 and first(jobs["engine"], "forward") == "model.embed_tokens"
    assert 1e-4 < jobs["engine"]["first"]["forward"][1] < 1e-2  # bf16 rounding, not a bug's size


def test_layout_faults_are_named_against_the_twins_floor(tmp_path, replay):
    faults = "tp_no_allreduce:1,grad_scale:dp2,perturb_shard:fsdp2"
    proc = relax_cli(
        "-m",
        *replay,
        "parallel=single,twin,twin2,dp2,tp2,fsdp2",
        *SMALL,
        DUMP,
        cwd=tmp_path,
        env={"RELAX_FAULT": faults},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    multirun = next((tmp_path / "outputs" / "multiruns").iterdir())
    code, jobs = compare_layers(multirun)
    assert code == 1
    # each twin is judged against the other's noise (not its own), and lies within it
    fixed = 256 * torch.finfo(torch.float32).eps
    twin, twin2 = (jobs[f"parallel={t}"]["diffs"]["grads"] for t in ("twin", "twin2"))
    for one, other in (("twin", twin2), ("twin2", twin)):
        floors = jobs[f"parallel={one}"]["floors"]["grads"]
        assert floors == pytest.approx({n: max(fixed, 10 * other[n]) for n in twin}), one
    nowhere = dict.fromkeys(("forward", "grads", "params"))
    assert jobs["parallel=twin"]["first"] == jobs["parallel=twin2"]["first"] == nowhere
    dp2, tp2, fsdp2 = jobs["parallel=dp2"], jobs["parallel=tp2"], jobs["parallel=fsdp2"]
    # one DP rank's gradient scaled: the forward and the weights agree, every gradient is off
    assert first(dp2, "forward") is None and first(dp2, "params") is None
    assert first(dp2, "grads") == "lm_head.weight" and 4e-3 < dp2["first"]["grads"][1] < 6e-3
    scaled = dp2["spreads"]["grads"]  # a scale: the difference lies where the gradient does
    assert 0.9 * scaled["own"] <= scaled["elements"] <= 1.1 * scaled["own"]
    assert set(dp2["spreads"]) == {"grads"}  # (one per departing part)
    # layer 1's attention output never all-reduced over TP
    assert first(tp2, "forward") == "model.layers.1.self_attn" and first(tp2, "params") is None
    assert tp2["diffs"]["forward"]["model.layers.0"] < 1e-5
    # one shard of one weight perturbed
    assert first(fsdp2, "params") == "model.layers.0.self_attn.q_proj.weight"
    shard = fsdp2["spreads"]["params"]  # rank 1's half of the rows, each element + 1e-3
    half, side = shard["total"] // 2, math.isqrt(shard["total"])  # (the tiny q_proj: hidden x hidden)
    assert 0.85 * half <= shard["elements"] <= half and shard["at"][0] >= side // 2
    assert shard["values"][0] - shard["values"][1] == pytest.approx(1e-3, rel=1e-3)
    assert first(fsdp2, "forward") == "model.layers.0.self_attn"
    twin_floor = jobs["parallel=tp2"]["floors"]["grads"]
    assert max(twin_floor.values()) > fixed  # the twins raised some floors
    # two twins, two samples of the noise: a tensor's floor is 10 x the larger of their differences
    assert twin_floor == pytest.approx({n: max(fixed, 10 * twin[n], 10 * twin2[n]) for n in twin_floor})
    assert any(twin[n] < twin2[n] for n in twin_floor) and any(twin[n] > twin2[n] for n in twin_floor)
    # a twin that lacks a tensor departs there and measures no noise there: dp2's gradient at lm_head
    # is judged against the other twin's floor (an infinite floor would hide it)
    path = multirun / "parallel=twin2" / "layers" / "0_train.pt"
    dump = safe_load(path)
    del dump["grads"]["lm_head.weight"]
    torch.save(dump, path)
    code, jobs = compare_layers(multirun)
    assert code == 1 and jobs["parallel=twin2"]["first"]["grads"][:2] == ["lm_head.weight", math.inf]
    floor = max(fixed, 10 * twin["lm_head.weight"])
    assert jobs["parallel=dp2"]["first"]["grads"] == ["lm_head.weight", dp2["first"]["grads"][1], floor]


def test_dropout_in_one_layer_is_named_run_against_run(tmp_path, replay, monkeypatch):
    dumped(tmp_path / "a", *replay)
    monkeypatch.setenv("RELAX_FAULT", "trainer_dropout:1")
    code, jobs = compare_layers(tmp_path / "a", dumped(tmp_path / "b", *replay))
    assert code == 1 and first(jobs["b"], "forward") == "model.layers.1.self_attn"
    assert jobs["b"]["diffs"]["forward"]["model.layers.0"] == 0.0


def test_a_noisy_actor_forward_is_named_against_the_reference(tmp_path, tiny_path, monkeypatch):
    """First-step KL != 0 means the actor's and the reference's forwards differ: where they part."""
    monkeypatch.setenv("RELAX_FAULT", "trainer_dropout:1")
    code, jobs = compare_layers(dumped(tmp_path / "run", "rollout.num_rollout=1"))
    assert code == 1 and first(jobs["ref"], "forward") == "model.layers.1.self_attn"
    assert jobs["ref"]["diffs"]["forward"]["model.layers.0"] == 0.0


def test_bad_layer_comparisons_exit_2_with_the_reason(tmp_path, tiny_path, replay):
    run_loop(tmp_path / "plain", *replay, *SMALL)
    proc = relax_cli("compare", "--layers", str(tmp_path / "plain"), cwd=tmp_path)
    assert proc.returncode == 2 and "no layer dump (run it with debug=dump" in proc.stderr
    assert "Traceback" not in proc.stderr
    dumped(tmp_path / "a", *replay)
    dumped(tmp_path / "b", *replay, "debug.dump_layers_samples=[0,1]")
    proc = relax_cli("compare", "--layers", str(tmp_path / "a"), str(tmp_path / "b"), cwd=tmp_path)
    assert proc.returncode == 2 and "cannot be compared: samples: [0, 1] in" in proc.stderr, proc.stderr
    whole = (tmp_path / "a" / "layers" / "0_train.pt").read_bytes()
    for broken in (b"not a dump", whole[:len(whole) // 2]):  # (a dump is read memory-mapped)
        (tmp_path / "a" / "layers" / "0_train.pt").write_bytes(broken)
        proc = relax_cli("compare", "--layers", str(tmp_path / "a"), str(tmp_path / "b"), cwd=tmp_path)
        assert proc.returncode == 2 and "0_train.pt: corrupt or truncated file" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "override, message",
    [
        ("debug.dump_layers_samples=[0,99]", "sample index(es) [99] beyond the 16 samples per rollout"),
        ("debug.dump_layers_samples=[]", "expected distinct sample indices >= 0"),
        ("debug.dump_layers_rollouts=[7]", "rollout id(s) [7] are not among this run's rollouts"),
    ],
)
def test_bad_dump_settings_are_refused_before_anything_runs(tmp_path, tiny_path, override, message):
    proc = relax_cli(
        "rollout.num_rollout=1",
        *SMALL,
        f"debug.dump_layers={tmp_path}/layers",
        override,
        f"hydra.run.dir={tmp_path}/run",
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and message in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "layers").exists()


def test_a_replays_dump_samples_are_checked_against_the_dumped_rollouts_file_only(tmp_path, replay):
    """Rollout 1's replay file holds 8 samples, rollout 0's 16: sample 15 is refused only where
    rollout 1 is the one dumped, and the error names its file."""
    from relax.errors import ConfigError
    from relax.startup import prepare
    from relax.replay import keep_groups, read_rollout, save_rollout

    first = Path(replay[1].split("=", 1)[1].format(rollout_id=0))
    data, samples = read_rollout(first)
    shutil.copy(first, tmp_path / "0.pt")
    save_rollout(tmp_path / "1.pt", 1, keep_groups(samples, {0, 1}), data["manifest"])
    args = ("debug=train_only", f"debug.load_rollout_data={tmp_path}/{{rollout_id}}.pt",
            "rollout.num_rollout=2", *SMALL, f"debug.dump_layers={tmp_path}/layers",
            "debug.dump_layers_samples=[0,15]")
    assert prepare(make_cfg(*args, run_dir=tmp_path / "a"), tmp_path / "a").plan.dump_layers_rollouts == [0]
    with pytest.raises(ConfigError, match=r"\[15\] beyond the 8 samples per rollout of the replay file "
                                          + re.escape(str(tmp_path / "1.pt"))):
        prepare(make_cfg(*args, "debug.dump_layers_rollouts=[1]", run_dir=tmp_path / "b"), tmp_path / "b")


def test_rollout_only_has_no_trainer_to_dump(tmp_path, tiny_path):
    proc = relax_cli(
        "debug=rollout_only",
        "rollout.num_rollout=1",
        f"debug.dump_layers={tmp_path}/l",
        f"hydra.run.dir={tmp_path}/run",
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "debug.rollout_only builds no trainer" in proc.stdout + proc.stderr


def test_rel_diff_is_relative_to_the_baseline_over_all_samples():
    """||a - b|| / ||b|| with b the baseline; per-sample lists are one vector (the root of the summed
    squares); another shape is inf, and so is any difference from an all-zero baseline."""
    assert layers.rel_diff(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])) == 1.0
    assert layers.rel_diff(torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.0])) == 0.5
    base = [torch.tensor([3.0]), torch.tensor([0.0, 4.0])]  # norm 5
    moved = [torch.tensor([3.3]), torch.tensor([0.0, 4.4])]  # differences 0.3 and 0.4: norm 0.5
    assert layers.rel_diff(moved, base) == pytest.approx(0.1, rel=1e-6)
    assert layers.rel_diff(torch.zeros(2), torch.zeros(1, 2)) == math.inf
    assert layers.rel_diff(base[:1], base) == math.inf
    assert layers.rel_diff(torch.ones(2), torch.zeros(2)) == math.inf
    assert layers.rel_diff(torch.zeros(2), torch.zeros(2)) == 0.0


def test_holding_counts_the_largest_elements_exactly_without_sorting_them_all():
    """holding's bins give the count a full sort gives: gaussian, heavy-tailed (values over many
    powers of two), one element, all equal, ties, at three shares."""
    def by_sorting(x, share):
        ordered = x.sort(descending=True).values.cumsum(0)
        if ordered[-1] == 0:
            return 0
        return min(int(torch.searchsorted(ordered, share * ordered[-1])) + 1, len(x))

    g = torch.Generator().manual_seed(0)
    for trial in range(100):
        n = int(torch.randint(1, 3000, (1,), generator=g))
        normal = torch.randn(n, generator=g, dtype=torch.float64)
        x = [normal ** 2, (normal * torch.exp(5 * torch.randn(n, generator=g, dtype=torch.float64))) ** 2,
             torch.zeros(n, dtype=torch.float64).index_fill_(0, torch.tensor([n // 2]), 3.0),
             torch.ones(n, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g).double()][trial % 5]
        for share in (0.5, 0.9, 0.99):
            assert layers.holding(x, share) == by_sorting(x, share), (trial, share)
    assert layers.holding(torch.zeros(5, dtype=torch.float64), 0.9) == 0


def test_the_recording_side_by_hand(tmp_path):
    """layer_dump by hand: the module names in forward order; `recording` takes a module's output
    (of a tuple, the first element) as whole fp32 while the block runs, and its hooks are gone
    after it; `per_sample` cuts each right-padded row to its length, into tensors of their own
    (not views holding the batch's storage); `save_dump` writes <dir>/<rollout>_<source>.pt with
    the manifest completed, the gradients and the weights each where they belong."""
    assert layer_dump.module_names(1) == ["model.embed_tokens", "model.layers.0.self_attn",
                                          "model.layers.0.mlp", "model.layers.0", "model.norm"]

    class WithBias(torch.nn.Module):
        def forward(self, x):
            return 2 * x, torch.ones(1)  # the output, then a bias

    linear = torch.nn.Linear(3, 2).bfloat16()
    x = torch.randn(4, 3)
    modules = {"attn": WithBias(), "mlp": linear}
    with recording(modules, layer_dump.whole_fp32) as got:
        modules["attn"](x)
        out = modules["mlp"](x.bfloat16())
        assert torch.equal(got["attn"], 2 * x) and got["mlp"].dtype == torch.float32
        assert torch.equal(got["mlp"], out.float())
    modules["attn"](x + 1)
    assert torch.equal(got["attn"], 2 * x)  # recorded no more
    assert not modules["attn"]._forward_hooks and not linear._forward_hooks

    batch = {"m": torch.arange(30.0).reshape(2, 5, 3)}
    rows = layer_dump.per_sample(batch, [3, 5])["m"]
    assert [torch.equal(r, batch["m"][b, :n]) for r, (b, n) in zip(rows, [(0, 3), (1, 5)])] == [True, True]
    assert [r.untyped_storage().nbytes() for r in rows] == [3 * 3 * 4, 5 * 3 * 4]

    forward, log_probs = {"model.norm": rows}, [torch.tensor([-1.0, -2.0])]
    params, grads = {"w": torch.ones(2)}, {"w": torch.full((2,), 0.5)}
    path = layer_dump.save_dump(tmp_path / "layers", 4, "train", {"layout": "dp2"}, [1, 5], forward,
                                log_probs, grads, params)
    assert path == tmp_path / "layers" / "4_train.pt"
    assert [p.name for p in path.parent.iterdir()] == ["4_train.pt"]
    saved = safe_load(path)
    assert saved["format_version"] == layer_dump.FORMAT_VERSION
    assert saved["manifest"] == {"layout": "dp2", "source": "train", "rollout_id": 4, "samples": [1, 5]}
    assert torch.equal(saved["params"]["w"], params["w"]) and torch.equal(saved["grads"]["w"], grads["w"])
    assert torch.equal(saved["forward"]["model.norm"][1], rows[1])
    assert torch.equal(saved["log_probs"][0], log_probs[0])
    engine = safe_load(layer_dump.save_dump(tmp_path / "layers", 4, "engine", {}, [1], forward, log_probs))
    assert engine["grads"] == {} and engine["params"] == {}


def test_rollout_id_picks_the_dumped_rollout_to_compare(tmp_path, tiny_path):
    """`--rollout-id N` (what compare's own hint recommends) reads rollout N's dumps: at rollout
    0 the reference is the actor, one forward twice; at rollout 1 the actor has taken a step the
    reference has not, and its engine has been synced to it. A rollout without a dump is named."""
    run = dumped(tmp_path / "run", "rollout.num_rollout=2", "debug.dump_layers_rollouts=[0,1]")
    code, at_0 = compare_layers(run)  # (default: the first dumped rollout)
    assert code == 0 and max(at_0["ref"]["diffs"]["forward"].values()) == 0.0, at_0["ref"]
    code, at_1 = compare_layers(run, args=("--rollout-id", "1"))
    assert code == 1 and first(at_1["ref"], "forward") == "model.embed_tokens", at_1["ref"]["first"]
    assert not at_1["engine"]["departs"] and at_1["engine"]["diffs"]["forward"]["model.norm"] == 0.0
    proc = relax_cli("compare", "--layers", str(run), "--rollout-id", "7", cwd=tmp_path)
    assert proc.returncode == 2 and "no train layer dump of rollout 7 in" in proc.stderr, proc.stderr
