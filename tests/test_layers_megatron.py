"""Layer dumps of train=megatron: name by name the same tensors as train=torch's, equal to them
within the fixed floor; a conversion fault is named at its module and weight. (A clean Megatron
layout sweep departs nowhere: tests/test_megatron.py's sweep, which dumps its layers too.)"""

import pytest
import torch

from relax.debug import layers
from relax.train.layer_dump import module_names

from . import test_layers
from .test_layers import compare_layers, dumped, first

replay = test_layers.replay  # its replay data fixture (one rollout of 16 samples)

pytestmark = pytest.mark.slow
FLOOR = 256 * torch.finfo(torch.float32).eps  # relax compare --layers' fixed floor for fp32


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory, replay):
    return dumped(tmp_path_factory.mktemp("torch") / "torch", *replay)


def load(run, source="train"):
    return layers.load_dump(run / "layers" / f"0_{source}.pt")


def test_a_megatron_dump_lines_up_with_torch_name_by_name(tmp_path, replay, torch_run):
    megatron = dumped(tmp_path / "megatron", *replay, "train=megatron")
    for source in ("train", "ref"):
        ours, theirs = load(megatron, source), load(torch_run, source)
        assert list(ours.forward) == list(theirs.forward) == module_names(2)
        assert sorted(ours.grads) == sorted(theirs.grads)
        assert sorted(ours.params) == sorted(theirs.params)
        assert [t.shape for t in ours.log_probs] == [t.shape for t in theirs.log_probs]
        # measured on the tiny model: forward <= 3.3e-7 (log_probs), gradients <= 1.1e-5 (layer 1's
        # q_proj: its small gradient carries the most relative rounding), weights 0
        d = layers.diffs(ours, theirs)
        assert all(v < FLOOR for part in d.values() for v in part.values()), d
    assert load(megatron).grads and all(g.abs().sum() > 0 for g in load(megatron).grads.values())
    code, jobs = compare_layers(torch_run, megatron)
    assert code == 0 and not jobs["megatron"]["departs"], jobs["megatron"]["first"]
    assert max(jobs["megatron"]["diffs"]["params"].values()) == 0.0  # the same checkpoint, converted


def test_a_transposed_qkv_half_after_conversion_is_named(tmp_path, replay, torch_run, monkeypatch):
    monkeypatch.setenv("RELAX_FAULT", "megatron_qkv_half_transposed:1")
    code, jobs = compare_layers(torch_run, dumped(tmp_path / "megatron", *replay, "train=megatron"))
    job = jobs["megatron"]
    assert code == 1 and first(job, "forward") == "model.layers.1.self_attn", job["first"]
    assert first(job, "params") == "model.layers.1.self_attn.q_proj.weight"
    assert job["diffs"]["forward"]["model.layers.0"] < FLOOR  # layer 0 as converted right
    changed = [n for n, v in job["diffs"]["params"].items() if v > 0]
    assert changed == ["model.layers.1.self_attn.q_proj.weight"]
