"""The tiny model directory and the loading code shared with real HF checkpoints."""

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer

from relax.errors import ConfigError
from relax.model import load_tokenizer, model_fingerprint, resolve_model_path, tiny, tokenizer_fingerprint

from .conftest import make_cfg, only_run_dir, relax_cli, status_of


def test_tiny_model_is_a_normal_hf_directory(tiny_path):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_path / name).is_file(), name
    config = json.loads((tiny_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    recipe = json.loads((tiny_path / "relax_tiny.json").read_text())
    assert recipe["warmup_greedy_accuracy"] >= make_cfg().model.tiny.warmup_target_accuracy


def test_the_default_tiny_model_is_the_shipped_bytes_on_every_machine(tiny_path, tmp_path, monkeypatch):
    """The default recipe is never trained here: a fresh cache gets the shipped file, verified."""
    assert tiny.sha256(tiny.SHIPPED / "model.safetensors") == tiny.SHIPPED_SHA256
    assert tiny.sha256(tiny_path / "model.safetensors") == tiny.SHIPPED_SHA256
    fresh = resolve_model_path(make_cfg(f"model.cache_dir={tmp_path}").model)
    assert fresh.parent == tmp_path / "models"
    assert (fresh / "model.safetensors").read_bytes() == (tiny.SHIPPED / "model.safetensors").read_bytes()
    assert sorted(p.name for p in fresh.iterdir()) == sorted(p.name for p in tiny.SHIPPED.iterdir())
    # a cache built by an older Relax (other CPU, other bytes) under the same name is replaced
    (fresh / "model.safetensors").write_bytes(b"built elsewhere")
    again = resolve_model_path(make_cfg(f"model.cache_dir={tmp_path}").model)
    assert again == fresh and tiny.sha256(fresh / "model.safetensors") == tiny.SHIPPED_SHA256
    assert sorted(p.name for p in tmp_path.joinpath("models").iterdir()) == [fresh.name]  # no temp left
    # a damaged package copy is named, not used
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny.SHIPPED, damaged)
    (damaged / "model.safetensors").write_bytes(b"x")
    monkeypatch.setattr(tiny, "SHIPPED", damaged)
    with pytest.raises(ConfigError, match="sha256 is not .*reinstall"):
        resolve_model_path(make_cfg(f"model.cache_dir={tmp_path / 'other'}").model)


def test_a_non_default_recipe_is_built_here(tmp_path):
    path = resolve_model_path(make_cfg(f"model.cache_dir={tmp_path}", "model.tiny.warmup_max_steps=0",
                                       "model.tiny.num_layers=1").model)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 1
    assert json.loads((path / "relax_tiny.json").read_text())["recipe"]["warmup_max_steps"] == 0
    assert tiny.sha256(path / "model.safetensors") != tiny.SHIPPED_SHA256


def test_the_recipe_code_builds_the_shipped_config():
    """build_config is what builds every non-default recipe and what start-up checks read before
    one is built (tiny_config): for the default recipe it must give the shipped config.json."""
    got = tiny.build_config(make_cfg().model.tiny, tiny.build_tokenizer()).to_dict()
    shipped = json.loads((tiny.SHIPPED / "config.json").read_text())
    assert {k: got[k] for k in shipped if k not in ("architectures", "dtype")} == \
        {k: v for k, v in shipped.items() if k not in ("architectures", "dtype")}


def test_saved_tokenizer_loads_back_identically(tiny_path):
    """transformers 5's AutoTokenizer would pick Qwen2Tokenizer and drop the space in
    '= 7'; Relax must tokenize exactly as tokenizer.json says (as SGLang does)."""
    tok = load_tokenizer(tiny_path)
    raw = Tokenizer.from_file(str(tiny_path / "tokenizer.json"))
    for text in ["12+34=46", "<|user|>12+34= 7<|assistant|>", "1 2  3", "99-1*3"]:
        assert tok(text, add_special_tokens=False)["input_ids"] == raw.encode(text).ids, text
        assert tok.decode(raw.encode(text).ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "1+2="}],
                                   add_generation_prompt=True, tokenize=False)
    assert chat == "<|user|>1+2=<|assistant|>"
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|end|>"


def test_tokenizer_fingerprint_survives_a_round_trip_and_tracks_the_vocabulary(tiny_path, tmp_path):
    tok = load_tokenizer(tiny_path)
    tok.save_pretrained(tmp_path / "copy")
    assert tokenizer_fingerprint(load_tokenizer(tmp_path / "copy")) == tokenizer_fingerprint(tok)
    tok.add_tokens(["<|tool|>"])
    changed = tokenizer_fingerprint(tok)
    assert changed["vocab_size"] == tokenizer_fingerprint(load_tokenizer(tiny_path))["vocab_size"] + 1
    assert changed["vocab_hash"] != tokenizer_fingerprint(load_tokenizer(tiny_path))["vocab_hash"]


