"""rollout=sglang on the architectures beyond the families that SGLang serves on CPU here
(relax/model/sglang_support.py SERVED): every one the support matrix says runs on SGLang, and a
servable checkpoint of each whose tests/families.py config it refuses (SGLANG_VARIANTS). One short
loop each, in this process (SGLang imported once): strict checks, the engine-weights check at load
and after every sync, the first step's log_probs equal to ref_log_probs bit for bit, and the
engine's log-probs the trainer's. The refusals are in tests/test_architectures.py."""

import json

import pytest

pytest.importorskip("sglang", reason="needs the SGLang environment (scripts/setup_sglang_cpu.sh)")

from relax.model import families, read_hf_config  # noqa: E402
from relax.model.sglang_support import NOT_SERVED, SERVED  # noqa: E402

from .conftest import first_step_exact, run_loop  # noqa: E402
from .families import ARCHITECTURES, SGLANG_RUNS, SGLANG_VARIANTS, build_family_model  # noqa: E402
from .test_architectures import RUN  # noqa: E402
# rollout=torch, which every refusal names, in this environment too (SGLang pins its own transformers):
# transformers' forward samples what the hand-written one does
from .test_architectures import (  # noqa: E402, F401
    test_the_transformers_path_samples_what_the_hand_written_forward_does)

pytestmark = pytest.mark.sglang


def test_the_served_architectures_are_sglangs_and_every_tested_one_decided(family_model):
    """SERVED names SGLang's own models, or (sglang_model=False) what its transformers backend
    runs; those refused for want of a model are not in SGLang's registry; each architecture
    tests/families.py builds is either served or refused with a reason."""
    from sglang.srt.models.registry import ModelRegistry

    registry = set(ModelRegistry.get_supported_archs())
    assert {a for a, s in SERVED.items() if s.sglang_model} <= registry
    assert not {a for a, s in SERVED.items() if not s.sglang_model} & registry
    assert not {a for a, why in NOT_SERVED.items() if "has no model" in why} & registry
    tested = {read_hf_config(family_model(name))["architectures"][0] for name in ARCHITECTURES}
    assert set(SERVED) | set(NOT_SERVED) == tested


@pytest.mark.parametrize("name", [*SGLANG_RUNS, *SGLANG_VARIANTS])
def test_architecture_runs_on_sglang_exactly(name, family_model, tmp_path):
    if name in SGLANG_VARIANTS:
        arch, settings = SGLANG_VARIANTS[name]
        path = build_family_model(tmp_path / "model", arch, **settings)
    else:
        path = family_model(name)
    assert families.sglang_blocker(read_hf_config(path)) is None
    run = tmp_path / "run"
    run_loop(run, *RUN, f"model.path={path}", "rollout=sglang")
    assert json.loads((run / "built.json").read_text())["rollout_engine"] == \
        "relax.rollout.sglang_engine.SGLangEngine"
    first = first_step_exact(run)  # first step: log_probs == ref_log_probs bit for bit
    assert first["train/ppo_kl"] == 0.0 and first["train/grad_norm"] > 0
    assert first["train/train_rollout_logprob_abs_diff"] < 1e-5  # SGLang's log-probs are the trainer's
    check = json.loads((run / "weight_check.json").read_text())
    assert check["passed"] and [c["stage"] for c in check["checks"]] == ["load", "sync", "sync", "sync"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert check["checks"][0]["compared"] == len(index["weight_map"])  # every checkpoint tensor, by its name
