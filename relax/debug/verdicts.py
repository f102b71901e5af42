"""What a check returns and how it compares: the verdicts, the thresholds (re-derived for a
real model, docs/debugging.md), and NaN-safe comparisons that `relax doctor` and `relax
compare` share (`nan > limit` and `nan < limit` are both False)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
SEVERITY = {PASS: 0, SKIP: 0, WARN: 1, FAIL: 2}


# Every level below was re-derived for a real model (SmolLM2-135M-Instruct, 1000x the tiny
# model's parameters); the values each rests on are in docs/debugging.md ("How the thresholds
# were set") and docs/results.md. A level that depends on the model is relative to the run.
@dataclass
class Thresholds:
    # exactness, not a tolerance: the same weights through the same deterministic forward give
    # bit-equal log-probs at any size (also SmolLM2's 30 layers)
    kl_tol: float = 1e-8                  # first-step KL and |log_probs - ref_log_probs|
    # check 3. The trainer's log_probs are of the policy's own samples at the sampling
    # temperature, so E[-log p(x)] over sampled tokens IS the mean entropy at those positions,
    # for a model of any size (the tiny model and SmolLM2 alike). WARN when mean
    # |log_prob| leaves [H / ratio - slack, ratio * H + slack]; slack is the larger of the floor
    # below and 4 standard errors of the mean difference, sqrt(varentropy / tokens) (the terms
    # -log p(x_t) - H_t have conditional mean 0, so they are uncorrelated: the variance of
    # their mean is exact, not a bound); see logprob_slack()
    logprob_entropy_ratio: float = 2.0
    logprob_entropy_slack: float = 0.25   # nats: the floor of that slack
    # mean |log_prob| above log(vocab_size) (+ slack) is impossible for the policy's own samples:
    # their mean is the entropy, and no distribution over V tokens has more than log V (the
    # uniform guess): the tokens were scored by another model, tokenizer or temperature (FAIL).
    # None: log(vocab_size) of the run's model, 5.0 when unknown
    logprob_config_error: float | None = None
    # first-step grad_norm (before clipping at train.clip_grad): the token-mean GRPO gradient of
    # std-normalised advantages through normalised layers barely grows with the model (1000x
    # the parameters); 10 is several times both models' norms, and a gradient scaled by a
    # layout bug shows in `relax compare` long before it reaches 10
    grad_norm_max: float = 10.0
    # train/train_rollout_logprob_abs_diff at each rollout's first step (the weights the engine
    # sampled with): rounding only for the same code in fp32, at any depth; a bf16 engine
    # against the fp32 trainer, a real mismatch, grows with depth (SmolLM2's 30 layers stay
    # well under this); a dropped or corrupted tensor gives far more
    train_rollout_diff_max: float = 0.1
    # check 9 (MoE): the fraction of (token, MoE layer) pairs whose experts the trainer's router
    # picks as the engine's did. Rounding flips only near-ties: a bf16 engine against the fp32
    # trainer agrees on 0.992 of the tiny MoE's pairs, 0.9957 with a near-tie built into every
    # router (relax/train/routing.py); a layer under this routes a tenth of its tokens elsewhere
    routing_agreement_min: float = 0.9
    routing_agreement_drop: float = 0.05  # last third vs first third of the rollouts' agreement
    # ... and R3 is the next step where the mismatch is also high: a flip moves the log-probs of
    # every later token (the near-tie model's bf16 engine: mean |Δ| 1.9e-3, 0.9e-3 with R3)
    routing_mismatch_min: float = 0.01
    drift_ratio: float = 2.0              # last third vs first third of that diff (relative: any size)
    drift_floor: float = 1e-3             # ... once it is at least this large
    # garbage signals are shares of responses or tokens, not of the model: SmolLM2 and the tiny
    # model both score none on the first two at the first rollout
    invalid_token_ratio: float = 0.2      # garbage: undecodable / special tokens mid-response
    repetition_ratio: float = 0.5         # garbage: responses dominated by one token
    # a chat model explains before it answers and is cut at rollout.max_new_tokens (SmolLM2 at 8
    # tokens: most responses cut): a cut response is unfinished, not garbage, so the floor
    # is on the responses in format or cut; below it, most responses ENDED outside the format
    format_ok_min: float = 0.2
    collapse_fraction: float = 0.25       # reward falling below this share of its start
    # check 2, a collapse within one or two rollouts: the policy moved fast (any of the three
    # below) while the reward did not rise. Learning also sharpens the policy, but then the
    # reward rises with it. Prompts alone move a 4-prompt rollout's entropy by a third at most;
    # a collapse (train.lr=3e-4 on SmolLM2) more than halves it in one update
    entropy_collapse_ratio: float = 0.5   # rollout/entropy below this share of 1-2 rollouts before
    # ... and by at least this share of the run's first entropy: a sharp policy losing its last
    # bits is not collapsing (a healthy SmolLM2 run late in training), and the level follows
    # the model
    entropy_collapse_min_share: float = 0.25
    # rollout/kl (to the reference) up by this many nats in 1-2 rollouts, and by this factor: a
    # collapse leaves the reference at once (SmolLM2 at lr 3e-4: over a nat in one rollout); a
    # healthy run's KL, estimated from 32 samples, wanders in proportion to its level (the
    # SmolLM2 recipe, late, while it learned)
    kl_jump: float = 0.5
    kl_jump_factor: float = 2.0
    # the mean log-ratio of a later step within a rollout (num_steps_per_rollout > 1) as large
    # as PPO's clip range (algo.eps_clip 0.2): the average token left the trust region
    ppo_kl_max: float = 0.2
    # check 8, debug/batch_invariance_max_abs_diff: each sample alone with 8 more pad tokens against
    # its first-step micro-batch, fp32 on CPU: rounding from the padding (alone at the same length
    # it is bit-equal); 10x the largest over seeds and both models. The `batch_variant` fault
    # (logits scaled by 1 + 1e-4 x the micro-batch's rows) is far above it, and so is a bf16
    # trainer's rounding alone
    batch_invariance_tol: float = 2e-4


@dataclass
class Check:
    id: int
    name: str
    verdict: str
    summary: str
    evidence: dict = field(default_factory=dict)
    causes: list[str] = field(default_factory=list)
    next_steps: list[str] = field(default_factory=list)


def over(value: float, limit: float) -> bool:
    """value beyond limit, NaN included (a plain `value > limit` passes NaN)."""
    return not value <= limit


def below(value: float, limit: float) -> bool:
    """value under limit, NaN included (a plain `value < limit` passes NaN)."""
    return not value >= limit


def worst(values: Iterable[float], default: float = 0.0) -> float:
    """The largest value, NaN if any is NaN."""
    return nan_first(max, values, default)


def least(values: Iterable[float], default: float | None = None) -> float | None:
    """The smallest value, NaN if any is NaN."""
    return nan_first(min, values, default)


def nan_first(pick, values: Iterable[float], default):
    """pick(values) (min or max), NaN if any is NaN: min() and max() keep a NaN only when it
    comes first."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else pick(values, default=default)


@dataclass
class Tolerances:
    """`relax compare`'s tolerances (its flags' defaults), also what check 4 and 5's layer hints use."""
    logprob_atol: float = 1e-5
    grad_norm_rtol: float = 1e-4
    loss_atol: float = 1e-5
    strict_steps: int = 2
    envelope_margin: float = 10.0
    departure_ratio: float = 4.0
    layer_eps_multiple: float = 256.0  # --layers without a twin: the floor in units of the dtype's epsilon


def scaled_floor(fixed: float, twin_diff: float | None, margin: float) -> float:
    """The noise rule of every comparison (steps in relax compare, layers in relax/debug/layers.py): a
    difference is noise up to max(the fixed tolerance, margin x the twin's difference)."""
    return fixed if twin_diff is None else max(fixed, margin * twin_diff)
