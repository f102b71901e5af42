"""Check 9 of `relax doctor` (relax/debug/checks.py): MoE routing, the trainer's experts
against the engine's (train/routing_agreement, relax/train/routing.py), its trend, and the
plumbing of routing replay."""

from __future__ import annotations

from relax.debug.run_data import RunData
from relax.debug.verdicts import FAIL, PASS, SKIP, WARN, Check, Thresholds, below, least, over, worst


def check_routing(run: RunData, th: Thresholds) -> Check:
    name = "MoE routing: trainer vs engine"
    read = [r for r in run.rollouts if "train/routing_agreement" in r]
    if not read:
        return Check(9, name, SKIP, "no train/routing_agreement (a dense model, or an engine that "
                                    "does not record routing)")
    agreement = [r["train/routing_agreement"] for r in read]
    # (a rollout's mean counts too: it is never below its worst layer, and a NaN in either fails)
    worst_layer = least(v for r, a in zip(read, agreement)
                        for v in (a, r.get("train/routing_agreement_min_layer", a)))
    replayed = [r["train/routing_replayed"] for r in read if "train/routing_replayed" in r]
    diffs = [s["train/train_rollout_logprob_abs_diff"] for s in run.steps
             if "train/train_rollout_logprob_abs_diff" in s and s.get("step", 0) == 0]
    mismatch = worst(diffs)
    third = max(1, len(agreement) // 3)
    first, last = sum(agreement[:third]) / third, sum(agreement[-third:]) / third
    evidence = {"mean_agreement": sum(agreement) / len(agreement), "min_layer_agreement": worst_layer,
                "first_third": first, "last_third": last, "max_train_rollout_abs_diff": mismatch,
                "replayed_min": least(replayed)}
    if replayed and below(evidence["replayed_min"], 1.0):
        return Check(9, name, FAIL, f"routing replay ran {evidence['replayed_min']:.2%} of the replayed "
                     f"(token, layer) pairs on the recorded experts", evidence,
                     causes=["recorded experts lost between the engine and the trainer's ranks (token "
                             "order, sequence/context parallel split, pipeline stage)",
                             "a router path that bypasses replay (fused top-k, sinkhorn, capacity dropping)"],
                     next_steps=["relax -m debug=train_only debug.load_rollout_data=<dir>/{rollout_id}.pt "
                                 "algo.routing_replay=rollout parallel=single,<your layout>  # which layout "
                                 "loses them"])
    if replayed:
        return Check(9, name, PASS, f"replay on: every replayed pair ran on the recorded experts; the "
                     f"routers' own choice agrees on {evidence['mean_agreement']:.4f}", evidence)
    low = below(worst_layer, th.routing_agreement_min)
    falling = len(agreement) >= 6 and over(first - last, th.routing_agreement_drop)
    if not low and not falling:
        return Check(9, name, PASS, f"agreement {evidence['mean_agreement']:.4f} (worst layer "
                     f"{worst_layer:.4f})", evidence)
    high = over(mismatch, th.routing_mismatch_min)
    next_steps = (["relax algo.routing_replay=rollout <your overrides>  # R3: the trainer routes as the "
                   "engine did; watch train/routing_replayed (1.0) and train/train_rollout_logprob_abs_diff"]
                  if high else [f"the log-prob mismatch is small ({mismatch:.2g} <= "
                                f"{th.routing_mismatch_min:g}): routing replay would change little"])
    what = f"the worst layer agrees on {worst_layer:.3f} < {th.routing_agreement_min:g}" if low else \
        f"agreement falls: {first:.4f} -> {last:.4f}"
    return Check(9, name, WARN, what + (f", with a train vs rollout mismatch of {mismatch:.3g}" if high
                                        else ""), evidence,
                 causes=["engine and trainer compute router logits differently (dtype, kernels): tokens "
                         "near a tie pick other experts",
                         "engine weights that differ from the trainer's (check 6)"],
                 next_steps=next_steps + ["relax inspect <dump dir>  # agreement per MoE layer"])
