"""The driver process (relax/process.py): SIGTERM and Ctrl-C stop a run cleanly (the rollout
finished, its checkpoint written, status `interrupted`, no traceback; a second Ctrl-C aborts
at once), status.json says who runs it, a live run's dir is never taken over, a run resumed
in its own dir keeps its record, and an engine that reconfigures logging keeps relax.log."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax.checkpoint import scan
from relax.rollout.torch_engine import TorchEngine
from relax.logger import read_metrics
from relax.process import HOST, describe, read_status

LONG = ["rollout.num_rollout=1000", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
        "checkpoint.save_interval=100", "hydra.run.dir=outputs/run"]


def wait_for(path: Path, text: str, timeout: float = 120) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if path.is_file() and text in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} in {path} after {timeout} s")


def stopped_cleanly(cwd: Path, signum: int, exitcode: int, run: str = "outputs/run") -> tuple[dict, int]:
    """The run in `run` ended as a clean stop: (its status, the last rollout it finished)."""
    run = cwd / run
    status = read_status(run)
    assert exitcode == 128 + signum, (cwd / "out.log").read_text()[-3000:]
    assert status["status"] == "interrupted" and status["host"] == HOST and isinstance(status["pid"], int)
    name = signal.Signals(signum).name
    assert f"stopped by {name} after rollout" in status["error"]
    last = int(status["error"].split("after rollout ")[1].split(";")[0])
    rollouts, _ = read_metrics(run)
    assert [r["rollout_id"] for r in rollouts] == list(range(last + 1))  # the rollout was finished
    assert [c.name for c in scan(run)[0]] == [f"rollout_{last:06d}"]  # ... and its checkpoint written
    assert f"continue with resume={run}" in status["error"]
    assert "Traceback" not in (cwd / "out.log").read_text()
    return status, last


def test_sigterm_stops_after_the_rollout_with_a_checkpoint_then_resume_continues(tmp_path, fork_cli):
    proc = fork_cli(tmp_path, *LONG)
    wait_for(tmp_path / "outputs/run/relax.log", "Finish rollout 1")
    assert describe(read_status(tmp_path / "outputs/run")) == f"running (pid {proc.pid} on {HOST}, alive)"
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(120)
    _, last = stopped_cleanly(tmp_path, signal.SIGTERM, proc.exitcode)
    # resume=<run dir> into the same dir: the stopped run continues where it stopped
    proc = fork_cli(tmp_path, *LONG, f"rollout.num_rollout={last + 3}", "resume=outputs/run")
    proc.join(120)
    assert proc.exitcode == 0, (tmp_path / "out.log").read_text()[-3000:]
    rollouts, steps = read_metrics(tmp_path / "outputs/run")
    assert [r["rollout_id"] for r in rollouts] == list(range(last + 3))
    assert [s["rollout_id"] for s in steps] == list(range(last + 3))


def test_ctrl_c_stops_cleanly_and_twice_aborts_at_once(tmp_path, fork_cli):
    once, twice = tmp_path / "once", tmp_path / "twice"
    for cwd in (once, twice):
        cwd.mkdir()
    proc = fork_cli(once, *LONG)
    wait_for(once / "outputs/run/relax.log", "Finish rollout 1")
    os.kill(proc.pid, signal.SIGINT)
    proc.join(120)
    stopped_cleanly(once, signal.SIGINT, proc.exitcode)
    assert "SIGINT again aborts at once" in (once / "outputs/run/relax.log").read_text()

    # held after rollout 0's metrics, before its checkpoint: the second Ctrl-C surely comes
    # while the rollout is in progress (on a loaded machine it once came after its checkpoint)
    proc = fork_cli(twice, *LONG, fault="pause_at:metrics_written:1")
    wait_for(twice / "outputs/run/relax.log", "Finish rollout 0")
    os.kill(proc.pid, signal.SIGINT)
    wait_for(twice / "outputs/run/relax.log", "SIGINT: stopping after the current rollout")
    os.kill(proc.pid, signal.SIGINT)
    proc.join(120)
    status = read_status(twice / "outputs/run")
    assert proc.exitcode == 130 and status["status"] == "interrupted"
    assert status["error"].startswith("aborted: the rollout in progress is lost; no checkpoint was written")
    assert "Traceback" not in (twice / "out.log").read_text()


def test_a_live_runs_dir_is_refused_and_its_status_left_alone(tmp_path, fork_cli):
    proc = fork_cli(tmp_path, *LONG)
    wait_for(tmp_path / "outputs/run/relax.log", "Finish rollout 0")
    before = (tmp_path / "outputs/run/status.json").read_text()
    (tmp_path / "second").mkdir()
    second = fork_cli(tmp_path / "second", *LONG, f"hydra.run.dir={tmp_path}/outputs/run",
                      f"resume={tmp_path}/outputs/run")
    second.join(120)
    assert second.exitcode == 2
    assert f"is being written by a live run (running (pid {proc.pid} on {HOST}, alive))" in \
        (tmp_path / "second" / "out.log").read_text()
    assert (tmp_path / "outputs/run/status.json").read_text() == before
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(120)
    assert proc.exitcode == 128 + signal.SIGTERM


def signalled_run(cwd: Path, *args: str, signum: int, group: bool = True, timeout: float = 300,
                  run: str = "outputs/run") -> subprocess.Popen:
    """`relax <LONG> <args>` in a session of its own, sent `signum` after `run`'s rollout 1 (to its
    whole process group, or to the driver alone), and waited for; SIGKILLed whatever happens."""
    proc = subprocess.Popen([sys.executable, "-m", "relax", *LONG, *args], cwd=cwd,
                            stdout=open(cwd / "out.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_for(cwd / run / "relax.log", "Finish rollout 1", timeout=timeout)
        (os.killpg if group else os.kill)(proc.pid, signum)
        proc.wait(300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_of_the_whole_process_group_is_left_to_the_driver(tmp_path, signum):
    """A terminal's Ctrl-C (SIGINT), `timeout` or `kill -- -PGID` (SIGTERM) signal every process
    of the job: dp2 trainer ranks and train.async's engine process ignore it while the driver
    lives (the fork server the ranks come from dies of SIGTERM: the ranks outlive it), so the
    driver still finishes the rollout with them and writes its checkpoint."""
    proc = signalled_run(tmp_path, "parallel=dp2", "train.async=true", signum=signum)
    stopped_cleanly(tmp_path, signum, proc.returncode)
    # ... and the killed ranks and engine left no semaphore behind (tqdm's multiprocessing lock,
    # which the resource tracker reported at exit: thread_lock_for_progress_bars)
    assert "leaked semaphore" not in (tmp_path / "out.log").read_text()
    placement = json.loads((tmp_path / "outputs/run/built.json").read_text())["placement"]
    pids = {p["pid"] for p in placement["trainer_ranks"] + placement["engines"]}
    assert len(pids) == 3 and proc.pid not in pids  # two ranks and an engine, each a process
    if signum == signal.SIGTERM:
        logs = [tmp_path / "outputs/run" / f for f in ("rank0.log", "rank1.log", "engine0.log")]
        assert all(f"SIGTERM: left to the driver (pid {proc.pid})" in f.read_text() for f in logs)


def test_a_stop_of_a_sweep_ends_its_job_cleanly_and_starts_no_other(tmp_path):
    """`timeout` or `kill -- -PGID` on `relax -m`: the job in progress stops as a single run does
    (its rollout finished, its checkpoint written, status `interrupted`) and the sweep ends there,
    with the job's exit code, instead of going on to the next job."""
    proc = signalled_run(tmp_path, "-m", "seed=1,2", "hydra.sweep.dir=outputs",
                         "hydra.sweep.subdir=run${hydra.job.num}", signum=signal.SIGTERM, run="outputs/run0")
    stopped_cleanly(tmp_path, signal.SIGTERM, proc.returncode, run="outputs/run0")
    assert not (tmp_path / "outputs/run1").exists()  # the second job never started
    assert "#1 : seed=2" not in (tmp_path / "out.log").read_text()


