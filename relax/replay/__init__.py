"""Replay data: save rollouts, load them back safely, and refuse data from another model.

One file per rollout (`torch.save` of plain data only):
    {"format_version": 1, "rollout_id": int, "manifest": {...}, "samples": [Sample dicts]}
The manifest records the model (path, config fingerprint), the tokenizer (vocab size and
hash), sampling parameters, the composed-config hash and the Relax version. Files are
written atomically and read with `torch.load(weights_only=True)`: nothing in them runs.
"""

from __future__ import annotations

import glob
import hashlib
import math
import random
import re
from pathlib import Path

from omegaconf import OmegaConf

import relax
from relax.errors import ReplayError
from relax.files import atomic_save, fill, safe_load
from relax.sample import Sample

FORMAT_VERSION = 1


def discover_rollout_ids(template: str) -> dict[int, Path]:
    """Rollout ids for which `template` names an existing file."""
    if "{rollout_id}" not in template:
        path = fill(template)
        return {int(safe_load(path).get("rollout_id", 0)): path} if path.is_file() else {}
    pattern = str(fill(template)).replace("{rollout_id}", "*")
    regex = re.compile(re.escape(str(fill(template))).replace(r"\{rollout_id\}", r"(\d+)") + "$")
    found = {}
    for name in glob.glob(pattern):
        m = regex.match(name)
        if m:
            found[int(m.group(1))] = Path(name)
    return dict(sorted(found.items()))


def build_manifest(cfg, model_path: Path, tokenizer) -> dict:
    from relax.model import model_fingerprint, tokenizer_fingerprint

    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    return {
        "relax_version": relax.__version__,
        "model_path": str(model_path),
        "model_fingerprint": model_fingerprint(model_path),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "sampling": {
            "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
        },
        "config_hash": hashlib.sha256(config_yaml.encode()).hexdigest()[:16],
    }


def manifest_mismatches(saved: dict, current: dict) -> list[str]:
    """What differs in ways that make replayed tokens or log-probs mean something else."""
    diffs = []
    if saved.get("model_fingerprint") != current["model_fingerprint"]:
        diffs.append(f"model architecture: data from {saved.get('model_path')} "
                     f"(fingerprint {saved.get('model_fingerprint')}), this run uses "
                     f"{current['model_path']} ({current['model_fingerprint']})")
    s_tok, c_tok = saved.get("tokenizer", {}), current["tokenizer"]
    if s_tok.get("vocab_size") != c_tok["vocab_size"]:
        diffs.append(f"tokenizer vocab size: data {s_tok.get('vocab_size')}, "
                     f"this run {c_tok['vocab_size']}")
    elif s_tok.get("vocab_hash") != c_tok["vocab_hash"]:
        diffs.append(f"tokenizer vocabulary differs (hash {s_tok.get('vocab_hash')} vs "
                     f"{c_tok['vocab_hash']})")
    s_temp = saved.get("sampling", {}).get("temperature")
    if s_temp != current["sampling"]["temperature"]:
        diffs.append(f"rollout.temperature: data sampled at {s_temp}, this run uses "
                     f"{current['sampling']['temperature']} (the trainer divides logits by it)")
    return diffs


def save_rollout(path: Path, rollout_id: int, samples: list[Sample], manifest: dict) -> None:
    atomic_save({"format_version": FORMAT_VERSION, "rollout_id": rollout_id,
                 "manifest": manifest, "samples": [s.to_dict() for s in samples]}, path)


def load_rollout(path: Path, manifest: dict | None = None, allow_mismatch: bool = False,
                 subsample: float | None = None, seed: int = 0) -> tuple[int, list[Sample]]:
    data = safe_load(path)
    if data.get("format_version") != FORMAT_VERSION or "samples" not in data:
        raise ReplayError(f"{path}: not Relax rollout data (format_version "
                          f"{data.get('format_version')!r}, expected {FORMAT_VERSION})")
    if manifest is not None and not allow_mismatch:
        diffs = manifest_mismatches(data.get("manifest", {}), manifest)
        if diffs:
            raise ReplayError(f"{path}: rollout data does not match this run:\n  - "
                              + "\n  - ".join(diffs)
                              + "\nSet debug.allow_manifest_mismatch=true to replay it anyway.")
    try:
        samples = [Sample.from_dict(d) for d in data["samples"]]
    except (KeyError, TypeError) as e:
        raise ReplayError(f"{path}: malformed sample: {e}") from None
    rollout_id = int(data["rollout_id"])
    if subsample is not None:
        samples = subsample_groups(samples, subsample, seed + rollout_id)
    return rollout_id, samples


def subsample_groups(samples: list[Sample], fraction: float, seed: int) -> list[Sample]:
    """Keep a random `fraction` of whole GRPO groups (advantages need complete groups)."""
    groups = sorted({s.group_index for s in samples})
    keep = random.Random(seed).sample(groups, max(1, math.ceil(fraction * len(groups))))
    return keep_groups(samples, set(keep))


def keep_groups(samples: list[Sample], groups: set[int]) -> list[Sample]:
    """Copies of the samples of these GRPO groups, renumbered 0..N-1 as a rollout must be
    (metadata["replay_index"] keeps each one's index in the full rollout)."""
    kept = [Sample.from_dict(s.to_dict()) for s in samples if s.group_index in groups]
    remap = {g: i for i, g in enumerate(sorted(groups))}
    for i, s in enumerate(kept):
        s.metadata["replay_index"] = s.index
        s.index, s.group_index = i, remap[s.group_index]
    return kept
