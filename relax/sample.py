"""`Sample`: the one record a rollout produces, replay stores and trainers consume; and the
temperature its log-probs are taken at, which engines and trainers must agree on."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from relax.errors import ConfigError


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
    # MoE models: the engine's top-k expert ids of every token it fed (all but the last), per
    # MoE layer, flattened [len(tokens) - 1, layers, top_k] (relax/train/routing.py); None: dense
    routed_experts: list[int] | None = None
    # the policy version (rollouts trained into the engine's weights) that sampled each response
    # token: a response continued across a weight sync (rollout.partial) has several; None: unknown
    token_versions: list[int] | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Sample":
        """A saved sample, or a KeyError/ValueError saying what is wrong with it."""
        names = {f.name for f in fields(cls)}
        missing = names - d.keys() - OPTIONAL_FIELDS
        if missing:
            raise KeyError(f"sample lacks fields {sorted(missing)}")
        s = cls(**{k: d[k] for k in names if k in d})
        lists = (s.tokens, s.loss_mask, s.rollout_log_probs)
        if not all(isinstance(x, list) for x in lists) or not isinstance(s.reward, (int, float)) or \
                not all(isinstance(x, int) for x in (s.index, s.group_index, s.response_length, *s.tokens,
                                                     *s.loss_mask)):
            raise ValueError(f"sample {s.index!r}: indices, tokens and loss_mask must be integers (in "
                             f"lists), the reward a number")
        if not 0 <= s.response_length < len(s.tokens) or \
                not len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length:
            raise ValueError(f"sample {s.index}: response_length {s.response_length} does not match "
                             f"its {len(s.tokens)} tokens, {len(s.loss_mask)} loss_mask and "
                             f"{len(s.rollout_log_probs)} rollout_log_probs entries")
        if s.token_versions is not None and (
                not isinstance(s.token_versions, list) or len(s.token_versions) != s.response_length
                or not all(isinstance(v, int) and v >= 0 for v in s.token_versions)):
            raise ValueError(f"sample {s.index}: token_versions must be a list of {s.response_length} "
                             f"policy versions (integers >= 0), one per response token, or None")
        if not routed_experts_fit(s):
            raise ValueError(f"sample {s.index}: routed_experts must be a list of [len(tokens) - 1 = "
                             f"{len(s.tokens) - 1}, layers, top_k] expert ids, flattened")
        return s


class Samples(list):
    """A rollout's samples as they cross processes (Ray actors, engine and rank processes):
    pickled field by field, one list per field, not object by object: about twice as fast as
    Ray's cloudpickle or plain pickle, which visit every object in Python (docs/results.md)."""

    def __reduce__(self):
        if any(type(s) is not Sample for s in self):  # a subclass keeps its own fields
            return Samples, (list(self),)
        return _from_columns, ([[getattr(s, name) for s in self] for name in FIELD_NAMES],)


FIELD_NAMES = [f.name for f in fields(Sample)]


def _from_columns(columns: list[list]) -> Samples:
    return Samples(Sample(*values) for values in zip(*columns))


def routed_experts_fit(s: Sample) -> bool:
    """Sample.routed_experts is None, or a non-empty list of [len(tokens) - 1, layers, top_k] ids."""
    routed = s.routed_experts
    return routed is None or (isinstance(routed, list) and len(s.tokens) > 1 and len(routed) > 0
                              and len(routed) % (len(s.tokens) - 1) == 0)


OPTIONAL_FIELDS = {"routed_experts", "token_versions"}  # (added with replay formats 2 and 3)


def require_routed_experts(samples: list[Sample], where: str) -> None:
    """algo.routing_replay=rollout (R3) trains on the engine's experts: every sample must carry
    them (relax/train/routing.py)."""
    missing = [s.index for s in samples if s.routed_experts is None]
    if missing:
        raise ConfigError(f"algo.routing_replay=rollout: samples {missing[:8]} of {where} carry no "
                          f"routed_experts (rollout data saved before Relax recorded routing, or a "
                          f"generate_fn that built its Sample without the engine's "
                          f"Generation.routed_experts); use algo.routing_replay=null for it")


def group_size_of(samples: list[Sample]) -> int:
    """The GRPO group size of a rollout, whose samples come in equal, contiguous groups."""
    groups = [s.group_index for s in samples]
    size = groups.count(groups[0])
    if len(samples) % size or groups != sorted(groups):
        raise ValueError("samples must come in equal, contiguous GRPO groups")
    if [s.index for s in samples] != list(range(len(samples))):
        raise ValueError("sample indices must be 0..N-1 in order")
    return size


def log_prob_temperature(temperature: float) -> float:
    """What logits are divided by for `rollout_log_probs` (engine) and `log_probs` (trainer):
    the sampling temperature, except that temperature 0 samples greedily and scores tokens
    under the unscaled softmax. SGLang does the same (tests/test_sglang.py checks it)."""
    return temperature or 1.0
