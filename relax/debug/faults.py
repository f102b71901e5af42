"""Test-only fault injection, so tests can prove that each check can fail.

Not a user feature: faults are switched on only by the RELAX_FAULT environment variable
(comma-separated names), which the test suite sets for a single run.
"""

import os


def active(name: str) -> bool:
    return name in os.environ.get("RELAX_FAULT", "").split(",")
