"""Stops a job's private Ray instance even when the driver cannot (kill -9, a crash).

Ray starts its GCS, raylet and friends as children of the driver with a parent-death signal,
but the raylet's agents (dashboard and runtime-env agents) outlive a killed driver by a
minute or more, and they start at a moment of Ray's choosing, sometimes well after
ray.init returns. The driver therefore starts this small process (`Reaper`) before
ray.init; while the driver lives, the reaper records every process of the driver's tree
started since (pid and start time, once a second), and when the pipe from the driver
closes — because the driver finished and stopped Ray, or because it died — the reaper
stops whatever is still alive of them (SIGTERM, then SIGKILL) and exits. A process whose
start time differs is a new one that reused the pid, and is left alone.
Linux only (it reads /proc, through relax.process); elsewhere nothing is started.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

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
                [sys.executable, "-m", "relax.cluster.reaper", str(os.getpid()), str(now_ticks())],
                stdin=subprocess.PIPE, text=True, start_new_session=True)

    def release(self, wait_s: float = 15.0) -> None:
        """Stop what is left of the driver's new processes now (the driver stopped Ray first)."""
        if self.proc:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
            self.proc = None


def main(driver: int, since_ticks: int, poll_s: float = 1.0) -> None:
    # a stop of the whole job (Ctrl-C, a scheduler's SIGTERM to every process) must not stop the
    # reaper: it ends when the driver does
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    processes: dict[int, int] = {}
    while True:  # until the driver closes the pipe or dies
        processes.update((pid, started) for pid, started in descendants(driver, since_ticks)
                         if pid != os.getpid())
        if select.select([sys.stdin], [], [], poll_s)[0] and not sys.stdin.readline():
            break
    stop(processes)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
