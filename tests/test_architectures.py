"""Architectures without a hand-written forward (tests/families.py ARCHITECTURES: Gemma 3 and 2,
Phi-3, Mistral, Mixtral, OLMo 2, GPT-NeoX, Granite, StarCoder2, SmolLM3, Cohere, GLM, Phi) train
on the torch engine's transformers path and the torch trainer: strict checks pass, the first
step's log_probs equal ref_log_probs exactly, the engine holds the trainer's weights after every
sync, and dp2 is equivalent to single. What the other engines and backends refuse is tested too."""

import json
import re
from pathlib import Path

import pytest
import torch

from relax.errors import ConfigError
from relax.model import families, load_tokenizer, read_hf_config
from relax.rollout import SamplingParams
from relax.rollout.hf_engine import TransformersEngine
from relax.rollout.torch_engine import TorchEngine

from .conftest import engine_spec, first_step_exact, make_cfg, relax_cli
from .families import ARCHITECTURES, SGLANG_RUNS

RUN = ["model=hf", "rollout.num_rollout=2", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
       "rollout.max_new_tokens=8", "debug.strict_checks=true", "debug.check_weight_update_equal=true",
       "debug.check_weight_update_every_sync=true", "debug.save_train_data=train_data/{rollout_id}_{rank}.pt",
       "task.reward_fn=relax.task.rewards.response_length"]  # rewards that differ: gradients


