"""The layer dump (debug.dump_layers), recording side: what trainers and engines save so that
`relax compare --layers` (relax/debug/layers.py, which explains the whole feature) can say
where two runs part.

For the dumped samples: every module output of `module_names()` in forward order (embedding,
per layer the attention and MLP outputs and the layer's, the final norm), the trained tokens'
log-probs and, from the trainer, every parameter's gradient and value before the step. Whole
tensors (gathered over ranks), HF names, fp32. Files: `<dir>/{rollout_id}_{source}.pt`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from relax.files import atomic_save
from relax.train.parallel import full_tensor

FORMAT_VERSION = 1
LOG_PROBS = "log_probs"  # the trained tokens' log-probs, after the module outputs in forward order


def module_names(num_layers: int) -> list[str]:
    """The recorded module outputs, in forward order, by HF module name."""
    names = ["model.embed_tokens"]
    for i in range(num_layers):
        names += [f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp", f"model.layers.{i}"]
    return names + ["model.norm"]


def dump_path(directory: str | Path, rollout_id: int, source: str) -> Path:
    return Path(directory) / f"{rollout_id}_{source}.pt"


def whole_fp32(out: torch.Tensor) -> torch.Tensor:
    return full_tensor(out.detach()).float()  # (a DTensor gathered)


def per_sample(batch: dict[str, torch.Tensor], lengths: list[int]) -> dict[str, list[torch.Tensor]]:
    """[b, T, ...] module outputs of right-padded rows -> one [len, ...] tensor per sample."""
    return {name: [t[b, :n].clone() for b, n in enumerate(lengths)] for name, t in batch.items()}


def save_dump(
    directory: str | Path,
    rollout_id: int,
    source: str,
    manifest: dict,
    samples: list[int],
    forward: dict[str, list[torch.Tensor]],
    log_probs: list[torch.Tensor],
    grads: dict[str, torch.Tensor] | None = None,
    params: dict[str, torch.Tensor] | None = None,
) -> Path:
    path = dump_path(directory, rollout_id, source)
    atomic_save(
        {
            "format_version": FORMAT_VERSION,
            "manifest": {**manifest, "source": source, "rollout_id": rollout_id, "samples": samples},
            "forward": forward,
            LOG_PROBS: log_probs,
            "grads": grads or {},
            "params": params or {},
        },
        path,
    )
    return path
