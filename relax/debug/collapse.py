"""Check 2's trend readers: responses that turn to garbage, a reward that collapses over the
run, and a policy that collapses within one or two rollouts (a learning rate too high for
the model), from a run's per-rollout metrics."""

from __future__ import annotations

import math

from relax.debug.run_data import RunData, samples_of
from relax.debug.verdicts import Thresholds, below, over

def garbage_signals(record: dict, th: Thresholds) -> list[str]:
    signals = []
    if over(record.get("rollout/invalid_token_ratio", 0), th.invalid_token_ratio):
        signals.append(f"{record['rollout/invalid_token_ratio']:.0%} of tokens undecodable or "
                       f"special mid-response")
    if over(record.get("rollout/repetition_ratio", 0), th.repetition_ratio):
        signals.append(f"{record['rollout/repetition_ratio']:.0%} of responses repeat one token")
    fmt, cut = record.get("rollout/format_ok_ratio", 1), record.get("rollout/truncated_ratio", 0)
    if below(fmt + cut, th.format_ok_min):  # a response cut short has not reached its answer yet
        signals.append(f"only {fmt:.0%} of responses in the task's format ({cut:.0%} cut at "
                       f"rollout.max_new_tokens)")
    return signals


def find_collapse(rollouts: list[dict], th: Thresholds) -> tuple[int, str] | None:
    """(index, why) of the first rollout from the fourth on whose responses turn to garbage
    or from which the reward collapses (its next three against the first three); None if
    there is none. Non-finite rewards are check_later_responses's, before this."""
    rewards = [r["rollout/raw_reward"] for r in rollouts]
    early = sum(rewards[:3]) / 3
    for i in range(3, len(rollouts)):
        signals = garbage_signals(rollouts[i], th)
        window = rewards[i:i + 3]
        if signals:
            return i, "; ".join(signals)
        if early >= 0.05 and len(window) == 3 and below(sum(window) / 3, th.collapse_fraction * early):
            return i, f"mean reward {sum(window) / 3:.3f} vs {early:.3f} at the start"
    return None


DEAD_CHANCE = 1e-3  # a reward of exactly 0 the earlier policy would draw less often than this


def policy_moves(run: RunData, j: int, i: int, th: Thresholds) -> list[str]:
    """How far the policy moved from rollout j to rollout i (1-2 later), where that is fast."""
    prev, cur = run.rollouts[j], run.rollouts[i]
    moved = []
    if "rollout/entropy" in prev and "rollout/entropy" in cur:
        h0, h1 = prev["rollout/entropy"], cur["rollout/entropy"]
        start = next(r["rollout/entropy"] for r in run.rollouts if "rollout/entropy" in r)
        if below(h1, th.entropy_collapse_ratio * h0) and over(h0 - h1, th.entropy_collapse_min_share * start):
            moved.append(f"entropy {h0:.2f} -> {h1:.2f}")
    if "rollout/kl" in prev and "rollout/kl" in cur:  # rollouts that ran the reference pass
        k0, k1 = prev["rollout/kl"], cur["rollout/kl"]
        if over(k1 - k0, th.kl_jump) and over(k1, th.kl_jump_factor * k0):
            moved.append(f"KL to the reference {k0:.2f} -> {k1:.2f}")
    if not run.use_rollout_log_probs:  # else ppo_kl holds the engine/trainer mismatch (check 5)
        ids = {r["rollout_id"] for r in run.rollouts[j:i]}  # the updates that made rollout i's policy
        ppo = [(s["rollout_id"], s.get("step"), s["train/ppo_kl"]) for s in run.steps
               if s.get("rollout_id") in ids and "train/ppo_kl" in s]
        if ppo:
            rid, step, largest = max(ppo, key=lambda x: math.inf if math.isnan(x[2]) else abs(x[2]))
            if over(abs(largest), th.ppo_kl_max):
                moved.append(f"train/ppo_kl {largest:.2f} at rollout {rid} step {step}")
    return moved


def recovered(rewards: list[float], j: int, i: int) -> bool:
    """Whether the reward won back at least half of what it lost from before rollout j to
    rollout i, over the (up to 3) rollouts after i. A collapse does not recover; a healthy
    run's KL to the reference also jumps now and then beside a dip of a small rollout's reward,
    which it wins back (docs/debugging.md, "How the thresholds were set")."""
    later = rewards[i + 1:i + 4]
    if not later:
        return False  # the run ends here: judged on the move alone (a collapse within 3 rollouts)
    before = rewards[max(0, j - 2):j + 1]
    level = sum(before) / len(before)
    return sum(later) / len(later) >= level - (level - rewards[i]) / 2


def finite(run: RunData, j: int, i: int) -> bool:
    """The statistics of the move from rollout j to i are numbers (a NaN is never recovered from)."""
    ids = {r["rollout_id"] for r in run.rollouts[j:i]}
    return all(math.isfinite(r.get(k, 0.0)) for r in (run.rollouts[j], run.rollouts[i])
               for k in ("rollout/entropy", "rollout/kl")) and \
        all(math.isfinite(s.get("train/ppo_kl", 0.0)) for s in run.steps if s.get("rollout_id") in ids)


def find_fast_collapse(run: RunData, th: Thresholds) -> tuple[int, str] | None:
    """(index, why) of the first rollout at which the policy collapsed within one or two
    rollouts: it moved fast (entropy more than halved, KL to the reference or a step's ppo_kl
    jumped) while the reward did not rise nor recover after, or its reward fell to exactly 0
    with grad_norm 0 (every advantage 0: nothing left to learn from) where the earlier policy
    would almost never score 0. Learning sharpens a policy too, but its reward rises."""
    rewards = [r["rollout/raw_reward"] for r in run.rollouts]
    for i in range(1, len(run.rollouts)):
        for j in (i - 1, i - 2):
            if j < 0 or rewards[i] > rewards[j] or recovered(rewards, j, i) and finite(run, j, i):
                continue
            moved = policy_moves(run, j, i, th)
            if moved:
                span = "one rollout" if i - j == 1 else "two rollouts"
                return i, (f"{'; '.join(moved)} within {span} while the reward did not rise "
                           f"({rewards[j]:.3f} -> {rewards[i]:.3f})")
        rid = run.rollouts[i]["rollout_id"]
        norms = [s["train/grad_norm"] for s in run.steps if s.get("rollout_id") == rid]
        best = min(max(max(rewards[:i]), 0.0), 1.0)
        n = samples_of(run, rid)
        if rewards[i] == 0 and norms and all(g == 0 for g in norms) and n and (1 - best) ** n < DEAD_CHANCE:
            return i, (f"the reward fell from {best:.3f} to 0 with grad_norm 0 (every advantage 0): a "
                       f"policy scoring {best:.3f} draws {n} unrewarded samples with chance "
                       f"<= {(1 - best) ** n:.0e}")
    return None


def lower_lr(run: RunData) -> str:
    """The override that a tenth of the run's learning rate is."""
    return f"train.lr={run.lr / 10:.3g}" if run.lr else "train.lr=<a tenth of yours>"
