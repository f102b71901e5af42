"""The real model's layout sweep as docs/real-model.md writes it (the manual tier: ~5 min and
~5 GB a rank on 2 cores; `pytest -m manual`): Megatron's single, twin, pp2, tp3, dp2 and cp2
replaying the same two rollouts, every step with a gradient, all `equivalent`."""

import json
from pathlib import Path

import pytest

from .conftest import REPO, relax_cli
from .test_docs import command_lines

pytestmark = pytest.mark.manual

DOC = REPO / "docs" / "real-model.md"


def documented_sweep(data: Path) -> list[list[str]]:
    """The doc's commands of its layout sweep (rollouts, replay, compare), its /tmp/real in `data`."""
    commands = [[a.replace("/tmp/real", str(data)) for a in args] for args in command_lines(DOC.read_text())]
    replay = next(i for i, args in enumerate(commands) if "parallel=single,twin,pp2,tp3,dp2,cp2" in args)
    return commands[replay - 1:replay + 2]


@pytest.mark.timeout(1800)
def test_the_documented_real_model_sweep_trains_and_every_layout_is_equivalent(tmp_path, smollm2_path):
    make, replay, compare = documented_sweep(tmp_path / "real")
    assert "debug=rollout_only" in make and "-m" in replay and compare[0] == "compare"
    for args, timeout in ((make, 600), (replay, 1500)):
        proc = relax_cli(*args, cwd=tmp_path, env={"PYTHONPATH": str(REPO)}, timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = (tmp_path / "outputs" / "multiruns").iterdir()
    proc = relax_cli("compare", str(sweep), "--json", cwd=tmp_path)
    report = json.loads(proc.stdout)
    jobs = {j["name"]: j for j in report["jobs"]}
    assert proc.returncode == 0 and set(jobs) == {f"parallel={p}" for p in
                                                  ("single", "twin", "pp2", "tp3", "dp2", "cp2")}, jobs
    assert all(j["verdict"] == "equivalent" and len(j["grad_norm"]) == 2 for j in jobs.values()), jobs
    # every step trained (the reward varies in every group), so the verdicts judged backward and optimizer
    assert all(gn > 1 for j in jobs.values() for gn in j["grad_norm"]), jobs
    assert not [n for n in report["notes"] if "no gradient" in n], report["notes"]
