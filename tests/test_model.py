"""The tiny model directory and the loading code shared with real HF checkpoints."""

import json
import shutil

import pytest
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
