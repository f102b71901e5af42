"""Rollout/train mismatch on the real stack: an engine in bf16 (rollout.dtype) samples for an
fp32 trainer. train/mismatch_kl measures the mismatch; train/mismatch_residual, the mean
|applied IS weight - pi_train/pi_rollout| per token, is what of it the update keeps (the
update's bias from the mismatch is E_rollout[residual * A * grad log pi]). algo.tis=token
removes it up to its cap."""

import pytest

from relax.model import load_tokenizer
from relax.rollout import build_engine
from relax.rollout.generate import generate_rollout
from relax.task import build_task

from .conftest import engine_spec, local_trainer, make_cfg

BATCH = ["rollout.rollout_batch_size=8"]


@pytest.fixture(scope="module")
def rollouts(tiny_path):
    """The same prompts and seed, sampled by an fp32 and by a bf16 engine."""
    tokenizer = load_tokenizer(tiny_path)
    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = make_cfg(*BATCH, f"rollout.dtype={dtype}")
        engine = build_engine(cfg.rollout, engine_spec(cfg, tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
        out[dtype] = generate_rollout(engine, build_task(cfg.task, cfg.seed), tokenizer, cfg.rollout, 0, cfg.seed)[0]
    return out


def first_step(tiny_path, samples, *overrides) -> dict:
    trainer = local_trainer(make_cfg(*BATCH, *overrides), str(tiny_path), ref_model_path=str(tiny_path),
                           pad_token_id=0)
    return trainer.train(0, samples)["steps"][0]


def test_tis_removes_the_bf16_mismatch_from_the_update(tiny_path, rollouts):
    matched = first_step(tiny_path, rollouts["float32"])
    plain = first_step(tiny_path, rollouts["bfloat16"])
    tis = first_step(tiny_path, rollouts["bfloat16"], "algo.tis=token")
    # the mismatch is real and the same data either way: ~1e-4 nats vs ~1e-13 for an fp32 engine
    assert plain["train/mismatch_kl"] > 1e-5 > 1e-10 > matched["train/mismatch_kl"]
    assert tis["train/mismatch_kl"] == plain["train/mismatch_kl"]
    # without correction the update carries ~0.6% of weight error per token (fp32 engine: ~2e-7) ...
    assert plain["train/mismatch_residual"] > 1e-3
    assert matched["train/mismatch_residual"] < 1e-5
    assert plain["train/tis_weight_mean"] == 1.0 and plain["train/tis_clipfrac"] == 0.0
    # ... token TIS weights each token by pi_train/pi_rollout (below the cap 2: exactly)
    assert tis["train/mismatch_residual"] < 1e-7
    assert tis["train/tis_weight_mean"] != 1.0 and tis["train/tis_clipfrac"] == 0.0
    assert tis["train/grad_norm"] != plain["train/grad_norm"]  # the update itself changed


def test_a_tight_cap_truncates_and_leaves_a_residual(tiny_path, rollouts):
    capped = first_step(tiny_path, rollouts["bfloat16"], "algo.tis=token", "algo.tis_cap=1.001")
    plain = first_step(tiny_path, rollouts["bfloat16"])
    assert 0 < capped["train/tis_clipfrac"] < 1
    assert 0 < capped["train/mismatch_residual"] < plain["train/mismatch_residual"]
