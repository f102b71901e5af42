"""The reliability campaign (docs/reliability.md): each bad input of tests/campaign.py must end
in a clear error, before anything expensive is built where it can be; never a traceback, a
silent acceptance or lost data.

A case runs in-process: the loop's start-up (`rl_loop`, which stops in `prepare`), one
rollout for what only a rollout can show (a reward's return type), or a tool's `main()`.
`python -m tests.test_campaign` prints every case's outcome (clear / late / traceback /
silent / lost) for the code on the path: docs/reliability.md's "before" column is that table
for commit a68d779.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import signal
import sys
from pathlib import Path

import pytest

from .campaign import CASES, PWNED, Case, Env, stop_live
from .conftest import make_cfg, run_loop

SMALL = {"rollout.num_rollout": "1", "rollout.rollout_batch_size": "2", "rollout.n_samples_per_prompt": "2",
         "checkpoint.save_interval": "null"}


def build_env(root: Path, model: Path) -> Env:
    done, replay = root / "runs" / "done", root / "replay"
    run_loop(replay / "run", *args_of({"debug.rollout_only": "true", "rollout.num_rollout": "3",
                                       "debug.save_rollout_data": f"{replay}/{{rollout_id}}.pt"}))
    overrides = args_of({"rollout.num_rollout": "2", "checkpoint.save_interval": "1",
                         "checkpoint.keep_last": "9"})  # (null at a68d779 was no valid value)
    run_loop(done, *overrides)
    from omegaconf import OmegaConf

    (done / ".hydra").mkdir()
    OmegaConf.save(make_cfg(*overrides), done / ".hydra" / "config.yaml")
    (done / "status.json").write_text(json.dumps({"status": "completed"}))
    return Env(model, done, replay)


def args_of(overrides: dict) -> list[str]:
    """SMALL with `overrides` on top, as command-line overrides."""
    merged = {**SMALL, **overrides}
    return [f"{k}={v}" for k, v in merged.items()]


def run_case(case: Case, tmp: Path, env: Env) -> tuple[str, str]:
    """(outcome, message): clear (a user error at start-up, or a tool's clear refusal), late
    (a user error after the engine or trainer was built), traceback, silent, or lost."""
    from relax import errors

    overrides = case.make(tmp, env) if callable(case.make) else dict(case.make)
    clear = tuple(getattr(errors, n) for n in ("ConfigError", "ReplayError", "DiskFull", "RolloutError")
                  if hasattr(errors, n))  # (no DiskFull, RolloutError at a68d779)
    run_dir = tmp / "done" if case.kind == "run_in_done" else tmp / "runs" / "new"
    if case.kind in ("doctor", "compare", "inspect"):
        paths = {"doctor": [tmp / "done"], "compare": [tmp / "done", env.done],
                 "inspect": [tmp / "replay"]}
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                importlib.import_module(f"relax.debug.{case.kind}").main([str(p) for p in paths[case.kind]])
        except Exception as e:
            return "traceback", f"{type(e).__name__}: {e}"
        return ("clear" if re.search(case.expect, out.getvalue()) else "silent"), out.getvalue()
    if case.kind == "rollout":
        overrides["debug.rollout_only"] = "true"
    with contextlib.ExitStack() as stack:
        if case.kind == "disk_full":
            from unittest import mock

            def full(self, path):
                raise OSError(28, "No space left on device", str(Path(path) / "hf"))
            stack.enter_context(mock.patch("relax.train.torch_trainer.TorchTrainer.save_checkpoint", full))
        try:
            run_loop(run_dir, *args_of(overrides))
        except clear as e:
            return ("late" if (run_dir / "built.json").exists() and case.kind == "run" else "clear"), str(e)
        except TimeoutError:  # main()'s alarm: the run hangs
            raise
        except Exception as e:
            return "traceback", f"{type(e).__name__}: {e}"
    return ("lost" if case.loses else "silent"), ""


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_path):
    yield build_env(tmp_path_factory.mktemp("campaign"), tiny_path)
    stop_live()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_a_clear_error(case, env, tmp_path):
    PWNED.unlink(missing_ok=True)
    outcome, message = run_case(case, tmp_path, env)
    assert outcome == "clear", f"{case.what}: {outcome}: {message}"
    assert re.search(case.expect, message), message
    assert "weights_only=False" not in message and "Traceback" not in message
    assert not PWNED.exists()  # nothing in a hostile file ran
    if case.kind == "run":  # refused at start-up: nothing was built
        assert not (tmp_path / "runs" / "new" / "built.json").exists()


def test_the_campaign_holds_40_cases_across_every_area():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)


def main() -> None:
    """Print each case's outcome for the code on the path (the 'before' column)."""
    import tempfile

    from relax.model import resolve_model_path

    root = Path(tempfile.mkdtemp(prefix="relax_campaign_"))
    env = build_env(root / "env", resolve_model_path(make_cfg().model))
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("still running after 120 s")))
    for i, case in enumerate(CASES):
        (root / case.id).mkdir()
        signal.alarm(120)
        try:
            outcome, message = run_case(case, root / case.id, env)
        except TimeoutError as e:
            outcome, message = "silent", str(e)
        signal.alarm(0)
        print(json.dumps({"id": case.id, "what": case.what, "outcome": outcome, "message": message[:300]}),
              flush=True)
    stop_live()


if __name__ == "__main__":
    sys.exit(main())
