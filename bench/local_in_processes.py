"""`relax cluster=local ...` with the processes cluster=ray has: a single-rank trainer and each
engine in a process of its own (cluster=local keeps both in the driver). What
bench/cluster_overhead.py's `processes` side runs, to split cluster=ray's cost into what any
layout of separate processes pays (pipes, pickling, shared-memory weights) and what Ray adds.

    python bench/local_in_processes.py [key=value ...]
"""

from __future__ import annotations

import sys

import relax.train
from relax.cluster import LocalCluster

_engines = LocalCluster._engines


def engines_in_processes(self, model_path, tokenizer):
    """LocalCluster's engines as train.async builds them (EngineProcesses); the run stays sync."""
    run_async = self.cfg.train["async"]
    self.cfg.train["async"] = True
    try:
        return _engines(self, model_path, tokenizer)
    finally:
        self.cfg.train["async"] = run_async


if __name__ == "__main__":  # (spawned engine processes import this file too)
    relax.train.runs_in_driver = lambda cfg: False
    LocalCluster._engines = engines_in_processes
    from relax.cli import main

    main(sys.argv[1:])
