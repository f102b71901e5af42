"""debug.profile_dir: the trainer's train() of chosen rollouts under torch.profiler, per rank,
with the step's phases (relax/train/profile.py); refused at start-up where it cannot run."""

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from relax.debug.plan import resolve
from relax.errors import ConfigError
from relax.train.profile import PHASES, phase, write

from .conftest import make_cfg, run_loop

SHORT = ["rollout.num_rollout=3", "rollout.rollout_batch_size=8", "checkpoint.save_interval=null"]


def phases_of(table: str) -> dict[str, float]:
    rows = [line.split() for line in table.splitlines() if line.startswith("step:")]
    return {row[0]: float(row[1]) for row in rows}


@pytest.mark.parametrize("trainer, ranks", [(["parallel=single"], 1), (["parallel=dp2"], 2),
                                            (["train=megatron"], 1)], ids=["single", "dp2", "megatron"])
def test_the_profiled_rollout_has_a_trace_and_phases_on_every_rank(tmp_path, tiny_path, trainer, ranks):
    profile = tmp_path / "profile"
    run_loop(tmp_path / "run", *SHORT, *trainer, f"debug.profile_dir={profile}",
             "algo.use_kl_loss=true")  # the reference's forward at every step
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
        # the marked phases are inside the call, each that ran took time (which is largest is the
        # machine's business: on a loaded one the reference forward can outlast forward+backward)
        assert 0 < sum(phases.values()) <= total * 1.01, text
        assert min(v for k, v in phases.items() if k != "step:old_log_probs") > 0
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
    def __init__(self, train, algo, parallel, spec, **kwargs):
        raise AssertionError("never built")

    def train(self, rollout_id, samples):
        raise AssertionError("never built")

    @staticmethod
    def check_config(cfg, hf_config):
        pass


class FakeEvents(list):
    """prof.key_averages() of a made-up profile: events with a key and a CPU time in µs."""
    def table(self, sort_by, row_limit):
        return f"<operators by {sort_by}, top {row_limit}>"


class FakeProfile:
    def __init__(self, times_us: dict[str, float]):
        self.events = FakeEvents(SimpleNamespace(key=k, cpu_time_total=v) for k, v in times_us.items())

    def key_averages(self):
        return self.events

    def export_chrome_trace(self, path):
        Path(path).write_text('{"traceEvents": []}')


def test_the_phase_table_by_hand(tmp_path, caplog):
    """write(): each marked phase's seconds (µs / 1e6, unmarked ranges and operators left out)
    and its share of the call, the rest of train() as what the phases leave, the 30 operators
    with the most self CPU time; the trace is renamed into place; rank 0 alone logs."""
    prof = FakeProfile({"step:forward_backward": 1.5e6, "step:optimizer": 0.25e6, "step:custom": 0.5e6,
                        "aten::mm": 1.2e6})
    stem = tmp_path / "profile" / "rollout_3_rank1"
    with caplog.at_level(logging.INFO, logger="relax.train.profile"):
        write(prof, stem, 3, 1, 2.5)
    assert not caplog.records  # rank 1
    lines = (tmp_path / "profile" / "rollout_3_rank1.txt").read_text().splitlines()
    assert lines[0] == "train() of rollout 3, rank 1: 2.50 s under the profiler"
    rows = {line[:26].strip(): line[26:].split() for line in lines[3:8]}
    assert rows == {"step:reference": ["0.0000", "0.0%"], "step:old_log_probs": ["0.0000", "0.0%"],
                    "step:forward_backward": ["1.5000", "60.0%"], "step:optimizer": ["0.2500", "10.0%"],
                    "(rest of train())": ["0.7500", "30.0%"]}
    assert lines[9] == "<operators by self_cpu_time_total, top 30>"
    assert sorted(p.name for p in stem.parent.iterdir()) == ["rollout_3_rank1.json", "rollout_3_rank1.txt"]
    with caplog.at_level(logging.INFO, logger="relax.train.profile"):
        write(prof, tmp_path / "profile" / "rollout_3_rank0", 3, 0, 2.5)
    assert [r.getMessage() for r in caplog.records] == [
        f"profile of rollout 3 (rank 0, 2.5 s): forward_backward 1.50 s, optimizer 0.25 s; "
        f"{tmp_path / 'profile' / 'rollout_3_rank0'}.{{txt,json}}"]


def test_only_the_four_phases_can_be_marked():
    with pytest.raises(AssertionError, match="step:backward"):
        phase("step:backward")
