"""Every supported model family (relax/model/families/) on the torch engine and the torch
trainer, from real checkpoint layouts (tests/families.py): Megatron's side is in
test_megatron.py, SGLang's in test_sglang.py."""

import json
import re

import pytest
import torch
from safetensors import safe_open

from relax.algo import token_log_probs
from relax.errors import ConfigError
from relax.model import SUPPORTED_ARCHITECTURES, load_causal_lm, load_tokenizer
from relax.rollout import SamplingParams
from relax.rollout.torch_engine import TorchEngine

from .conftest import engine_spec, local_trainer, make_cfg
from .families import FAMILIES
from .test_engine import chat_prompts, hf_greedy

FAMILY_NAMES = list(FAMILIES)


def engine_for(path, tokenizer, *overrides):
    return TorchEngine(make_cfg(*overrides).rollout,
                       engine_spec(make_cfg(*overrides), path, [tokenizer.eos_token_id], tokenizer.pad_token_id))


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures[0]=GPT2LMHeadModel but model_type='qwen3', for "
     "which transformers builds Qwen3ForCausalLM: a relabelled or mixed-up config.json"),
    ({"architectures": None}, "no 'architectures' entry"),
])
def test_model_hf_refuses_what_no_engine_runs_before_anything_is_built(family_model, tmp_path, change,
                                                                       message):
    import shutil

    from relax.startup import prepare

    model = shutil.copytree(family_model("qwen3"), tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ConfigError, match=re.escape(message)):
        prepare(make_cfg("model=hf", f"model.path={model}"), tmp_path / "run")
    assert SUPPORTED_ARCHITECTURES == ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
                                       "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


@pytest.mark.parametrize("change,setting", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "RoPE type 'yarn'"),
    ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}, "use_sliding_window=True"),
])
def test_a_family_setting_the_hand_written_forward_lacks_runs_on_transformers_forward(
        family_model, tmp_path, change, setting):
    """The torch engine takes transformers' forward (and samples what generate() does); what needs the
    hand-written forward refuses, naming the setting."""
    import shutil

    from relax.debug.plan import resolve
    from relax.rollout.hf_engine import TransformersEngine

    model = shutil.copytree(family_model("qwen3"), tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | change))
    tokenizer = load_tokenizer(model)
    engine = engine_for(model, tokenizer)
    assert isinstance(engine, TransformersEngine)
    prompts = chat_prompts(tokenizer, 4, repeat=2)
    generations = engine.generate(prompts, SamplingParams(0.0, 1.0, 10), seed=0)
    hf = load_causal_lm(model, "float32")
    assert [g.tokens for g in generations] == [hf_greedy(hf, p, tokenizer, 10) for p in prompts]
    with pytest.raises(ConfigError, match=re.escape(setting)):
        resolve(make_cfg("model=hf", f"model.path={model}", "train=megatron"))