def test_a_run_resumed_in_its_own_dir_keeps_its_config_and_compares_equivalent(tmp_path, fork_cli):
    """Killed after rollout 2's metrics, before its checkpoint, then resumed into the same dir:
    .hydra/config.yaml is still the one the run started with (the resume's is beside it), and
    `relax compare` calls the run equivalent to an uninterrupted one."""
    args = ["rollout.num_rollout=4", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
            "checkpoint.save_interval=1"]
    for name, fault in (("whole", ""), ("resumed", "kill_at:metrics_written:3")):
        proc = fork_cli(tmp_path, *args, f"hydra.run.dir=outputs/{name}", fault=fault)
        proc.join(120)
        assert proc.exitcode == (-signal.SIGKILL if fault else 0), (tmp_path / "out.log").read_text()[-3000:]
    run = tmp_path / "outputs/resumed"
    original = (run / ".hydra/config.yaml").read_text()
    proc = fork_cli(tmp_path, *args, "hydra.run.dir=outputs/resumed", "resume=outputs/resumed")
    proc.join(120)
    assert proc.exitcode == 0, (tmp_path / "out.log").read_text()[-3000:]
    assert (run / ".hydra/config.yaml").read_text() == original and "resume: false" in original
    assert "resume: outputs/resumed" in (run / ".hydra/restart_1/config.yaml").read_text()
    compare = subprocess.run([sys.executable, "-m", "relax", "compare", str(tmp_path / "outputs/whole"),
                              str(run), "--json"], capture_output=True, text=True, timeout=300)
    assert compare.returncode == 0, compare.stdout + compare.stderr
    jobs = {j["name"]: j for j in json.loads(compare.stdout)["jobs"]}
    assert jobs["resumed"]["verdict"] == "equivalent" and jobs["resumed"]["max_loss_diff"] == 0.0


