"""A newcomer's first run (issue 46, item 7): the summary a run ends with, output that stays
readable when piped and on a terminal, what reward.png says it plots, and `relax compare` of
runs of different models."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import pty
import re
import select
import shlex
import struct
import termios
from pathlib import Path

import pytest

from relax.tools.compare import main as compare
from relax.tools.jobs import Job, same_model
from relax.errors import ConfigError
from relax.logger import read_metrics, reward_plot_title
from relax.logger.summary import log_summary
from relax.model import model_fingerprint

from .conftest import _cli_in_fork, cli_context, only_run_dir, relax_cli

SHORT = ["rollout.num_rollout=3", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
         "checkpoint.save_interval=null"]
LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]\[[\w.]+\]\[(DEBUG|INFO|WARNING|ERROR)\] - ")
MESSAGE = re.compile(r"\] - (.*)$")


def messages(text: str) -> list[str]:
    """The log messages of some output, in order."""
    return [MESSAGE.search(line).group(1) for line in text.splitlines() if LOG_LINE.match(line)]


@pytest.fixture(scope="module")
def dumped(tmp_path_factory, tiny_path):
    """A 3-rollout debug=dump run through the real CLI, its output piped (to files)."""
    cwd = tmp_path_factory.mktemp("first_run")
    proc = relax_cli(*SHORT, "debug=dump", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd, only_run_dir(cwd), proc


def test_the_run_ends_with_its_dir_its_reward_and_the_next_commands(dumped):
    cwd, run, proc = dumped
    rollouts, _ = read_metrics(run)
    rel = run.relative_to(cwd)
    said = messages(proc.stdout)
    start = said.index(f"Done: 3 rollouts in {rel}")
    summary = said[start:]
    first, last = rollouts[0]["rollout/raw_reward"], rollouts[-1]["rollout/raw_reward"]
    assert summary[1] == (f"reward (rollout/raw_reward): {first:.3f} (rollout 0) -> {last:.3f} (rollout 2), "
                          f"{last - first:+.3f}")
    assert summary[2] == f"plot: {rel}/reward.png" and (run / "reward.png").stat().st_size > 0
    commands = [shlex.split(line.split("   (")[0].removeprefix("next: ")) for line in summary[3:]]
    assert commands == [["relax", "doctor", str(rel)], ["relax", "inspect", str(rel)],
                        ["relax", "debug=train_only",
                         f"debug.load_rollout_data={rel}/rollout_data/{{rollout_id}}.pt"]]
    assert (cwd / rel / "rollout_data" / "0.pt").is_file() and (cwd / rel / "train_data").is_dir()
    assert summary == messages((run / "relax.log").read_text())[-len(summary):]  # in the log file too


def test_piped_output_has_log_lines_only(dumped):
    """No progress bar where stderr is a file: no carriage return anywhere, every line a log
    line, and a progress line per rollout (a tenth of 3) with the rollout's reward."""
    _, run, proc = dumped
    assert "\r" not in proc.stdout + proc.stderr and "rollouts:" not in proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines and all(LOG_LINE.match(line) for line in lines), [x for x in lines if not LOG_LINE.match(x)]
    rollouts, _ = read_metrics(run)
    progress = [m for m in messages(proc.stdout) if m.startswith("rollouts ")]
    assert [m.split(" s/rollout")[0].rsplit(", ", 1)[0] for m in progress] == [
        f"rollouts {i + 1}/3: reward {r['rollout/raw_reward']:.3f} (rollout {i})"
        for i, r in enumerate(rollouts)]
    assert progress[-1].endswith(", 0s left")


def run_in_terminal(cwd: Path, *args: str) -> str:
    """`relax <args>` with stdout and stderr on a pseudo-terminal 120 columns wide (a fork of
    the test session's fork server, like relax_cli); returns what the terminal received."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    tty = os.ttyname(slave)
    proc = cli_context().Process(target=_cli_in_fork, args=(str(cwd), list(args), dict(os.environ), tty, tty))
    proc.start()
    out = b""
    while True:  # (the slave stays open here: a read with no writer left would fail, not wait)
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            out += os.read(master, 65536)
        elif not proc.is_alive():
            break
    proc.join()
    os.close(slave)
    os.close(master)
    assert proc.exitcode == 0, out.decode()[-3000:]
    return out.decode()


def test_a_terminal_gets_the_bar_and_whole_log_lines(tmp_path, tiny_path):
    out = run_in_terminal(tmp_path, *SHORT)
    assert "rollouts: 100%|" in out and "reward=" in out  # the bar, with the reward
    assert not re.search(r"\] - rollouts \d+/3:", out)  # no progress log lines: the bar says it
    starts = [m.start() for m in re.finditer(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]\[", out)]
    assert len(starts) >= 7  # Building, 3 x Finish rollout, the summary
    assert all(i == 0 or out[i - 1] in "\r\n" for i in starts)  # a log line never starts inside the bar
    assert "Done: 3 rollouts in outputs/runs/" in out


@pytest.fixture(scope="module")
def replayed(dumped):
    """The dumped run's rollouts replayed with the command its summary printed."""
    cwd, _, proc = dumped
    line = next(m for m in messages(proc.stdout) if m.startswith("next: relax debug=train_only"))
    args = shlex.split(line.split("   (")[0].removeprefix("next: "))[1:]
    replay = relax_cli(*args, "hydra.run.dir=outputs/replay", cwd=cwd)
    assert replay.returncode == 0, replay.stderr[-3000:]
    return cwd / "outputs" / "replay", replay


