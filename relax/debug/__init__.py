"""Debugging (conf/debug/): run plans, replay inspection, layout comparison, fault hooks."""
