"""No silent NaN: non-finite rewards, losses, grad norms and weights stop or skip, loudly."""

import math

import pytest
import torch
from safetensors.torch import load_file

from relax.errors import ConfigError, NonFiniteError
from relax.files import safe_load
from relax.logger import read_metrics

from .conftest import local_trainer, make_cfg, run_loop

SMALL = ["rollout.rollout_batch_size=4", "train.micro_batch_size=8"]


def nan_reward(response: str, label: str) -> float:
    """A reward function with a bug: NaN for every response."""
    return float("nan")


def test_a_nan_reward_stops_before_training_naming_the_sample(tmp_path):
    with pytest.raises(NonFiniteError) as e:
        run_loop(tmp_path, *SMALL, "rollout.num_rollout=2", "checkpoint.save_interval=1",
                 "task.reward_fn=tests.test_nonfinite.nan_reward")
    message = str(e.value)
    assert "task.reward_fn=tests.test_nonfinite.nan_reward at rollout 0" in message
    assert "reward=nan for sample 0" in message and "prompt='" in message and "label='" in message
    assert not (tmp_path / "checkpoints").exists()
    rollouts, steps = read_metrics(tmp_path)
    assert rollouts == [] and steps == []  # nothing trained, nothing logged as if it had


def test_max_new_tokens_zero_is_refused_at_start_up(tmp_path):
    with pytest.raises(ConfigError, match="rollout.max_new_tokens=0"):
        run_loop(tmp_path, "rollout.max_new_tokens=0")
    assert not (tmp_path / "built.json").exists()  # refused before anything was built


def test_nonfinite_step_is_skipped_dumped_and_replayable(tmp_path, monkeypatch, tiny_path):
    monkeypatch.setenv("RELAX_FAULT", "nan_log_probs")  # sample 3's forward turns NaN
    rollouts, steps = run_loop(tmp_path / "run", *SMALL, "rollout.num_rollout=2", "train.on_nonfinite=skip",
                               "train.num_steps_per_rollout=2", "checkpoint.save_interval=2")
    # step 0 of each rollout holds samples 0-15 (sample 3): skipped; step 1 trains
    assert [s["train/skipped_steps"] for s in steps] == [1, 1, 2, 2]
    assert math.isnan(steps[0]["train/grad_norm"]) and math.isfinite(steps[1]["train/grad_norm"])
    assert all(math.isfinite(s["train/loss"]) for s in steps[1::2])
    weights = load_file(str(tmp_path / "run/checkpoints/rollout_000001/hf/model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert not torch.equal(weights["model.norm.weight"], load_file(str(tiny_path / "model.safetensors"))[
        "model.norm.weight"])  # the finite steps were applied
    _, resumed = run_loop(tmp_path / "resumed", *SMALL, "rollout.num_rollout=3", "train.on_nonfinite=skip",
                          "train.num_steps_per_rollout=2", f"resume={tmp_path / 'run'}")
    assert [s["train/skipped_steps"] for s in resumed] == [1, 1, 2, 2, 3, 3]  # counted on from the checkpoint
    dumped = safe_load(tmp_path / "run/nonfinite/0.pt")
    assert [s["metadata"]["replay_index"] for s in dumped["samples"]] == list(range(8))  # sample 3's group
    assert [s["index"] for s in dumped["samples"]] == list(range(8))

    replay = ["debug=train_only", f"debug.load_rollout_data={tmp_path}/run/nonfinite/{{rollout_id}}.pt",
              *SMALL, "checkpoint.save_interval=null", "rollout.num_rollout=2"]
    _, again = run_loop(tmp_path / "replay", *replay, "train.on_nonfinite=skip")
    assert [s["train/skipped_steps"] for s in again] == [1, 2]  # the same NaNs, from the dumps alone
    monkeypatch.delenv("RELAX_FAULT")
    _, clean = run_loop(tmp_path / "clean", *replay)
    assert all(math.isfinite(s["train/grad_norm"]) and s["train/skipped_steps"] == 0 for s in clean)


