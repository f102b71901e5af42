"""`python3 relax/entrypoints/train.py ...`: the debugging guide's entry point (same app as `relax`)."""

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: Python put relax/entrypoints/ on sys.path, not the repo root.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from relax.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
