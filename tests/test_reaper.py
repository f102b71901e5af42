"""The reaper (relax/reaper.py) without Ray: which processes it records, how it stops
them, and that it ends when the driver releases it or dies. Real processes, a few seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from relax.reaper import descendants, now_ticks, start_time, stop

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the reaper reads /proc")

# A child that starts a grandchild (`sleep`) 0.1 s after it starts, prints its pid and waits.
PARENT = ("import subprocess, time\ntime.sleep(0.1)\n"
          "p = subprocess.Popen(['sleep', '60'])\nprint(p.pid, flush=True)\np.wait()\n")


def gone(pid: int, started: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while start_time(pid) == started and time.monotonic() < deadline:
        time.sleep(0.05)
    return start_time(pid) != started


def test_descendants_are_the_whole_tree_started_at_or_after_since():
    """Grandchildren count (Ray's agents are the raylet's children), and `since_ticks` keeps
    a process started in that very tick (>=, not >) and leaves out those started before."""
    child = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        born = {child.pid: start_time(child.pid), grandchild: start_time(grandchild)}
        assert born[grandchild] > born[child.pid]  # (0.1 s later: at least one clock tick)
        found = dict(descendants(child.pid))
        assert found == {grandchild: born[grandchild]}
        mine = dict(descendants(os.getpid()))
        assert mine[child.pid] == born[child.pid] and mine[grandchild] == born[grandchild]
        late = dict(descendants(os.getpid(), since_ticks=born[grandchild]))
        assert grandchild in late and child.pid not in late
    finally:
        child.kill()
        child.wait()
        stop({pid: t for pid, t in born.items() if t is not None}, grace_s=1)


def test_now_ticks_is_the_clock_of_proc_start_times():
    """A process started after now_ticks() has a start time at or after it (and not far off)."""
    before = now_ticks()
    proc = subprocess.Popen(["sleep", "60"])
    try:
        started = start_time(proc.pid)
        assert before <= started <= now_ticks() + 1
        assert now_ticks() - before < 10 * 100  # ticks, not seconds or jiffies of another clock
    finally:
        proc.kill()
        proc.wait()


def test_stop_kills_what_ignores_sigterm_and_spares_a_reused_pid():
    """SIGTERM, then SIGKILL after the grace period; a pid whose start time differs from the
    one recorded is another process now and is not signalled."""
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint(flush=True)\n"
                                 "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        stubborn.stdout.readline()  # its handler is set
        start = time.monotonic()
        stop({stubborn.pid: start_time(stubborn.pid), bystander.pid: start_time(bystander.pid) - 1},
             grace_s=0.5)
        assert stubborn.wait(timeout=5) == -signal.SIGKILL
        assert 0.5 <= time.monotonic() - start < 5
        assert bystander.poll() is None  # left alone
    finally:
        for p in (stubborn, bystander):
            p.kill()
            p.wait()


# A driver: the reaper, a process started before it (kept) and one after it (the reaper's);
# prints their pids, waits for the reaper to record them, then releases it or waits to be killed.
DRIVER = """
import os, subprocess, sys, time
from multiprocessing import resource_tracker
from relax.reaper import Reaper
before = subprocess.Popen(['sleep', '60'])
time.sleep(0.1)
reaper = Reaper()
after = subprocess.Popen(['sleep', '60'])
resource_tracker.ensure_running()  # the driver's own helper, started after the reaper too
print(before.pid, after.pid, reaper.proc.pid, flush=True)
time.sleep(2.5)  # the reaper looks once a second
if sys.argv[1] == 'release':
    t = time.monotonic()
    reaper.release()
    tracker = resource_tracker._resource_tracker._pid
    print(round(time.monotonic() - t, 2), after.poll(), os.waitpid(tracker, os.WNOHANG)[0] == 0, flush=True)
    before.kill()
else:
    time.sleep(60)
"""


@pytest.mark.parametrize("end", ["release", "kill -9"])
def test_the_reaper_stops_the_drivers_new_processes_and_exits(end):
    """Released (the driver stopped Ray) or orphaned (the driver was killed), the reaper stops
    the processes the driver started after it, leaves the older ones, those of the driver's
    parent and (released) the driver's multiprocessing resource tracker, and exits."""
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, end], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    before, after, reaper = map(int, driver.stdout.readline().split())
    born = {pid: start_time(pid) for pid in (before, after, reaper)}
    try:
        if end == "release":
            seconds, after_code, tracker_alive = driver.stdout.readline().split()
            assert float(seconds) < 5 and after_code == str(-signal.SIGTERM) and tracker_alive == "True"
            assert driver.wait(timeout=10) == 0
        else:
            sibling = subprocess.Popen(["sleep", "60"])  # the driver's parent's, not the driver's
            born[sibling.pid] = start_time(sibling.pid)
            time.sleep(2.5)
            driver.kill()
            driver.wait()
            assert gone(after, born[after], 10)
            assert start_time(before) == born[before]  # older than the reaper: not its to stop
        assert gone(reaper, born[reaper], 10)
        if end == "kill -9":
            assert sibling.poll() is None
    finally:
        driver.kill()
        driver.wait()
        stop(born, grace_s=1)
