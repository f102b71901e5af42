"""train=megatron's optimizer step: the configured Adam settings and grad clipping reach
Megatron's optimizer (relax/train/megatron/model.py wrap_for_training) and its split step
(trainer.py _optimizer_step) clips and skips as train=torch does; a resume restores the
skipped-step count."""

from types import SimpleNamespace

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from relax.model import load_safetensors_dir
from relax.rollout.torch_engine import TorchEngine
from relax.train.megatron.trainer import MegatronTrainer

from .conftest import build_trainer, engine_spec, local_trainer, make_cfg
from .test_trainer import rollout

# every setting off its default, and a clip far below the grad norm (~1): two steps apart
OPTIMIZER = ["train.lr=0.01", "train.weight_decay=0.1", "train.adam_beta1=0.5", "train.adam_beta2=0.9",
             "train.adam_eps=1e-3", "train.clip_grad=0.05", "train.num_steps_per_rollout=2"]
BATCH = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "train.micro_batch_size=8"]


@pytest.mark.slow
def test_megatron_steps_with_the_configured_adam_and_clipping_as_train_torch_does(tiny_path, tokenizer):
    """An ignored lr, weight decay, beta, eps or clip_grad, or a skipped clip, moves the weights
    elsewhere than train=torch's two steps do."""
    cfg = make_cfg(*BATCH, *OPTIMIZER)
    engine = TorchEngine(cfg.rollout, engine_spec(cfg, tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    samples = rollout(cfg, engine, tokenizer)
    for s in samples:  # rewards that vary within groups (a random model earns none): gradients
        s.reward = float(s.index % 3 == 0)
    reference = local_trainer(cfg, str(tiny_path), ref_model_path=str(tiny_path),
                             pad_token_id=tokenizer.pad_token_id)
    expected_out = reference.train(0, samples)
    expected = reference.named_weights()
    trainer = build_trainer(make_cfg(*BATCH, *OPTIMIZER, "train=megatron"), tiny_path,
                            pad_token_id=tokenizer.pad_token_id)
    try:
        out = trainer.train(0, samples)
        weights = trainer.named_weights()
    finally:
        trainer.shutdown()
    norms = [s["train/grad_norm"] for s in out["steps"]]
    assert all(n > 10 * 0.05 for n in norms)  # the clip acts on both steps
    assert norms == pytest.approx([s["train/grad_norm"] for s in expected_out["steps"]], rel=1e-4)
    before = load_safetensors_dir(tiny_path)
    moved = max((expected[n] - before[n]).abs().max().item() for n in before)
    worst = max((weights[n] - expected[n]).abs().max().item() for n in before)
    # measured: the weights moved by up to 1.3e-2, Megatron's from torch's by 6.0e-8
    assert moved > 0.01 and worst < 1e-3 * moved


class StepRecorder:
    """Megatron's optimizer as _optimizer_step sees it: finite grads of norm 2, nothing to clip."""
    config = SimpleNamespace(clip_grad=0.0)
    stepped = False

    def prepare_grads(self):
        return False  # no inf found

    def get_grad_norm(self):
        return 2.0

    def get_parameters(self):
        return []

    def step_with_ready_grads(self):
        self.stepped = True
        return True


def _step_on_rank(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        optimizer = StepRecorder()
        result = MegatronTrainer._optimizer_step(SimpleNamespace(optimizer=optimizer), loss_finite=rank == 1)
        assert (result, optimizer.stepped) == ((False, 2.0), False), rank
    finally:
        dist.destroy_process_group()


def test_a_nonfinite_loss_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """Only the last pipeline stage knows the loss: a NaN there must stop the other stages'
    update too (the skip is the max over ranks, not the min), or the stages' weights part."""
    mp.start_processes(_step_on_rank, args=(str(tmp_path / "init"),), nprocs=2, start_method="fork")


@pytest.mark.slow
def test_a_resumed_megatron_trainer_keeps_its_skipped_steps_and_is_past_its_first_step(tmp_path, tiny_path):
    """load_checkpoint restores the skipped-step count (train/skipped_steps goes on counting)
    and leaves the first-step checks off (they hold only before any training)."""
    cfg = make_cfg("train=megatron")
    trainer = build_trainer(cfg, tiny_path)
    try:
        trainer.call("__setattr__", "skipped_steps", 3)
        trainer.call("save_checkpoint", str(tmp_path))
    finally:
        trainer.shutdown()
    resumed = build_trainer(cfg, tiny_path)
    try:
        resumed.call("load_checkpoint", str(tmp_path))
        assert resumed.call("__getattribute__", "skipped_steps") == 3
        assert resumed.call("__getattribute__", "first_step") is False
    finally:
        resumed.shutdown()
