"""What a trainer is given beyond its own config groups (train, algo, parallel): the facts the
run resolved at start-up. Frozen and plain, so it pickles to every rank and Ray actor."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerSpec:
    model_path: str                       # the actor's weights (a resumed run: its checkpoint's)
    ref_model_path: str | None = None     # the reference model (None: the actor's)
    pad_token_id: int = 0
    dtype: str = "float32"                # model.dtype
    seed: int = 0                         # the run's seed
    temperature: float = 1.0              # rollout.temperature: log-probs of the distribution sampled
    max_new_tokens: int = 1               # rollout.max_new_tokens: the horizon of seq-mean losses
    true_on_policy: bool = False          # rollout.true_on_policy: the engine's batch-invariant forward
    save_train_data: str | None = None    # debug.save_train_data, resolved (relax/debug/plan.py)
    check_batch_invariance: bool = False  # debug.check_batch_invariance
    profile_dir: str | None = None        # debug.profile_dir, resolved
    profile_rollouts: tuple[int, ...] = ()  # debug.profile_rollouts, resolved

    @classmethod
    def of(cls, model, rollout, debug, seed: int, **resolved) -> TrainerSpec:
        """From the model, rollout and debug groups, and what start-up resolved (`resolved`:
        paths, pad_token_id, the plan's save and profile settings)."""
        return cls(dtype=model.dtype, seed=seed, temperature=rollout.temperature,
                   max_new_tokens=rollout.max_new_tokens, true_on_policy=rollout.true_on_policy,
                   check_batch_invariance=debug.check_batch_invariance, **resolved)
