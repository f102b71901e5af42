"""The reliability campaign (docs/reliability.md): each bad input of tests/campaign.py must end
in a clear error and its exit code (2 for a refusal), before anything expensive is built where
it can be; never a traceback, a silent acceptance or lost data.

A case runs in-process: the job's start-up (`run_job`, what the CLI runs, whose `rl_loop` stops
in `prepare`), one rollout for what only a rollout can show (a reward's return type), or a
tool's `main()`.
`python -m tests.test_campaign` prints every case's outcome (clear / late / traceback /
silent / lost) for the code on the path: docs/reliability.md's "before" column is that table
for commit a68d779.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import re
import signal
import sys
from pathlib import Path

import pytest

from .campaign import CASES, PWNED, Case, Env, stop_live
from .conftest import REPO, make_cfg, run_loop

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


class ErrorLines(logging.Handler):
    """The error lines a job logs: a refused job's one line (its status.json records it only in a
    run dir the job created)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


def run_case(case: Case, tmp: Path, env: Env) -> tuple[str, str, int | None]:
    """(outcome, message, exit code): clear (a user error at start-up, or a tool's clear
    refusal), late (a user error after the engine or trainer was built), traceback, silent, or
    lost. A run goes through `run_job`, what the CLI runs, so its exit code is the CLI's; the
    message is then the error line it logs."""
    from relax.loop import run_job

    overrides = case.make(tmp, env) if callable(case.make) else dict(case.make)
    run_dir = tmp / "done" if case.kind == "run_in_done" else tmp / "runs" / "new"
    if case.kind in ("doctor", "compare", "inspect"):
        paths = {"doctor": [tmp / "done"], "compare": [tmp / "done", env.done],
                 "inspect": [tmp / "replay"]}[case.kind]
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = importlib.import_module(f"relax.tools.{case.kind}").main([str(p) for p in paths])
        except Exception as e:
            return "traceback", f"{type(e).__name__}: {e}", None
        return ("clear" if re.search(case.expect, out.getvalue()) else "silent"), out.getvalue(), code
    if case.kind == "rollout":
        overrides["debug.rollout_only"] = "true"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = make_cfg(*args_of(overrides), run_dir=run_dir)
    with contextlib.ExitStack() as stack:
        if case.kind == "disk_full":
            from unittest import mock

            def full(self, path):
                raise OSError(28, "No space left on device", str(Path(path) / "hf"))
            stack.enter_context(mock.patch("relax.train.torch_trainer.TorchTrainer.save_checkpoint", full))
        errors = ErrorLines()
        logging.getLogger("relax").addHandler(errors)
        stack.callback(logging.getLogger("relax").removeHandler, errors)
        try:
            run_job(cfg)
        except SystemExit as e:  # a user error: its one line
            message = errors.lines[-1] if errors.lines else ""
            late = (run_dir / "built.json").exists() and case.kind == "run"
            return ("late" if late else "clear"), message, e.code
        except TimeoutError:  # main()'s alarm: the run hangs
            raise
        except Exception as e:
            return "traceback", f"{type(e).__name__}: {e}", None
    return ("lost" if case.loses else "silent"), "", 0


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_path):
    yield build_env(tmp_path_factory.mktemp("campaign"), tiny_path)
    stop_live()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_a_clear_error(case, env, tmp_path):
    PWNED.unlink(missing_ok=True)
    outcome, message, code = run_case(case, tmp_path, env)
    assert outcome == "clear", f"{case.what}: {outcome}: {message}"
    assert code == case.code, f"{case.what}: exit code {code}, expected {case.code}: {message}"
    assert re.search(case.expect, message), message
    assert "weights_only=False" not in message and "Traceback" not in message
    assert not PWNED.exists()  # nothing in a hostile file ran
    if case.kind == "run":  # refused at start-up: nothing was built
        assert not (tmp_path / "runs" / "new" / "built.json").exists()


def test_the_campaign_holds_the_cases_docs_reliability_md_counts():
    docs = (REPO / "docs" / "reliability.md").read_text()
    inputs, clear = re.search(r"\*\*(\d+) bad inputs: (\d+) clear errors", docs).groups()
    rows = re.findall(r"^\| \d+ \| ", docs, re.MULTILINE)  # the campaign's table, one row a case
    assert len(CASES) == 68 == int(inputs) == int(clear) == len(rows)
    assert len({c.id for c in CASES}) == len(CASES)


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
            outcome, message, code = run_case(case, root / case.id, env)
        except TimeoutError as e:
            outcome, message, code = "silent", str(e), None
        signal.alarm(0)
        print(json.dumps({"id": case.id, "what": case.what, "outcome": outcome, "exit": code,
                          "message": message[:300]}), flush=True)
    stop_live()


if __name__ == "__main__":
    sys.exit(main())
