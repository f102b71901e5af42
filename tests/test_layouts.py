"""Parallel layouts on CPU (gloo), layout sweeps over one replay, and `relax compare`."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from relax.files import safe_load

from .conftest import build_trainer, make_cfg, only_run_dir, relax_cli, run_loop

# 2 steps per rollout and micro-batches of 8: gradient accumulation and the per-step
# mini-batch split over DP ranks are both exercised.
def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


TRAIN = ["train.num_steps_per_rollout=2", "train.micro_batch_size=8", "checkpoint.save_interval=null"]


@pytest.fixture(scope="module")
def replay_dir(tmp_path_factory, tiny_path):
    root = tmp_path_factory.mktemp("replay")
    run_loop(root / "run", "debug=rollout_only", "rollout.num_rollout=2",
             "rollout.rollout_batch_size=8", f"debug.save_rollout_data={root}/rollout_data/{{rollout_id}}.pt")
    return root


def replay(replay_dir) -> list[str]:
    return ["debug=train_only", f"debug.load_rollout_data={replay_dir}/rollout_data/{{rollout_id}}.pt"]


def sweep(cwd, replay_dir, layouts, *extra, env=None):
    proc = relax_cli("-m", *replay(replay_dir), f"parallel={layouts}", *TRAIN, *extra, cwd=cwd, env=env)
    runs = sorted((cwd / "outputs" / "multiruns").iterdir())
    assert len(runs) == 1
    return proc, runs[0]


def compare(*paths, args=()):
    proc = relax_cli("compare", *map(str, paths), "--json", *args, cwd=paths[0].parent)
    return proc.returncode, json.loads(proc.stdout)


def test_layout_sweep_is_equivalent_to_single(tmp_path, replay_dir):
    proc, multirun = sweep(tmp_path, replay_dir, "single,dp2,tp2,fsdp2,dp2tp2",
                           "debug.dump_layers=${hydra:runtime.output_dir}/layers")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in multirun.iterdir() if p.is_dir()) == [
        "parallel=dp2", "parallel=dp2tp2", "parallel=fsdp2", "parallel=single", "parallel=tp2"]
    code, report = compare(multirun)
    assert code == 0, report
    jobs = {j["name"]: j for j in report["jobs"]}
    assert report["baseline"] == "parallel=single"
    base = jobs.pop("parallel=single")
    assert len(base["grad_norm"]) == 4 and all(g > 0.1 for g in base["grad_norm"])
    for name, job in jobs.items():  # each layout against the baseline
        assert job["verdict"] == "equivalent", (name, job["reasons"])
        assert job["status"] == "completed"
        assert job["max_logprob_diff"] <= 1e-5, name
        assert job["max_grad_norm_rel_diff"] <= 1e-4, name
        assert len(job["loss"]) == 4
    assert {j["layout"] for j in jobs.values()} == {"dp2", "tp2", "fsdp2", "dp2tp2"}
    assert (multirun / "compare.png").stat().st_size > 1000
    # layer by layer too: no module, gradient or weight of any layout leaves the fixed floor
    code, report = compare(multirun, args=("--layers",))
    assert code == 0, report
    assert sorted(j["job"] for j in report["jobs"] if not j["departs"]) == sorted(jobs)
    assert max(v for j in report["jobs"] for v in j["diffs"]["grads"].values()) > 0  # tp2: rounding, not 0


@pytest.mark.slow
def test_a_perturbed_weight_shard_is_reported_diverged(tmp_path, replay_dir):
    proc, multirun = sweep(tmp_path, replay_dir, "single,tp2", env={"RELAX_FAULT": "perturb_shard:tp2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, report = compare(multirun)
    assert code == 1
    tp2 = next(j for j in report["jobs"] if j["layout"] == "tp2")
    assert tp2["verdict"] == "DIVERGED"
    assert tp2["max_logprob_diff"] > 1e-5
    assert any("log_prob" in r for r in tp2["reasons"])


@pytest.mark.slow
def test_a_failing_job_does_not_stop_the_sweep(tmp_path, replay_dir):
    proc, multirun = sweep(tmp_path, replay_dir, "single,pp2,dp2")
    assert proc.returncode != 0  # the sweep reports the failure ...
    code, report = compare(multirun)
    jobs = {j["layout"]: j for j in report["jobs"]}
    assert jobs["pp2"]["verdict"] == "FAILED" and "use train=megatron" in jobs["pp2"]["reasons"][0]
    assert jobs["dp2"]["verdict"] == "equivalent"  # ... after running the jobs behind it
    assert code == 1


def test_a_tp_that_splits_a_head_is_refused_before_any_rank_starts(tmp_path):
    proc = relax_cli("parallel=tp2", "model.tiny.num_kv_heads=1", cwd=tmp_path)
    assert proc.returncode == 2
    message = "parallel=tp2: parallel.tp=2 must divide the model's num_key_value_heads=1 (config.json)"
    assert message in proc.stdout + proc.stderr
    run = only_run_dir(tmp_path)
    assert not list(run.glob("rank*.log")) and not (run / "built.json").exists()  # nothing was built


HF = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2,
      "intermediate_size": 8}


@pytest.mark.parametrize("overrides,hf,message", [
    (["parallel=pp2"], HF, "pp=2 is not supported by train=torch"),
    (["parallel=cp2"], HF, "cp=2 is not supported by train=torch"),
    (["parallel=ep2"], HF, "ep=2 is not supported by train=torch"),
    (["parallel=single", "parallel.vpp=2"], HF, "vpp=2 is not supported by train=torch"),
    (["parallel=tp2sp"], HF, "sequence_parallel needs train=megatron"),
    (["parallel=dp2tp2", "parallel.fsdp=false"], HF, "runs as 2-D FSDP x TP; set parallel.fsdp=true"),
    (["parallel=tp3"], HF, "tp=3 must divide the model's num_attention_heads=4, num_key_value_heads=2, "
                           "intermediate_size=8 "),
    (["parallel=tp2"], {**HF, "num_key_value_heads": 1},
     "tp=2 must divide the model's num_key_value_heads=1 ("),
    (["parallel=tp2"], {**HF, "intermediate_size": 9}, "tp=2 must divide the model's intermediate_size=9 ("),
])
def test_layouts_train_torch_cannot_run_are_refused_naming_the_cause(overrides, hf, message):
    """Each refusal of check_torch_layout, with the counts that do not split (by name): a
    layout it let through would start ranks that fail or train a different model."""
    from relax.errors import ConfigError
    from relax.train.parallel import check_torch_layout

    with pytest.raises(ConfigError, match=re.escape(message)):
        check_torch_layout(make_cfg(*overrides).parallel, hf)
    check_torch_layout(make_cfg("parallel=dp2tp2").parallel, HF)  # what it can run passes


def test_compare_two_run_dirs_and_its_tolerances(tmp_path, replay_dir):
    runs = []
    for layout in ("single", "fsdp2"):
        proc = relax_cli(*replay(replay_dir), f"parallel={layout}", *TRAIN,
                         f"hydra.run.dir=outputs/{layout}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(tmp_path / "outputs" / layout)
    code, report = compare(*runs)
    fsdp = report["jobs"][1]
    assert report["baseline"] == "single" and fsdp["name"] == "fsdp2"
    assert (code, fsdp["verdict"]) == (0, "equivalent")
    # The verdict follows the numbers: equivalent at tolerances equal to the measured differences,
    # DIVERGED just below one. FSDP2 sums the gradients in another order, so the grad norms differ
    # (7.0e-8 relative, measured, over the judged steps: the 2 strict ones without a noise twin);
    # the first-step log-probs need not (0 measured).
    base, judged = report["jobs"][0], fsdp["judged_steps"]
    # (computed here, not with compare's own function: a wrong one would set both sides alike)
    gn = max(abs(a - b) / abs(b) for a, b in zip(fsdp["grad_norm"][:judged], base["grad_norm"][:judged],
                                                 strict=True))
    lp, loss = fsdp["max_logprob_diff"], fsdp["max_loss_diff"]
    assert 0 < gn <= 1e-4
    code, report = compare(*runs, args=("--logprob-atol", repr(lp), "--grad-norm-rtol", repr(gn),
                                        "--loss-atol", repr(loss)))
    assert (code, report["jobs"][1]["verdict"]) == (0, "equivalent")
    code, report = compare(*runs, args=("--grad-norm-rtol", repr(gn / 2)))
    fsdp = report["jobs"][1]
    assert (code, fsdp["verdict"]) == (1, "DIVERGED")
    assert len(fsdp["reasons"]) == 1 and "grad_norm rel Δ" in fsdp["reasons"][0]


def test_multi_rank_train_dumps_one_file_per_dp_shard(tmp_path, replay_dir):
    dump = tmp_path / "dump"
    proc = relax_cli(*replay(replay_dir), "parallel=dp2tp2", *TRAIN,
                     f"debug.save_train_data={dump}/train_data/{{rollout_id}}_{{rank}}.pt", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (dump / "train_data").iterdir()) == ["0_0.pt", "0_1.pt", "1_0.pt", "1_1.pt"]
    shards = [safe_load(dump / "train_data" / f"0_{r}.pt") for r in (0, 1)]
    indices = [sorted(row["index"] for row in s["samples"]) for s in shards]
    assert not set(indices[0]) & set(indices[1]) and len(indices[0]) + len(indices[1]) == 64
    (dump / "rollout_data").symlink_to(replay_dir / "rollout_data")
    out = relax_cli("inspect", str(dump), "--json", cwd=tmp_path)
    join = json.loads(out.stdout)["train_join"]
    assert join["trained_samples"] == 64 and join["ranks"] == [0, 1]


def test_full_loop_with_tensor_parallel_trainer_syncs_weights(tmp_path, tiny_path):
    common = ["rollout.num_rollout=2", "rollout.rollout_batch_size=8", "checkpoint.save_interval=null"]
    single, _ = run_loop(tmp_path / "single", *common)
    tp2, _ = run_loop(tmp_path / "tp2", *common, "parallel=tp2")
    # rollout 1 is generated by the engine after a weight sync from the TP=2 trainer
    assert tp2[1]["rollout/raw_reward"] == single[1]["rollout/raw_reward"]
    assert abs(tp2[1]["rollout/rollout_log_probs"] - single[1]["rollout/rollout_log_probs"]) < 1e-5


def test_a_rank_failure_stops_the_group_and_leaves_no_process(tmp_path, tiny_path, monkeypatch):
    from relax.cluster.ranks import RankError

    group = build_trainer(make_cfg("parallel=dp2"), tiny_path, tmp_path)
    pids = group.pids
    with pytest.raises(RankError, match=r"rank . \(node .*, pid \d+\) failed"):
        group.call("no_such_method")
    assert not any(alive(pid) for pid in pids)


def test_ranks_die_with_a_killed_driver(tmp_path, tiny_path):
    code = (
        "import sys, time\n"
        "from tests.conftest import build_trainer, make_cfg\n"
        f"g = build_trainer(make_cfg('parallel=dp2'), {str(tiny_path)!r}, {str(tmp_path)!r})\n"
        "print(' '.join(map(str, g.pids)), flush=True)\n"
        "time.sleep(600)\n")
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
    pids = [int(p) for p in driver.stdout.readline().split()]
    assert len(pids) == 2
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.time() + 20
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)


# The tiny recipe with heads, KV heads and MLP width that divide by 3 (48 / 6 heads: an even
# head width), random weights; rewards by length, so that every group has a gradient.
HEADS_OF_3 = ["model.tiny.hidden_size=48", "model.tiny.num_heads=6", "model.tiny.num_kv_heads=3",
              "model.tiny.intermediate_size=96", "model.tiny.warmup_max_steps=0",
              "task.reward_fn=relax.task.rewards.response_length"]


@pytest.mark.slow
def test_tp3_trains_as_single_does_on_a_model_whose_heads_divide_by_3(tmp_path):
    """parallel=tp3 with train=torch (three ranks, q/k/v split by whole heads, the MLP by
    width): one rollout, two steps, first-step log-probs and both steps' loss and grad_norm
    within the fixed tolerances of single's."""
    proc = relax_cli("-m", "parallel=single,tp3", *HEADS_OF_3, *TRAIN, "rollout.num_rollout=1",
                     "rollout.rollout_batch_size=4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, report = compare(only_run_dir(tmp_path, "multiruns"))
    assert code == 0, report
    single, tp3 = (next(j for j in report["jobs"] if j["layout"] == name) for name in ("single", "tp3"))
    assert len(single["grad_norm"]) == 2 and min(single["grad_norm"]) > 1e-3, single
    assert tp3["verdict"] == "equivalent" and tp3["status"] == "completed", tp3["reasons"]
    assert tp3["max_logprob_diff"] <= 1e-5 and tp3["max_grad_norm_rel_diff"] <= 1e-4, tp3
    assert len(tp3["grad_norm"]) == 2 and tp3["max_grad_norm_rel_diff"] > 0  # 3 ranks' rounding: no copy
