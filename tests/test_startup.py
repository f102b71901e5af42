"""Start-up checks: a run whose driver has exited but is not reaped yet (a zombie) is no live run."""

from __future__ import annotations

import json
import os
import time


def test_an_exited_unreaped_driver_is_dead_to_every_reader(tmp_path):
    """A zombie (exited, its parent has not waited on it) is no live run: status.json readers
    and the reaper agree, through the one /proc reader."""
    from relax.checkpoint import check_run_dir
    from relax.cluster.reaper import descendants
    from relax.process import HOST, describe, is_alive, live_elsewhere, proc_stat, start_time

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while proc_stat(pid)[0] != "Z":
            assert time.monotonic() < deadline, proc_stat(pid)
            time.sleep(0.01)
        state, ppid, started = proc_stat(pid)
        assert ppid == os.getpid() and started > 0
        status = {"status": "running", "pid": pid, "host": HOST, "pid_start": started}
        assert start_time(pid) is None
        assert is_alive(status) is False and not live_elsewhere(status)
        assert describe(status).startswith(f"died: status.json says running but its process (pid {pid}")
        assert pid not in [p for p, _ in descendants(os.getpid())]
        killed = tmp_path / "killed"
        killed.mkdir()
        (killed / "status.json").write_text(json.dumps(status))
        check_run_dir(tmp_path / "resumed", killed)  # its resume is not refused as "still running"
        me = {"status": "running", "pid": os.getpid(), "host": HOST, "pid_start": start_time(os.getpid())}
        assert is_alive(me) is True  # a running process still is
        assert is_alive({**me, "pid_start": me["pid_start"] - 1}) is False  # a reused pid is not the run's
    finally:
        os.waitpid(pid, 0)
    assert proc_stat(pid) is None and is_alive(status) is False
