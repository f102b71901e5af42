"""Partial rollouts (rollout.partial): a rollout decodes over_sampling_batch_size groups (null:
1.5x the batch) and stops once rollout_batch_size of them are complete; the responses still in
flight carry over into the next rollout, where they go on with the new weights (`continue`) or
start over from their prompt (`abort`). Every response token records the policy version that
sampled it (Sample.token_versions). The cut is counted in decode steps, not seconds, so a run
makes the same samples every time: a checkpoint keeps what is in flight and a resume goes on to
the bit.
How and why: docs/rollouts.md, "Partial rollouts".
"""

from __future__ import annotations

import inspect
from dataclasses import replace

from relax.errors import ConfigError
from relax.model import decode_responses
from relax.rollout import DEFAULT_GENERATE_FN, Generation, SamplingParams, num_engines, rollout_seed, sample_seeds
from relax.rollout.prefetch import max_staleness
from relax.sample import Sample, Samples
from relax.targets import load_target
from relax.task import check_rewards

CHUNK = 16  # tokens per call of an engine that decodes each call to its end (in_chunks)
MODES = ("continue", "abort")
STALE = ("drop", "keep")
IN_FLIGHT = "aborted"  # Sample.status of a response that is not finished (or not begun)


def check_partial(rollout, train, builds_rollout: bool) -> None:
    """rollout.partial and rollout.partial_stale refusals, before anything is built."""
    r = rollout
    if r.partial is not None and r.partial not in MODES:
        raise ConfigError(f"rollout.partial={r.partial!r}: expected null (a rollout waits for its longest "
                          f"response), continue or abort")
    if r.partial_stale not in STALE:
        raise ConfigError(f"rollout.partial_stale={r.partial_stale!r}: expected drop or keep")
    if r.partial is None:
        return
    key = f"rollout.partial={r.partial}"
    if not builds_rollout:
        raise ConfigError(f"{key}: a train-only run replays saved rollouts and generates none: drop it "
                          f"to replay (the saved samples carry each token's policy version)")
    if max_staleness(train) < 1:
        raise ConfigError(f"{key} carries a response begun on one policy into the next rollout, which "
                          f"trains one version later: it needs train.max_staleness >= 1 (1: every rollout "
                          f"generated on the weights that train it, as a synchronous run; 2: also one "
                          f"rollout ahead)")
    over = r.over_sampling_batch_size
    if over is not None and over <= r.rollout_batch_size:
        raise ConfigError(f"{key} needs rollout.over_sampling_batch_size > rollout.rollout_batch_size="
                          f"{r.rollout_batch_size} (it is {over}; null: 1.5x the batch): a rollout decodes "
                          f"that many groups and stops once rollout_batch_size of them are complete")
    engine, engines = load_target(r, "rollout"), num_engines(r)
    refused = [
        (r.dynamic_sampling_filter, f"rollout.dynamic_sampling_filter={r.dynamic_sampling_filter}",
         "the cut counts complete groups while decoding, before rewards exist"),
        (r.agent or r.generate_fn != DEFAULT_GENERATE_FN, "rollout.agent or rollout.generate_fn",
         "a partial rollout continues the engine's own single-turn decode"),
        (engines > 1, f"{engines} engines", "the cut needs every response in one decode"),
        ("until" not in inspect.signature(engine.generate).parameters, f"rollout._target_={r._target_}",
         "its generate takes no `until` (the torch engine's does)"),
    ]
    for on, setting, why in refused:
        if on:
            raise ConfigError(f"{key} with {setting} is refused: {why}")


