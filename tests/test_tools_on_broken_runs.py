"""Every tool through the real CLI (`relax doctor`, `compare`, `inspect`, `relax resume=<dir>`) on
runs that are broken in the ways a crash, a custom trainer or a wrong path leave them: each
exits with the status docs/reliability.md gives (2 for bad input; compare's 1 for a job that
FAILED or DIVERGED, 0 for a report), prints one clear message, and never a traceback.

One real run (`debug=dump`: rollout and train data, first-step log-probs) is made once; the
broken runs are copies of it with a few small files rewritten. The CLI's `main` runs in a
process forked from a server that imported Relax once (conftest's fork_cli): a Python start-up
per case would make this file minutes long on a busy 2-core machine."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from .conftest import relax_cli

RUN = ["rollout.num_rollout=2", "rollout.rollout_batch_size=4", "checkpoint.save_interval=null"]


@pytest.fixture(scope="module")
def good_run(tmp_path_factory, tiny_path) -> Path:
    root = tmp_path_factory.mktemp("good")
    proc = relax_cli(*RUN, "debug=dump", f"hydra.run.dir={root}/run", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "run"


# -- ways to break a run (each edits a fresh copy of the good run) -----------------------------

def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def write_records(run: Path, rows: list[dict]) -> None:
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def rollout_only(run: Path) -> None:
    """What a completed debug=rollout_only run (parallel=single) leaves: no step records."""
    write_records(run, [r for r in records(run) if "step" not in r])
    (run / "first_step_log_probs.pt").unlink()


def failed_at_start(run: Path) -> None:
    rollout_only(run)
    (run / "metrics.jsonl").write_text("")
    (run / "status.json").write_text(json.dumps({"status": "failed", "error": "model.path: no config.json"}))


def only_required_metrics(run: Path) -> None:
    """A custom trainer's run: no perf/*, no KL, no response-health signals."""
    write_records(run, [{k: v for k, v in r.items() if k in ("rollout_id", "step", "train/loss",
                                                             "train/grad_norm", "rollout/raw_reward")}
                        for r in records(run)])


def no_train_loss(run: Path) -> None:
    write_records(run, [{k: v for k, v in r.items() if k != "train/loss"} for r in records(run)])


