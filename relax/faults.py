"""Test-only fault injection, so tests can prove that each check can fail.

Not a user feature: faults are switched on only by the RELAX_FAULT environment variable
(comma-separated names), which the test suite sets for a single run.
"""

import errno
import os
import signal
import time

import torch


def _faults() -> list[str]:
    return os.environ.get("RELAX_FAULT", "").split(",")


def active(name: str) -> bool:
    return name in _faults()


_visits: dict[str, int] = {}


def point(site: str) -> None:
    """The n-th time the process passes `site`: `kill_at:<site>:<n>` kills it with SIGKILL, as
    a power loss there would (the kill-anywhere test resumes from what is left);
    `pause_at:<site>:<n>` holds it there for 10 minutes, so a test's signals surely land there;
    `fill_disk_at:<site>:<n>` fills the disk of the working directory there (`fill_disk`);
    `meet_at:<site>:<n>:<count>` holds it there until `count` processes started in the same
    working directory are there too, so a test can tell jobs that run at once from jobs that
    happen to overlap (at most 2 minutes: then it goes on, and the test's overlap check fails)."""
    _visits[site] = _visits.get(site, 0) + 1
    if active(f"kill_at:{site}:{_visits[site]}"):
        os.kill(os.getpid(), signal.SIGKILL)
    if active(f"pause_at:{site}:{_visits[site]}"):
        time.sleep(600)
    if active(f"fill_disk_at:{site}:{_visits[site]}"):
        fill_disk(".")
    meeting = f"meet_at:{site}:{_visits[site]}:"
    for fault in _faults():
        if fault.startswith(meeting):
            meet(f".meet_{site}", int(fault[len(meeting):]))


def meet(folder: str, count: int) -> None:
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, str(os.getpid())), "w").close()
    deadline = time.time() + 120
    while len(os.listdir(folder)) < count and time.time() < deadline:
        time.sleep(0.1)


def fill_disk(folder: str) -> None:
    """The filesystem holding `folder` filled to the last byte by one file in it, as another
    program filling a shared disk would: the next write that needs space fails as on a full
    disk (ENOSPC). Only a small one (a test's tmpfs): a filesystem over 64 MiB is refused."""
    stat = os.statvfs(folder)
    if stat.f_blocks * stat.f_frsize > 64 << 20:
        raise RuntimeError(f"fill_disk: refusing to fill {os.path.abspath(folder)}: over 64 MiB")
    with open(os.path.join(folder, ".fill_disk"), "ab", buffering=0) as f:
        try:
            while True:
                f.write(bytes(1 << 16))
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise


def perturb_sync(named: dict) -> dict:
    """`sync_perturb`: one tensor corrupted on its way into the engine."""
    name = "model.layers.0.mlp.down_proj.weight"
    if not active("sync_perturb") or name not in named:  # weights may come in buckets
        return named

    noise = 3 * named[name].std() * torch.randn_like(named[name])
    return {**named, name: named[name] + noise}


def skip_sync(named: dict) -> dict:
    """`sync_skip`: one tensor left out of the sync (the engine keeps its old values), as a
    name mapping that misses a tensor or a bucket lost on the way would."""
    name = "model.layers.0.self_attn.o_proj.weight"
    if not active("sync_skip") or name not in named:
        return named
    return {k: v for k, v in named.items() if k != name}


SGLANG_DROP_BUFFER = f"{__name__}.drop_rotary_cache"


def drop_rotary_cache(model, named_tensors) -> None:
    """`drop_buffer` inside an SGLang engine (its scheduler process runs this as a custom
    weight loader): the rotary cos/sin cache zeroed, as a buffer lost across
    release/resume_memory_occupation would be."""
    for name, buffer in model.named_buffers():
        if name.endswith("rotary_emb.cos_sin_cache"):
            buffer.zero_()
