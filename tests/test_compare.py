"""`relax compare` over long runs: strict on the first steps, then the baseline's own
noise envelope (a `parallel=twin` job); broken layouts, made by real code faults
(relax/faults.py), are DIVERGED at step 0 or 1; NaN is always DIVERGED."""

import json
import math

import pytest

from relax.debug.compare import Job, Tolerances, envelope, first_divergence, judge, pick_baseline
from relax.errors import ConfigError

from .conftest import relax_cli, run_loop

# A short replay with a learning rate high enough that fp32 rounding differences between
# correct layouts outgrow the fixed tolerances within its 24 steps, as they do over the
# README's 400 rollouts at the default rate.
ROLLOUTS = 24
TRAIN = ["train.lr=3e-3", "train.micro_batch_size=8", "checkpoint.save_interval=null"]


@pytest.fixture(scope="module")
def long_replay(tmp_path_factory, tiny_path):
    root = tmp_path_factory.mktemp("long")
    run_loop(root / "run", "debug=rollout_only", f"rollout.num_rollout={ROLLOUTS}",
             "rollout.rollout_batch_size=4", f"debug.save_rollout_data={root}/rollout_data/{{rollout_id}}.pt")
    return root


def replay(root) -> list[str]:
    return ["debug=train_only", f"debug.load_rollout_data={root}/rollout_data/{{rollout_id}}.pt",
            f"rollout.num_rollout={ROLLOUTS}", *TRAIN]


def sweep(cwd, root, layouts, env=None):
    proc = relax_cli("-m", *replay(root), f"parallel={layouts}", cwd=cwd, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (multirun,) = (cwd / "outputs" / "multiruns").iterdir()
    return multirun


def compare(*paths, args=()):
    proc = relax_cli("compare", *map(str, paths), "--json", *args, cwd=paths[0].parent)
    return proc.returncode, {j["layout"]: j for j in json.loads(proc.stdout)["jobs"]}


@pytest.fixture(scope="module")
def clean(tmp_path_factory, long_replay):
    return sweep(tmp_path_factory.mktemp("clean"), long_replay, "single,twin,dp2")


@pytest.mark.slow
def test_equivalent_layout_stays_in_the_twins_envelope(clean):
    code, jobs = compare(clean)
    assert code == 0, jobs
    dp2 = jobs["dp2"]
    assert dp2["verdict"] == "equivalent" and dp2["envelope"] == "parallel=twin"
    assert dp2["max_logprob_diff"] <= 1e-5
    # held to the fixed tolerances at every step, the same run is a false alarm: the
    # rounding differences really grow, and only the envelope tells them from a bug
    code, strict = compare(clean, args=("--strict-steps", str(ROLLOUTS)))
    assert code == 1 and strict["dp2"]["verdict"] == "DIVERGED"
    assert strict["dp2"]["diverged_at_step"] >= 2
    assert strict["twin"]["diverged_at_step"] >= 2  # the twin too: same mechanism


@pytest.mark.slow
def test_broken_layouts_diverge_at_step_0_or_1(tmp_path, long_replay, clean):
    faults = "no_allreduce:dp2,grad_scale:fsdp2,perturb_shard:tp2"
    broken = sweep(tmp_path, long_replay, "dp2,fsdp2,tp2", env={"RELAX_FAULT": faults})
    jobs = [clean / "parallel=single", clean / "parallel=twin", *sorted(broken.iterdir())]
    code, report = compare(*[j for j in jobs if j.is_dir()])
    assert code == 1
    assert report["twin"]["verdict"] == "equivalent"
    for layout in ("dp2", "fsdp2", "tp2"):  # a missing all-reduce, a 1% gradient scale, a perturbed shard
        assert report[layout]["verdict"] == "DIVERGED", layout
        assert report[layout]["diverged_at_step"] in (0, 1), (layout, report[layout]["reasons"])


@pytest.mark.slow
def test_nan_metrics_are_diverged_naming_the_metric(tmp_path, long_replay, clean):
    proc = relax_cli(*replay(long_replay), "rollout.num_rollout=2", "train.on_nonfinite=skip",
                     f"hydra.run.dir={tmp_path}/nan", cwd=tmp_path, env={"RELAX_FAULT": "nan_log_probs"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, report = compare(clean / "parallel=single", tmp_path / "nan")
    nan_job = next(j for j in report.values() if j["name"] == "nan")
    assert code == 1 and nan_job["verdict"] == "DIVERGED"
    assert nan_job["diverged_at_step"] == 0 and "step 0: train/loss is nan" in nan_job["reasons"]


def job(loss, grad_norm, name="x", log_probs=None, layout="?", status="completed"):
    return Job(path=None, name=name, layout=layout, status=status, loss=loss, grad_norm=grad_norm,
               log_probs={0: [0.0]} if log_probs is None else log_probs)


def test_envelope_rules_by_hand():
    base = job([1.0] * 6, [1.0] * 6, "base")
    twin = job([1.0, 1.0, 1.0, 1.001, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.02, 1.0], "twin")
    env = envelope(twin, base)
    assert env[2] == (0.0, 0.0) and env[3][0] == pytest.approx(1e-3) and env[5][1] == pytest.approx(0.02)
    tol = Tolerances(strict_steps=2, envelope_margin=10.0)
    inside = job([1.0, 1.0, 1.0, 1.005, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.1, 1.15])
    assert first_divergence(inside, base, tol, env) is None
    late = job([1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.3])  # 0.3 > 10 x 0.02 + 1e-4
    assert first_divergence(late, base, tol, env)[0] == 5
    early = job([1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.001, 1.0, 1.0, 1.0, 1.0])  # strict step 1
    assert first_divergence(early, base, tol, env)[0] == 1
    nan = job([1.0, math.nan, 1.0, 1.0, 1.0, 1.0], [1.0] * 6)
    assert first_divergence(nan, base, tol, env) == (1, "step 1: train/loss is nan")
    judge(late, base, tol, twin)
    assert late.verdict == "DIVERGED" and late.diverged_at_step == 5 and late.envelope == "twin"
    judge(late, base, tol, None)  # no twin: every step strict
    assert late.diverged_at_step == 5
    judge(inside, base, tol, None)
    assert inside.verdict == "DIVERGED" and inside.diverged_at_step == 3


def test_the_twin_moves_every_weight_by_one_ulp():
    import torch

    from relax.train.common import nudge_ulps

    weights = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 3.0, 1e-30, 7.0]))
    before = weights.detach().clone()
    nudge_ulps([weights], 1, seed=0)
    up = torch.nextafter(before, torch.tensor(torch.inf))
    down = torch.nextafter(before, torch.tensor(-torch.inf))
    moved = weights.detach()
    assert torch.all((moved == up) | (moved == down)) and not torch.equal(moved, before)
    assert 0 < int((moved == up).sum()) < 6  # random signs, both present


