"""debug.profile_dir: the trainer's train() of chosen rollouts under torch.profiler, per rank,
with the step's phases (relax/train/profile.py); refused at start-up where it cannot run."""

import json
import re

import pytest

from relax.debug.plan import resolve
from relax.errors import ConfigError
from relax.train.profile import PHASES

from .conftest import make_cfg, run_loop

SHORT = ["rollout.num_rollout=3", "rollout.rollout_batch_size=8", "checkpoint.save_interval=null"]


def phases_of(table: str) -> dict[str, float]:
    rows = [line.split() for line in table.splitlines() if line.startswith("step:")]
    return {row[0]: float(row[1]) for row in rows}


@pytest.mark.parametrize("layout", ["single", "dp2"])
def test_the_profiled_rollout_has_a_trace_and_phases_on_every_rank(tmp_path, tiny_path, layout):
    profile = tmp_path / "profile"
    run_loop(tmp_path / "run", *SHORT, f"parallel={layout}", f"debug.profile_dir={profile}",
             "algo.use_kl_loss=true")  # the reference's forward at every step
    ranks = 2 if layout == "dp2" else 1
    # by default the second rollout only: the first carries one-time work (first-step checks)
    assert sorted(p.name for p in profile.iterdir()) == sorted(
        f"rollout_1_rank{r}.{ext}" for r in range(ranks) for ext in ("json", "txt"))
    for rank in range(ranks):
        trace = json.loads((profile / f"rollout_1_rank{rank}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert set(PHASES) - {"step:old_log_probs"} <= names and "step:old_log_probs" not in names
        text = (profile / f"rollout_1_rank{rank}.txt").read_text()
        total = float(text.split(": ")[1].split(" s")[0])
        phases = phases_of(text)
        # on-policy (one step per rollout): no pass of the old policy of its own
        assert set(phases) == set(PHASES) and phases["step:old_log_probs"] == 0 < phases["step:reference"]
        # the marked phases are inside the call, and the backward pass is the largest of them
        assert 0 < sum(phases.values()) <= total * 1.01, text
        assert phases["step:forward_backward"] == max(phases.values()) > 0
        assert "Self CPU" in text and "aten::" in text  # the operator table


def test_profile_rollouts_are_chosen_and_the_rest_run_unprofiled(tmp_path, tiny_path):
    profile = tmp_path / "profile"
    run_loop(tmp_path / "run", *SHORT, f"debug.profile_dir={profile}", "debug.profile_rollouts=[0,2]")
    assert sorted(p.name for p in profile.iterdir()) == [
        "rollout_0_rank0.json", "rollout_0_rank0.txt", "rollout_2_rank0.json", "rollout_2_rank0.txt"]


@pytest.mark.parametrize("overrides, message", [
    (["debug=rollout_only", "debug.profile_dir=/tmp/p"], "debug.rollout_only builds no trainer"),
    (["debug.profile_dir=/tmp/p", "debug.profile_rollouts=[3]"], "rollout id(s) [3] are not among"),
    (["debug.profile_dir=/tmp/p", "debug.profile_rollouts=[]"], "debug.profile_rollouts=[]"),
    (["debug.profile_dir=/dev/null/p"], "is a file, not a directory"),
    (["debug.profile_dir=/tmp/p", "train._target_=tests.test_profile.Unprofiled"], "is not profiled"),
])
def test_bad_profile_settings_are_refused_at_start_up(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(make_cfg(*SHORT, *overrides))


class Unprofiled:
    """A custom trainer whose train() is not decorated."""
    def __init__(self, cfg, model_path, **kwargs):
        raise AssertionError("never built")

    def train(self, rollout_id, samples):
        raise AssertionError("never built")

    @staticmethod
    def check_config(cfg, hf_config):
        pass