def test_megatron_refuses_an_moe_model_with_dense_layers_at_plan_time(family_model, tmp_path):
    import shutil

    from relax.debug.plan import resolve

    model = shutil.copytree(family_model("qwen3_moe"), tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"mlp_only_layers": [1]}))
    cfg = make_cfg("model=hf", f"model.path={model}", "train=megatron")
    with pytest.raises(ConfigError, match=re.escape("this model's layers [1] are dense")):
        resolve(cfg)
    resolve(make_cfg("model=hf", f"model.path={model}"))  # train=torch takes it


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_family_dirs_have_real_checkpoint_layouts(family_model, dtype):
    path = family_model("llama", dtype)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((path / s).is_file() for s in shards)
    assert "lm_head.weight" not in index["weight_map"]  # tied embeddings
    with safe_open(str(path / shards[0]), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == getattr(torch, dtype)
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())
    assert load_tokenizer(path).apply_chat_template(
        [{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=False) == \
        "<|user|>1+2=<|assistant|>"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_engine_greedy_and_log_probs_match_hf(family_model, tokenizer, family):
    """Greedy tokens equal HF generate; sampled log-probs equal a teacher-forced HF forward."""
    path = family_model(family)
    prompts = chat_prompts(tokenizer, 8, 1, 999, repeat=2)  # left-padded, shared prefill
    engine = engine_for(path, tokenizer)
    model = load_causal_lm(path, "float32")
    greedy = engine.generate(prompts, SamplingParams(0.0, 1.0, 8), seed=0)
    assert [g.tokens for g in greedy] == [hf_greedy(model, p, tokenizer, 8) for p in prompts]
    sampled = engine.generate(prompts, SamplingParams(1.0, 1.0, 8), seed=1)
    worst = 0.0
    for prompt, gen in zip(prompts, sampled, strict=True):
        tokens = torch.tensor([prompt + gen.tokens])
        with torch.no_grad():
            lp, _ = token_log_probs(model(tokens).logits[:, :-1], tokens[:, 1:])
        worst = max(worst, (lp[0, len(prompt) - 1:] - torch.tensor(gen.log_probs)).abs().max().item())
    assert worst < 1e-4


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_torch_trainer_first_step_and_weight_sync(family_model, tokenizer, family, tmp_path):
    """The trainer's first-step log-probs are the engine's and the reference's; its weights
    come back under the checkpoint's names and values (MoE experts per expert, not fused),
    so the engine takes them and a saved checkpoint has the same layout."""
    from relax.model import load_safetensors_dir

    from .test_trainer import rollout

    path = family_model(family)
    cfg = make_cfg("rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "train.lr=0.01")
    engine = engine_for(path, tokenizer)
    trainer = local_trainer(cfg, str(path), ref_model_path=str(path), pad_token_id=tokenizer.pad_token_id)
    checkpoint = load_safetensors_dir(path)
    weights = trainer.named_weights()
    assert sorted(weights) == sorted(checkpoint)
    assert all(torch.equal(weights[k], v) for k, v in checkpoint.items())

    samples = rollout(cfg, engine, tokenizer)
    out = trainer.train(0, samples)
    assert out["rollout"]["rollout/log_probs"] == out["rollout"]["rollout/ref_log_probs"]
    assert out["steps"][0]["train/ppo_kl"] == 0.0
    assert out["steps"][0]["train/train_rollout_logprob_abs_diff"] < 1e-4

    with torch.no_grad():  # new weights (a random model earns no reward, so no gradient either)
        for p in trainer.model.parameters():
            p.mul_(1.5)
    engine.update_weights(trainer.named_weights())
    prompts = [s.tokens[:s.prompt_length] for s in samples[::4]]
    sampled = engine.generate(prompts, SamplingParams(1.0, 1.0, 8), seed=2)
    for prompt, gen in zip(prompts, sampled, strict=True):
        tokens = torch.tensor([prompt + gen.tokens])
        with torch.no_grad():
            lp, _ = token_log_probs(trainer.model(tokens).logits[:, :-1], tokens[:, 1:])
        assert (lp[0, len(prompt) - 1:] - torch.tensor(gen.log_probs)).abs().max() < 1e-4
    trainer.save_checkpoint(str(tmp_path))
    assert sorted(load_safetensors_dir(tmp_path / "hf")) == sorted(checkpoint)


@pytest.mark.parametrize("family,compute_dtype", [("llama", "float32"), ("qwen3", "bfloat16")])
def test_rl_loop_on_a_sharded_bf16_checkpoint_starts_with_kl_zero(family_model, tmp_path, family,
                                                                  compute_dtype):
    """model=hf on a bf16 checkpoint: engine and trainer compute in model.dtype (fp32 upcasts
    the stored bf16 exactly), and the actor starts as the reference: first-step KL exactly 0."""
    from .conftest import run_loop

    path = family_model(family, "bfloat16")
    rollouts, steps = run_loop(tmp_path, "model=hf", f"model.path={path}", f"model.dtype={compute_dtype}",
                               "rollout.num_rollout=3", "rollout.rollout_batch_size=4",
                               "rollout.n_samples_per_prompt=4", "checkpoint.save_interval=null",
                               "debug.check_weight_update_equal=true")
    assert [r["rollout_id"] for r in rollouts] == [0, 1, 2] and len(steps) == 3
    assert rollouts[0]["rollout/log_probs"] == rollouts[0]["rollout/ref_log_probs"]
    assert rollouts[0]["rollout/kl"] == 0.0
    assert steps[0]["train/ppo_kl"] == 0.0 and steps[0]["train/kl_loss"] == 0.0
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < (1e-4 if compute_dtype == "float32" else 1e-2)
    assert json.loads((tmp_path / "weight_check.json").read_text())["passed"]


def test_moe_weight_sync_under_torch_tensor_parallelism(family_model, tmp_path):
    """The reported bug: `parallel=tp2` with an MoE model failed at the first weight sync
    (KeyError: mlp.experts.gate_up_proj). Qwen3-MoE's q/k norms run on TP-sharded heads."""
    from .conftest import run_loop

    from relax.model import load_safetensors_dir

    path = family_model("qwen3_moe")
    _, steps = run_loop(tmp_path, "model=hf", f"model.path={path}", "parallel=tp2", "rollout.num_rollout=1",
                        "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4",
                        "checkpoint.save_interval=null", "debug.check_weight_update_equal=true",
                        "debug.check_weight_update_every_sync=true")
    assert len(steps) == 1 and steps[0]["train/ppo_kl"] == 0.0
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-4
    report = json.loads((tmp_path / "weight_check.json").read_text())
    assert report["passed"] and [c["stage"] for c in report["checks"]] == ["load", "sync", "sync"]
    # every per-expert tensor of the checkpoint, and the rotary buffer
    assert all(c["compared"] == len(load_safetensors_dir(path)) + 1 for c in report["checks"][1:])
