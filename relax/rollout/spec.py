"""What an engine is given beyond its rollout group: the facts the run resolved at start-up.
Frozen and plain, so it pickles to every engine process and Ray actor."""

from __future__ import annotations

from dataclasses import dataclass

from relax.rollout import engine_dtype


@dataclass(frozen=True)
class EngineSpec:
    model_path: str                  # the weights it loads (a resumed run: its checkpoint's)
    eos_token_ids: tuple[int, ...]   # the tokens that end a response
    pad_token_id: int = 0
    dtype: str = "float32"           # rollout.dtype, or model.dtype where that is null
    seed: int = 0                    # the run's seed

    @classmethod
    def of(cls, rollout, model, seed: int, model_path, eos_token_ids, pad_token_id: int) -> EngineSpec:
        return cls(model_path=str(model_path), eos_token_ids=tuple(eos_token_ids), pad_token_id=pad_token_id,
                   dtype=engine_dtype(rollout, model), seed=seed)
