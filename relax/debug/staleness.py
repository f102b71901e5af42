"""Check 10 of `relax doctor` (relax/debug/checks.py): the train vs rollout mismatch by
staleness (train.max_staleness). A rollout made k versions ago differs from the trainer's
policy by k updates too; when that grows past what would fail a fresh rollout and no algo key
corrects for it, off-policy updates stack up unseen."""

from __future__ import annotations

from relax.debug.run_data import RunData
from relax.debug.verdicts import PASS, SKIP, WARN, Check, Thresholds, over


def check_staleness(run: RunData, th: Thresholds) -> Check:
    name = "off-policy mismatch by staleness"
    staleness = {r["rollout_id"]: r.get("rollout/staleness", 0) for r in run.rollouts}
    by: dict[int, list[float]] = {}
    for s in run.steps:  # a rollout's first step: the weights it was trained from
        if "train/train_rollout_logprob_abs_diff" in s and s.get("step", 0) == 0:
            diff = s["train/train_rollout_logprob_abs_diff"]
            by.setdefault(staleness.get(s.get("rollout_id"), 0), []).append(diff)
    if not any(k > 0 for k in by):
        return Check(10, name, SKIP, "no stale rollouts (train.max_staleness=0)")
    means = {k: sum(v) / len(v) for k, v in sorted(by.items())}
    shown = ", ".join(f"staleness {k}: {m:.2e}" for k, m in means.items())
    evidence = {"mismatch_by_staleness": means, "correction": run.off_policy_correction or None}
    stalest = means[max(means)]
    if over(stalest, th.train_rollout_diff_max) and over(stalest, means.get(0, 0.0)) \
            and not run.off_policy_correction:
        return Check(10, name, WARN, f"mean abs diff grows with staleness ({shown}) past "
                     f"{th.train_rollout_diff_max:g}, and no algo key corrects for it", evidence,
                     causes=["the policy moves between generating a rollout and training on it: "
                             "off-policy updates stack with train.max_staleness"],
                     next_steps=["relax algo.policy_loss=decoupled_ppo <your overrides>  # weight each "
                                 "token by pi_old / pi_rollout, drop the far-off ones",
                                 "relax algo.tis=token <your overrides>  # or truncated IS",
                                 "a lower train.max_staleness, or a lower train.lr"])
    corrected = f"; corrected by {run.off_policy_correction}" if run.off_policy_correction else ""
    return Check(10, name, PASS, f"{shown}{corrected}", evidence)
