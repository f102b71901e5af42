"""Tools never need to write into a run, and a full disk ends a run cleanly (issue 46, item 3).

`relax doctor`, `inspect` and `compare` (`--layers` too) on a run they cannot write (a shared
results disk: here a read-only bind mount, which binds root too) print their report, skip
their plots with a one-line note naming `--out`, and leave the run as it was; with `--out DIR`
the plots (and doctor.md) go into DIR; an `--out` that cannot be written is refused at once.
A disk that fills mid-run (a real tmpfs, filled by the `fill_disk_at` fault) ends the run with
status `failed`, the reason (ENOSPC, which file) in one line and exit 2, and no metrics line
cut in half."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

from .conftest import relax_cli, status_of

RUN = ["rollout.num_rollout=2", "rollout.rollout_batch_size=4", "checkpoint.save_interval=null", "debug=dump",
       "debug.dump_layers=${hydra:runtime.output_dir}/layers"]


def mount(*args: str) -> bool:
    try:
        return subprocess.run(["mount", *args], capture_output=True).returncode == 0
    except FileNotFoundError:  # no mount command
        return False


@contextmanager
def read_only(folder: Path):
    """`folder` read-only for real: a read-only bind mount where mount is allowed (root ignores
    permission bits), else chmod a-w for a user who is not root; skipped where a write still
    succeeds."""
    bound = mount("--bind", str(folder), str(folder))
    if not (bound and mount("-o", "remount,bind,ro", str(folder))):
        subprocess.run(["chmod", "-R", "a-w", str(folder)], check=True)
    try:
        if not why_not_writable(folder):
            pytest.skip("cannot make a read-only folder here (root without mount)")
        yield
    finally:
        if bound:
            subprocess.run(["umount", str(folder)], check=True)
        subprocess.run(["chmod", "-R", "u+w", str(folder)], check=True)


def why_not_writable(folder: Path) -> str | None:
    """What this machine says to a file made in `folder` (Read-only file system, or Permission
    denied where the fallback is chmod), or None where it is made."""
    try:
        (folder / "probe").write_text("x")
    except OSError as e:
        return e.strerror
    return None


@contextmanager
def small_tmpfs(folder: Path, size: str = "8m"):
    folder.mkdir()
    if not mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)):
        pytest.skip("mount -t tmpfs is not allowed here: no real full disk to test with")
    try:
        yield folder
    finally:  # (lazily: a killed rank process may hold its working directory a moment longer)
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_path) -> Path:
    """Two copies of one finished run (rollout, train and layer dumps), on a read-only mount."""
    root = tmp_path_factory.mktemp("read_only")
    proc = relax_cli(*RUN, f"hydra.run.dir={root}/made", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shared = root / "shared"
    for name in ("a", "b"):
        shutil.copytree(root / "made", shared / name)
    with read_only(shared):
        yield shared


# (tool and its arguments, the files --out gets, what the report says)
TOOLS = {
    "doctor": (["doctor", "{a}"], {"doctor.md", "doctor_curves.png", "doctor_logprob_hist.png"},
               r"\[PASS\] 7\. non-finite metrics"),
    "inspect": (["inspect", "{a}"], {"token_logprobs_0.png"}, r"largest \|log_probs - rollout_log_probs\|"),
    "compare": (["compare", "{a}", "{b}"], {"compare.png"}, r"b .* equivalent"),
    "compare_layers": (["compare", "--layers", "{a}", "{b}"], {"compare_layers.png"},
                       r"(?m)^b: departs nowhere$"),
    "mismatch": (["mismatch", "{a}", "--rollout", "0"], {"mismatch_0.png"}, r"relax mismatch: rollout 0: mean"),
}


def tool_args(tool: str, runs: Path) -> list[str]:
    return [arg.format(a=runs / "a", b=runs / "b") for arg in TOOLS[tool][0]]


@pytest.mark.parametrize("tool", TOOLS)
def test_a_tool_on_a_read_only_run_prints_its_report_and_a_note_on_its_plots(tool, runs, tmp_path):
    before = snapshot(runs)
    proc = relax_cli(*tool_args(tool, runs), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert re.search(TOOLS[tool][2], proc.stdout), proc.stdout[-3000:]
    beside = runs / "a" / "plots" if tool == "inspect" else runs / "a"
    what = "doctor.md or plots" if tool == "doctor" else "plots"
    note = (f"note: no {what}: {beside} cannot be written ({why_not_writable(runs / 'a')}); "
            f"relax {tool.split('_')[0]} ... --out DIR writes them there")
    assert note in proc.stdout.splitlines(), proc.stdout[-3000:]
    assert snapshot(runs) == before


def plot_and_note(tool: str, report: dict) -> tuple[str | None, str | None]:
    """Where --json says the tool's plot (doctor: its report) went, and its note."""
    if tool == "inspect":
        return report["train_join"]["token_plot"], report["train_join"]["plot_note"]
    return report["report" if tool == "doctor" else "plot"], report["note"]


