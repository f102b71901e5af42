"""What `relax bugreport` records about the machine a run ran on: package versions, CPU, memory,
GPU and driver, and the git revision of the Relax source."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGES = ("torch", "transformers", "sglang", "megatron-core", "ray", "hydra-core", "omegaconf", "relax")


def versions() -> dict[str, str]:
    """Installed versions, from package metadata: nothing is imported (SGLang and Megatron take
    seconds to import, and may fail to)."""
    out = {"python": f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _run(args: list[str], cwd: Path | None = None) -> str | None:
    """A command's stdout without its trailing newlines, or None when it is missing, fails or hangs."""
    try:
        proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip("\n") if proc.returncode == 0 else None  # porcelain lines start with a space


def _meminfo() -> dict[str, str]:
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    info = dict(line.split(":", 1) for line in lines if ":" in line)
    return {k: f"{int(info[k].split()[0]) / 2**20:.1f} GiB"  # /proc/meminfo counts kB
            for k in ("MemTotal", "MemAvailable") if k in info}


def _gpu() -> dict | str:
    gpu: dict = {}
    try:
        # torch here, inside the try: a broken torch install is reported, not fatal to the report
        import torch

        gpu["torch_cuda"] = torch.version.cuda or "none (CPU build)"
        if torch.cuda.is_available():
            gpu["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as e:  # a broken CUDA setup is worth reporting, not a reason to stop
        gpu["torch_error"] = f"{type(e).__name__}: {e}"
    if shutil.which("nvidia-smi"):
        smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
        gpu["nvidia_smi"] = smi.splitlines() if smi else "nvidia-smi failed"
    return gpu if gpu.get("devices") or "nvidia_smi" in gpu else {**gpu, "gpus": "none"}


def machine() -> dict:
    cpu_model = None
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu_model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                         None)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"platform": platform.platform(), "machine": platform.machine(),
            "cpu": cpu_model or platform.processor() or "unknown",
            "cpu_count": os.cpu_count(), "cpus_usable": usable,
            "memory": _meminfo() or "unknown", "gpu": _gpu()}


def source_revision(source: Path) -> dict:
    """The git revision of the checkout `source` (Relax's own dir) is the top of, and whether it
    has uncommitted changes; "unknown" for an installed copy (or without git)."""
    top = _run(["git", "rev-parse", "--show-toplevel"], cwd=source)
    head = _run(["git", "rev-parse", "HEAD"], cwd=source)
    if not top or not head or Path(top).resolve() != source.resolve():  # not the package's own checkout
        return {"source": str(source), "revision": "unknown", "dirty": "unknown"}
    changed = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=source)
    if changed is None:
        return {"source": str(source), "revision": head, "dirty": "unknown"}
    names = [line[3:] for line in changed.splitlines() if line.strip()]
    return {"source": str(source), "revision": head, "dirty": bool(names), "changed_files": names[:100]}


def environment(names: list[str]) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}  # None: not set
