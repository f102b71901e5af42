"""`relax compare --layers`' verdicts on differences and dumps made by hand: the order tensors are
judged in, what a departure line says; a noise twin is judged too (against the other twins, or
where none measured a tensor on NaN/Inf alone), a twin's difference that is not finite measures
no noise, and an engine that recorded no module outputs is said to have been compared on its
log-probs only. On real dumps (the tiny sweep with faults): tests/test_layers.py."""

import json
import math
from pathlib import Path

import pytest
import torch

from relax.debug import layers
from relax.tools import compare
from relax.train import layer_dump

FIXED, MARGIN = 1e-4, 10.0


# HF parameter names in the order backward reaches them: output layer first, layer 1 before layer 0,
# within a layer the MLP before the attention, the embedding last
BACKWARD = ["lm_head.weight", "model.norm.weight", "model.layers.1.mlp.down_proj.weight",
            "model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.input_layernorm.weight", "model.embed_tokens.weight"]
MODULES = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]  # forward order


def synthetic(*off: str) -> layers.Dump:
    """A dump by hand whose tensors named in `off` are 1.5x the others' (rel 0.5); held in
    alphabetical order, which is neither forward nor backward order."""
    def t(name):
        return torch.full((2,), 1.5 if name in off else 1.0)
    return layers.Dump(Path("x"), {}, {m: [t(m)] for m in MODULES}, [t("log_probs")],
                       {n: t(n) for n in sorted(BACKWARD)}, {n: t(n) for n in sorted(BACKWARD)})


def test_gradients_are_judged_in_backward_order_and_weights_in_forward_order():
    d = layers.diffs(synthetic("model.layers.0", "model.norm", "model.layers.1.self_attn.q_proj.weight",
                               "model.layers.0.mlp.down_proj.weight"), synthetic())
    assert list(d["grads"]) == BACKWARD and list(d["params"]) == BACKWARD[::-1]
    dep = layers.judge_layers("job", d, 1e-4, 10.0, None)
    assert dep.first == {"forward": ("model.layers.0", 0.5, 1e-4),
                         "grads": ("model.layers.1.self_attn.q_proj.weight", 0.5, 1e-4),
                         "params": ("model.layers.0.mlp.down_proj.weight", 0.5, 1e-4)}


def test_a_departure_says_over_how_many_elements_it_lies():
    """One element off (Adam's first step turning a gradient that rounding decides the sign of)
    against a whole tensor off (a layout bug): the first tensors' spreads, in the line printed."""
    base = synthetic()
    stray = synthetic()
    stray.params["model.layers.0.input_layernorm.weight"] = torch.tensor([1.0, 1.0006])
    stray.forward["model.layers.1"] = [torch.tensor([1.0, 1.3])]
    stray.grads["model.norm.weight"] = torch.tensor([1.2, 1.2])
    dep = layers.judge_layers("stray", layers.diffs(stray, base), 1e-4, 10.0, None)
    dep.locate(stray, base)
    assert dep.spreads["params"] == {"elements": 1, "total": 2, "share": 0.9, "own": 2, "at": [1],
                                     "values": [pytest.approx(1.0006), 1.0]}
    assert dep.spreads["forward"]["at"] == [0, 1]  # [sample, element] of a module's output
    assert dep.spreads["grads"]["elements"] == 2  # both off alike: 90 % needs both
    line = dep.line()
    assert "weights depart at model.layers.0.input_layernorm.weight (rel 4.2e-04, floor 1.0e-04; 90% of it " \
           "in 1 of 2 elements (of the tensor itself: 2), the largest at [1]: 1.0006 vs 1)" in line, line
    assert layers.spread(torch.ones(3), torch.ones(3))["elements"] == 0  # equal: no largest
    assert layers.spread(torch.ones(3), torch.ones(4)) is None  # shapes differ (rel_diff: inf)


def grads(**diffs: float) -> dict[str, dict[str, float]]:
    """A job's diffs() with differences in its gradients only."""
    return {"forward": {}, "grads": diffs, "params": {}}


