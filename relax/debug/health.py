"""Measurable signals of coherent vs garbage responses, logged for every rollout.

The guide's first check is "are the responses normal, coherent replies?". These numbers
answer it without reading text, from the model's own tokens (a tool's are masked out of the
loss and left out here): tokens the tokenizer cannot decode or special tokens in the middle
of a turn, one token repeated over most of a response, few distinct
bigrams, and (when the task declares one) responses that miss the expected format.
"""

from __future__ import annotations

import re
from collections import Counter

from relax.sample import Sample


def model_turns(response: list[int], loss_mask: list[int]) -> list[list[int]]:
    """The runs of model tokens (loss_mask 1) in a response: one per turn of a multi-turn sample."""
    turns, current = [], []
    for token, m in zip(response, loss_mask, strict=True):
        if m:
            current.append(token)
        elif current:
            turns.append(current)
            current = []
    return turns + ([current] if current else [])


def response_health(samples: list[Sample], tokenizer, answer_format: str | None) -> dict:
    vocab_size = len(tokenizer.get_vocab())
    special = set(tokenizer.all_special_ids)
    eos = tokenizer.eos_token_id
    invalid = total = repetitive = 0
    bigrams: list[tuple[int, int]] = []
    for s in samples:
        response, body = s.tokens[s.prompt_length:], []
        for turn in model_turns(response, s.loss_mask):  # tool and environment tokens are not the model's
            body += turn[:-1] if turn[-1] == eos else turn
            total += len(turn)
        invalid += sum(t >= vocab_size or t in special for t in body)
        if len(body) >= 4 and Counter(body).most_common(1)[0][1] > len(body) / 2:
            repetitive += 1
        bigrams += list(zip(body, body[1:]))
    stats = {
        "rollout/invalid_token_ratio": invalid / max(total, 1),
        "rollout/repetition_ratio": repetitive / len(samples),
        "rollout/distinct_2": len(set(bigrams)) / len(bigrams) if bigrams else 1.0,
    }
    if answer_format:
        pattern = re.compile(answer_format)
        stats["rollout/format_ok_ratio"] = sum(
            bool(pattern.fullmatch(s.response.strip())) for s in samples) / len(samples)
    return stats


SAMPLES_FILE = "samples.jsonl"  # in the run dir: one line per rollout, read by `relax doctor`


def sample_record(rollout_id: int, samples: list[Sample], tokenizer, answer_format: str | None) -> dict:
    """The rollout's example sample (the one its `Finish rollout` line shows), with that
    response's own health numbers."""
    s = samples[0]
    health = response_health([s], tokenizer, answer_format)
    return {"rollout_id": rollout_id, "num_samples": len(samples),
            "mean_reward": sum(x.reward for x in samples) / len(samples),
            "index": s.index, "prompt": s.prompt, "response": s.response, "label": s.label,
            "reward": s.reward, "status": s.status, "response_length": s.response_length,
            **{k.removeprefix("rollout/"): v for k, v in health.items()}}
