"""Relax: reinforcement-learning post-training of LLMs, built to be debugged."""

__version__ = "0.1.0"