def pool_groups(rollout) -> int:
    """The groups a partial rollout decodes: rollout.over_sampling_batch_size, or 1.5x the batch."""
    return rollout.over_sampling_batch_size or -(-3 * rollout.rollout_batch_size // 2)


def in_chunks(generate, prompts: list[list[int]], sp: SamplingParams, seeds: list[int], done: list[int],
              until: tuple[list[int], int] | None) -> list[Generation]:
    """A partial decode (the torch engine's `generate(..., done, until)`) for an engine whose
    call decodes to its end (SGLang): calls of CHUNK new tokens at most, each row going on from
    what it has (its prefix cache makes that a short prefill), until `until` is met after a
    chunk. `generate(prompts, sp, seeds)`; a chunk's seed: its row's seed and its position."""
    out = [Generation([], [], IN_FLIGHT) for _ in prompts]
    groups, enough = until or (list(range(len(prompts))), len(prompts))

    def at(i: int) -> int:
        return done[i] + len(out[i].tokens)

    while True:
        rows = [i for i, g in enumerate(out) if g.status == IN_FLIGHT]
        open_groups = {groups[i] for i in rows}
        if not rows or len(set(groups) - open_groups) >= enough:
            return out
        for size in sorted({min(CHUNK, sp.max_new_tokens - at(i)) for i in rows}):
            part = [i for i in rows if min(CHUNK, sp.max_new_tokens - at(i)) == size]
            gens = generate([prompts[i] + out[i].tokens for i in part], replace(sp, max_new_tokens=size),
                            [sample_seeds(seeds[i], [at(i)])[0] for i in part])
            for i, g in zip(part, gens, strict=True):
                out[i].tokens += g.tokens
                out[i].log_probs += g.log_probs
                out[i].routed_experts = g.routed_experts
                out[i].status = g.status if g.status == "completed" or at(i) >= sp.max_new_tokens else IN_FLIGHT


def generation_lag(train, rollout) -> int:
    """How many versions behind its trainer a rollout is generated: train.max_staleness, one less
    with partial rollouts (a response carried into the next rollout trains one version later)."""
    return max_staleness(train) - (rollout.partial is not None)


class InFlight:
    """The responses each rollout left in flight, by rollout_id, kept from the last trained
    rollout on (a checkpoint saves them: what it made ahead goes on from them)."""

    def __init__(self, saved: dict[int, list[Sample]] | None = None):
        self.by_rollout = dict(saved or {})

    def before(self, rollout_id: int) -> list[Sample]:
        return self.by_rollout.get(rollout_id - 1, [])

    def put(self, rollout_id: int, samples: list[Sample]) -> None:
        self.by_rollout[rollout_id] = samples

    def trained(self, rollout_id: int) -> None:
        for j in [j for j in self.by_rollout if j < rollout_id]:
            del self.by_rollout[j]

    def kept(self, last: int) -> dict[int, list[Sample]]:
        """What a checkpoint keeps when `last` is the newest rollout it has (trained or made ahead)."""
        return {j: s for j, s in list(self.by_rollout.items()) if j <= last}


def fresh(prompt, index: int, seed: int, rollout_id: int) -> Sample:
    return Sample(index, 0, prompt.text, list(prompt.tokens), 0, label=prompt.label, status=IN_FLIGHT,
                  metadata={**prompt.metadata, "sample_seed": seed, "begun_at": rollout_id}, token_versions=[])


def extend(s: Sample, gen, version: int) -> None:
    """A generation's tokens appended to the response they continue."""
    s.tokens += gen.tokens
    s.response_length += len(gen.tokens)
    s.loss_mask += [1] * len(gen.tokens)
    s.rollout_log_probs += gen.log_probs
    s.token_versions += [version] * len(gen.tokens)
    s.status, s.routed_experts = gen.status, gen.routed_experts


def restart(s: Sample) -> int:
    """rollout.partial=abort: the response dropped, to be generated again; its token count."""
    n = s.response_length
    s.tokens, s.response_length = s.tokens[:s.prompt_length], 0
    s.loss_mask, s.rollout_log_probs, s.token_versions, s.routed_experts = [], [], [], None
    return n


def generate_partial_rollout(engine, task, tokenizer, rollout_cfg, rollout_id: int, seed: int,
                             policy_version: int, carried: list[Sample],
                             staleness: int) -> tuple[list[Sample], dict, list[Sample]]:
    """One partial rollout on the engine's `policy_version`: `carried` (what the rollout before
    left in flight) and new prompts up to over_sampling_batch_size groups, decoded until
    rollout_batch_size are complete. A carried group whose oldest token would train more than
    `staleness` versions late is dropped or kept (rollout.partial_stale). Returns the complete
    groups' scored samples, the metrics, and what is left in flight."""
    r, n = rollout_cfg, rollout_cfg.n_samples_per_prompt
    groups = [carried[i:i + n] for i in range(0, len(carried), n)]
    stale = [g for g in groups if any(rollout_id - min(s.token_versions, default=rollout_id) > staleness
                                      for s in g)]
    if r.partial_stale == "drop":
        groups = [g for g in groups if not any(g is x for x in stale)]
    new = max(pool_groups(r) - len(groups), 0)
    seeds = sample_seeds(rollout_seed(seed, rollout_id), range(new * n))  # a synchronous run's seeds
    groups += [[fresh(p, i * n + j, seeds[i * n + j], rollout_id) for j in range(n)]
               for i, p in enumerate(task.prompts(rollout_id, new, tokenizer))]

    def complete(g: list[Sample]) -> bool:
        return all(s.status != IN_FLIGHT for s in g)

    rows = [(gi, s) for gi, g in enumerate(groups) for s in g if s.status == IN_FLIGHT]
    enough = r.rollout_batch_size - sum(map(complete, groups))
    if rows and enough > 0:
        gens = engine.generate([s.tokens for _, s in rows], SamplingParams.of(r),
                               [s.metadata["sample_seed"] for _, s in rows],
                               done=[s.response_length for _, s in rows],
                               until=([gi for gi, _ in rows], enough))
        for (_, s), gen in zip(rows, gens, strict=True):
            extend(s, gen, policy_version)
    taken = [g for g in groups if complete(g)][:r.rollout_batch_size]
    left = [s for g in groups if not any(g is t for t in taken) for s in g]
    dropped = sum(restart(s) for s in left if s.status == IN_FLIGHT) if r.partial == "abort" else 0
    for i, s in enumerate(left):
        s.index, s.group_index = i, i // n

    samples = Samples(s for g in taken for s in g)
    for s, text in zip(samples, decode_responses(tokenizer, [s.tokens[s.prompt_length:] for s in samples]),
                       strict=True):
        s.response = text
    task.score(samples, n)
    check_rewards(samples, f"{task.rewards.source} at rollout {rollout_id}")
    for i, s in enumerate(samples):
        s.metadata.update(rollout_id=rollout_id, policy_version=min(s.token_versions))
        s.index, s.group_index = i, i // n
    stats = {"rollout/partial_carried_groups": len(carried) // n, "rollout/partial_stale_groups": len(stale),
             "rollout/partial_in_flight_groups": len(left) // n, "rollout/partial_aborted_tokens": dropped}
    return samples, stats, Samples(left)
