"""`relax mismatch`: for a fault of each kind (an engine class of tests/mismatch_engines.py through
rollout._target_, another engine dtype, train.async's stale weights) the tool names the factor it
injected first; `relax doctor` prints that factor under its failing check 5; routing it cannot
measure says why, and a turn's ids are compared with its text re-encoded."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from relax.replay import save_rollout
from relax.sample import Sample
from relax.tools.mismatch_factors import recorded_experts, retokenized, routing_factor, turns

from .conftest import only_run_dir, relax_cli
from .test_true_on_policy import TWO_THREADS

TINY = ["rollout.rollout_batch_size=4", "debug=dump"]
ONE = ["rollout.num_rollout=1", "checkpoint.save_interval=null"]
ENGINE = "rollout._target_=tests.mismatch_engines."
MOE = ["model.tiny.num_experts=4", "model.tiny.warmup_max_steps=0", "model.tiny.shared_expert_intermediate_size=64"]
CALC = ["rollout.generate_fn=relax.rollout.calculator.generate", "task.reward_fn=relax.rollout.calculator.reward"]

FAULTS = {  # factor -> (the run's overrides, the rollout the tool picks, what the engine side reads)
    "engine dtype": ([*ONE, "rollout.dtype=bfloat16"], 0, "bfloat16"),
    "KV-cache decode vs full forward": ([*ONE, ENGINE + "LossyCacheEngine"], 0, "KV-cache decode"),
    "batch composition": ([*ONE, ENGINE + "BatchVariantEngine"], 0, "in its batch"),
    "logits processing": ([*ONE, ENGINE + "HotEngine"], 0, "temperature 0.7"),
    "weights' version": (["rollout.num_rollout=2", "train.async=true", "checkpoint.save_interval=1",
                          "checkpoint.keep_last=null"], 1, "initial model"),
    "MoE routing": ([*ONE, *MOE, ENGINE + "RerouteEngine"], 0, "the engine's experts"),
    # (an untrained model: its ids are seldom the tokenizer's own encoding of their text)
    "tokenization": ([*ONE, *CALC, "model.tiny.warmup_max_steps=0", ENGINE + "TextPromptEngine"], 0,
                     "the text re-encoded"),
}
CURES = {"engine dtype": "rollout.true_on_policy=true", "KV-cache decode vs full forward": "rollout.true_on_policy=true",
         "batch composition": "rollout.true_on_policy=true", "MoE routing": "algo.routing_replay=rollout",
         "tokenization": "feed the engine token ids"}


def run_with(tmp_path, overrides) -> object:
    proc = relax_cli(*TINY, *overrides, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return only_run_dir(tmp_path)


@pytest.mark.parametrize("factor", FAULTS)
def test_mismatch_names_the_injected_factor_first(factor, tmp_path, tiny_path):
    overrides, rollout_id, engine_side = FAULTS[factor]
    run = run_with(tmp_path, overrides)
    proc = relax_cli("mismatch", str(run), "--json", "--out", str(tmp_path / "plots"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    top, *rest = report["factors"]
    assert report["rollout_id"] == rollout_id and report["mismatch"] > 1e-4
    assert report["replica_error"] < 1e-3 * report["mismatch"]  # the engine rebuilt: its log-probs
    assert (top["name"], top["engine"]) == (factor, engine_side), report
    assert top["share"] > 0.9 and all(f["share"] is None or f["share"] < 0.5 for f in rest), report
    unmeasured = [f["name"] for f in rest if f["share"] is None]  # dense: routing; no checkpoint: none
    assert unmeasured == ([] if factor == "MoE routing" else ["MoE routing"]), report
    assert (tmp_path / "plots" / f"mismatch_{rollout_id}.png").is_file()
    assert (report["cure"] or "").startswith(CURES[factor]) if factor in CURES else report["cure"] is None


def test_doctor_prints_the_top_factor_under_its_failing_mismatch_check(tmp_path, tiny_path):
    run = run_with(tmp_path, [*ONE, ENGINE + "HotEngine"])
    proc = relax_cli("doctor", str(run), "--train-rollout-diff-max", "0.01", "--out", str(tmp_path / "d"),
                     cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("[FAIL] 5."))
    after = next(line for line in lines[at + 1:] if not line.startswith("    likely cause") and
                 not line.startswith("    next"))
    assert after.startswith("    relax mismatch: top factor at rollout 0: logits processing"), proc.stdout


def test_mismatch_refuses_a_run_without_train_data(tmp_path, tiny_path):
    run = run_with(tmp_path, [*ONE, "debug=none"])
    proc = relax_cli("mismatch", str(run), cwd=tmp_path)
    assert proc.returncode == 2 and "no train data (run with debug=dump" in proc.stderr, proc.stderr


def test_a_turns_ids_are_compared_with_its_text_re_encoded():
    """Two model turns around a tool's output, with a BPE that merges a+b: the first turn spells
    "ab" as a, b (not the tokenizer's encoding of its text), the second as ab. The first turn is
    the one that differs; the second's context, re-encoded, holds "ab" as one token."""
    bpe = Tokenizer(models.BPE(vocab={"<e>": 0, "a": 1, "b": 2, "ab": 3, ":": 4, "x": 5}, merges=[("a", "b")]))
    bpe.add_special_tokens(["<e>"])
    bpe.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe)
    prompt, tool = [5, 4], [0, 5, 4]
    row = {"tokens": prompt + [1, 2] + tool + [3], "loss_mask": [1, 1, 0, 0, 0, 1]}
    assert turns(row["loss_mask"]) == [(0, 2), (5, 6)]
    view = retokenized(tokenizer, [row])
    assert (view.differ, view.turns, view.samples_differ, view.samples, view.changed) == (1, 2, 1, 1, True)
    assert view.rows == [{"tokens": [5, 4, 1, 2], "loss_mask": [1, 1]},
                         {"tokens": [5, 4, 3, 0, 5, 4, 3], "loss_mask": [1]}]
    canonical = retokenized(tokenizer, [{**row, "tokens": prompt + [3] + tool + [1, 2], "loss_mask": [1, 0, 0, 0, 1, 1]}])
    assert (canonical.differ, canonical.changed) == (1, False)  # its last turn: nothing reads it again
    assert "1 of 2 turns (1 of 1 samples)" in canonical.describe()