class SelfishEngine(TorchEngine):
    """An engine that configures logging for itself, as SGLang's does (basicConfig(force=True)
    at its own level), and on top disables every existing logger (dictConfig's default)."""

    def __init__(self, *args, **kwargs):
        import logging.config

        logging.basicConfig(level=logging.ERROR, format="[engine] %(message)s", force=True)
        logging.config.dictConfig({"version": 1, "root": {"level": "ERROR"}})
        super().__init__(*args, **kwargs)


def test_an_engine_that_reconfigures_logging_does_not_take_relax_log_away(tmp_path, fork_cli):
    proc = fork_cli(tmp_path, "rollout._target_=tests.test_process.SelfishEngine", "rollout.num_rollout=2",
                    "rollout.rollout_batch_size=2", "checkpoint.save_interval=null",
                    "hydra.run.dir=outputs/run")
    proc.join(120)
    assert proc.exitcode == 0, (tmp_path / "out.log").read_text()[-3000:]
    log = (tmp_path / "outputs/run/relax.log").read_text()
    assert "Finish rollout 0" in log and "Finish rollout 1" in log
    assert "Finish rollout 1" in (tmp_path / "out.log").read_text()  # the console handler, too


def test_status_json_names_this_process_and_says_when_a_run_cannot_be_checked(tmp_path):
    """status.json carries pid, host and the process's start time (so a reused pid is no live
    run); this process's own leftover `running` is no other live run (a run resumed in-process
    after a failure), and a run of another host is one whose liveness cannot be told here."""
    from relax.process import StatusFile, is_alive, live_elsewhere, start_time

    me = {"status": "running", "pid": os.getpid(), "host": HOST, "pid_start": start_time(os.getpid())}
    (tmp_path / "status.json").write_text(json.dumps(me))
    status_file = StatusFile(tmp_path)
    status_file.claim()
    status = read_status(tmp_path)
    assert {k: status[k] for k in me} == me and is_alive(status) is True and not live_elsewhere(status)
    elsewhere = {**status, "host": f"{HOST}-other"}
    assert is_alive(elsewhere) is None and not live_elsewhere(elsewhere)
    assert describe(elsewhere) == (f"running according to status.json (pid {os.getpid()} on {HOST}-other; "
                                   f"this is {HOST}: cannot check whether it is alive)")
    status_file.write("failed", error="model.path: no config.json")
    assert describe(read_status(tmp_path)) == "failed: model.path: no config.json"
    for garbage in ('{"status": ', '{"pid": 1}'):
        (tmp_path / "status.json").write_text(garbage)
        assert describe(read_status(tmp_path)).startswith("status.json unreadable (")


def test_stop_records_the_first_signal_aborts_at_the_second_and_restores_the_handlers():
    from relax.errors import Interrupted
    from relax.process import Stop

    before = {s: signal.getsignal(s) for s in Stop.SIGNALS}
    with Stop() as stop:
        stop.check("after rollout 2")  # no signal yet
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested
        try:
            stop.check("after rollout 3")
        except Interrupted as e:
            assert "stopped by SIGTERM after rollout 3" in str(e)
        else:
            raise AssertionError("no Interrupted after SIGTERM")
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("a second signal did not abort")
    assert {s: signal.getsignal(s) for s in Stop.SIGNALS} == before


def test_log_guard_puts_back_handlers_level_and_relax_loggers_without_truncating_the_log(tmp_path):
    """What an engine like SGLang's does to logging (closes and replaces the root handlers,
    raises the level, disables existing loggers) is undone; the reopened log keeps its lines."""
    import logging

    from relax.process import LogGuard

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    handler = logging.FileHandler(tmp_path / "relax.log")
    try:
        root.handlers[:] = [handler]
        root.setLevel(logging.INFO)
        early = logging.getLogger("relax.guard_test")
        guard = LogGuard()
        later = logging.getLogger("relax.guard_test_later")
        early.info("before")
        handler.close()  # the library's basicConfig(force=True) and dictConfig
        root.handlers[:] = [logging.NullHandler()]
        root.setLevel(logging.ERROR)
        early.disabled = later.disabled = True
        guard.restore()
        early.info("after")
        later.info("from a logger made after the guard")
        handler.flush()
        assert (tmp_path / "relax.log").read_text() == "before\nafter\nfrom a logger made after the guard\n"
    finally:
        handler.close()
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


