"""Writing an HF model directory: what the trainers' checkpoints and relax convert-gguf make."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file


def save_hf_dir(path: Path, config, weights: dict) -> None:
    """An HF model directory: `config` (a transformers config) and the weights, by HF name."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in weights.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