def judged(apart: list[dict], twins: list[int]) -> list[tuple]:
    """Per job, its first departing gradient (name, rel) and its floors."""
    deps = layers.judge_sweep([f"job{k}" for k in range(len(apart))], apart, twins, FIXED, MARGIN)
    return [(d.first["grads"] and d.first["grads"][:2], d.floors["grads"]) for d in deps]


def test_a_twin_is_judged_against_the_other_twins():
    # two twins 20x apart at w: the noisier one departs there, the other is inside its floor
    (quiet, quiet_floor), (noisy, noisy_floor), (job, job_floor) = judged(
        [grads(w=1e-3, v=1e-3), grads(w=2e-2, v=1e-3), grads(w=5e-3, v=5e-3)], twins=[0, 1])
    assert quiet is None and quiet_floor == {"w": 0.2, "v": 0.01}  # 10 x the other twin's
    assert noisy == ("w", 2e-2) and noisy_floor == {"w": 0.01, "v": 0.01}
    assert job is None and job_floor == {"w": 0.2, "v": 0.01}  # 10 x the larger twin's
    # a lone twin: no other to measure it by size; finite, it departs nowhere
    (twin, twin_floor), (job, job_floor) = judged([grads(w=1e-3), grads(w=2e-3)], twins=[0])
    assert twin is None and twin_floor == {"w": math.inf} and job is None and job_floor == {"w": 0.01}


def test_a_twins_difference_that_is_not_finite_measures_no_noise_and_departs():
    # a twin lacking tensor v (inf): v's floor is the other twin's, where the job departs
    (lacking, _), (whole, whole_floor), (job, job_floor) = judged(
        [grads(w=1e-3, v=math.inf), grads(w=1e-3, v=1e-3), grads(w=1e-3, v=5e-2)], twins=[0, 1])
    assert lacking == ("v", math.inf) and whole is None and whole_floor == {"w": 0.01, "v": math.inf}
    assert job == ("v", 5e-2) and job_floor == {"w": 0.01, "v": 0.01}
    # a lone twin NaN at w: it departs there, and w's floor for the others is the fixed one
    (twin, _), (job, job_floor) = judged([grads(w=math.nan, v=1e-3), grads(w=1e-3, v=1e-3)], twins=[0])
    assert twin[0] == "w" and math.isnan(twin[1])
    assert job == ("w", 1e-3) and job_floor == {"w": FIXED, "v": 0.01}
    (twin, twin_floor), _ = judged([grads(w=1e-3, v=math.inf), grads(w=1e-3, v=1e-3)], twins=[0])
    assert twin == ("v", math.inf) and twin_floor == {"w": math.inf, "v": math.inf}  # inf departs from inf


def test_an_engine_without_module_outputs_is_said_to_be_compared_on_its_log_probs(tmp_path, capsys):
    """rollout=sglang's engine dump (relax/loop.py's dump_layers): log-probs, no module outputs."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "built.json").write_text(json.dumps({"dump_layers": str(run / "layers")}))
    forward = {m: [torch.ones(3, 4)] for m in layer_dump.module_names(1)}
    log_probs = [torch.tensor([-1.0, -2.0])]
    layer_dump.save_dump(run / "layers", 0, "train", {}, [0], forward, log_probs, {"w": torch.ones(2)},
                         {"w": torch.ones(2)})
    layer_dump.save_dump(run / "layers", 0, "engine", {}, [0], {}, [torch.tensor([-1.0, -2.5])])
    assert compare.main(["--layers", str(run), "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[1] == (
        "engine: forward departs at log_probs (rel 2.2e-01, floor 3.1e-05; 90% of it in 1 of 2 elements (of "
        "the tensor itself: 2), the largest at [0, 1]: -2.5 vs -2) (log-probs only: the engine recorded no "
        "module outputs)"), out
    layer_dump.save_dump(run / "layers", 0, "engine", {}, [0], {}, log_probs)
    assert compare.main(["--layers", str(run), "--out", str(tmp_path), "--json"]) == 0
    engine = json.loads(capsys.readouterr().out)["jobs"][0]
    assert engine["diffs"]["forward"] == {"log_probs": 0.0} and not engine["departs"]
    assert engine["note"] == "log-probs only: the engine recorded no module outputs"
