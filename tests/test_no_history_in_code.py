"""Code says what and why; measurements, dates and commit ids go to docs/results.md.

Every comment and docstring under relax/ is read (comments by the tokenizer, docstrings by the
parser) and refused when it carries a measurement (a timing, size or ratio next to a word that
reports one, a timing `->` a timing, or an approximate timing such as "~15 ms"), a date
(2026-12-05) or a commit id (7 to 40 hex characters with a digit and a letter). Module
docstrings stay at most 10 lines; longer explanations go to docs/*.md. Each rule is also run
on planted text, so that a pattern that stopped matching fails here instead of passing.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "relax"
MAX_MODULE_DOCSTRING_LINES = 10

NUM = r"\d+(?:\.\d+)?(?:e-?\d+)?"
TIME = r"(?:ms|s|µs|us|min)"
UNIT = rf"(?:{TIME}|%|GiB|GB|MiB|MB|KiB|KB|tokens/s)"
QUANTITY = rf"(?<![\w.]){NUM}(?:\s*[-–]\s*{NUM})?\s*{UNIT}(?![\w/])|(?<![\w.]){NUM}(?:-{NUM})?[x×](?!\w)"
REPORTS = (r"\b(?:measured|faster|slower|speed-?ups?|took|takes|saves?|saved|costs?|cost us|gave|"
           r"against|instead of|down from|up from|here)\b")
MEASUREMENT = re.compile(
    rf"(?:{QUANTITY}).*{REPORTS}|{REPORTS}.*(?:{QUANTITY})"  # a quantity and a word that reports it
    rf"|{NUM}\s*{TIME}\s*(?:->|→)\s*~?{NUM}\s*{TIME}(?!\w)"  # 3.6 ms -> 0.3 ms
    rf"|~\s*{NUM}\s*{TIME}(?!\w)"  # ~15 ms: a timing someone took
    rf"|\d\.\d+\s*(?:->|→)\s*\d+\.\d+"  # KL 0.72 -> 1.24: a run's values moving
    rf"|\bmeasured\b[^;]*\d\.\d|\d\.\d[^;]*\bmeasured\b"  # measured ... 3.7
    rf"|\bat rollout \d+\b[^.;]*\d\.\d|\d\.\d[^.;]*\bat rollout \d+\b",  # 0.34 at rollout 27: one run's moment
    re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
RULES = {"a measurement": MEASUREMENT, "a date": DATE, "a commit id": COMMIT}


def sentences(text: str) -> list[str]:
    """A comment block's or docstring's sentences, each on one line."""
    return [s for s in re.split(r"(?<=[.;])\s+|\n\s*\n", text) if s.strip()]


def prose(source: str) -> list[tuple[int, str]]:
    """(line, sentence) of every comment block (full-line comments in a row; a comment after
    code stands alone) and docstring of a module's source."""
    found, block, start, last = [], [], 0, -2
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            alone = tok.line.lstrip().startswith("#")
            if not (alone and tok.start[0] == last + 1):
                found += [(start, s) for s in sentences(" ".join(block))]
                block, start = [], tok.start[0]
            block.append(tok.string.lstrip("#").strip())
            last = tok.start[0] if alone else -2
    found += [(start, s) for s in sentences(" ".join(block))]
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)  # (a lambda's is an expression)
        for stmt in body if isinstance(body, list) else []:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) \
                    and isinstance(stmt.value.value, str):
                found += [(stmt.lineno, " ".join(s.split())) for s in sentences(stmt.value.value)]
    return found


def history(source: str) -> list[str]:
    return [f"line {line}: {what}: {text[:160]}" for line, text in prose(source)
            for what, rule in RULES.items() if rule.search(text)]


def checked_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", checked_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_measurement_date_or_commit_id_in_comments_and_docstrings(path):
    found = history(path.read_text())
    assert not found, f"{path.relative_to(REPO)}: move these to docs/results.md: {found}"


def test_module_docstrings_stay_short():
    long = {str(p.relative_to(REPO)): n for p in checked_files()
            if (n := len((ast.get_docstring(ast.parse(p.read_text()), clean=False) or "").splitlines()))
            > MAX_MODULE_DOCSTRING_LINES}
    assert not long, f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (move the rest to docs/): {long}"


def test_the_check_sees_the_package():
    assert len(checked_files()) > 60


PLANTED = [
    '"""Batched seeds: 3.6 ms -> 0.3 ms."""\n',
    "x = 1  # measured on the SmolLM2 recipe: 2.9 s a sync\n",
    "x = 1  # 2-3x faster than one call per sample\n",
    "def f():\n    \"\"\"One call per step\n    (~15 ms per sync for the tiny model).\"\"\"\n",
    "# a sync of 540 MB took\n# 2.9 s that way\n",
    "x = 1  # found on 2026-12-05\n",
    "x = 1  # fixed in f5edd2c\n",
    "x = 1  # (measured on the SmolLM2 recipe: KL 0.72 -> 1.24 and reward 0.69 -> 0.34 at rollout 27)\n",
    "x = 1  # SmolLM2 healthy: entropy 2.05 -> 0.13 over 30 rollouts\n",
    '"""Since commit 57d8bf3a9e0c the sync is shared."""\n',
]
FINE = [
    '"""Retries after a failure (backoff 0.5 s, doubling); logs every 30 s."""\n',
    "x = 1  # the update is alpha / rank x B @ A (null: 2 x rank)\n",
    "x = 1  # differences exact for values within 2x of each other; 10x the largest\n",
    "x = 1  # an idle scheduler polls at 100% of a core; a filesystem over 64 MiB is refused\n",
    "x = 1  # read in 1 MiB blocks; sha256 of the file; exp(20) ~ 4.9e8\n",
    "a = 1  # rewards -> floats, instead of reward_fn\nb = 2  # retries (backoff 0.5 s, doubling)\n",
    "x = 1  # rollout 0 -> 1 (the ids); a decade; facade; deadbeef is a word here\n",
    '"""(verl issue 6280: log-probs that changed with the batch\'s composition)."""\n',
    '"""The twin\'s distance from the baseline at step 0 is the measured rounding noise."""\n',
]


@pytest.mark.parametrize("source", PLANTED)
def test_a_planted_measurement_date_or_commit_id_is_found(source):
    assert history(source), source


@pytest.mark.parametrize("source", FINE)
def test_what_and_why_pass(source):
    assert not history(source), history(source)