def test_nonfinite_step_stops_the_run_by_default_naming_the_dump(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_FAULT", "nan_log_probs")
    with pytest.raises(NonFiniteError, match=r"rollout 0: non-finite training step .*nonfinite/0\.pt"):
        run_loop(tmp_path, *SMALL, "rollout.num_rollout=2", "checkpoint.save_interval=1")
    assert (tmp_path / "nonfinite" / "0.pt").is_file()
    assert not (tmp_path / "checkpoints").exists()
    _, steps = read_metrics(tmp_path)
    assert len(steps) == 1 and math.isnan(steps[0]["train/grad_norm"])


def test_the_trainer_stops_at_the_nonfinite_step_or_skips_it_naming_its_samples(tiny_path, monkeypatch):
    """Two steps of 4 samples, sample 3's forward NaN (step 0): on_nonfinite=error trains no later
    step; skip names sample 3's micro-batch and trains step 1."""
    from relax.sample import Sample

    monkeypatch.setenv("RELAX_FAULT", "nan_log_probs")
    samples = [Sample(index=i, group_index=i // 4, prompt="", tokens=[5, 6, 7 + i, 8], response_length=2,
                      reward=float(i % 2), loss_mask=[1, 1], rollout_log_probs=[-1.0, -1.0])
               for i in range(8)]
    cfg = make_cfg("train.num_steps_per_rollout=2", "train.micro_batch_size=2", "train.on_nonfinite=error")
    trainer = local_trainer(cfg, str(tiny_path), ref_model_path=str(tiny_path), pad_token_id=0)
    for rollout_id, (mode, steps) in enumerate((("error", 1), ("skip", 2))):
        trainer.train_cfg.on_nonfinite = mode
        out = trainer.train(rollout_id, samples)
        assert len(out["steps"]) == steps and [e["indices"] for e in out["nonfinite"]] == [[2, 3]]
        assert out["steps"][0]["train/skipped_steps"] == rollout_id + 1


def test_a_step_with_finite_losses_but_a_nonfinite_grad_norm_names_all_its_samples():
    from relax.train.common import MicroBatch, nonfinite_indices

    mbs = [MicroBatch([0, 1], *[None] * 6), MicroBatch([2, -1], *[None] * 6)]
    assert nonfinite_indices(mbs, [torch.tensor(1.0), torch.tensor(2.0)]) == [0, 1, 2]
    assert nonfinite_indices(mbs, [torch.tensor(1.0), torch.tensor(float("inf"))]) == [2]


def test_a_checkpoint_is_never_written_from_nonfinite_weights(tmp_path, tiny_path, tokenizer):
    from relax.checkpoint import save_checkpoint

    trainer = local_trainer(make_cfg(), str(tiny_path), ref_model_path=str(tiny_path), pad_token_id=0)
    with torch.no_grad():
        trainer.model.model.layers[1].mlp.up_proj.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="model.layers.1.mlp.up_proj.weight is not finite"):
        save_checkpoint(trainer, tokenizer, tmp_path, 0, tiny_path, 2, {}, (make_cfg(), []))
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_clip_grad_norm_lets_no_nan_through():
    from relax.train.parallel import clip_grad_norm

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("nan"), 2.0])
    assert math.isnan(clip_grad_norm([p], 1.0))
    assert p.grad[0].item() == 1.0 and p.grad[2].item() == 2.0  # untouched: the caller skips the step


def test_clip_grad_norm_scales_every_grad_to_max_norm_and_returns_the_norm_before():
    """The global norm is over all grads together, and clipping scales them all by
    max_norm / norm; a norm under max_norm (or max_norm 0, or not finite) leaves them as they are."""
    from relax.train.parallel import clip_grad_norm

    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert clip_grad_norm([a, b], 1.0) == pytest.approx(5.0)
    assert torch.allclose(a.grad, torch.tensor([0.6, 0.0]), atol=1e-6) and b.grad.item() == pytest.approx(0.8)
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert clip_grad_norm([a, b], 10.0) == pytest.approx(5.0) and a.grad[0].item() == 3.0
    assert clip_grad_norm([a, b], 0.0) == pytest.approx(5.0) and b.grad.item() == 4.0
    b.grad = torch.tensor([float("inf")])  # an infinite norm clips nothing either: the step is skipped
    assert clip_grad_norm([a, b], 1.0) == float("inf") and a.grad[0].item() == 3.0
