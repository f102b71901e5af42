"""Stops a job's private Ray instance even when the driver cannot (kill -9, a crash).

How it works in detail: docs/cluster.md, "Inside `relax/reaper.py`".
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from multiprocessing import forkserver, resource_tracker

from relax.process import proc_stat, start_time


def descendants(root: int, since_ticks: int = 0) -> list[tuple[int, int]]:
    """(pid, start time) of every live descendant of `root` started at or after `since_ticks`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        stat = proc_stat(int(entry)) if entry.isdigit() else None
        if stat:
            children.setdefault(stat[1], []).append(int(entry))
    found, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        started = start_time(pid)
        if started is not None and started >= since_ticks:
            found.append((pid, started))
    return found


def now_ticks() -> int:
    """This moment, in the clock ticks of /proc start times."""
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def stop(processes: dict[int, int], grace_s: float = 5.0) -> None:
    def alive():
        return [pid for pid, started in processes.items() if start_time(pid) == started]

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive():
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)


class Reaper:
    """The driver's side: start the reaper (before Ray), release it at the end."""

    def __init__(self):
        self.proc = None
        if sys.platform == "linux":
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "relax.reaper", str(os.getpid()), str(now_ticks())],
                stdin=subprocess.PIPE, text=True, start_new_session=True)

    def release(self, wait_s: float = 15.0) -> None:
        """Stop what is left of the driver's new processes now (the driver stopped Ray first),
        but for the driver's own multiprocessing helpers, which it goes on using: the next job of
        a sweep in this process (`relax -m cluster=ray,local`) would find them killed."""
        if self.proc:
            self.proc.stdin.write("".join(f"{pid}\n" for pid in multiprocessing_helpers()))
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
            self.proc = None


def multiprocessing_helpers() -> list[int]:
    """The pids of this process's multiprocessing resource tracker and fork server, if started
    (the standard library keeps them in private attributes)."""
    pids = [getattr(resource_tracker._resource_tracker, "_pid", None),
            getattr(forkserver._forkserver, "_forkserver_pid", None)]
    return [pid for pid in pids if pid]


def main(driver: int, since_ticks: int, poll_s: float = 1.0) -> None:
    # a stop of the whole job (Ctrl-C, a scheduler's SIGTERM to every process) must not stop the
    # reaper: it ends when the driver does
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    processes: dict[int, int] = {}
    spared: set[int] = set()  # what the driver, releasing the reaper, keeps (one pid a line)
    while True:  # until the driver closes the pipe or dies
        processes.update((pid, started) for pid, started in descendants(driver, since_ticks)
                         if pid != os.getpid())
        line = sys.stdin.readline() if select.select([sys.stdin], [], [], poll_s)[0] else None
        if line == "":
            break
        if line:
            spared.add(int(line))
    stop({pid: started for pid, started in processes.items() if pid not in spared})


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
