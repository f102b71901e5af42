"""The driver process of a run: its status.json, how it stops, and its log.

How it works in detail: docs/reliability.md, "Inside `relax/process.py`".
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from multiprocessing import resource_tracker
from pathlib import Path

from relax.errors import ConfigError, DiskFull, EngineDied, Interrupted

log = logging.getLogger("relax")
STATUS_FILE = "status.json"
HOST = socket.gethostname()


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks since boot) of process `pid`, from
    /proc/<pid>/stat (Linux), or None if there is no such process. State "Z": a zombie, a
    process that has exited and whose parent has not reaped it yet. The one reader of /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after "pid (comm)", which may hold spaces: field 3 on
    return fields[0], int(fields[1]), int(fields[19])


def start_time(pid: int) -> int | None:
    """When the running process `pid` started (clock ticks since boot); None when it is gone or
    has exited (a zombie), so a run whose driver exited is never taken for a live one."""
    stat = proc_stat(pid)
    return None if stat is None or stat[0] == "Z" else stat[2]


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class StatusFile:
    """This process's status.json in `run_dir`: every write carries who is writing it. Nothing
    is written before `claim()` has checked that no other live run writes that dir."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.claimed = Path(run_dir), False
        self.identity = {"pid": os.getpid(), "host": HOST, "pid_start": start_time(os.getpid()),
                         "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    def check(self) -> dict | None:
        """The dir's status, unless a live run writes the dir (a ConfigError); writes nothing."""
        previous = read_status(self.run_dir)
        if live_elsewhere(previous):
            raise ConfigError(f"{self.run_dir} is being written by a live run ({describe(previous)}): "
                              f"stop it first (kill -INT {previous['pid']}), or run in another directory")
        return previous

    def claim(self) -> None:
        previous = self.check()
        if previous and previous["status"] == "running":
            log.warning("%s: the previous run in this directory %s", self.run_dir, describe(previous))
        self.claimed = True
        self.write("running")

    def write(self, status: str, **extra) -> None:
        """On a full disk even in place (files.rewrite_small_file); where that fails too, the
        run goes on (or ends) with one line saying so: its console still says what happened."""
        if self.claimed:
            from relax.files import rewrite_small_file  # (imports torch, which the reaper must not load)

            try:
                rewrite_small_file(self.run_dir / STATUS_FILE,
                                   json.dumps({"status": status, **extra, **self.identity}, indent=2))
            except DiskFull as e:
                log.error("status %s not recorded: %s", status, e)


def read_status(run_dir: Path) -> dict | None:
    """A run dir's status.json, None if it has none, `{"status": "unreadable", ...}` if garbage."""
    path = Path(run_dir) / STATUS_FILE
    if not path.is_file():
        return None
    try:
        status = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return {"status": "unreadable", "error": f"{path}: {type(e).__name__}: {e}"}
    if not isinstance(status, dict) or not isinstance(status.get("status"), str):
        return {"status": "unreadable", "error": f"{path}: not a Relax status record"}
    return status


def is_alive(status: dict) -> bool | None:
    """For a `running` status: True (its process runs), False (it died), or None (it ran on
    another host, or was written before Relax recorded pids: cannot tell)."""
    pid = status.get("pid")
    if not isinstance(pid, int) or status.get("host") != HOST:
        return None
    if not Path("/proc/self/stat").exists():  # not Linux: whether the pid exists is all one can tell
        return _exists(pid)
    ticks = start_time(pid)
    return ticks is not None and status.get("pid_start") in (None, ticks)


def live_elsewhere(status: dict | None) -> bool:
    """A `running` status written by another process that is still alive."""
    return bool(status) and status["status"] == "running" and is_alive(status) is True and \
        (status.get("pid"), status.get("host")) != (os.getpid(), HOST)


def describe(status: dict | None) -> str:
    """One line on a run's state, for doctor, inspect, compare and resume."""
    if status is None:
        return "no status.json"
    state = status["status"]
    if state == "unreadable":
        return f"status.json unreadable ({status['error']})"
    if state != "running":
        error = status.get("error")
        return state + (f": {error}" if error else "")
    where = f"pid {status.get('pid')} on {status.get('host')}"
    alive = is_alive(status)
    if alive:
        return f"running ({where}, alive)"
    if alive is None:
        why = "no pid recorded" if "pid" not in status else f"this is {HOST}"
        return f"running according to status.json ({where}; {why}: cannot check whether it is alive)"
    return (f"died: status.json says running but its process ({where}) is gone (killed with "
            f"SIGKILL, out of memory, or the machine restarted); resume=<run dir> continues from "
            f"its newest complete checkpoint")


@contextmanager
def sigterm_left_to_the_driver():
    """Processes started inside (a private Ray instance's, SGLang's scheduler) inherit SIGTERM
    blocked, as Ray and SGLang block SIGINT there themselves: a SIGTERM to every process of the
    job (`timeout`, `kill -- -PGID`, Slurm, systemd) is then the driver's, which stops after the
    rollout and stops them itself, instead of each dying of it under a running job."""
    # started inside, multiprocessing's resource tracker would unblock SIGTERM again: it blocks
    # SIGINT and SIGTERM around its own start, then unblocks them, whatever they were before
    resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def engine_died(signum, frame):
    """rollout=sglang's SIGQUIT handler while the engine starts (SGLang's custom_sigquit_handler).
    A scheduler or detokenizer that fails there sends the driver SIGQUIT, and SGLang's own handler
    SIGKILLs the driver and its children: exit 137, status.json left `running`, no word from
    Relax. Raised instead, it ends the run as a failure, with its status and message."""
    raise EngineDied("an SGLang process (scheduler or detokenizer) exited while the engine started; "
                     "its error is above in the log (often memory: rollout.mem_fraction_static, "
                     "rollout.max_total_tokens)")


class Stop:
    """SIGINT and SIGTERM, while installed: the first asks for a stop after the current
    rollout (`requested`, `check`), the second aborts at once (KeyboardInterrupt)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "Stop":
        self._previous = {s: signal.getsignal(s) for s in self.SIGNALS}
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def install(self) -> None:
        """(Again, after a library that sets its own handlers.)"""
        if self._previous:
            for s in self.SIGNALS:
                signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        # said from a thread: the signal may land inside a log handler's write, which this
        # thread would enter again (RuntimeError: reentrant call inside BufferedWriter)
        name = signal.Signals(signum).name
        if self.signum is not None:
            threading.Thread(target=log.error, args=("%s again: aborting now", name)).start()
            raise KeyboardInterrupt
        self.signum = signum
        threading.Thread(target=log.warning, args=(
            "%s: stopping after the current rollout (and writing its checkpoint when checkpointing is on); "
            "%s again aborts at once", name, name)).start()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def check(self, where: str) -> None:
        if self.signum is not None:
            raise Interrupted(self.signum, f"stopped by {signal.Signals(self.signum).name} {where}")


class LogGuard:
    """What Hydra's logging set up (root handlers and level, which loggers are enabled),
    put back by `restore()` after a library reconfigured it."""

    def __init__(self):
        root = logging.getLogger()
        self.handlers, self.level = list(root.handlers), root.level
        self.enabled = {lg for lg in logging.root.manager.loggerDict.values()
                        if isinstance(lg, logging.Logger) and not lg.disabled}

    def restore(self) -> None:
        root = logging.getLogger()
        if root.handlers != self.handlers or root.level != self.level:
            log.debug("logging was reconfigured by a library: restoring Relax's handlers")
        root.handlers[:] = self.handlers
        root.setLevel(self.level)
        for handler in self.handlers:
            if isinstance(handler, logging.FileHandler) and handler.stream is None:  # closed by it
                handler.mode = "a"  # reopen without truncating the log
                handler.stream = handler._open()
        for name, logger in logging.root.manager.loggerDict.items():
            ours = logger in self.enabled or name.split(".")[0] == "relax"
            if isinstance(logger, logging.Logger) and ours:
                logger.disabled = False


def output_subdir(run_dir: Path) -> Path:
    """Where a job keeps its config: `.hydra`, or `.hydra/restart_<n>` for the n-th later job in
    the same run dir (a resume into the run's own dir), so the config a run was started with,
    which `relax compare` and `relax doctor` read, is never overwritten."""
    base = Path(run_dir) / ".hydra"
    if not (base / "config.yaml").exists():
        return base
    n = 1
    while (base / f"restart_{n}").exists():
        n += 1
    return base / f"restart_{n}"


class HeldFile(logging.Filter):
    """A log file handler's records, held in memory until `release` writes them (and lets the
    rest through), or `drop` lets none through. The handler opens its file at its first record
    (conf/config.yaml: delay), so a held file is never created."""

    def __init__(self, handler: logging.FileHandler):
        super().__init__()
        self.handler, self.records = handler, []
        handler.addFilter(self)

    def filter(self, record) -> bool:
        if self.records is not None:
            self.records.append(record)
        return False

    def release(self) -> None:
        self.handler.removeFilter(self)
        for record in self.records:
            self.handler.handle(record)
        self.records = []

    def drop(self) -> None:
        self.records = None


class Job:
    """One Hydra job's writes into its run dir: status.json, its config (.hydra/) and its log
    files, all held back until `accept()`, after the start-up checks passed. Hydra itself
    writes nothing there (conf/config.yaml: output_subdir null), so an empty dir at the start
    is one Hydra created for this job."""

    def __init__(self, cfg):
        # Hydra here, not at the top: the reaper's process imports this module and starts light
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        from omegaconf import OmegaConf

        hydra = HydraConfig.get()
        self.run_dir, self.accepted = Path(hydra.runtime.output_dir), False
        self.sweep, self.launcher = hydra.mode == RunMode.MULTIRUN, hydra.launcher._target_
        self.configs = {"config.yaml": OmegaConf.to_yaml(cfg),  # the files Hydra would save
                        "hydra.yaml": OmegaConf.to_yaml(HydraConfig.instance().cfg),
                        "overrides.yaml": OmegaConf.to_yaml(hydra.overrides.task)}
        self.created = not any(self.run_dir.iterdir())
        self.status = StatusFile(self.run_dir)
        self.logs = [HeldFile(h) for h in logging.getLogger().handlers
                     if isinstance(h, logging.FileHandler) and Path(h.baseFilename).parent == self.run_dir]

    def accept(self) -> None:
        """The run dir is this job's from here (a live run that took it meanwhile refuses it)."""
        self.status.claim()
        self._keep()

    def _keep(self) -> None:
        from relax.files import atomic_write_text  # (imports torch, which the reaper must not load)

        folder = output_subdir(self.run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in self.configs.items():
            atomic_write_text(folder / name, text)
        for held in self.logs:
            held.release()
        self.accepted = True

    def end(self, status: str, **extra) -> None:
        """The job's last status. A job that ends before it was accepted (refused) records it
        only in a dir it created: another run's dir is left exactly as it was."""
        if not self.accepted:
            if not self.created:
                for held in self.logs:
                    held.drop()
                return
            self.status.claimed = True
            self._keep()
        self.status.write(status, **extra)

    def user_error(self, error: Exception) -> None:
        """Ends the job with a user error's one line and exit 2. In a sweep whose jobs run in
        this process (Hydra's basic launcher) the sweep goes on, and relax.cli exits 2 at its
        end; a launcher that ran the job elsewhere gets it raised, to record."""
        self.end("failed", error=str(error))
        if self.sweep and self.launcher != BASIC_LAUNCHER:
            raise error
        log.error("%s", f"job {self.run_dir.name}: {error}" if self.sweep else error)
        if not self.sweep:
            sys.exit(2)
        _failed_jobs.append(self.run_dir.name)


BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
_failed_jobs: list[str] = []  # this process's sweep jobs that ended with a user error


def take_failed_jobs() -> list[str]:
    """The sweep jobs noted since the last call (relax.cli: the sweep's exit code)."""
    failed = list(_failed_jobs)
    _failed_jobs.clear()
    return failed


def close_on_exit(parts: ExitStack, part, method: str):
    """Call `part.<method>()` when `parts` closes (nothing for None). ExitStack runs every
    callback even when one raises; the first error (the loop's own, else the first close's)
    propagates and later close errors are logged, not lost and not masking it."""
    if part is None:
        return part
    close = getattr(part, method)

    def exit_(exc_type, exc, tb) -> bool:
        try:
            close()
        except Exception:
            if exc is None:
                raise
            log.exception("%s.%s failed while %s propagates", type(part).__name__, method, exc_type.__name__)
        return False
    parts.push(exit_)
    return part
