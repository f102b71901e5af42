"""task=word_problems: generated arithmetic word problems with exact labels, for chat models.

No data set can be downloaded where Relax is tested, so the problems are made here: a sentence
template, a name, an object and operands drawn from the rollout's seeded generator. A fixed
share of all problems (those whose text hashes into the held-out bucket) is never drawn for
training: `held_out()` draws only those, so an evaluation on them measures what the policy
learned, not what it saw.
"""

from __future__ import annotations

import hashlib
import random

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Kira", "Liam",
         "Maya", "Noah", "Olga", "Pablo"]
ITEMS = ["apples", "marbles", "stickers", "books", "coins", "shells", "pencils", "cards", "stamps", "cookies"]
# (template, answer): a, b are the operands, with a >= b for subtraction
TEMPLATES = {
    "plus": ("What is {a} + {b}?", lambda a, b: a + b),
    "minus": ("What is {a} - {b}?", lambda a, b: a - b),
    "add": ("{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
            lambda a, b: a + b),
    "sub": ("{name} had {a} {item} and gave {b} of them away. How many {item} does {name} have left?",
            lambda a, b: a - b),
    "mul": ("{name} fills {b} bags with {a} {item} each. How many {item} are in the bags?",
            lambda a, b: a * b),
}
HELD_OUT_BUCKETS = 10  # one problem in ten is held out for evaluation


def held_out(question: str) -> bool:
    return int(hashlib.sha256(question.encode()).hexdigest(), 16) % HELD_OUT_BUCKETS == 0


def make_problem(rng: random.Random, operations: list[str], min_operand: int, max_operand: int,
                 instruction: str) -> tuple[str, str]:
    op = rng.choice(operations)
    template, answer = TEMPLATES[op]
    a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
    if op in ("sub", "minus"):
        a, b = max(a, b), min(a, b)
    if op == "mul":
        b = rng.randint(2, 9)  # a one-digit count of bags keeps the product in reach
    text = template.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b)
    return f"{text} {instruction}".strip(), str(answer(a, b))


def draw(rng: random.Random, n: int, want_held_out: bool, **problem) -> list[tuple[str, str]]:
    """`n` problems from the training share (or the held-out one)."""
    out = []
    while len(out) < n:
        question, label = make_problem(rng, **problem)
        if held_out(question) == want_held_out:
            out.append((question, label))
    return out
