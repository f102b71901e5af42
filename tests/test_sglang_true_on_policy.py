"""rollout.true_on_policy with rollout=sglang on CPU (SGLang tier): why it is refused, how close
SGLang comes without it, and where its log-probs depart from the trainer's (docs/debugging.md,
"Train vs rollout" with SGLang). Module outputs are recorded in SGLang's scheduler
(relax/rollout/sglang_layers.py)."""

import json
import re
import tempfile

import pytest
import torch

pytest.importorskip("sglang", reason="needs the SGLang environment (scripts/setup_sglang_cpu.sh)")

from relax.errors import ConfigError  # noqa: E402
from relax.rollout.sglang_engine import SGLangEngine, _run_in_scheduler  # noqa: E402
from relax.rollout.sglang_layers import RECORD_MODULES, record  # noqa: E402

from .conftest import engine_spec, make_cfg, run_loop  # noqa: E402
from .test_engine import chat_prompts  # noqa: E402

pytestmark = pytest.mark.sglang
PARTS = ["input_layernorm", "self_attn.qkv_proj", "self_attn.attn", "self_attn.o_proj", "self_attn",
         "post_attention_layernorm", "mlp.gate_up_proj", "mlp.act_fn", "mlp.down_proj", "mlp", ""]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on GPU SGLang runs its deterministic inference")
@pytest.mark.parametrize("overrides,message", [
    (["rollout.true_on_policy=true"], "rollout.true_on_policy=true is refused with rollout=sglang on CPU: "
                                      "it needs SGLang's deterministic inference"),
    (["+rollout.sglang_server_args.enable_deterministic_inference=true"],
     "rollout.sglang_server_args.enable_deterministic_inference=true is refused on CPU"),
])
def test_deterministic_inference_is_refused_on_cpu_for_sglangs_own_reasons(overrides, message, tiny_path):
    """Refused at start-up, and the two reasons the refusal gives are SGLang's: its deterministic
    attention backends exclude torch_native, and its batch-invariant kernels need CUDA or XPU
    (an SGLang that lifts either fails this test: then the refusal should go)."""
    from sglang.srt.batch_invariant_ops import enable_batch_invariant_mode
    from sglang.srt.server_args import ServerArgs

    from relax.debug.plan import resolve

    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(make_cfg("rollout=sglang", *overrides))
    with pytest.raises(ValueError, match="attention backends are supported for deterministic inference"):
        ServerArgs(model_path=str(tiny_path), device="cpu", attention_backend="torch_native",
                   skip_tokenizer_init=True, enable_deterministic_inference=True).resolve_once()
    with pytest.raises(RuntimeError, match=r"No supported accelerator \(CUDA/XPU\)"):
        enable_batch_invariant_mode()


def test_without_it_the_engines_forward_is_the_trainers_and_its_log_probs_only_close(tmp_path):
    """A run's layer dump (debug.dump_layers): SGLang's prefill of each dumped sequence equals the
    trainer's forward at every recorded module, bit for bit (fp32, one thread); the log-probs it
    generated with, decoded one token at a time, do not: the mismatch comes after the forward's
    modules or from decoding (test_decode_departs_...)."""
    _, steps = run_loop(tmp_path, "rollout=sglang", "rollout.num_rollout=2", "checkpoint.save_interval=null",
                        f"debug.dump_layers={tmp_path}/layers")
    assert len(steps) == 2
    for m in steps:
        assert 0 < m["train/train_rollout_logprob_abs_diff"] < 1e-5 and 0 < m["train/mismatch_kl"] < 1e-10
    engine, trainer = (torch.load(tmp_path / "layers" / f"0_{side}.pt") for side in ("engine", "train"))
    assert engine["forward"].keys() == trainer["forward"].keys() and len(engine["forward"]) == 8
    for name, outputs in engine["forward"].items():
        assert all(torch.equal(a, b) for a, b in zip(outputs, trainer["forward"][name], strict=True)), name
    worst = max((a - b).abs().max().item() for a, b in zip(engine["log_probs"], trainer["log_probs"], strict=True))
    assert 0 < worst < 1e-5


