"""The temporary folders models are built in (the cache's first-use installs, builds, downloads
and conversions; `relax convert-gguf`), named for the process that owns them:
`<target>.relax-tmp-<host>-<pid>-<start time>`. A process killed with SIGKILL cannot remove its
own, so whoever next makes one in that folder removes those whose owner is dead (the start time
tells a reused pid apart; another host's are left alone: whether its owner lives cannot be told
from here).
"""

from __future__ import annotations

import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from relax.errors import ConfigError
from relax.process import HOST, is_alive, start_time

log = logging.getLogger(__name__)

MARK = ".relax-tmp-"


def owner_of(name: str) -> dict | None:
    """The owner a temporary folder's name records, as relax.process.is_alive reads it."""
    _, mark, owner = name.rpartition(MARK)
    host, pid, ticks = ([""] * 3 + owner.rsplit("-", 2))[-3:]
    if not mark or not host or not pid.isdigit() or not ticks.isdigit():
        return None
    return {"pid": int(pid), "host": host, "pid_start": int(ticks) or None}


def remove_stale(folder: Path) -> None:
    """Remove the temporary folders in `folder` whose owner is dead."""
    try:
        entries = list(Path(folder).iterdir())
    except OSError:  # no such folder yet
        return
    for entry in entries:
        owner = owner_of(entry.name)
        if owner and is_alive(owner) is False:
            log.info("Removing %s, left by a killed process (pid %d)", entry, owner["pid"])
            shutil.rmtree(entry, ignore_errors=True)


@contextmanager
def temp_dir_beside(target: Path, key: str):
    """A new empty folder beside `target` to build it in (then renamed into place), removed on
    leaving, and after a SIGKILL by the next call for that folder. A folder that cannot be
    written is refused here, naming `key` (the setting that chose it), before anything is built."""
    target = Path(target)
    remove_stale(target.parent)
    tmp = target.with_name(f"{target.name}{MARK}{HOST}-{os.getpid()}-{start_time(os.getpid()) or 0}")
    shutil.rmtree(tmp, ignore_errors=True)  # this process's own, from an earlier attempt
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise ConfigError(f"{key}: cannot write into {target.parent} ({e.strerror})") from None
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
