"""How the test tiers are scheduled (tests/conftest.py): under `--dist loadgroup` (the slow
tier) a test file is one group that one worker runs, so its module fixtures are built once."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict

from .conftest import REPO


def test_loadgroup_runs_each_test_file_on_one_worker():
    """What broke silently with pytest 9.2 and pytest-xdist 3.8 (every test its own group):
    the conftest refuses that pair, and this run shows the grouping holds with what is installed."""
    files = ["tests/test_algo.py", "tests/test_answers.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
                           "-p", "no:cacheprovider", *files], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers = defaultdict(set)
    for worker, path in re.findall(r"^\[(gw\d+)\] \[\s*\d+%\] PASSED (tests/\S+?)::", proc.stdout, re.M):
        workers[path].add(worker)
    assert sorted(workers) == files, proc.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
    passed = int(re.search(r"(\d+) passed", proc.stdout).group(1))
    assert passed == len(re.findall(r"^\[gw\d+\] \[\s*\d+%\] PASSED", proc.stdout, re.M)) > 10