def test_routing_the_run_did_not_record_is_not_measured_and_says_why(tmp_path):
    moe, dense, dump = tmp_path / "moe", tmp_path / "dense", tmp_path / "dump"
    shape = {"vocab_size": 8, "hidden_size": 4, "num_hidden_layers": 1, "num_attention_heads": 1}
    for path, hf in ((moe, {**shape, "num_experts": 4}), (dense, shape)):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(hf))
    rows = [{"index": 0, "tokens": [1, 2, 3], "loss_mask": [1]}]
    assert recorded_experts(dense, dump, 0, rows)[1] == "a dense model (no MoE layer routes tokens)"
    assert recorded_experts(moe, dump, 0, rows)[1].startswith("no rollout data of rollout 0")
    sample = Sample(0, 0, "p", [1, 2, 3], 1, loss_mask=[1], rollout_log_probs=[-1.0])
    save_rollout(dump / "rollout_data" / "0.pt", 0, [sample], {})
    experts, why = recorded_experts(moe, dump, 0, rows)
    assert experts is None and why.startswith("the engine recorded no routing")
    factor = routing_factor(None, experts, why, False, moe, "float32", 1.0, None, None, None)
    assert (factor.share, factor.note) == (None, f"not measured: {why}")
    sample.routed_experts = [0, 1, 2, 3]  # 2 fed tokens x (1 layer x top-2)
    save_rollout(dump / "rollout_data" / "0.pt", 0, [sample], {})
    assert recorded_experts(moe, dump, 0, rows) == ([[0, 1, 2, 3]], "")
    assert recorded_experts(moe, dump, 0, [{**rows[0], "tokens": [1, 2, 4]}])[1].endswith("(other tokens)")


def test_the_routing_cure_removes_the_routing_fault(tmp_path, tiny_path):
    """The same rerouting engine under the cure the report names (algo.routing_replay=rollout):
    the trainer runs the engine's experts, the mismatch is the kernels' (float32) and the
    routing factor, measured, is 0."""
    run = run_with(tmp_path, [*ONE, *MOE, ENGINE + "RerouteEngine", "algo.routing_replay=rollout"])
    proc = relax_cli("mismatch", str(run), "--json", "--out", str(tmp_path / "plots"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    routing = next(f for f in report["factors"] if f["name"] == "MoE routing")
    assert report["mismatch"] < 1e-5 and (routing["share"], routing["trainer"]) == (0.0, "replayed (R3)"), report


def test_a_true_on_policy_run_at_2_threads_is_rebuilt_to_the_bit_at_1(tmp_path, tiny_path):
    """rollout.true_on_policy cuts a linear layer's columns into train.num_threads blocks; a
    block's width does not change a row's sums, so the tool, at 1 thread, rebuilds the engine
    of a run made at 2 exactly."""
    run = run_with(tmp_path, [*ONE, "rollout.true_on_policy=true", *TWO_THREADS])
    proc = relax_cli("mismatch", str(run), "--json", "--out", str(tmp_path / "plots"), cwd=tmp_path)
    assert torch.get_num_threads() == 1  # (the forked CLI's, as the session's: tests/conftest.py)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["mismatch"] == 0.0 and report["replica_error"] == 0.0, report
