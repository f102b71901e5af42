"""Rewards for free-form answers (task.reward_fn): chat models explain before they answer.

`exact_match` (relax.task.arithmetic) scores `7 + 2 = 9.` 0; these read the answer out of the
text: the last number, the last `\\boxed{}`, GSM8K's `#### answer` line, or (`math_answer`) any
final mathematical expression, each compared with the label by math-verify (equal values,
not equal strings: `9.0`, `9` and `\\frac{18}{2}` all match 9). math-verify is the `real` extra.
"""

from __future__ import annotations

import logging
import re

# math-verify warns on every call made without its signal-based timeouts (which only work in
# the main thread); the answers parsed here are short
logging.getLogger("math_verify").setLevel(logging.ERROR)

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def same_value(answer: str | None, label: str) -> float:
    """1.0 when math-verify finds `answer` and `label` equal as mathematical values."""
    if answer is None:
        return 0.0
    # optional: math-verify (relax[real])
    from math_verify import parse, verify

    # no timeouts: math-verify's use signal.alarm, which only works in the main thread
    gold = parse(label, parsing_timeout=None)
    found = parse(answer, parsing_timeout=None)
    return float(bool(gold and found and verify(gold, found, timeout_seconds=None)))


def last_number(response: str, label: str) -> float:
    """The last number in the response (`14 + 11 = 25.` -> 25) equals the label."""
    numbers = NUMBER.findall(response)
    return same_value(numbers[-1].replace(",", "") if numbers else None, label)


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, nested braces included."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return f"${text[i:j]}$"
    return None  # unclosed


def boxed(response: str, label: str) -> float:
    """The last `\\boxed{}` of the response equals the label (MATH-style answers)."""
    return same_value(last_boxed(response), label)


def gsm8k(response: str, label: str) -> float:
    """GSM8K's format: the last `#### <number>` line equals the label."""
    answers = GSM8K_ANSWER.findall(response)
    return same_value(answers[-1].replace(",", "") if answers else None, label)


def math_answer(response: str, label: str) -> float:
    """math-verify's own extraction (boxed first, then the last expression) equals the label."""
    return same_value(response, label)
