"""Test-only fault injection, so tests can prove that each check can fail.

Not a user feature: faults are switched on only by the RELAX_FAULT environment variable
(comma-separated names), which the test suite sets for a single run.
"""

import os


def active(name: str) -> bool:
    return name in os.environ.get("RELAX_FAULT", "").split(",")


_visits: dict[str, int] = {}


def point(site: str) -> None:
    """The n-th time the process passes `site`: `kill_at:<site>:<n>` kills it with SIGKILL, as
    a power loss there would (the kill-anywhere test resumes from what is left);
    `pause_at:<site>:<n>` holds it there for 10 minutes, so a test's signals surely land there."""
    _visits[site] = _visits.get(site, 0) + 1
    if active(f"kill_at:{site}:{_visits[site]}"):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if active(f"pause_at:{site}:{_visits[site]}"):
        import time

        time.sleep(600)


def perturb_sync(named: dict) -> dict:
    """`sync_perturb`: one tensor corrupted on its way into the engine."""
    name = "model.layers.0.mlp.down_proj.weight"
    if not active("sync_perturb") or name not in named:  # weights may come in buckets
        return named
    import torch

    noise = 3 * named[name].std() * torch.randn_like(named[name])
    return {**named, name: named[name] + noise}


SGLANG_DROP_BUFFER = f"{__name__}.drop_rotary_cache"


def drop_rotary_cache(model, named_tensors) -> None:
    """`drop_buffer` inside an SGLang engine (its scheduler process runs this as a custom
    weight loader): the rotary cos/sin cache zeroed, as a buffer lost across
    release/resume_memory_occupation would be."""
    for name, buffer in model.named_buffers():
        if name.endswith("rotary_emb.cos_sin_cache"):
            buffer.zero_()
