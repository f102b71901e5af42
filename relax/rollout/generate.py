"""One rollout: `rollout.generate_fn` on every (prompt, sample) pair, rewards, and dynamic sampling.

Dynamic sampling (DAPO, `rollout.dynamic_sampling_filter`): whole GRPO groups that the filter
rejects (built-in: `rewards_differ`) are dropped and more prompts generated, in rounds of
`rollout.over_sampling_batch_size` prompts, until `rollout_batch_size` groups pass; round r's
prompts are the task's (rollout_id, round) prompts, so a resumed run draws the same ones.

The generate_fn interface: docs/rollouts.md, "Inside `relax/rollout/generate.py`".
"""

from __future__ import annotations

import math
from relax.targets import load_function
from relax.errors import RolloutError
from relax.model import decode_responses
from relax.rollout import AGENT_FN, FILTER_FN, GENERATE_FN, SamplingParams, rollout_seed, sample_seeds
from relax.rollout.agent import AgentSpec, Endpoint, agent_metrics
from relax.rollout.client import Batcher
from relax.sample import Sample, Samples, routed_experts_fit
from relax.task import Prompt, check_rewards
from relax.task.rewards import raised

async def single_turn(client, prompt, sampling_params: SamplingParams) -> Sample:
    """The default generate_fn: one engine call; every response token is the model's.
    (generate_samples makes its samples without coroutines, all in one engine call: the same.)"""
    gen = await client.generate(prompt.tokens, sampling_params)
    return single_turn_sample(prompt, gen, client.tokenizer.decode(gen.tokens, skip_special_tokens=True))


def single_turn_sample(prompt, gen, response: str) -> Sample:
    return Sample(
        index=prompt.index, group_index=prompt.group_index, prompt=prompt.text,
        tokens=prompt.tokens + gen.tokens, response_length=len(gen.tokens), response=response,
        label=prompt.label, loss_mask=[1] * len(gen.tokens), rollout_log_probs=gen.log_probs,
        status=gen.status, metadata=dict(prompt.metadata), routed_experts=gen.routed_experts)


def rewards_differ(group: list[Sample]) -> bool:
    """The built-in dynamic sampling filter: a group whose rewards are all equal has zero
    advantages under GRPO and teaches nothing."""
    return len({s.reward for s in group}) > 1


def check_sample(sample, prompt, source: str) -> None:
    """A generate_fn's Sample can be trained on: a clear error naming what is wrong, if not."""
    where = f"{source} returned for sample {prompt.index} (prompt={prompt.text!r})"
    if not isinstance(sample, Sample):
        raise RolloutError(f"{where} {type(sample).__name__} {sample!r}: expected a relax.sample.Sample")
    n = sample.response_length
    problems = []
    if not 0 < n < len(sample.tokens):
        problems.append(f"response_length={n} with {len(sample.tokens)} tokens (the response is the "
                        f"tail of `tokens`, after at least one prompt token)")
    if len(sample.loss_mask) != n:
        problems.append(f"loss_mask has {len(sample.loss_mask)} entries for {n} response tokens")
    elif not set(sample.loss_mask) <= {0, 1}:
        problems.append(f"loss_mask holds {sorted(set(sample.loss_mask) - {0, 1})}: expected 0 or 1 a token")
    if len(sample.rollout_log_probs) != n:
        problems.append(f"rollout_log_probs has {len(sample.rollout_log_probs)} entries for {n} response "
                        f"tokens (the engine's log-prob of each model token; 0.0 at masked ones)")
    elif not _finite_sum(sample.rollout_log_probs):  # one C-level pass; the slow scan only to say where
        bad = [t for t, lp in enumerate(sample.rollout_log_probs) if not _finite_sum([lp])]
        problems.append(f"rollout_log_probs has no finite number at response tokens {bad[:8]} "
                        f"(e.g. {sample.rollout_log_probs[bad[0]]!r}; masked tokens take 0.0)")
    if not routed_experts_fit(sample):
        routed = sample.routed_experts
        count = len(routed) if isinstance(routed, list) else repr(routed)
        problems.append(f"routed_experts has {count} entries: expected [len(tokens) - 1 = "
                        f"{len(sample.tokens) - 1}, MoE layers, top_k] expert ids, flattened (the "
                        f"Generation.routed_experts of the engine call that fed every token), or None")
    if problems:
        raise RolloutError(f"{where} a Sample that cannot be trained on: " + "; ".join(problems))


def _finite_sum(values) -> bool:
    try:
        return math.isfinite(math.fsum(values))
    except (TypeError, ValueError, OverflowError):
        return False


