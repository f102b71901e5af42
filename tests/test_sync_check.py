"""The always-on weight-sync check (relax/debug/sync_check.py, issue 50 item 4): after every
sync each engine's sample of every tensor sent, taken in the engine, equals the trainer's; a
sync that skipped, left stale or corrupted a tensor stops the run naming it, with no debug flag."""

from __future__ import annotations

import logging

import pytest
import torch

from relax.debug.sync_check import check_sync_landed, differences
from relax.errors import CheckFailed, WeightSyncFailed
from relax.rollout.fingerprint import SAMPLE, fingerprint, samples

from .conftest import run_loop

SHORT = ["rollout.rollout_batch_size=8", "checkpoint.save_interval=null"]
SKIPPED = "model.layers.0.self_attn.o_proj.weight"  # relax.faults.skip_sync's


def weights(seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(300, 70, generator=g), "b.bias": torch.randn(5, generator=g)}


def test_the_sample_is_strided_fixed_by_the_salt_and_small():
    w = weights()
    (shape, sample), = samples(fingerprint(w, ["a.weight"], salt=0)).values()
    assert shape == (300, 70) and len(sample) == SAMPLE
    stride = 300 * 70 // SAMPLE
    assert torch.equal(sample, w["a.weight"].reshape(-1)[::stride][:SAMPLE])
    moved = samples(fingerprint(w, ["a.weight"], salt=5))["a.weight"][1]
    assert torch.equal(moved, w["a.weight"].reshape(-1)[5::stride][:SAMPLE])
    assert torch.equal(samples(fingerprint(w))["b.bias"][1], w["b.bias"])  # small tensors: every element
    assert fingerprint(w, ["nope"])["names"] == []
    mixed = fingerprint({**w, "c": torch.ones(3, dtype=torch.bfloat16)})  # one sample tensor per dtype
    assert {k: len(v) for k, v in mixed["samples"].items()} == {"float32": SAMPLE + 5, "bfloat16": 3}


def test_differences_name_each_tensor_that_did_not_land():
    sent = weights()
    assert differences(fingerprint(sent), fingerprint(sent)) == []
    stale = {**weights(1), "b.bias": sent["b.bias"]}  # a.weight kept the old values
    problems = differences(fingerprint(stale), fingerprint(sent))
    assert len(problems) == 1 and problems[0].startswith(f"a.weight: {SAMPLE} of {SAMPLE} sampled elements")
    one = {**sent, "b.bias": sent["b.bias"].clone()}
    one["b.bias"][3] = float("nan")
    assert differences(fingerprint(one), fingerprint(sent)) == ["b.bias: 1 of 5 sampled elements differ (max |Δ| nan)"]
    assert differences(fingerprint({}), fingerprint(sent, ["b.bias"])) == ["b.bias: not in the engine"]
    shaped = {**sent, "b.bias": torch.zeros(6)}
    assert differences(fingerprint(shaped), fingerprint(sent, ["b.bias"])) == [
        "b.bias: shape [6] in the engine, [5] sent"]


def test_a_bf16_engine_holds_the_fp32_weights_rounded_as_the_sync_copies_them():
    sent = weights()
    engine = {k: torch.empty_like(v, dtype=torch.bfloat16).copy_(v) for k, v in sent.items()}
    assert differences(fingerprint(engine), fingerprint(sent)) == []
    engine["model.rotary_emb.inv_freq"] = sent["b.bias"]  # an fp32 buffer beside bf16 weights
    assert differences(fingerprint(engine), fingerprint({**sent, "model.rotary_emb.inv_freq": sent["b.bias"]})) == []
    engine["a.weight"].view(-1)[0] += 1  # the first sampled element
    assert differences(fingerprint(engine), fingerprint(sent))[0].startswith("a.weight: 1 of")


def test_a_skipped_tensor_stops_the_run_naming_it_with_no_debug_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_FAULT", "sync_skip")
    with pytest.raises(WeightSyncFailed) as failed:
        run_loop(tmp_path, *SHORT, "rollout.num_rollout=2")
    message = str(failed.value)
    assert message.startswith(f"rollout 0: the weight sync did not land in the engine: {SKIPPED}: ")
    assert "\n" not in message and message.count("sampled elements differ") == 1
    assert isinstance(failed.value, CheckFailed)  # a user error: exit 2 with its message (relax.loop)


@pytest.mark.parametrize("where", [
    ["rollout._target_=relax.rollout.hf_engine.TransformersEngine"],  # transformers' forward
    ["train.async=true"],  # the engine in a process of its own: sampled there
    ["train.lora.rank=4"],  # LoRA: the merged projections sent, and only they compared
], ids=["transformers", "engine_process", "lora"])
def test_it_checks_every_engine_and_sync(tmp_path, monkeypatch, where):
    monkeypatch.setenv("RELAX_FAULT", "sync_skip")
    with pytest.raises(WeightSyncFailed, match=f"rollout 0: .*: {SKIPPED}: "):
        run_loop(tmp_path, *SHORT, "rollout.num_rollout=1", *where)


@pytest.mark.parametrize("lora", [[], ["train.lora.rank=4"]], ids=["full", "lora"])
def test_a_healthy_run_passes_quietly(tmp_path, caplog, lora):
    with caplog.at_level(logging.DEBUG, logger="relax.debug.sync_check"):
        metrics = run_loop(tmp_path, *SHORT, "rollout.num_rollout=2", *lora)
    assert len(metrics) == 2
    assert not [r for r in caplog.records if r.name == "relax.debug.sync_check" and r.levelno >= logging.INFO]


class Engines:
    """An engine group whose one engine holds `held` (in the engine's process: its own sample)."""
    num_engines = 1

    def __init__(self, held):
        self.held, self.salts = held, []

    def weight_fingerprints(self, names, salt):
        self.salts.append(salt)
        return [fingerprint(self.held, names, salt)]


def test_only_what_was_sent_is_compared_and_the_sample_moves_with_the_rollout():
    """LoRA syncs send the merged projections only: the engine's other tensors are not compared."""
    sent = weights()
    engines = Engines({**sent, "c.weight": torch.ones(3)})
    assert check_sync_landed(engines, {"a.weight": sent["a.weight"]}, 7) == 1
    assert engines.salts == [7]
    engines.held["a.weight"] = sent["a.weight"] + 1e-3
    with pytest.raises(WeightSyncFailed, match="rollout 8: .* a.weight: 64 of 64"):
        check_sync_landed(engines, {"a.weight": sent["a.weight"]}, 8)
