"""What a finished run left behind, read once for `relax doctor` (relax/debug/checks.py).

metrics.jsonl (rollout and step records), samples.jsonl (each rollout's example sample),
built.json, weight_check.json, the composed config, and the dumps when the run made them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from relax.debug.health import SAMPLES_FILE
from relax.files import read_jsonl, safe_load
from relax.logger import read_metrics


@dataclass
class RunData:
    path: Path
    rollouts: list[dict]
    steps: list[dict]
    num_steps_per_rollout: int | None = None
    samples: dict[int, dict] = field(default_factory=dict)      # rollout_id -> example sample
    samples_missing: str | None = None                          # why `samples` is empty
    prompts: list[str] = field(default_factory=list)            # first-rollout prompts
    chat_template_parts: tuple[str, str] | None = None          # (prefix, suffix) of a user turn
    first_train_data: list[dict] = field(default_factory=list)   # per-sample rows, first rollout
    weight_check: dict | None = None
    backend: str = ""  # train._target_: the trainer class
    use_rollout_log_probs: bool = False  # algo.use_rollout_log_probs: the engine's were PPO's old policy


def chat_template_parts(tokenizer) -> tuple[str, str] | None:
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "\x00MSG\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}],
                                         add_generation_prompt=True, tokenize=False)
    prefix, _, suffix = text.partition(marker)
    return prefix, suffix


def load_run(path: Path) -> RunData:
    from omegaconf import OmegaConf

    path = Path(path)
    rollouts, steps = read_metrics(path)
    run = RunData(path=path, rollouts=rollouts, steps=steps)
    config = path / ".hydra" / "config.yaml"
    if not config.is_file():
        config = path / "config.yaml"  # a dump dir
    if config.is_file():
        cfg = OmegaConf.load(config)
        run.num_steps_per_rollout = cfg.train.num_steps_per_rollout
        run.backend = cfg.train._target_
        run.use_rollout_log_probs = cfg.algo.get("use_rollout_log_probs", False)
    if (path / SAMPLES_FILE).is_file():
        run.samples = {s["rollout_id"]: s for s in read_jsonl(path / SAMPLES_FILE)}
    else:
        run.samples_missing = f"no {SAMPLES_FILE} in {path} (runs before Relax wrote it lack it)"
    built = json.loads((path / "built.json").read_text()) if (path / "built.json").is_file() else {}
    dump = Path(built["dump_dir"]) if built.get("dump_dir") else path
    first_id = rollouts[0]["rollout_id"] if rollouts else 0
    rollout_file = dump / "rollout_data" / f"{first_id}.pt"
    if rollout_file.is_file():
        run.prompts = [s["prompt"] for s in safe_load(rollout_file)["samples"]]
    elif first_id in run.samples:
        run.prompts = [run.samples[first_id]["prompt"]]
    for train_file in sorted((dump / "train_data").glob(f"{first_id}_*.pt")):
        run.first_train_data += safe_load(train_file)["samples"]
    tokenizer_dir = dump / "tokenizer" if (dump / "tokenizer").is_dir() else built.get("model_path")
    if tokenizer_dir and Path(tokenizer_dir).is_dir():
        from relax.model import load_tokenizer

        run.chat_template_parts = chat_template_parts(load_tokenizer(Path(tokenizer_dir)))
    if (path / "weight_check.json").is_file():
        run.weight_check = json.loads((path / "weight_check.json").read_text())
    return run