def test_proc_stat_reads_a_process_whose_name_holds_spaces_and_parentheses():
    """/proc/<pid>/stat's second field is the process name in parentheses, which may itself hold
    spaces and ')': the fields after it are found from the last ')'."""
    from relax.process import proc_stat

    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        Path("/proc/self/comm").write_text("a b) c")
        os.write(ready_w, b"x")
        time.sleep(60)
        os._exit(0)
    try:
        os.read(ready_r, 1)
        assert Path(f"/proc/{pid}/comm").read_text().strip() == "a b) c"
        state, ppid, started = proc_stat(pid)
        assert state in ("R", "S") and ppid == os.getpid() and started >= proc_stat(os.getpid())[2]
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(ready_w)


def _serve_until_stopped(conn, driver) -> None:
    """A process the driver started, in short: its signals set up, then waiting on its pipe."""
    from relax.cluster.ranks import leave_stops_to_the_driver

    leave_stops_to_the_driver(driver)
    conn.send("ready")
    conn.recv()


def started_by(driver):
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_until_stopped, args=(child, driver), daemon=True)
    proc.start()
    assert parent.recv() == "ready"
    return proc, parent


def test_a_rank_ignores_the_jobs_signals_while_its_driver_lives_and_the_driver_stops_it_at_once():
    from relax.cluster.ranks import stop_processes, this_driver

    proc, conn = started_by(this_driver())
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGTERM):
        os.kill(proc.pid, signum)
    proc.join(2)
    assert proc.is_alive()
    begin = time.monotonic()
    stop_processes([proc], [conn])
    assert proc.exitcode == -signal.SIGKILL and time.monotonic() - begin < 5


def test_a_rank_dies_of_sigterm_once_its_driver_is_gone_even_as_a_zombie():
    from relax.process import start_time

    driver = subprocess.Popen(["sleep", "60"])
    proc, _ = started_by((driver.pid, start_time(driver.pid)))
    driver.kill()  # not reaped yet: a zombie, whose pid still exists
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(10)
    driver.wait()
    assert proc.exitcode == -signal.SIGTERM


def _send_status(conn) -> None:
    conn.send(Path("/proc/self/status").read_text())


def test_processes_started_with_sigterm_left_to_the_driver_have_it_blocked_and_the_driver_does_not():
    """What a private Ray instance and SGLang's scheduler are started inside: they inherit SIGTERM
    blocked (SigBlk, bit 15), the driver's own mask is as it was after."""
    from relax.process import sigterm_left_to_the_driver

    def blocked(status: str) -> bool:
        mask = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
        return bool(mask >> (signal.SIGTERM - 1) & 1)

    show = [sys.executable, "-c", "print(open('/proc/self/status').read())"]
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    with sigterm_left_to_the_driver():
        assert blocked(subprocess.run(show, capture_output=True, text=True, check=True).stdout)  # Ray's way
        ctx = multiprocessing.get_context("spawn")  # SGLang's way (its first start, the resource tracker's)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_send_status, args=(child,))
        proc.start()
        assert blocked(parent.recv())
        proc.join()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before
    assert not blocked(subprocess.run(show, capture_output=True, text=True, check=True).stdout)


def test_a_signal_that_lands_inside_a_log_write_is_said_after_it_not_inside_it():
    """A stop's message is logged from another thread: logged in the handler, it entered the log
    handler's write that the signal interrupted (on a file: RuntimeError: reentrant call)."""
    import logging

    from relax.process import Stop

    stop = Stop()

    class Probe(logging.Handler):
        depth, nested, said = 0, False, []

        def emit(self, record):
            self.depth += 1
            self.nested |= self.depth > 1
            if not stop.requested:
                stop._handle(signal.SIGTERM, None)  # as if the signal landed in this write
            self.said.append(record.getMessage())
            self.depth -= 1

    probe, logger = Probe(), logging.getLogger("relax")
    logger.addHandler(probe)
    try:
        logger.warning("a line being written")
        deadline = time.time() + 10
        while len(probe.said) < 2 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        logger.removeHandler(probe)
    assert not probe.nested and stop.requested
    assert probe.said == ["a line being written", "SIGTERM: stopping after the current rollout (and writing its "
                          "checkpoint when checkpointing is on); SIGTERM again aborts at once"]