@pytest.mark.parametrize("tool", TOOLS)
def test_out_takes_a_tools_plots_elsewhere(tool, runs, tmp_path):
    before = snapshot(runs)
    out = tmp_path / "figures" / "new"  # made if missing
    proc = relax_cli(*tool_args(tool, runs), "--out", str(out), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == TOOLS[tool][1]
    assert all((out / name).stat().st_size > 1000 for name in TOOLS[tool][1])
    plot, note = plot_and_note(tool, json.loads(proc.stdout))
    assert Path(plot).parent == out and note is None
    assert snapshot(runs) == before


def test_an_out_that_cannot_be_written_is_refused_at_once(runs, tmp_path):
    for tool in TOOLS:
        proc = relax_cli(*tool_args(tool, runs), "--out", str(runs / "a" / "figures"), cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.splitlines()[-1] == (f"relax {tool.split('_')[0]}: error: argument --out: "
                                                f"{runs / 'a' / 'figures'}: cannot write there "
                                                f"({why_not_writable(runs / 'a')})")
        assert proc.stdout == ""


def test_a_disk_that_fills_mid_run_fails_the_run_with_the_reason_in_one_line(tmp_path, tiny_path):
    with small_tmpfs(tmp_path / "disk") as disk:
        proc = relax_cli("rollout.num_rollout=20", "rollout.rollout_batch_size=4",
                         "checkpoint.save_interval=null", f"hydra.run.dir={disk}/run", cwd=disk,
                         env={"RELAX_FAULT": "fill_disk_at:metrics_written:1"})
        run = disk / "run"
        assert os.statvfs(disk).f_bavail == 0  # the disk is full indeed
        assert proc.returncode == 2, proc.stderr[-3000:]
        reason = ("[Errno 28] disk full (ENOSPC: No space left on device) while writing "
                  f"{run / 'metrics.jsonl'}")
        out = proc.stdout + proc.stderr
        assert "Traceback" not in out and "Logging error" not in out, out[-3000:]
        errors = [line for line in out.splitlines() if "[ERROR]" in line]
        assert [e.split(" - ", 1)[1] for e in errors] == [reason], out[-3000:]
        assert status_of(run)["status"] == "failed" and status_of(run)["error"] == reason
        text = (run / "metrics.jsonl").read_text()
        records = [json.loads(line) for line in text.splitlines()]  # each line whole
        assert text.endswith("\n") and [r["rollout_id"] for r in records if "step" not in r][:1] == [0]
        assert not (run / "reward.png").exists()


@pytest.mark.slow  # (~30 s on a busy 2-core machine: two rank processes)
def test_a_disk_that_fills_under_a_trainer_rank_fails_the_run_with_the_reason(tmp_path, tiny_path):
    """parallel=dp2: the ranks write their train data, and rank 1's DiskFull reaches the driver
    as itself (relax.errors.USER_ERRORS), not as a RankError with the rank's traceback."""
    with small_tmpfs(tmp_path / "disk") as disk:
        proc = relax_cli("rollout.num_rollout=5", "rollout.rollout_batch_size=4",
                         "checkpoint.save_interval=null", "parallel=dp2",
                         "debug.save_train_data=${hydra:runtime.output_dir}/train_data/{rollout_id}_{rank}.pt",
                         f"hydra.run.dir={disk}/run", cwd=disk,
                         env={"RELAX_FAULT": "fill_disk_at:metrics_written:1"})
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
        error = status_of(disk / "run")["error"]
        assert re.fullmatch(r"\[Errno 28\] disk full \(ENOSPC: No space left on device\) while writing "
                            rf"{disk}/run/train_data/1_[01]\.pt", error), error
        assert [line.split(" - ", 1)[1] for line in out.splitlines() if "[ERROR]" in line] == [error]


def test_a_full_disk_in_a_rank_process_reaches_the_driver_as_itself():
    """The pipe from a trainer rank (relax.cluster.ranks.receive): its DiskFull is raised in the
    driver as itself (the run's one line), not wrapped in a RankError with the rank's traceback."""
    import errno
    from multiprocessing import Pipe

    from relax.cluster.ranks import receive
    from relax.errors import DiskFull

    ours, rank = Pipe()
    rank.send(("error", DiskFull(errno.ENOSPC, "disk full (ENOSPC: ...) while writing x/train_data/0_1.pt")))
    with pytest.raises(DiskFull, match=r"^\[Errno 28\] disk full .* while writing x/train_data/0_1\.pt\n"
                                       r"in trainer rank 1$"):
        receive(ours, None, "trainer rank 1", "rank1.log", kill=lambda: None)


def append_past_a_file_size_limit(path: Path, write) -> OSError | None:
    """`write` with the process's file size limit 10 bytes past `path`'s size: the kernel writes
    10 bytes of the line, then refuses the rest (EFBIG), as a disk filling mid-line does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 10, hard))
    try:  # (nothing else may be written meanwhile: pytest's captured output counts too)
        write()
    except OSError as e:
        return e
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    return None


def test_an_append_that_fails_leaves_the_file_as_it_was(tmp_path):
    from relax.files import append_jsonl

    path, record = tmp_path / "metrics.jsonl", {"rollout_id": 1, "note": "x" * 100}
    append_jsonl(path, {"rollout_id": 0})
    before = path.read_bytes()

    def plain_append():  # what a run wrote before: half a line left behind
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    assert append_past_a_file_size_limit(path, plain_append).errno == 27
    assert path.read_bytes() == before + (json.dumps(record) + "\n").encode()[:10]
    path.write_bytes(before)
    e = append_past_a_file_size_limit(path, lambda: append_jsonl(path, record))
    assert e.errno == 27 and path.read_bytes() == before
    append_jsonl(path, record)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"rollout_id": 0}, record]


def test_on_a_full_disk_append_and_atomic_writes_raise_disk_full_and_leave_nothing(tmp_path, capsys):
    import logging

    from relax.errors import DiskFull
    from relax.faults import fill_disk
    from relax.files import append_jsonl, atomic_write_text, rewrite_small_file
    from relax.logger import lose_log_lines_on_a_full_disk

    with small_tmpfs(tmp_path / "disk", size="1m") as disk:
        (disk / "status.json").write_text('{"status": "running"}')
        append_jsonl(disk / "m.jsonl", {"a": 1})
        handler = logging.FileHandler(disk / "relax.log")
        logging.getLogger().addHandler(handler)
        try:
            lose_log_lines_on_a_full_disk()
            fill_disk(str(disk))
            with pytest.raises(DiskFull, match=r"disk full \(ENOSPC: .*\) while writing .*/m.jsonl$"):
                append_jsonl(disk / "m.jsonl", {"b": "x" * 5000})
            assert (disk / "m.jsonl").read_text() == '{"a": 1}\n'
            with pytest.raises(DiskFull, match=r"while writing .*/new.json$"):
                atomic_write_text(disk / "new.json", "x" * 5000)
            rewrite_small_file(disk / "status.json", '{"status": "failed"}')  # in its own block
            assert (disk / "status.json").read_text() == '{"status": "failed"}'
            for _ in range(2):
                logging.getLogger("relax").warning("y" * 5000)
            assert capsys.readouterr().err.count(f"relax: {disk / 'relax.log'}: disk full") == 1
        finally:
            logging.getLogger().removeHandler(handler)
            with contextlib.suppress(OSError):  # (its last lines: still no space)
                handler.close()
        assert sorted(p.name for p in disk.iterdir()) == [".fill_disk", "m.jsonl", "relax.log", "status.json"]
