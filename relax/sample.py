"""`Sample`: the one record a rollout produces, replay stores and trainers consume; and the
temperature its log-probs are taken at, which engines and trainers must agree on."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class Sample:
    index: int                     # position in the rollout batch
    group_index: int               # which prompt it answers (its GRPO group)
    prompt: str                    # prompt text, chat template applied
    tokens: list[int]              # prompt tokens + response tokens
    response_length: int           # number of response tokens (the tail of `tokens`)
    response: str = ""             # decoded response, special tokens removed
    label: str = ""                # reference answer for the reward
    reward: float = 0.0            # raw reward (advantages are normalised from it)
    loss_mask: list[int] = field(default_factory=list)            # per response token
    rollout_log_probs: list[float] = field(default_factory=list)  # engine's, per response token
    status: str = "completed"      # completed (stop token) | truncated | aborted
    metadata: dict = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Sample":
        names = {f.name for f in fields(cls)}
        missing = names - d.keys()
        if missing:
            raise KeyError(f"sample lacks fields {sorted(missing)}")
        return cls(**{k: d[k] for k in names})


def log_prob_temperature(temperature: float) -> float:
    """What logits are divided by for `rollout_log_probs` (engine) and `log_probs` (trainer):
    the sampling temperature, except that temperature 0 samples greedily and scores tokens
    under the unscaled softmax. SGLang does the same (tests/test_sglang.py checks it)."""
    return temperature or 1.0
