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
    def of(cls, model, rollout, debug, seed: int, model_path, ref_model_path=None, pad_token_id: int = 0,
           plan=None) -> TrainerSpec:
        """From the model, rollout and debug groups, the paths, and the run's plan (its resolved
        save and profile settings; relax/debug/plan.py)."""
        resolved = {} if plan is None else dict(
            save_train_data=plan.save_train_data, profile_dir=plan.profile_dir,
            profile_rollouts=tuple(plan.profile_rollouts))
        return cls(model_path=str(model_path), ref_model_path=ref_model_path and str(ref_model_path),
                   pad_token_id=pad_token_id, dtype=model.dtype, seed=seed, temperature=rollout.temperature,
                   max_new_tokens=rollout.max_new_tokens, true_on_policy=rollout.true_on_policy,
                   check_batch_invariance=debug.check_batch_invariance, **resolved)
