"""scripts/gpu_check.sh --dry-run: what the GPU check can verify without a GPU (CI runs it)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException

from .conftest import REPO


def test_dry_run_composes_every_command_and_checks_the_model_and_pins(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = json.loads(out.read_text())["checks"]
    assert {name: c["status"] for name, c in checks.items()} == dict.fromkeys(
        ["python_compiles", "config_session", "config_deterministic", "config_rl_loop", "model", "pins"],
        "PASS")
    assert "rollout.weight_update_mode=distributed" in checks["config_rl_loop"]["command"]
    assert 0.45e9 < checks["model"]["params"] < 0.55e9  # ~0.5B, Qwen2.5-0.5B's shape
    assert "sglang==0.5.23" in checks["pins"]["pins"] and "torch==2.14.1" in checks["pins"]["pins"]


def test_dry_run_fails_on_a_command_that_does_not_compose(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    typo = [*gpu_check.COMMANDS["rl_loop"], "rollout.num_rolout=5"]
    monkeypatch.setitem(gpu_check.COMMANDS, "rl_loop", typo)
    with pytest.raises(ConfigCompositionException, match="num_rolout"):
        gpu_check.dry_run({"checks": {}})
