"""Optional packages some tests need (the ray, wandb, verl, real, lora, rgym and agent extras; tensorboard).

Where one is not installed its tests are skipped, except in CI (`CI` set: .ci/run sets it),
whose command installs every one of them: there a missing package is a failure that names
the install step, so a broken install cannot pass as a run of skips.
"""

from __future__ import annotations

import importlib
import os

import pytest

RAY = "the [ray] extra (pip install -c constraints.txt -e '.[ray]')"
WANDB = "the [wandb] extra (pip install -c constraints.txt -e '.[wandb]')"
TENSORBOARD = "tensorboard (a dependency of relax: pip install -c constraints.txt -e .)"
REAL = "the [real] extra (pip install -c constraints.txt -e '.[real]')"
LORA = "the [lora] extra (pip install -c constraints.txt -e '.[lora]')"
RGYM = "the [rgym] extra (pip install -c constraints.txt -e '.[rgym]')"
AGENT = "the [agent] extra (pip install -c constraints.txt -e '.[agent]')"
VERL = ("verl 0.9.1 (pip install -c constraints.txt -e '.[verl]', then "
        "pip install --no-deps verl==0.9.1)")


def require(module: str, install: str):
    """`module`, imported; else a skip (outside CI) or a failure (in CI) saying `install`."""
    if not os.environ.get("CI"):
        return pytest.importorskip(module, reason=f"needs {install}")
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"CI installs {install}, but {module!r} does not import: {e}", pytrace=False)


def needs(module: str, install: str, name: str):
    """A test module's autouse fixture `name`: `module`, required when one of the module's tests
    runs. Not at import: a tier that deselects the module (the SGLang tier, in an environment
    without the extra) must still collect it."""
    @pytest.fixture(scope="module", autouse=True, name=name)
    def imported():
        return require(module, install)
    return imported