def test_model_fingerprint_tracks_architecture(tiny_path, tmp_path):
    config = json.loads((tiny_path / "config.json").read_text())
    config["hidden_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(tmp_path) != model_fingerprint(tiny_path)


@pytest.mark.parametrize("key,value", [
    ("rope_theta", 1234.0), ("num_key_value_heads", 1), ("tie_word_embeddings", True), ("rms_norm_eps", 1e-5),
    ("intermediate_size", 7), ("num_experts_per_tok", 3), ("qkv_bias", False), ("moe_intermediate_size", 5),
    ("shared_expert_intermediate_size", 9), ("rope_scaling", {"type": "linear", "factor": 2.0}),
])
def test_model_fingerprint_tracks_each_key_that_changes_what_the_weights_mean(tiny_path, tmp_path, key,
                                                                              value):
    """Replay data recorded on one model must not pass as another's: every key that changes
    the computation (the families' own keys too, where present) changes the fingerprint;
    a key that does not (the saved dtype) leaves it."""
    config = json.loads((tiny_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
    assert model_fingerprint(tmp_path) != model_fingerprint(tiny_path)
    saved_as = {"dtype": "bfloat16", "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps({**config, **saved_as}))
    assert model_fingerprint(tmp_path) == model_fingerprint(tiny_path)


def test_the_tiny_cache_name_changes_with_the_recipe_and_its_format(monkeypatch):
    """A recipe change or a FORMAT bump (the build code changed) must not reuse an old cache."""
    cfg = make_cfg().model
    name = tiny.tiny_model_dir(cfg)
    assert tiny.tiny_model_dir(make_cfg("model.tiny.num_layers=3").model) != name
    monkeypatch.setattr(tiny, "FORMAT", tiny.FORMAT + 1)
    assert tiny.tiny_model_dir(cfg) != name


def test_every_shard_of_a_sharded_checkpoint_is_checked_and_the_broken_one_named(tiny_path, tmp_path):
    """A truncated second shard must be named at start-up, not deep inside a rank."""
    from safetensors.torch import save_file

    from relax.model import check_model_dir

    shutil.copy(tiny_path / "config.json", tmp_path / "config.json")
    save_file({"a": torch.zeros(2)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(64)}, tmp_path / "model-00002-of-00002.safetensors")
    assert check_model_dir(tmp_path) == tmp_path
    second = tmp_path / "model-00002-of-00002.safetensors"
    second.write_bytes(second.read_bytes()[:-100])
    with pytest.raises(ConfigError, match="model-00002-of-00002.safetensors: corrupt or truncated"):
        check_model_dir(tmp_path)


@pytest.mark.parametrize("value", [None, "4", 4.0])
def test_a_config_json_whose_required_count_is_not_an_integer_is_refused(tiny_path, tmp_path, value):
    """Start-up checks divide these counts: a null, a string or a float is refused by name."""
    from relax.model import read_hf_config

    config = json.loads((tiny_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_attention_heads": value}))
    with pytest.raises(ConfigError, match="no integer num_attention_heads"):
        read_hf_config(tmp_path)


def test_any_local_hf_dir_via_model_path(tmp_path, tiny_path):
    proc = relax_cli("model=hf", f"model.path={tiny_path}", "rollout.num_rollout=1",
                     "rollout.rollout_batch_size=4", "checkpoint.save_interval=null", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert status_of(only_run_dir(tmp_path))["status"] == "completed"


def test_responses_decode_as_batch_decode_does_in_one_call(tokenizer, monkeypatch):
    """relax.model.decode_responses: the rollout's batch decode, through the Rust tokenizer
    where transformers would do nothing more, and through transformers where it would."""
    import random

    from relax.model import decode_responses

    rng = random.Random(0)
    ids = [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 12))] for _ in range(64)]
    ids[0] = [tokenizer.eos_token_id, *ids[1], tokenizer.pad_token_id]  # special tokens are skipped
    expected = tokenizer.batch_decode(ids, skip_special_tokens=True)
    assert decode_responses(tokenizer, ids) == expected
    assert any(expected) and expected[0] == expected[1]
    calls = []
    monkeypatch.setattr(type(tokenizer), "batch_decode",
                        lambda self, *a, **k: calls.append(a) or ["via transformers"] * len(a[0]))
    assert decode_responses(tokenizer, ids) == expected and not calls
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)  # transformers would clean up
    assert decode_responses(tokenizer, ids) == ["via transformers"] * len(ids) and calls == [(ids,)]


@pytest.mark.parametrize("chat", [True, False])
def test_prompts_are_rendered_and_encoded_as_one_by_one_calls_would(tokenizer, chat):
    import random

    from relax.task import build_task

    task = build_task(make_cfg(f"task.apply_chat_template={chat}"))
    questions = task.questions(random.Random(0), 16)
    prompts = task.to_prompts(questions, tokenizer, "test")
    one_by_one = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                tokenize=False) if chat else q for q, *_ in questions]
    assert [p.text for p in prompts] == one_by_one and len(set(one_by_one)) > 1
    assert [p.tokens for p in prompts] == [tokenizer(t, add_special_tokens=False)["input_ids"]
                                           for t in one_by_one]
    assert task.to_prompts([], tokenizer, "test") == []