def test_per_token_log_probs_of_another_shape_are_diverged_naming_the_sample():
    base = job([1.0], [1.0], "base", {0: [-0.5, -0.25], 1: [-1.0, -2.0]})
    cases = {  # the overlap is equal in each: only the shape tells them from the baseline
        "sample 0: 1 first-step log_probs vs 2 in the baseline": {0: [-0.5], 1: [-1.0, -2.0]},
        "first-step log_probs missing for baseline sample(s) 1": {0: [-0.5, -0.25]},
        "first-step log_probs for sample(s) 2 that the baseline lacks": {**base.log_probs, 2: [-1.0]},
    }
    for reason, log_probs in cases.items():
        other = job([1.0], [1.0], "other", log_probs)
        judge(other, base, Tolerances())
        assert other.verdict == "DIVERGED" and other.reasons == [reason], other.reasons
        assert other.max_logprob_diff == 0.0  # the samples of the baseline's shape agree
    same = job([1.0], [1.0], "same", {0: [-0.5, -0.25], 1: [-1.0, -2.0]})
    judge(same, base, Tolerances())
    assert same.verdict == "equivalent"
    nan = job([1.0], [1.0], "nan", {0: [-0.5, math.nan], 1: [-1.0, -2.0]})
    judge(nan, base, Tolerances())
    assert nan.verdict == "DIVERGED" and math.isnan(nan.max_logprob_diff)


def test_the_baseline_is_a_completed_job_with_training_steps():
    rollout_only = job([], [], "rollout_only", {}, layout="single")  # debug=rollout_only: parallel=single
    failed = job([], [], "failed", {}, layout="single", status="failed")
    dp2 = job([1.0], [1.0], "dp2", layout="dp2")
    assert pick_baseline([rollout_only, failed, dp2], None) is dp2
    assert pick_baseline([failed, dp2, job([1.0], [1.0], "single", layout="single")], None).name == "single"
    with pytest.raises(ConfigError, match=r"--baseline 'single': rollout_only cannot be the baseline: "
                                          r"no training steps"):
        pick_baseline([rollout_only, dp2], "single")
    with pytest.raises(ConfigError, match=r"--baseline 'failed': failed cannot be the baseline: "
                                          r"status failed"):
        pick_baseline([failed, dp2], "failed")
    with pytest.raises(ConfigError, match=r"--baseline 'tp2': no such job \(jobs: failed, dp2\)"):
        pick_baseline([failed, dp2], "tp2")
    with pytest.raises(ConfigError, match=r"no job can be the baseline .*rollout_only: no training steps.*"
                                          r"failed: status failed"):
        pick_baseline([rollout_only, failed], None)
    judge(rollout_only, dp2, Tolerances())
    assert rollout_only.verdict == "FAILED" and "no training steps" in rollout_only.reasons[0]