def cut(path: Path, keep: float) -> None:
    """The file as a crash mid-write leaves it: only its first `keep` share of bytes."""
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def metrics_cut_in_rollout_1(run: Path) -> None:
    text = (run / "metrics.jsonl").read_text()
    lines = text.splitlines(keepends=True)  # step 0, rollout 0, step 0 of rollout 1, rollout 1
    assert '"step"' in lines[2] and '"step"' not in lines[3]
    (run / "metrics.jsonl").write_text("".join(lines[:2]) + lines[2][:len(lines[2]) // 2])


def edit_log_probs(run: Path, edit) -> None:
    path = run / "first_step_log_probs.pt"
    torch.save(edit(torch.load(path, weights_only=True)), path)


def edit_train_row(run: Path, edit) -> None:
    """Edit sample 0's row of rollout 0's train data."""
    path = run / "train_data" / "0_0.pt"
    data = torch.load(path, weights_only=True)
    edit(next(row for row in data["samples"] if row["index"] == 0))
    torch.save(data, path)


def rollout_log_probs_cut(run: Path) -> None:
    path = run / "rollout_data" / "0.pt"
    data = torch.load(path, weights_only=True)
    data["samples"][0]["rollout_log_probs"].pop()
    torch.save(data, path)


def train_data_of_another_run(run: Path) -> None:
    """Sample 0's train row one trained token short throughout: consistent in itself, not with
    the rollout file beside it."""
    def drop_last_token(row):
        for key in ("log_probs", "ref_log_probs", "rollout_log_probs", "loss_mask"):
            row[key].pop()
    edit_train_row(run, drop_last_token)


def bad_checkpoint(run: Path) -> None:
    checkpoint = run / "checkpoints" / "rollout_000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "relax_state.json").write_text('{"rollout_id": 1, "ref_mod')


BROKEN = {
    "good": lambda run: None,
    "rollout_only": rollout_only,
    "failed": failed_at_start,
    "only_required_metrics": only_required_metrics,
    "no_train_loss": no_train_loss,
    "metrics_cut": metrics_cut_in_rollout_1,
    "metrics_cut_to_nothing": lambda run: cut(run / "metrics.jsonl", 0.1),
    "log_probs_cut": lambda run: edit_log_probs(run, lambda lp: {i: v[:-1] for i, v in lp.items()}),
    "fewer_samples": lambda run: edit_log_probs(run, lambda lp: {i: v for i, v in lp.items() if i < 4}),
    "train_data_cut": lambda run: edit_train_row(run, lambda row: row["log_probs"].pop()),
    "train_data_of_another_run": train_data_of_another_run,
    "train_data_text": lambda run: edit_train_row(run, lambda row: row.update(log_probs=["-0.1"] * 3)),
    "rollout_log_probs_cut": rollout_log_probs_cut,
    "rollout_file_cut": lambda run: cut(run / "rollout_data" / "0.pt", 0.5),
    "bad_checkpoint": bad_checkpoint,
}


def make(kind: str, good_run: Path, tmp_path: Path) -> Path:
    if kind == "empty":
        (tmp_path / kind).mkdir()
    elif kind == "not_a_run":
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "notes.txt").write_text("results of last week\n")
    elif kind != "missing":
        shutil.copytree(good_run, tmp_path / kind)
        BROKEN[kind](tmp_path / kind)
    return tmp_path / kind


# (tool, the runs it is given, extra args, exit status, what it must say)
CASES = [
    ("doctor", ["empty"], [], 2, r"empty has no metrics.jsonl: not a run dir"),
    ("doctor", ["not_a_run"], [], 2, r"not_a_run has no metrics.jsonl: not a run dir"),
    ("doctor", ["metrics_cut_to_nothing"], [], 2, r"metrics.jsonl holds no rollout record"),
    ("doctor", ["metrics_cut"], [], 0, r"\[PASS\] 7\. non-finite metrics: 2 records, all finite"),
    ("doctor", ["no_train_loss"], [], 2, r"metrics.jsonl: not a metrics record .*train/loss"),
    ("doctor", ["only_required_metrics"], [], 0, r"\[SKIP\] 5\. train vs rollout log-prob mismatch"),
    ("doctor", ["rollout_only"], [], 0, r"\[SKIP\] 4\. first-step KL and grad_norm: no train steps"),
    ("doctor", ["train_data_cut"], [], 2,
     r"train_data/0_0.pt: sample 0: per-token lists of different lengths \(log_probs \d+, ref_log_probs \d+"),
    ("doctor", ["rollout_file_cut"], [], 2, r"rollout_data/0.pt: corrupt or truncated file"),
    ("inspect", ["empty"], [], 2, r"empty: no rollout data.*saves it with debug=dump"),
    ("inspect", ["not_a_run"], [], 2, r"not_a_run: no rollout data"),
    ("inspect", ["missing"], [], 2, r"missing: no such file or directory"),
    ("inspect", ["rollout_file_cut"], [], 2, r"rollout_data/0.pt: corrupt or truncated file"),
    ("inspect", ["rollout_log_probs_cut"], [], 2,
     r"rollout_data/0.pt: malformed rollout data: sample 0: response_length \d+ does not match .* "
     r"\d+ rollout_log_probs"),
    ("inspect", ["train_data_cut"], [], 2,
     r"train_data/0_0.pt: sample 0: per-token lists of different lengths"),
    ("inspect", ["train_data_text"], [], 2,
     r"train_data/0_0.pt: not Relax train data \(a list of samples with index, reward, advantage and lists "
     r"of numbers log_probs"),
    ("inspect", ["train_data_of_another_run"], [], 2,
     r"train_data/0_0.pt: sample 0 has \d+ per-token log_probs, but the rollout file .*0.pt gives it \d+"),
    ("compare", ["rollout_only", "good"], [], 1, r"rollout_only: no training steps in its metrics.jsonl"),
    ("compare", ["rollout_only", "good"], ["--baseline", "rollout_only"], 2,
     r"--baseline 'rollout_only': rollout_only cannot be the baseline: no training steps"),
    ("compare", ["failed", "good"], ["--baseline", "failed"], 2,
     r"failed cannot be the baseline: failed: model.path: no config.json"),
    ("compare", ["rollout_only", "failed"], [], 2,
     r"no job can be the baseline .*rollout_only: no training steps.*; failed: failed"),
    ("compare", ["good", "only_required_metrics"], [], 0, r"only_required_metrics .* equivalent"),
    ("compare", ["good", "no_train_loss"], [], 2, r"no_train_loss/metrics.jsonl: not a metrics record"),
    ("compare", ["good", "metrics_cut"], [], 1, r"metrics_cut: 1 steps vs 2 in the baseline"),
    ("compare", ["good", "log_probs_cut"], [], 1,
     r"sample 0: \d+ first-step log_probs vs \d+ in the baseline"),
    ("compare", ["good", "fewer_samples"], [], 1,
     r"first-step log_probs missing for baseline sample\(s\) 4, 5, 6"),
    ("compare", ["fewer_samples", "good"], [], 1, r"good: first-step log_probs for sample\(s\) 4, 5, 6"),
    ("compare", ["empty", "good"], [], 2, r"empty is not a run dir \(no .hydra/ in it\)"),
    ("compare", ["not_a_run"], [], 2, r"not_a_run: neither a run dir nor a multirun dir"),
    ("resume", ["empty"], [], 2, r"empty': neither a checkpoint \(relax_state.json\) nor a run dir"),
    ("resume", ["not_a_run"], [], 2, r"not_a_run': neither a checkpoint"),
    ("resume", ["bad_checkpoint"], ["checkpoints/rollout_000001"], 2,
     r"rollout_000001': incomplete checkpoint \(relax_state.json unreadable"),
]


def run_cli(fork_cli, cwd: Path, *args: str) -> tuple[int | None, str]:
    """(exit status, stdout and stderr together) of `relax <args>` run in `cwd`."""
    proc = fork_cli(cwd, *args)
    proc.join(300)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return proc.exitcode, (cwd / "out.log").read_text()


def case_id(tool: str, kinds: list[str], args: list[str]) -> str:
    return "-".join([tool, *kinds, *(["baseline", args[1]] if args[:1] == ["--baseline"] else [])])


@pytest.mark.parametrize(("tool", "kinds", "args", "code", "message"), CASES,
                         ids=[case_id(*c[:3]) for c in CASES])
def test_a_tool_on_a_broken_run_says_what_is_wrong(tool, kinds, args, code, message, good_run, tmp_path,
                                                   fork_cli):
    runs = [str(make(kind, good_run, tmp_path)) for kind in kinds]
    if tool == "resume":  # the run dir (or the path inside it that args give) into a new run dir
        status, out = run_cli(fork_cli, tmp_path, *RUN, f"resume={Path(runs[0], *args)}",
                              f"hydra.run.dir={tmp_path}/new")
    else:
        status, out = run_cli(fork_cli, tmp_path, tool, *runs, *args)
    assert status == code, out[-3000:]
    assert "Traceback" not in out
    assert re.search(message, out), out[-3000:]
    if code == 2 and tool != "resume":  # a refusal is one line
        assert out.startswith(f"relax {tool}: error: ") and len(out.splitlines()) == 1, out[-3000:]


def test_compare_shows_metrics_a_custom_trainer_did_not_log_as_missing(good_run, tmp_path, fork_cli):
    runs = [str(make(kind, good_run, tmp_path)) for kind in ("good", "only_required_metrics")]
    status, out = run_cli(fork_cli, tmp_path, "compare", *runs, "--json")
    assert status == 0, out[-3000:]
    jobs = {j["name"]: j for j in json.loads(out)["jobs"]}
    assert jobs["only_required_metrics"]["step_time"] is None
    assert jobs["only_required_metrics"]["peak_memory_mb"] is None
    assert jobs["good"]["step_time"] > 0 and jobs["good"]["peak_memory_mb"] > 0
    assert jobs["only_required_metrics"]["max_loss_diff"] == 0.0