def test_the_printed_replay_command_runs_and_its_rewards_are_called_replayed(dumped, replayed):
    _, run, _ = dumped
    rollouts, _ = read_metrics(run)
    first, last = rollouts[0]["rollout/raw_reward"], rollouts[-1]["rollout/raw_reward"]
    said = messages(replayed[1].stdout)
    assert said[said.index("Done: 3 rollouts in outputs/replay") + 1] == (
        f"reward: not this run's (debug=train_only trains on replayed rollouts, scored when they were "
        f"made: {first:.3f} (rollout 0) -> {last:.3f} (rollout 2))")
    assert not any(m.startswith("next: relax debug=train_only") for m in said)  # it just did that


def write_metrics(run: Path, rewards: list[float]) -> None:
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"rollout_id": i, "rollout/raw_reward": r}) + "\n" for i, r in enumerate(rewards)))


def test_a_long_runs_reward_is_the_mean_of_a_tenth_at_each_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rewards = [0.1 * (i % 3) + i / 100 for i in range(25)]  # 25 rollouts: the first and last 2
    write_metrics(tmp_path / "run", rewards)
    lines = log_summary(tmp_path / "run", "full", None, None, None)
    start, end = (rewards[0] + rewards[1]) / 2, (rewards[23] + rewards[24]) / 2
    assert lines == ["Done: 25 rollouts in run",
                     f"reward (rollout/raw_reward): {start:.3f} (rollouts 0-1) -> {end:.3f} "
                     f"(rollouts 23-24), {end - start:+.3f}",
                     "next: relax doctor run   (the run's health: what went wrong, if anything)"]
    lines = log_summary(tmp_path / "run", "rollout_only", None, str(tmp_path / "my rollouts/{rollout_id}.pt"),
                        None)
    assert lines[1].endswith(
        "(debug=rollout_only trains nothing: the policy never changed, the change is noise)")
    assert lines[-1].startswith(
        "next: relax debug=train_only debug.load_rollout_data='my rollouts/{rollout_id}.pt'")
    write_metrics(tmp_path / "empty", [])
    assert log_summary(tmp_path / "empty", "full", None, None, None)[:2] == [
        "Done: 0 rollouts in empty", "reward: no rollout finished"]


def test_the_reward_plot_says_where_kl_was_measured():
    def rollouts(kl_at):
        return [{"rollout_id": i, "rollout/raw_reward": 0.5, **({"rollout/kl": 0.0} if i in kl_at else {})}
                for i in range(4)]
    assert reward_plot_title("run", rollouts({0, 1, 2, 3})) == (
        "run: mean raw reward (blue) and KL(actor || reference) (red) per rollout\nKL at every rollout")
    assert reward_plot_title("run", rollouts({0})) == (
        "run: mean raw reward (blue) and KL(actor || reference) (red) per rollout\nKL at 1 of 4 rollouts, "
        "only where the reference ran (the first step, algo.use_kl_loss, train.ref_log_probs_interval)")
    assert reward_plot_title("run", rollouts(set())) == (
        "run: mean raw reward per rollout\nno KL: it is measured where the reference ran (the first step, "
        "algo.use_kl_loss, train.ref_log_probs_interval)")


def run_compare(*args: str) -> tuple[int, str]:
    """`relax compare <args>` in-process, stdout and stderr in one stream, as a terminal shows them."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = compare(list(args))
    return code, out.getvalue()


def test_compare_of_runs_of_different_models_says_so_first(dumped, tmp_path, tiny_path, family_model):
    cwd, tiny_run, _ = dumped
    built = json.loads((tiny_run / "built.json").read_text())
    assert (built["model_path"], built["model_fingerprint"]) == (str(tiny_path), model_fingerprint(tiny_path))
    llama = family_model("llama")
    proc = relax_cli(*SHORT, "model=hf", f"model.path={llama}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    llama_run = only_run_dir(tmp_path)
    before = {p: sorted(os.listdir(p)) for p in (tiny_run, llama_run)}

    code, out = run_compare(str(tiny_run), str(llama_run))
    assert code == 2 and out == (
        f"relax compare: error: different models: the baseline {tiny_run.name} trained {tiny_path} "
        f"(architecture {model_fingerprint(tiny_path)}), {llama_run.name} {llama} (architecture "
        f"{model_fingerprint(llama)}): their per-step differences are not a layout's, the verdicts compare "
        f"different models (--allow-different-models judges them anyway)\n")
    assert before == {p: sorted(os.listdir(p)) for p in (tiny_run, llama_run)}  # nothing written

    code, out = run_compare(str(tiny_run), str(llama_run), "--allow-different-models")
    assert code == 1 and out.startswith("relax compare: note: different models: the baseline ")
    assert out.index("note: different models") < out.index("relax compare (baseline") < out.index("DIVERGED")


def test_compare_of_runs_of_one_model_has_no_such_note(dumped, replayed):
    """The replay trained the same model on the same rollouts: equivalent, and no word of models."""
    code, out = run_compare(str(dumped[1]), str(replayed[0]))
    assert code == 0 and "different models" not in out and "relax compare (baseline" in out


def test_a_model_is_its_folder_name_and_its_architecture():
    """Runs from before built.json named the architecture go by folder name; the same folder in
    another machine's cache is the same model; another folder may be other weights (or a copy:
    --allow-different-models)."""
    def job(name, model, fingerprint):
        return Job(Path(name), name, model=model, model_fingerprint=fingerprint)
    base = job("a", "/m/one", "f1")
    assert same_model([base, job("old", "/m/one", None), job("unbuilt", None, None),
                       job("elsewhere", "/home/ci/.cache/m/one", "f1")], base, False) is base
    for other in (job("b", "/m/two", "f1"), job("c", "/m/one", "f2")):
        with pytest.raises(ConfigError, match=f"different models: the baseline a trained /m/one "
                                              f"\\(architecture f1\\), {other.name} {other.model}"):
            same_model([base, other], base, False)
