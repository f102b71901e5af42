"""The built-in verifiable task: two-digit addition, "a+b=" -> "c", exact-match reward."""

from __future__ import annotations

import random


def make_problem(rng: random.Random, min_operand: int, max_operand: int) -> tuple[str, str]:
    a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
    return f"{a}+{b}=", str(a + b)


def exact_match(response: str, label: str) -> float:
    return float(response.strip() == label.strip())
