"""`relax replay-agent <run dir>`: regenerate a saved agent rollout from its recorded I/O.

Every agent sample keeps its conversation's I/O in metadata["agent_io"] (relax/rollout/agent.py).
This rebuilds the run's engine on the weights the rollout was generated with, feeds each
sample's recorded messages back turn by turn (no agent or tool code runs) at the recorded
seeds, and compares the regenerated tokens to the saved ones: exit 0 when every sample is
identical, 1 naming the first differing sample, turn and token, 2 on an error.
docs/debugging.md, "relax replay-agent".
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from omegaconf import OmegaConf

from relax.errors import ConfigError, ReplayError
from relax.files import fill, read_json
from relax.model import load_tokenizer
from relax.replay import discover_rollout_ids, read_rollout
from relax.rollout import SamplingParams
from relax.rollout.agent_replay import Replayed, recorded_turns, replay_sample
from relax.rollout.spec import EngineSpec
from relax.tools.mismatch_scoring import Scorer

CONTEXT = 8  # tokens shown before the first differing one


def rollout_files(run_dir: Path, dump: Path, template: str | None) -> dict[int, Path]:
    """The run's saved rollouts: a dump's rollout_data/, else debug.save_rollout_data's files."""
    found = discover_rollout_ids(str(dump / "rollout_data" / "{rollout_id}.pt"))
    if not found and template:
        path = template if Path(template).is_absolute() else str(run_dir / template)
        found = discover_rollout_ids(path)
    return found


def weights_of(run_dir: Path, model_path: Path, policy_version: int) -> Path:
    """The weights a rollout made on `policy_version` (its samples' metadata; with
    train.max_staleness older than its rollout_id) was generated with: the model, or the
    checkpoint saved after that many rollouts."""
    if policy_version == 0:
        return model_path
    hf = run_dir / "checkpoints" / f"rollout_{policy_version - 1:06d}" / "hf"
    if not (hf / "config.json").is_file():
        raise ReplayError(f"the rollout was generated with the weights after rollout {policy_version - 1}, "
                          f"and {hf} is not there (checkpoint.save_interval=1 saves them); pass --weights DIR")
    return hf


def load_run(run_dir: Path, rollout: int | None, file: Path | None):
    """(the composed config, the model path, the tokenizer, the rollout id, its data file)."""
    built = read_json(run_dir / "built.json") if (run_dir / "built.json").is_file() else {}
    own = (run_dir / "rollout_data").is_dir() or (run_dir / "config.yaml").is_file()
    dump = run_dir if own or not built.get("dump_dir") else Path(built["dump_dir"])
    configs = (run_dir / ".hydra" / "config.yaml", dump / "config.yaml")
    config = next((c for c in configs if c.is_file()), None)
    if config is None:
        raise ReplayError(f"{run_dir}: no composed config (.hydra/config.yaml, or a debug=dump's "
                          f"config.yaml)")
    cfg = OmegaConf.load(config)
    model_path = Path(built.get("model_path") or "")
    if not (model_path / "config.json").is_file():
        raise ReplayError(f"{run_dir}: the run's model ({model_path}) is not on this machine "
                          f"(built.json's model_path)")
    if file is None:
        files = rollout_files(run_dir, dump, cfg.debug.get("save_rollout_data"))
        if not files:
            raise ReplayError(f"{run_dir}: no saved rollouts (run with debug=dump or "
                              f"debug.save_rollout_data)")
        rollout = min(files) if rollout is None else rollout
        if rollout not in files:
            raise ReplayError(f"{run_dir}: no saved rollout {rollout} (saved: {sorted(files)})")
        file = files[rollout]
    tokenizer = load_tokenizer(dump / "tokenizer" if (dump / "tokenizer").is_dir() else model_path)
    return cfg, model_path, tokenizer, file


def shown(tokenizer, tokens: list[int], p: int) -> str:
    before = tokenizer.decode(tokens[max(0, p - CONTEXT):p], skip_special_tokens=False)
    at = tokenizer.decode(tokens[p:p + 1], skip_special_tokens=False) if p < len(tokens) else "(ends)"
    return f"{before!r} [{at!r}]"


