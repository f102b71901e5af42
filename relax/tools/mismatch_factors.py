"""Two factors of `relax mismatch` (relax/tools/mismatch.py) that need more than the engine's
forward: MoE routing (the engine's recorded experts replayed in the trainer's forward) and
tokenization (each model turn's ids against its text re-encoded, the context of every engine
call as text re-encoded); and the Factor each reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from relax.errors import ReplayError
from relax.model import families, read_hf_config
from relax.replay import read_rollout

ROUTING, TOKENIZATION = "MoE routing", "tokenization"


@dataclass
class Factor:
    name: str
    key: str              # the config key (or what) changes it
    engine: str           # the factor's value on the engine's side
    trainer: str          # ... and on the trainer's
    share: float | None   # the part of the gap this factor alone closes; None: not measured
    note: str = ""
    residual: list[float] = field(default_factory=list, repr=False)  # |switched - trainer| per token


# -- MoE routing ---------------------------------------------------------------------------

def recorded_experts(model_path: Path, dump: Path, rollout_id: int, rows: list[dict]) -> tuple[list | None, str]:
    """Per row, the experts the engine recorded (Sample.routed_experts of the dumped rollout
    data), or None and why the routing cannot be measured."""
    if not families.num_experts(read_hf_config(model_path)):
        return None, "a dense model (no MoE layer routes tokens)"
    path = dump / "rollout_data" / f"{rollout_id}.pt"
    if not path.is_file():
        return None, f"no rollout data of rollout {rollout_id} in {dump} (debug=dump writes it, with the experts)"
    try:
        samples = {s.index: s for s in read_rollout(path)[1]}
    except ReplayError as e:
        return None, str(e)
    found = [samples.get(r["index"]) for r in rows]
    if any(s is None or s.tokens != r["tokens"] for s, r in zip(found, rows, strict=True)):
        return None, f"{path}: its samples are not the trained ones (other tokens)"
    if any(s.routed_experts is None for s in found):
        return None, ("the engine recorded no routing (samples without routed_experts: an engine or "
                      "rollout.generate_fn that does not return Generation.routed_experts)")
    return [s.routed_experts for s in found], ""


def routing_factor(scorer, experts: list | None, why: str, replayed: bool, trainer_path: Path, dtype: str,
                   temperature: float, replica, trainer_own, trainer_agree) -> Factor:
    """The trainer's forward with the engine's experts replayed vs its own routing, against the
    engine replica. `replayed`: the run trained with algo.routing_replay=rollout already;
    `trainer_own`, `trainer_agree`: the trainer's log-probs as it ran and full_forward's agreement."""
    if experts is None:
        return Factor(ROUTING, "algo.routing_replay", "-", "-", None, f"not measured: {why}")
    if replayed:
        return Factor(ROUTING, "algo.routing_replay", "the engine's experts", "replayed (R3)", 0.0,
                      f"the trainer replays the engine's recorded experts; {agreement(trainer_agree)}")
    switched, agree = scorer.full_forward(trainer_path, dtype, temperature, experts)
    base = float((trainer_own.double() - replica.double()).abs().mean())
    left = (switched.double() - replica.double()).abs()
    share = max(0.0, min(1.0, 1 - float(left.mean()) / base)) if base > 0 else 0.0
    return Factor(ROUTING, "algo.routing_replay", "the engine's experts", "its own routers", share,
                  f"replayed in the trainer's forward (algo.routing_replay=rollout); {agreement(agree)}",
                  left.tolist())


def agreement(sums) -> str:
    same, compared = (float(x) for x in sums)
    return f"its routers choose the engine's top-k on {same / max(compared, 1):.1%} of {int(compared)} (token, layer) pairs"


# -- tokenization --------------------------------------------------------------------------

def reencoded(tokenizer, ids: list[int]) -> list[int]:
    """`ids` as text (special tokens kept), encoded again."""
    return tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"]


def turns(mask: list[int]) -> list[tuple[int, int]]:
    """The model's turns of a response: its runs of trained tokens, (start, end)."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


@dataclass
class Retokenized:
    """Each turn as an engine that takes text would have scored it: the context before the
    turn (prompt, earlier turns, tool output) as text re-encoded, then the turn's own ids."""
    rows: list[dict]        # one row per turn, in the trained tokens' order
    changed: bool           # some turn's context re-encodes to other ids
    differ: int             # turns whose own ids are not their text's re-encoding
    turns: int
    samples_differ: int
    samples: int

    def describe(self) -> str:
        return (f"{self.differ} of {self.turns} turns ({self.samples_differ} of {self.samples} samples) are "
                f"not the re-encoding of their own text")


def retokenized(tokenizer, rows: list[dict]) -> Retokenized:
    out, changed, differ, turn_count, samples_differ = [], False, 0, 0, 0
    for r in rows:
        mask = r["loss_mask"]
        prompt_len = len(r["tokens"]) - len(mask)
        sample_differs = False
        for start, end in turns(mask):
            turn = r["tokens"][prompt_len + start:prompt_len + end]
            context = r["tokens"][:prompt_len + start]
            seen = reencoded(tokenizer, context)
            changed |= seen != context
            own = reencoded(tokenizer, turn) != turn
            differ, turn_count, sample_differs = differ + own, turn_count + 1, sample_differs or own
            out.append({"tokens": seen + turn, "loss_mask": [1] * len(turn)})
        samples_differ += sample_differs
    return Retokenized(out, changed, differ, turn_count, samples_differ, len(rows))


def tokenization_factor(view: Retokenized, engine_side: bool, share: float, residual: list[float]) -> Factor:
    """`engine_side`: the engine's log-probs match the re-encoded contexts (share: how much of
    the gap scoring the trained ids instead closes)."""
    key = "rollout.generate_fn (token ids in, token ids out)"
    if engine_side:
        return Factor(TOKENIZATION, key, "the text re-encoded", "the generated ids", share,
                      f"the engine's log-probs match each call's context re-encoded from text; {view.describe()}",
                      residual)
    why = ("the engine's log-probs match the generated ids" if view.changed else
           "every engine call's context re-encodes to itself")
    return Factor(TOKENIZATION, key, "the generated ids", "the generated ids", 0.0, f"{why}; {view.describe()}")
