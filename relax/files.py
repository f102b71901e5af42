"""Files that must never be half-written or unsafe to read: atomic saves, plain-data loads,
JSON-lines records, and the `{rollout_id}` / `{rank}` path templates of the debugging guide.

Used by replay, train dumps and checkpoints alike, so it sits below all of them.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from relax.errors import DiskFull, ReplayError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk, or the user's quota on it


def fill(template: str, rollout_id: int | None = None, rank: int | None = None) -> Path:
    """Expand a path template's `{rollout_id}` and `{rank}` (and nothing else)."""
    path = template
    if rollout_id is not None:
        path = path.replace("{rollout_id}", str(rollout_id))
    if rank is not None:
        path = path.replace("{rank}", str(rank))
    return Path(path).expanduser().absolute()


@contextmanager
def atomic_open(path: Path, mode: str = "wb"):
    """A file in the same directory as `path`, renamed onto it once written and synced: readers
    see the old file or the new one, never half of one (a crash leaves a hidden .tmp)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if is_disk_full(e):
            raise disk_full(e, path) from None
        raise


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in NO_SPACE


def disk_full(e: OSError, path: Path) -> DiskFull:
    """A full disk's OSError as a DiskFull naming the file Relax was writing: the one line a
    run ends with."""
    if isinstance(e, DiskFull):
        return e
    return DiskFull(e.errno, f"disk full ({errno.errorcode[e.errno]}: {os.strerror(e.errno)}) while "
                             f"writing {path}")


def atomic_save(obj, path: Path) -> None:
    """torch.save, atomically."""
    with atomic_open(path) as f:
        torch.save(obj, f)


def atomic_write_text(path: Path, text: str) -> None:
    """A small text file (JSON state, status), atomically."""
    with atomic_open(path, "w") as f:
        f.write(text)


def safe_load(path: Path, mmap: bool = False) -> dict:
    """Load plain data; a file that would run code, or is corrupt, is refused by name. `mmap`:
    tensors are read from the file when used, not all copied in at load (large dumps)."""
    path = Path(path)
    if not path.is_file():
        raise ReplayError(f"{path}: no such file")
    try:
        data = torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
    except pickle.UnpicklingError as e:
        # torch wraps the reason in boilerplate paragraphs; keep the reason itself
        paragraphs = [p.strip() for p in str(e).split("\n\n") if p.strip()]
        detail = [p for p in paragraphs if not p.startswith("Check the documentation")][-1]
        if "global" in detail.lower() or "class" in detail.lower():  # a callable to import
            raise ReplayError(f"{path}: refused: it holds objects other than plain data "
                              f"({detail}); loaded with weights_only=True, nothing was executed") from None
        raise ReplayError(f"{path}: corrupt or truncated file ({detail})") from None
    except Exception as e:  # truncated zip, bad magic number, EOF ...
        raise ReplayError(f"{path}: corrupt or truncated file ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ReplayError(f"{path}: expected a dict, found {type(data).__name__}")
    return data


def save_figure(fig, path: Path, dpi: int = 90) -> None:
    """A matplotlib figure as PNG, atomically (a reader never sees half an image)."""
    with atomic_open(path) as f:
        fig.savefig(f, format="png", dpi=dpi)


def rewrite_small_file(path: Path, text: str) -> None:
    """atomic_write_text, or on a full disk, `path` rewritten in place within the blocks it
    already has (status.json's last word): a new file needs space that is not there."""
    try:
        atomic_write_text(path, text)
    except DiskFull:
        data = text.encode()
        if not path.is_file() or path.stat().st_blocks * 512 < len(data):
            raise
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, data)
            os.ftruncate(fd, len(data))
        except OSError as e:
            raise disk_full(e, path) from None
        finally:
            os.close(fd)


def append_jsonl(path: Path, record: dict) -> None:
    """Append one JSON line to a file opened for appending. A write that fails (a full disk) is
    undone, the file cut back to its size before it, so the file never ends in half a line; a
    kill mid-write can tear only this last line (which `read_jsonl` drops), never an earlier one."""
    line = memoryview((json.dumps(record) + "\n").encode())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    size = os.fstat(fd).st_size
    try:
        while line:  # a short write (the disk filled mid-line): the rest's write raises the reason
            line = line[os.write(fd, line):]
    except OSError as e:
        os.ftruncate(fd, size)
        if is_disk_full(e):
            raise disk_full(e, path) from None
        raise
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict]:
    """The records (one JSON object per line) of a JSON-lines file; a last line torn by a crash
    mid-write is dropped; anything else is a ReplayError naming the line."""
    try:
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    except UnicodeDecodeError as e:
        raise ReplayError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    records = []
    for n, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if n < len(lines):
                raise ReplayError(f"{path}: line {n} is not JSON ({e})") from None
            continue
        if not isinstance(record, dict):
            raise ReplayError(f"{path}: line {n} is not a JSON object")
        records.append(record)
    return records


def read_json(path: Path) -> dict:
    """A JSON object from a file Relax wrote (built.json, weight_check.json ...), or a
    ReplayError naming it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ReplayError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ReplayError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def sha256(path: Path) -> str:
    """The file's sha256, read in 1 MiB blocks (model weights are hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