def describe(rollout_id: int, saved, r: Replayed, tokenizer) -> str:
    d = r.difference
    before = "the prompt" if d.turn == 1 else "the recorded messages: tool results, observations"
    where = f"token {d.offset} of the model's reply" if d.generated else \
        f"token {d.offset} of the context before it ({before})"
    ids = f"saved {d.saved if d.saved is not None else '(ends)'} vs regenerated " \
          f"{d.replayed if d.replayed is not None else '(ends)'}"
    lines = [f"differs: rollout {rollout_id}, sample {r.index}, turn {d.turn}, token {d.position} ({where}): "
             f"{ids}",
             f"  saved:       {shown(tokenizer, saved.tokens, d.position)}",
             f"  regenerated: {shown(tokenizer, r.tokens, d.position)}"]
    if r.stopped:
        lines.append(f"  the replay stopped early: {r.stopped}")
    return "\n".join(lines)


def replay(run_dir: Path, rollout: int | None = None, sample: int | None = None, file: Path | None = None,
           weights: Path | None = None) -> tuple[int, list, list[Replayed], object, str | None]:
    """(rollout id, the saved samples replayed, their replays, the tokenizer, the stand-in note)."""
    cfg, model_path, tokenizer, file = load_run(run_dir, rollout, file)
    data, samples = read_rollout(file)
    rollout_id = data["rollout_id"]
    if sample is not None:
        samples = [s for s in samples if s.index == sample]
        if not samples:
            raise ReplayError(f"{file}: no sample {sample}")
    samples = [s for s in samples if recorded_turns(s)]
    if not samples:
        raise ReplayError(f"{file}: no sample with recorded agent I/O (metadata['agent_io']: a run with "
                          f"rollout.agent)")
    spec = EngineSpec.of(cfg.rollout, cfg.model, cfg.seed, model_path, [tokenizer.eos_token_id],
                         tokenizer.pad_token_id)
    scorer = Scorer(cfg.rollout, spec, [], tokenizer)
    version = samples[0].metadata.get("policy_version", rollout_id)
    engine = scorer.engine(weights or weights_of(run_dir, model_path, version))
    sp = SamplingParams.of(cfg.rollout)
    replays = [replay_sample(engine, tokenizer, s, sp) for s in samples]
    return rollout_id, samples, replays, tokenizer, scorer.stand_in


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="relax replay-agent", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path, help="a run dir (with debug=dump or debug.save_rollout_data)")
    ap.add_argument("--rollout", type=int, default=None, help="which saved rollout (default: the first)")
    ap.add_argument("--sample", type=int, default=None, help="only this sample (its index in the rollout)")
    ap.add_argument("--file", type=Path, default=None, help="this rollout file instead of the run's")
    ap.add_argument("--weights", type=Path, default=None,
                    help="the weights the rollout was generated with (default: those its samples' "
                         "policy_version names: the model, or the checkpoint after that many rollouts)")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(argv)
    if not args.path.is_dir():
        print(f"relax replay-agent: error: {args.path} is not a directory", file=sys.stderr)
        return 2
    try:
        rollout_id, samples, replays, tokenizer, stand_in = replay(
            args.path, args.rollout, args.sample, args.file, args.weights)
    except (ReplayError, ConfigError) as e:
        print(f"relax replay-agent: error: {e}", file=sys.stderr)
        return 2
    first = next(((s, r) for s, r in zip(samples, replays, strict=True) if r.difference), None)
    if args.json:
        print(json.dumps({"rollout_id": rollout_id, "identical": first is None, "stand_in": stand_in,
                          "samples": [{"index": r.index, "turns": r.turns, "stopped": r.stopped,
                                       "difference": r.difference and asdict(r.difference)}
                                      for r in replays]}))
        return 0 if first is None else 1
    if stand_in:
        print(f"note: {stand_in}")
    turns = sum(r.turns for r in replays)
    if first is None:
        print(f"identical: rollout {rollout_id}, {len(replays)} samples, {turns} turns regenerated token for "
              f"token")
        return 0
    print(describe(rollout_id, first[0], first[1], tokenizer))
    differing = sum(bool(r.difference) for r in replays)
    print(f"{differing} of {len(replays)} samples differ")
    return 1
