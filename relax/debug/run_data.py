"""What a finished run left behind, read once for `relax doctor` (relax/debug/checks.py).

metrics.jsonl (rollout and step records), samples.jsonl (each rollout's example sample),
built.json, weight_check.json, the composed config, and the dumps when the run made them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from relax.debug.health import SAMPLES_FILE
from relax.errors import ReplayError
from relax.files import read_json, read_jsonl, safe_load
from relax.logger import read_metrics
from relax.model import load_tokenizer
from relax.replay import read_rollout


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
    lr: float | None = None  # train.lr (the collapse check names a tenth of it)
    top_p: float = 1.0  # rollout.top_p: < 1 samples a nucleus, below the entropy by design
    samples_per_rollout: int | None = None  # rollout_batch_size x n_samples_per_prompt (see samples_of)
    vocab_size: int | None = None  # the model's output vocabulary (config.json, else the tokenizer)
    dump_dir: Path | None = None  # where the run's train data was dumped (relax inspect reads it)
    off_policy_correction: str = ""  # the algo keys that correct for an older behaviour policy, if any


def samples_of(run: RunData, rollout_id: int) -> int | None:
    """How many samples a rollout drew: its samples.jsonl line says, else the config."""
    n = run.samples.get(rollout_id, {}).get("num_samples")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else run.samples_per_rollout


def chat_template_parts(tokenizer) -> tuple[str, str] | None:
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "\x00MSG\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}],
                                         add_generation_prompt=True, tokenize=False)
    prefix, _, suffix = text.partition(marker)
    return prefix, suffix


def read_config(path: Path) -> dict:
    """The keys readers use from a composed config.yaml (a run's .hydra/ or a dump's), or a
    ReplayError naming the file (OmegaConf loads YAML safely: no tag runs code)."""
    try:
        cfg = OmegaConf.to_container(OmegaConf.load(path))
        train, parallel, algo = cfg.get("train", {}), cfg.get("parallel", {}), cfg.get("algo", {})
        rollout = cfg.get("rollout", {})
        per_rollout = rollout.get("rollout_batch_size"), rollout.get("n_samples_per_prompt")
        keys = {"train._target_": train.get("_target_", train.get("backend", "?")),  # (backend: older runs)
                "parallel.name": parallel.get("name", "?"),
                "parallel.noise_ulp": parallel.get("noise_ulp", 0),
                "parallel.step_noise_ulp": parallel.get("step_noise_ulp", 0),
                "train.num_steps_per_rollout": train.get("num_steps_per_rollout"),
                "algo.use_rollout_log_probs": algo.get("use_rollout_log_probs", False),
                "train.lr": train.get("lr"), "rollout.top_p": rollout.get("top_p", 1.0),
                "off_policy_correction": ", ".join(
                    [f"algo.{k}={algo[k]}" for k in ("tis", "mis") if algo.get(k)]
                    + ["algo.policy_loss=decoupled_ppo"] * (algo.get("policy_loss") == "decoupled_ppo")),
                "samples_per_rollout": per_rollout[0] * per_rollout[1]
                if all(isinstance(n, int) for n in per_rollout) else None}
    except Exception as e:  # YAML errors, a list or scalar where a mapping belongs
        reason = str(e).splitlines()[0] if str(e) else ""
        raise ReplayError(f"{path}: not a Relax config ({type(e).__name__}: {reason})") from None
    if not isinstance(keys["train.num_steps_per_rollout"], (int, type(None))):
        raise ReplayError(f"{path}: train.num_steps_per_rollout is not an integer")
    for key in ("train.lr", "rollout.top_p"):
        if not isinstance(keys[key], (int, float, type(None))) or isinstance(keys[key], bool):
            raise ReplayError(f"{path}: {key} is not a number")
    return keys


PER_TOKEN = ("log_probs", "ref_log_probs", "rollout_log_probs")  # one value per trained token


def train_rows(path: Path) -> list[dict]:
    """The per-sample rows of a train-data file (debug.save_train_data), checked: readers zip
    the per-token lists, so a list cut short would be compared on its overlap only."""
    data = safe_load(path)
    rows = data.get("samples")
    numbers = ("reward", "advantage")
    if not isinstance(rows, list) or not all(
            isinstance(r, dict) and isinstance(r.get("index"), int)
            and all(isinstance(r.get(k), (int, float)) for k in numbers)
            and all(isinstance(r.get(k), list) and all(isinstance(x, (int, float)) for x in r[k])
                    for k in PER_TOKEN) for r in rows):
        raise ReplayError(f"{path}: not Relax train data (a list of samples with index, "
                          f"{', '.join(numbers)} and lists of numbers {', '.join(PER_TOKEN)})")
    for row in rows:
        lengths = {k: len(row[k]) for k in PER_TOKEN}
        if isinstance(row.get("loss_mask"), list):
            lengths["trained tokens (loss_mask)"] = sum(map(bool, row["loss_mask"]))
        if len(set(lengths.values())) > 1:
            raise ReplayError(f"{path}: sample {row['index']}: per-token lists of different lengths "
                              f"({', '.join(f'{k} {n}' for k, n in lengths.items())}): truncated or corrupt")
    return rows


def load_run(path: Path) -> RunData:
    path = Path(path)
    rollouts, steps = read_metrics(path)
    run = RunData(path=path, rollouts=rollouts, steps=steps)
    config = path / ".hydra" / "config.yaml"
    if not config.is_file():
        config = path / "config.yaml"  # a dump dir
    if config.is_file():
        cfg = read_config(config)
        run.num_steps_per_rollout, run.backend = cfg["train.num_steps_per_rollout"], cfg["train._target_"]
        run.use_rollout_log_probs = cfg["algo.use_rollout_log_probs"]
        run.lr, run.samples_per_rollout = cfg["train.lr"], cfg["samples_per_rollout"]
        run.top_p = 1.0 if cfg["rollout.top_p"] is None else cfg["rollout.top_p"]
        run.off_policy_correction = cfg["off_policy_correction"]
    first_lr = steps[0].get("train/lr") if steps else None
    if run.lr is None and isinstance(first_lr, (int, float)) and not isinstance(first_lr, bool):
        run.lr = first_lr  # an in-process run (no .hydra/): the rate its first step logged
    if (path / SAMPLES_FILE).is_file():
        samples = read_jsonl(path / SAMPLES_FILE)
        if not all(isinstance(s.get("rollout_id"), int) for s in samples):
            raise ReplayError(f"{path / SAMPLES_FILE}: a record without an integer rollout_id")
        run.samples = {s["rollout_id"]: s for s in samples}
    else:
        run.samples_missing = f"no {SAMPLES_FILE} in {path} (runs before Relax wrote it lack it)"
    built = read_json(path / "built.json") if (path / "built.json").is_file() else {}
    # a dump inside the run dir (debug=dump) is the run's own, also in a copy of the run whose
    # built.json still names the original's
    own = any((path / name).is_dir() for name in ("rollout_data", "train_data"))
    dump = Path(built["dump_dir"]) if built.get("dump_dir") and not own else path
    first_id = rollouts[0]["rollout_id"] if rollouts else 0
    rollout_file = dump / "rollout_data" / f"{first_id}.pt"
    if rollout_file.is_file():
        run.prompts = [s.prompt for s in read_rollout(rollout_file)[1]]
    elif first_id in run.samples:
        run.prompts = [run.samples[first_id].get("prompt", "")]
    for train_file in sorted((dump / "train_data").glob(f"{first_id}_*.pt")):
        run.first_train_data += train_rows(train_file)
        run.dump_dir = dump
    tokenizer_dir = dump / "tokenizer" if (dump / "tokenizer").is_dir() else built.get("model_path")
    if tokenizer_dir and Path(tokenizer_dir).is_dir():
        tokenizer = load_tokenizer(Path(tokenizer_dir))
        run.chat_template_parts = chat_template_parts(tokenizer)
        run.vocab_size = len(tokenizer)
    model_config = Path(built["model_path"]) / "config.json" if built.get("model_path") else None
    if model_config and model_config.is_file():  # the softmax's support: the model's rows, padding included
        try:
            vocab = json.loads(model_config.read_text()).get("vocab_size")
        except (UnicodeDecodeError, ValueError, AttributeError):
            vocab = None
        if isinstance(vocab, int) and vocab > 0:
            run.vocab_size = vocab
    if (path / "weight_check.json").is_file():
        run.weight_check = read_json(path / "weight_check.json")
    return run
