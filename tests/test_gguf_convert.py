"""`relax convert-gguf` beyond the five families (relax/model/gguf.py): a GGUF of any
architecture transformers' GGUF loader reads converts; what it cannot convert (a tensor type,
a vocabulary) is refused from the header before anything is de-quantized; the start-up verdict
is relax.model.families.check's; the output folder is checked first; progress is logged."""

from __future__ import annotations

import logging

import pytest
import torch

from .extras import REAL, require
from .test_model import add_vocabulary, write_tiny_gguf


def write_gguf(path, architecture: str, tensors: dict, vocab: int = 32, tokenizer: str | None = "llama",
               quantized: tuple[str, ...] = (), **keys) -> dict:
    """A one-layer GGUF of `tensors` (name -> shape; fp32, or Q8_0 for the names in `quantized`,
    int32 for shapes given as ("i32", shape)) with a SentencePiece vocabulary of `vocab` tokens
    (none where `tokenizer` is None); returns the arrays written."""
    import numpy as np

    gguf = require("gguf", REAL)
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(keys.get("hidden", 32))
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(8)
    w.add_vocab_size(vocab)
    if tokenizer is not None:
        add_vocabulary(w, tokenizer, ["<unk>", "<s>", "</s>"] + [chr(ord("a") + i) for i in range(26)]
                       + [f"<x{i}>" for i in range(vocab - 29)])
    rng = np.random.default_rng(0)
    arrays = {}
    for name, shape in tensors.items():
        if shape[0] == "i32":
            arrays[name] = w_array = np.arange(np.prod(shape[1]), dtype=np.int32).reshape(shape[1])
            w.add_tensor(name, w_array)
            continue
        arrays[name] = rng.standard_normal(shape).astype(np.float32)
        if name in quantized:
            Q8_0 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(arrays[name], Q8_0), raw_dtype=Q8_0)
            arrays[name] = gguf.quants.dequantize(gguf.quants.quantize(arrays[name], Q8_0), Q8_0)
        else:
            w.add_tensor(name, arrays[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arrays


# Phi-3 (fused qkv and gate_up projections): not one of the five; its config's pad_token_id
# 32000 needs a vocabulary past it
PHI3 = {"token_embd.weight": (32064, 32), "blk.0.attn_norm.weight": (32,), "blk.0.attn_qkv.weight": (96, 32),
        "blk.0.attn_output.weight": (32, 32), "blk.0.ffn_norm.weight": (32,), "blk.0.ffn_up.weight": (128, 32),
        "blk.0.ffn_down.weight": (32, 64), "output_norm.weight": (32,), "output.weight": (32064, 32)}


@pytest.fixture
def events(monkeypatch):
    """What happened, in order: families.check's verdicts ("check", config: the real check runs)
    and the model loads ("load")."""
    require("accelerate", REAL)
    import transformers

    from relax.model import families

    happened, check = [], families.check

    def checking(config, where):
        happened.append(("check", config))
        return check(config, where)
    monkeypatch.setattr(families, "check", checking)
    load = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def loading(cls, *args, **kwargs):
        happened.append(("load", kwargs.get("gguf_file")))
        return load(cls, *args, **kwargs)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(loading))
    return happened


def test_a_gguf_of_another_family_converts_with_progress_and_the_families_verdict_first(
        tmp_path, events, caplog):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from relax.model import gguf

    arrays = write_gguf(tmp_path / "phi3.gguf", "phi3", PHI3, vocab=32064, quantized=("blk.0.ffn_down.weight",))
    caplog.set_level(logging.INFO, logger="relax.model.gguf")
    assert gguf.main([str(tmp_path / "phi3.gguf"), str(tmp_path / "out")]) == 0
    (kind, config), load = events[0], events[1:]
    assert kind == "check" and config["architectures"] == ["Phi3ForCausalLM"] and config["model_type"] == "phi3"
    assert load == [("load", "phi3.gguf")]  # after the verdict, once
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(weights["model.layers.0.self_attn.qkv_proj.weight"],
                       torch.from_numpy(arrays["blk.0.attn_qkv.weight"]))
    assert torch.equal(weights["model.layers.0.mlp.gate_up_proj.weight"],
                       torch.from_numpy(arrays["blk.0.ffn_up.weight"]))
    assert torch.equal(weights["model.layers.0.mlp.down_proj.weight"],  # Q8_0, de-quantized as gguf does
                       torch.from_numpy(arrays["blk.0.ffn_down.weight"]))
    assert weights["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[")]
    assert steps[0] == ("[1/3] De-quantizing phi3.gguf to fp32: Phi3ForCausalLM, 9 tensors (F32 x 8, Q8_0 x 1), "
                        f"1 layers, a 32064-token vocabulary, {(tmp_path / 'phi3.gguf').stat().st_size / 2**20:.0f} MB")
    assert steps[1].startswith("[2/3] De-quantized in ") and steps[2].startswith("[3/3] Writing")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(model).__name__ == "Phi3ForCausalLM" and model(torch.tensor([[1, 3, 4]])).logits.isfinite().all()


