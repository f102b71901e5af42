"""Replay data: save rollouts, load them back safely, and refuse data from another model.

One file per rollout (`torch.save` of plain data only):
    {"format_version": 3, "rollout_id": int, "manifest": {...}, "samples": [Sample dicts]}
(format 2 added Sample.routed_experts, 3 Sample.token_versions; older files load without them)
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
from tqdm.auto import tqdm

import relax
from relax.errors import ReplayError
from relax.files import atomic_save, fill, safe_load
from relax.model import model_fingerprint, tokenizer_fingerprint
from relax.sample import Sample, Samples, group_size_of, require_routed_experts
from relax.task import check_rewards

FORMAT_VERSION = 3  # 2: samples may carry routed_experts (MoE); 3: token_versions
READABLE_VERSIONS = (1, 2, 3)


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


def save_rollout(path: Path, rollout_id: int, samples: list[Sample], manifest: dict, **extra) -> None:
    atomic_save({"format_version": FORMAT_VERSION, "rollout_id": rollout_id,
                 "manifest": manifest, "samples": [s.to_dict() for s in samples], **extra}, path)


AHEAD_DIR = "rollouts_ahead"  # in a checkpoint: rollouts made ahead of training (train.max_staleness)


def save_ahead(folder: Path, ahead: dict, in_flight: dict, manifest: dict) -> None:
    """A checkpoint's rollouts made on older weights than its own and not trained yet, as
    `Rollouts.ahead()` gives them: rollout_id -> ((samples, metrics), seconds, policy version);
    and the responses partial rollouts left in flight (`InFlight.kept()`: rollout_id -> samples)."""
    for rollout_id, ((samples, metrics), seconds, version) in ahead.items():
        save_rollout(Path(folder) / AHEAD_DIR / f"{rollout_id}.pt", rollout_id, samples, manifest,
                     metrics=metrics, seconds=seconds, policy_version=version)
    for rollout_id, samples in in_flight.items():
        if samples:
            save_rollout(Path(folder) / AHEAD_DIR / f"in_flight_{rollout_id}.pt", rollout_id, samples, manifest)


def load_in_flight(checkpoint: Path) -> dict:
    """The responses in flight save_ahead wrote into `checkpoint`, by rollout_id."""
    return {data["rollout_id"]: Samples(samples) for data, samples in
            map(read_rollout, sorted((Path(checkpoint) / AHEAD_DIR).glob("in_flight_*.pt")))}


def load_ahead(checkpoint: Path) -> dict:
    """What save_ahead wrote into `checkpoint` (nothing: {}), in `Rollouts.ahead()`'s form."""
    ahead = {}
    for path in sorted((Path(checkpoint) / AHEAD_DIR).glob("[0-9]*.pt")):
        data, samples = read_rollout(path)
        try:
            ahead[data["rollout_id"]] = ((Samples(samples), dict(data["metrics"])), float(data["seconds"]),
                                         int(data["policy_version"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ReplayError(f"{path}: malformed rollout made ahead: {type(e).__name__}: {e}") from None
    return ahead


def read_rollout(path: Path) -> tuple[dict, list[Sample]]:
    """A rollout file's data and its samples, checked (plain data, Relax's format, well-formed
    samples in whole GRPO groups), or a ReplayError naming the file."""
    data = safe_load(path)
    if data.get("format_version") not in READABLE_VERSIONS or "samples" not in data:
        raise ReplayError(f"{path}: not Relax rollout data (format_version "
                          f"{data.get('format_version')!r}, expected one of {READABLE_VERSIONS})")
    if not isinstance(data["samples"], list) or not data["samples"]:
        raise ReplayError(f"{path}: no samples (expected a non-empty list)")
    try:
        samples = [Sample.from_dict(d) for d in data["samples"]]
        group_size_of(samples)
        data["rollout_id"] = int(data["rollout_id"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ReplayError(f"{path}: malformed rollout data: {e}") from None
    if not isinstance(data.get("manifest", {}), dict):
        raise ReplayError(f"{path}: malformed rollout data: the manifest is not a mapping")
    return data, samples


def load_rollout(path: Path, manifest: dict | None = None, allow_mismatch: bool = False,
                 subsample: float | None = None, seed: int = 0) -> tuple[int, list[Sample]]:
    data, samples = read_rollout(path)
    if manifest is not None and not allow_mismatch:
        try:
            diffs = manifest_mismatches(data.get("manifest", {}), manifest)
        except (AttributeError, TypeError):  # nested entries that are not mappings
            raise ReplayError(f"{path}: malformed rollout data: unreadable manifest") from None
        if diffs:
            raise ReplayError(f"{path}: rollout data does not match this run:\n  - "
                              + "\n  - ".join(diffs)
                              + "\nSet debug.allow_manifest_mismatch=true to replay it anyway.")
    if subsample is not None:
        samples = subsample_groups(samples, subsample, seed + data["rollout_id"])
    return data["rollout_id"], Samples(samples)


def check_replay_files(files: dict[int, Path], manifest: dict, allow_mismatch: bool,
                       subsample: float | None, seed: int,
                       routing_replay: str | None = None) -> dict[int, int]:
    """Start-up: every file a replay will read loads as it will then (plain data, this run's
    manifest, whole GRPO groups, finite rewards, the engine's experts for algo.routing_replay=
    rollout) and holds the rollout its name says. Returns the number of samples each gives."""
    counts = {}
    for rollout_id, path in tqdm(files.items(), desc="checking replay files", unit="file",
                                 disable=len(files) < 20 or None):
        saved_id, samples = load_rollout(path, manifest, allow_mismatch, subsample, seed)
        if saved_id != rollout_id:
            raise ReplayError(f"{path}: holds rollout {saved_id}, but its name says rollout {rollout_id}")
        check_rewards(samples, f"the replay file {path}")
        if routing_replay == "rollout":
            require_routed_experts(samples, f"the replay file {path}")
        counts[rollout_id] = len(samples)
    return counts


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