def test_at_least_twelve_architectures_beyond_the_families_none_hand_written(family_model):
    assert len(ARCHITECTURES) >= 12
    for arch in ARCHITECTURES:
        support = families.check(json.loads((family_model(arch) / "config.json").read_text()))
        assert support.family is None and support.architecture not in families.FAMILIES


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_architecture_trains_exactly_and_dp2_matches_single(arch, family_model, tmp_path):
    path = family_model(arch)
    for layout in ("single", "dp2"):
        proc = relax_cli(*RUN, f"model.path={path}", f"parallel={layout}", f"hydra.run.dir=outputs/{layout}",
                         cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    single = tmp_path / "outputs/single"
    assert "on transformers' forward" in (single / "relax.log").read_text()
    first = first_step_exact(single)  # first step: log_probs == ref_log_probs bit for bit
    assert first["train/ppo_kl"] == 0.0 and first["train/grad_norm"] > 0  # a real step
    assert first["train/train_rollout_logprob_abs_diff"] < 1e-5  # engine and trainer: one forward, two ways
    check = json.loads((single / "weight_check.json").read_text())
    assert check["passed"] and [c["stage"] for c in check["checks"]] == ["load", "sync", "sync", "sync"]
    proc = relax_cli("compare", str(single), str(tmp_path / "outputs/dp2"), "--json", cwd=tmp_path)
    jobs = {j["layout"]: j for j in json.loads(proc.stdout)["jobs"]}
    assert proc.returncode == 0 and jobs["dp2"]["verdict"] == "equivalent", proc.stdout[-2000:]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_the_transformers_path_samples_what_the_hand_written_forward_does(family, family_model):
    """On a family both run, the two forwards sample the same tokens (greedy and at temperature 1,
    left-padded prompts sharing a GRPO prefix) with log-probs within fp32 rounding."""
    path = family_model(family)
    tokenizer = load_tokenizer(path)
    cfg = make_cfg()
    args = (cfg.rollout, engine_spec(cfg, path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    fast, generic = TorchEngine(*args), TransformersEngine(*args)
    assert type(fast) is TorchEngine and generic.forward_name == "transformers' forward"
    prompts = [tokenizer(p)["input_ids"] for p in ("1+2=", "12+345=", "1+2=", "7*8=")]
    for temperature in (0.0, 1.0):
        sp = SamplingParams(temperature, 1.0, 12)
        a, b = fast.generate(prompts, sp, seed=3), generic.generate(prompts, sp, seed=3)
        assert [g.tokens for g in a] == [g.tokens for g in b]
        assert max(abs(x - y) for ga, gb in zip(a, b) for x, y in zip(ga.log_probs, gb.log_probs)) < 1e-5


def test_engine_named_tensors_and_updates_by_hf_name(family_model):
    path = family_model("gpt_neox")
    tokenizer = load_tokenizer(path)
    cfg = make_cfg()
    engine = TorchEngine(cfg.rollout, engine_spec(cfg, path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    named = engine.named_tensors()
    assert "gpt_neox.layers.0.attention.query_key_value.weight" in named
    assert any(n.endswith("rotary_emb.inv_freq") for n in named)
    new = {"embed_out.weight": torch.zeros_like(named["embed_out.weight"])}
    engine.update_weights(new)
    assert torch.equal(engine.named_tensors()["embed_out.weight"], new["embed_out.weight"])
    with pytest.raises(KeyError, match="no tensor named 'model.embed_tokens.weight'"):
        engine.update_weights({"model.embed_tokens.weight": torch.zeros(1)})
    layers = engine.record_layers([[1, 2, 3, 4]])
    assert list(layers)[:4] == ["gpt_neox.embed_in", "gpt_neox.layers.0.attention", "gpt_neox.layers.0.mlp",
                                "gpt_neox.layers.0"] and list(layers)[-1] == "gpt_neox.final_layer_norm"
    assert layers["gpt_neox.layers.1"][0].shape == (4, 64)


@pytest.mark.parametrize("overrides,message", [
    (["parallel=tp2"], "parallel=tp2: train=torch's tensor parallelism"),
    (["train.shared_prompt=true"], "train.shared_prompt=true packs a group's responses"),
])
def test_what_needs_the_hand_written_forward_is_refused_for_other_architectures(
        overrides, message, family_model, tmp_path):
    from relax.debug.plan import resolve

    cfg = make_cfg("model=hf", f"model.path={family_model('mistral')}", *overrides)
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        resolve(cfg)
    assert "MistralForCausalLM" in str(e.value)


# The tests' configs rollout=sglang refuses (relax/model/sglang_support.py), and why
SGLANG_REFUSED = {
    "gemma2": "SGLang 0.5.23's Gemma 2 reads config.hidden_act, which transformers 5's Gemma2Config no "
              "longer has",
    "mistral": "sliding_window=6: SGLang's model ignores the sliding window",
    "starcoder2": "sliding_window=6: SGLang's model ignores the sliding window",
    "phi": "SGLang 0.5.23's logits leave out the output layer's bias (lm_head.bias)",
    "gpt_neox": "SGLang 0.5.23 has no model for it, and its transformers backend fails to build one on CPU",
    "glm": "SGLang 0.5.23 has no model for it, and its transformers backend refuses",
}


def refused_on_sglang(path) -> str:
    from relax.debug.plan import resolve

    with pytest.raises(ConfigError) as e:
        resolve(make_cfg("model=hf", f"model.path={path}", "rollout=sglang"))
    message = str(e.value)
    assert message.startswith("rollout=sglang: SGLang on CPU here serves LlamaForCausalLM, ")
    assert message.endswith("use rollout=torch, which runs any transformers causal LM")
    return message


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_rollout_sglang_serves_or_refuses_each_architecture_at_start_up(arch, family_model):
    """What the SGLang tier runs (tests/test_sglang_architectures.py) passes the start-up check;
    the rest is refused before anything is built, naming the setting or why, and the torch engine."""
    hf = read_hf_config(family_model(arch))
    if arch not in SGLANG_REFUSED:
        assert arch in SGLANG_RUNS and families.sglang_blocker(hf) is None
        return
    assert arch not in SGLANG_RUNS
    message = refused_on_sglang(family_model(arch))
    assert f"this model is {hf['architectures'][0]} ({SGLANG_REFUSED[arch]}" in message


@pytest.mark.parametrize("arch,change,why", [
    ("gemma3", {"tie_word_embeddings": False}, "tie_word_embeddings=False: SGLang's Gemma 3 uses the "
                                               "embedding as the output layer and drops lm_head.weight"),
    ("cohere", {"tie_word_embeddings": False}, "tie_word_embeddings=False: SGLang's Cohere uses the "
                                               "embedding"),
    ("mistral", {"sliding_window": 4096, "max_position_embeddings": 32768}, "sliding_window=4096:"),
    ("phi3", {"sliding_window": 2047, "max_position_embeddings": 4096}, "sliding_window=2047: SGLang's model "
                                                                          "ignores the sliding window"),
    ("smollm3", {"use_sliding_window": True}, "use_sliding_window=True: sliding-window layers, not tested"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True: sliding-window attention"),
])
def test_rollout_sglang_refuses_a_setting_its_model_ignores(arch, change, why, family_model, tmp_path):
    import shutil

    model = shutil.copytree(family_model(arch), tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | change))
    assert f"({why}" in refused_on_sglang(model)


def test_routing_replay_is_refused_for_an_moe_without_a_hand_written_forward(family_model):
    from relax.debug.plan import resolve

    cfg = make_cfg("model=hf", f"model.path={family_model('mixtral')}", "algo.routing_replay=rollout")
    with pytest.raises(ConfigError, match=r"algo.routing_replay=rollout: routing replay .* MixtralForCausalLM"):
        resolve(cfg)


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["Qwen2ForCausalLM"]},  # a Mistral config relabelled as a supported family
     "architectures[0]=Qwen2ForCausalLM but model_type='mistral', for which transformers builds "
     "MistralForCausalLM"),
    ({"model_type": "not_a_model"}, "transformers has no causal LM for model_type='not_a_model'"),
    ({"model_type": None}, "no 'architectures' entry or no 'model_type'"),
    ({"rope_parameters": {"rope_type": "no_such_rope"}}, "transformers cannot build this model"),
])
def test_a_config_transformers_would_not_build_is_refused_at_start_up(change, message, family_model, tmp_path):
    import shutil

    from relax.startup import prepare

    model = shutil.copytree(family_model("mistral"), tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ConfigError, match=re.escape(message)):
        prepare(make_cfg("model=hf", f"model.path={model}"), tmp_path / "run")


MATRIX = ("<!-- support matrix: generated by relax.model.families.matrix -->\n", "\n<!-- end of support matrix -->")


def support_matrix(family_model) -> str:
    from .families import FAMILIES

    return families.matrix([read_hf_config(family_model(name)) for name in [*FAMILIES, *ARCHITECTURES]])


def test_the_support_matrix_in_the_docs_is_the_codes(family_model):
    table = support_matrix(family_model)
    docs = (Path(__file__).parents[1] / "docs" / "models.md").read_text()
    assert docs.split(MATRIX[0])[1].split(MATRIX[1])[0] == table, f"docs/models.md's support matrix is not the code's:\n{table}"
    assert table.count("\n| `") == len(ARCHITECTURES) + 5 and "transformers' forward" in table
