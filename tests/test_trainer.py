"""The torch trainer: first-step numerics, weight sync into the engine, checkpoint/resume."""

import pytest
import torch

from relax.rollout import SamplingParams
from relax.rollout.generate import generate_rollout
from relax.rollout.torch_engine import TorchEngine
from relax.sample import Sample
from relax.task import build_task

from .conftest import engine_spec, local_trainer, make_cfg, run_loop


def rollout(cfg, engine, tokenizer, rollout_id=0):
    return generate_rollout(engine, build_task(cfg.task, cfg.seed), tokenizer, cfg.rollout, rollout_id,
                            cfg.seed)[0]


def test_first_step_log_probs_equal_ref_and_kl_zero(tiny_path, tokenizer):
    cfg = make_cfg("rollout.rollout_batch_size=8", "algo.use_kl_loss=true", "algo.kl_loss_coef=0.1")
    engine = TorchEngine(cfg.rollout, engine_spec(cfg, tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    trainer = local_trainer(cfg, str(tiny_path), ref_model_path=str(tiny_path),
                           pad_token_id=tokenizer.pad_token_id)
    out = trainer.train(0, rollout(cfg, engine, tokenizer))
    r, step = out["rollout"], out["steps"][0]
    assert r["rollout/log_probs"] == r["rollout/ref_log_probs"]
    assert r["rollout/kl"] == 0.0
    assert step["train/ppo_kl"] == 0.0 and step["train/kl_loss"] == 0.0
    assert step["train/pg_clipfrac"] == 0.0
    assert step["train/train_rollout_logprob_abs_diff"] < 1e-4
    assert 0 < step["train/grad_norm"] < 10
    # after one step the actor moved away from the reference
    out2 = trainer.train(1, rollout(cfg, engine, tokenizer, 1))
    assert out2["rollout"]["rollout/kl"] != 0.0


def test_weight_sync_makes_engine_match_trainer(tiny_path, tokenizer):
    cfg = make_cfg("rollout.rollout_batch_size=16", "train.lr=0.02")
    engine = TorchEngine(cfg.rollout, engine_spec(cfg, tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    trainer = local_trainer(cfg, str(tiny_path), ref_model_path=str(tiny_path),
                           pad_token_id=tokenizer.pad_token_id)
    samples = rollout(cfg, engine, tokenizer)
    prompts = [s.tokens[:s.prompt_length] for s in samples[::8]]
    greedy = SamplingParams(0.0, 1.0, 8)
    before = [g.tokens for g in engine.generate(prompts, greedy, 0)]
    for rollout_id in range(3):
        trainer.train(rollout_id, rollout(cfg, engine, tokenizer, rollout_id))

    # The trainer moved; the engine still holds the old weights.
    weights = trainer.named_weights()
    assert not torch.equal(weights["model.norm.weight"], engine.params["model.norm.weight"])
    engine.update_weights(weights)
    for name, tensor in weights.items():
        assert torch.equal(engine.params[name], tensor), name
    after = [g.tokens for g in engine.generate(prompts, greedy, 0)]
    assert after != before
    with torch.no_grad():  # the engine now generates what the trainer's model would
        for prompt, tokens in zip(prompts, after, strict=True):
            x = torch.tensor([prompt + tokens[:-1]])
            expected = trainer.model(x).logits[0, len(prompt) - 1:].argmax(-1).tolist()
            assert tokens == expected


def test_checkpoint_resume_equals_uninterrupted_run(tmp_path):
    """Rollout 2 starts from the saved weights; rollout 3 also needs the saved Adam state."""
    common = ["rollout.num_rollout=4", "rollout.rollout_batch_size=8", "checkpoint.save_interval=2",
              "checkpoint.keep_last=3", "train.ref_log_probs_interval=2"]
    full_rollouts, full_steps = run_loop(tmp_path / "full", *common)
    checkpoints = sorted((tmp_path / "full" / "checkpoints").iterdir())
    assert [c.name for c in checkpoints] == ["rollout_000001", "rollout_000003"]
    assert (checkpoints[0] / "hf" / "model.safetensors").is_file()
    assert (checkpoints[0] / "hf" / "tokenizer.json").is_file()

    resumed_rollouts, resumed_steps = run_loop(tmp_path / "resumed", *common,
                                               f"resume={checkpoints[0]}")
    assert [r["rollout_id"] for r in resumed_rollouts] == [0, 1, 2, 3]  # with the checkpoint's history
    for resumed, full in zip(resumed_steps, full_steps, strict=True):
        for key in ("train/loss", "train/grad_norm", "train/pg_clipfrac", "train/ppo_kl"):
            assert resumed[key] == full[key], key
    for resumed, full in zip(resumed_rollouts, full_rollouts, strict=True):
        assert resumed.keys() == full.keys()  # ref_log_probs at the same rollouts (0 and the interval's)
        for key in ("rollout/raw_reward", "rollout/log_probs", "rollout/entropy"):
            assert resumed[key] == full[key], key
    assert [("rollout/ref_log_probs" in r) for r in resumed_rollouts] == [True, False, True, False]
    assert resumed_rollouts[2]["rollout/ref_log_probs"] == full_rollouts[2]["rollout/ref_log_probs"]


def test_resume_true_without_checkpoint_is_a_clear_error(tmp_path):
    from relax.errors import ConfigError

    with pytest.raises(ConfigError, match="no complete checkpoint"):
        run_loop(tmp_path / "runs" / "a", "resume=true")


def test_a_pad_token_inside_a_response_trains_like_any_other_token(tiny_path, tokenizer):
    """Rollout 43 of a 400-rollout replay: the policy generated the pad token mid-response
    (with a non-zero advantage). HF's nn.Embedding(padding_idx=pad) dropped the pad row's
    gradient, train=megatron did not: grad_norm 0.90320 vs 0.90539. Here the pad token and an
    unused token get identical weights, so swapping one for the other may not change a thing."""
    pad, twin = tokenizer.pad_token_id, tokenizer.convert_tokens_to_ids("*")
    cfg = make_cfg()

    def step(token: int):
        trainer = local_trainer(cfg, str(tiny_path), ref_model_path=str(tiny_path), pad_token_id=pad)
        model = trainer.model
        with torch.no_grad():
            for weight in (model.model.embed_tokens.weight, model.lm_head.weight):
                weight[twin] = weight[pad]
        prompt = tokenizer.encode("<|user|>12+34=<|assistant|>")
        samples = [Sample(index=i, group_index=0, prompt="", tokens=prompt + response,
                          response_length=len(response), reward=float(i == 0), loss_mask=[1] * len(response),
                          rollout_log_probs=[-1.0] * len(response))
                   for i, response in enumerate([[11, token, 12, 1], [13, 1]])]
        before = model.model.embed_tokens.weight[token].clone()
        grad_norm = trainer.train(0, samples)["steps"][0]["train/grad_norm"]
        return grad_norm, (model.model.embed_tokens.weight[token] - before).detach().abs()

    with_pad, with_twin = step(pad), step(twin)
    assert with_pad[0] == pytest.approx(with_twin[0], rel=1e-6) and with_pad[0] > 0.1
    # Adam's first step moves every weight with a gradient by lr
    assert with_pad[1].min() == pytest.approx(cfg.train.lr, rel=1e-3)
    assert torch.allclose(with_pad[1], with_twin[1], rtol=1e-4, atol=0)
