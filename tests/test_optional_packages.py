"""Every tier collects every test module, whichever extras its environment lacks: the SGLang
tier runs in .venv-sglang, which installs only some of the extras. An optional package is
required when a test that needs it runs (tests/extras.py), never when its module is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXTRAS = ["reasoning_gym", "peft", "math_verify", "wandb", "verl", "ray", "gguf", "openai"]

# A pytest plugin that makes every extra fail to import, as in an environment without it.
BLOCKER = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in EXTRAS)


def collect(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "block_extras.py").write_text(BLOCKER)
    env = {**os.environ, "CI": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "block_extras", "--collect-only",
                           "-q", "-p", "no:cacheprovider", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_the_sglang_tier_collects_without_any_extra(tmp_path):
    done = collect(tmp_path, "-m", "sglang")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "error" not in done.stdout.splitlines()[-1], done.stdout[-3000:]


def test_a_module_level_require_breaks_collection(tmp_path):
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "test_planted.py").write_text(
        "from tests import extras\nextras.require('reasoning_gym', extras.RGYM)\n"
        "def test_nothing():\n    pass\n")
    done = collect(tmp_path, str(planted), "--rootdir", str(planted))
    assert done.returncode != 0
    assert "does not import" in done.stdout