def generate_samples(engine, task, tokenizer, prompts: list, n: int, sampling_params: SamplingParams,
                     seed: int, generate_fn: str, where: str, first_index: int = 0,
                     agent: AgentSpec | None = None) -> list[Sample]:
    """`n` scored samples per prompt; sample k (numbered from `first_index`) draws with
    sample_seeds(seed, [first_index + k], [call]). `where` (e.g. "at rollout 3") goes into errors.
    With `agent` (rollout.agent), the agent makes each sample and its reward (relax/rollout/agent.py)."""
    fn = load_function(agent.path if agent else generate_fn, "rollout.agent" if agent else "rollout.generate_fn",
                       AGENT_FN if agent else GENERATE_FN)
    source = f"rollout.agent={agent.path} {where}" if agent else f"rollout.generate_fn={generate_fn} {where}"
    records = [Prompt(p.text, p.tokens, p.label, p.metadata, first_index + i * n + j, first_index // n + i,
                      p.chat_template, p.question) for i, p in enumerate(prompts) for j in range(n)]
    on_error = lambda record, e: raised(source, _as_sample(record), e)  # noqa: E731
    if agent:
        endpoint = Endpoint(fn, agent, getattr(task, "max_prompt_tokens", None))
        samples = endpoint.run(engine, records, sampling_params, tokenizer, seed, on_error)
    elif fn is single_turn:  # the default needs no coroutine per sample: one batched call, one decode
        gens = engine.generate([r.tokens for r in records], sampling_params,
                               sample_seeds(seed, [r.index for r in records]))
        responses = decode_responses(tokenizer, [g.tokens for g in gens])
        samples = [single_turn_sample(r, g, text)
                   for r, g, text in zip(records, gens, responses, strict=True)]
    else:
        samples = Batcher(engine, seed).run(fn, records, sampling_params, tokenizer, on_error)
    for sample, record in zip(samples, records, strict=True):
        check_sample(sample, record, source)
        sample.index, sample.group_index = record.index, record.group_index
    if not agent:  # an agent's samples carry its rewards
        task.score(samples, n)
    check_rewards(samples, source if agent else f"{task.rewards.source} {where}")
    return samples


def _as_sample(prompt) -> Sample:
    """What an error names for a sample that has no response yet."""
    return Sample(prompt.index, prompt.group_index, prompt.text, prompt.tokens, 0, label=prompt.label)


def generate_rollout(engine, task, tokenizer, rollout_cfg, rollout_id: int,
                     seed: int) -> tuple[list[Sample], dict]:
    """Sample `n_samples_per_prompt` responses per prompt and score them; with a dynamic
    sampling filter, until `rollout_batch_size` groups pass it. Returns the samples and the
    rollout's generation metrics."""
    r, n = rollout_cfg, rollout_cfg.n_samples_per_prompt
    keep = r.dynamic_sampling_filter and load_function(
        r.dynamic_sampling_filter, "rollout.dynamic_sampling_filter", FILTER_FN)
    per_round = (r.over_sampling_batch_size or r.rollout_batch_size) if keep else r.rollout_batch_size
    groups, filtered, rounds, made = [], 0, 0, []
    while len(groups) < r.rollout_batch_size:
        if rounds == r.max_generation_rounds:
            raise RolloutError(
                f"rollout {rollout_id}: only {len(groups)} of rollout_batch_size={r.rollout_batch_size} "
                f"groups "
                f"passed rollout.dynamic_sampling_filter={r.dynamic_sampling_filter} in "
                f"rollout.max_generation_rounds={r.max_generation_rounds} rounds of {per_round} prompts "
                f"({filtered} dropped): raise over_sampling_batch_size or max_generation_rounds")
        prompts = task.prompts(rollout_id, per_round, tokenizer, rounds)
        samples = generate_samples(engine, task, tokenizer, prompts, n, SamplingParams.of(r),
                                   rollout_seed(seed, rollout_id), r.generate_fn, f"at rollout {rollout_id}",
                                   first_index=rounds * per_round * n, agent=AgentSpec.of(r))
        made += samples
        for i in range(0, len(samples), n):
            group = samples[i:i + n]
            if not keep or _keeps(keep, group, r.dynamic_sampling_filter):
                groups.append(group)
            else:
                filtered += 1
        rounds += 1
    samples = Samples(s for g in groups[:r.rollout_batch_size] for s in g)  # (crosses processes)
    for i, s in enumerate(samples):
        s.metadata.update(rollout_id=rollout_id, **({"generation_index": s.index} if keep else {}))
        s.index, s.group_index = i, i // n
    stats = {"rollout/filtered_groups": filtered, "rollout/generation_rounds": rounds}
    if r.agent:  # over every sample the agent made, the filtered ones included
        stats.update(agent_metrics(made, f"rollout {rollout_id}"))
    return samples, stats


def _keeps(keep, group: list[Sample], path: str) -> bool:
    try:
        return bool(keep(group))
    except Exception as e:
        raise raised(f"rollout.dynamic_sampling_filter={path}", group[0], e) from None