def test_the_families_refusal_is_the_conversions_and_comes_before_de_quantizing(tmp_path, events,
                                                                                monkeypatch, capsys):
    from relax.errors import ConfigError
    from relax.model import families, gguf

    write_tiny_gguf(tmp_path / "llama.gguf", tied=True)

    def refuse(config, where):
        raise ConfigError(f"{where}: {config['architectures'][0]} refused here")
    monkeypatch.setattr(families, "check", refuse)
    assert gguf.main([str(tmp_path / "llama.gguf"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"relax convert-gguf: error: {tmp_path / 'llama.gguf'} (its architecture): "
                                       f"LlamaForCausalLM refused here\n")
    assert events == [] and sorted(p.name for p in tmp_path.iterdir()) == ["llama.gguf"]


LLAMA = {"token_embd.weight": (32, 32), "blk.0.attn_norm.weight": (32,), "output_norm.weight": (32,)}


@pytest.mark.parametrize("case, message", [
    ("i32", "2 of its 5 tensors are of types transformers cannot de-quantize for 'llama' (I32: "
            "blk.0.ffn_gate.weight, blk.0.ffn_up.weight); it de-quantizes: BF16, F16, F32, IQ1_M, "),
    ("rwkv", "its vocabulary is of the tokenizer kind 'rwkv' (tokenizer.ggml.model), which transformers "
             "cannot rebuild; it rebuilds: gemma4, gpt2, llama, t5"),
    ("no_vocabulary", "its vocabulary is of the tokenizer kind None (tokenizer.ggml.model)"),
    ("no_tokens", "its header has no vocabulary (tokenizer.ggml.tokens): there is no tokenizer to convert"),
])
def test_what_it_cannot_convert_is_refused_from_the_header_before_de_quantizing(tmp_path, events, capsys,
                                                                                case, message):
    from relax.model import gguf

    path = tmp_path / f"{case}.gguf"
    if case == "i32":
        write_gguf(path, "llama", {**LLAMA, "blk.0.ffn_gate.weight": ("i32", (4, 8)),
                                   "blk.0.ffn_up.weight": ("i32", (4, 8))})
    elif case == "no_tokens":
        write_gguf(path, "llama", LLAMA, tokenizer=None)
        gguf_py = require("gguf", REAL)
        w = gguf_py.GGUFWriter(str(path), "llama")
        w.add_tokenizer_model("llama")
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    else:
        write_gguf(path, "llama", LLAMA, tokenizer={"rwkv": "rwkv", "no_vocabulary": None}[case])
    assert gguf.main([str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"relax convert-gguf: error: {path}: {message}") and err.count("\n") == 1, err
    assert events == [] and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_the_output_folder_is_checked_before_the_gguf_is_read_and_an_empty_one_is_used(tmp_path, events,
                                                                                      monkeypatch, capsys):
    from relax.model import gguf

    write_tiny_gguf(tmp_path / "llama.gguf", tied=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    monkeypatch.setattr(gguf, "check_header", lambda path: pytest.fail("the GGUF was read first"))
    assert gguf.main([str(tmp_path / "llama.gguf"), str(tmp_path / "full")]) == 2
    assert capsys.readouterr().err == (f"relax convert-gguf: error: {tmp_path / 'full'}: already exists and "
                                       f"is not empty; give a new or empty directory\n")
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"
    monkeypatch.undo()
    (tmp_path / "empty").mkdir()
    assert gguf.main([str(tmp_path / "llama.gguf"), str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / "model.safetensors").is_file() and (tmp_path / "empty" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "full", "llama.gguf"]