@pytest.fixture(scope="module")
def decoded(tiny_path, tokenizer):
    """One sampled response (temperature 1, 6 tokens) with the modules of PARTS recorded at every
    forward, and the same sequence prefilled alone, recorded too, with its prompt's log-probs."""
    cfg = make_cfg("rollout=sglang")
    engine = SGLangEngine(cfg.rollout, engine_spec(cfg, tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    names = ["model.embed_tokens", *(f"model.layers.{i}.{part}".rstrip(".") for i in range(2) for part in PARTS),
             "model.norm", "logits_processor"]
    prompt = chat_prompts(tokenizer, 1, 1, 999)[0]
    run = lambda loader, argument: _run_in_scheduler(engine.engine, loader, argument)  # noqa: E731
    try:
        engine.engine.flush_cache()
        run(RECORD_MODULES, json.dumps({"action": "start", "names": names}))
        out, = engine.engine.generate(input_ids=[prompt], return_logprob=True, sampling_params={
            "temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True})
        with tempfile.TemporaryDirectory() as tmp:
            run(RECORD_MODULES, json.dumps({"action": "stop", "dir": tmp}))
            steps = torch.load(f"{tmp}/tp0.pt")
        sequence = prompt + out["output_ids"]
        prefilled = record(engine.engine, run, [sequence], names)
        engine.engine.flush_cache()
        scored, = engine.engine.generate(input_ids=[sequence], return_logprob=True, logprob_start_len=0,
                                         sampling_params={"temperature": 1.0, "max_new_tokens": 1})
    finally:
        engine.shutdown()
    return dict(names=names, P=len(prompt), steps=steps, prefilled=prefilled, tokens=out["output_ids"],
                decoded=torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]),
                rescored=torch.tensor([lp for lp, _, _ in scored["meta_info"]["input_token_logprobs"][len(prompt):]]))


def test_decode_departs_from_the_full_forward_at_its_first_one_row_matmul(decoded):
    """Each decoded token's module outputs against the same position in the prefill of the
    whole sequence: equal up to layer 0's input norm (the same row-wise arithmetic), and first
    different at layer 0's fused QKV projection: the same input row multiplied alone (decode)
    and in a product of the sequence's rows (prefill) is reduced in another order by the CPU's
    BLAS. The decoded log-probs then differ from the prefill's rescoring of the same tokens."""
    P, steps, prefilled = decoded["P"], decoded["steps"], decoded["prefilled"]
    assert all(t.shape[0] == 1 for t in steps["model.layers.0.self_attn.qkv_proj"][1:])  # one row a step
    departed = [name for name in decoded["names"][:-1]
                if not torch.equal(torch.cat(steps[name][1:]), prefilled[name][0][P:P + len(steps[name]) - 1])]
    assert departed[0] == "model.layers.0.self_attn.qkv_proj", departed
    difference = (decoded["decoded"] - decoded["rescored"]).abs()
    assert 0 < difference.max() < 1e-5


def test_sampled_log_probs_are_log_of_softmax_not_log_softmax(decoded):
    """Outside its deterministic mode SGLang returns a sampled token's log-prob as
    log(softmax(logits / T)), where the trainer takes log_softmax(logits / T): mathematically
    one, not bit for bit (the second difference; the deterministic mode switches to log_softmax)."""
    logits = torch.cat(decoded["steps"]["logits_processor"])[:len(decoded["tokens"])]  # T = 1
    index = torch.tensor(decoded["tokens"])[:, None]
    log_of_softmax = torch.log(torch.softmax(logits, -1)).gather(-1, index)[:, 0]
    log_softmax = torch.log_softmax(logits, -1).gather(-1, index)[:, 0]
    assert torch.equal(decoded["decoded"], log_of_softmax)
    assert not torch.equal(decoded["decoded"], log_softmax)


def test_on_gpu_it_runs_sglangs_deterministic_inference_with_the_torch_engines_refusals(tiny_path, monkeypatch):
    """(GPU simulated) rollout.true_on_policy=true asks SGLang for its deterministic inference,
    which seeds every sample; top_p < 1 and an engine dtype of its own are refused as with
    rollout=torch."""
    from relax.rollout import sglang_engine as se

    monkeypatch.setattr(se, "GPU", True)
    cfg = make_cfg("rollout=sglang", "rollout.true_on_policy=true")
    assert se.engine_args(cfg.rollout, engine_spec(cfg, tiny_path, [0]))["enable_deterministic_inference"] is True
    assert "enable_deterministic_inference" not in se.engine_args(make_cfg("rollout=sglang").rollout,
                                                                  engine_spec(cfg, tiny_path, [0]))
    se.check_determinism(cfg.rollout, cfg.model, cfg.algo, cfg.debug)
    for override, message in (("rollout.top_p=0.9", "rollout.top_p=0.9 is refused"),
                              ("rollout.dtype=bfloat16", "rollout.dtype=bfloat16 is refused")):
        bad = make_cfg("rollout=sglang", "rollout.true_on_policy=true", override)
        with pytest.raises(ConfigError, match=re.escape(message)):
            se.check_determinism(bad.rollout, bad.model, bad.algo, bad.debug)
