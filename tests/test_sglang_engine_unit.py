"""relax/rollout/sglang_engine.py without an engine: the keyword arguments Relax gives
sglang.Engine, the CPU memory share, the unfusing of SGLang's tensors back to HF names, the
sampling params, the start-up refusals, and the wrapper's calls into a stand-in engine
(generate, weight sync, the tensor export, SIGTERM and shutdown). The module imports without
SGLang; the one test that reads SGLang's ServerArgs is in the SGLang tier."""

import asyncio
import base64
import json
import os
import signal
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from relax.errors import ConfigError
from relax.rollout import SamplingParams, sample_seeds
from relax.rollout import sglang_engine as se
from relax.rollout.sglang_engine import SGLangEngine

from .conftest import engine_spec, make_cfg

MB = 2**20


def fake_meminfo(monkeypatch, available_bytes: int) -> None:
    """/proc/meminfo as cpu_mem_fraction reads it, with MemAvailable fixed."""
    text = f"MemTotal:       999999999 kB\nMemAvailable:   {available_bytes // 1024} kB\n"
    real = se.Path

    def path(p, *rest):
        if str(p) == "/proc/meminfo":
            return types.SimpleNamespace(read_text=lambda: text)
        return real(p, *rest)

    monkeypatch.setattr(se, "Path", path)


def write_model(path: Path, weights_bytes: int, **config) -> Path:
    """A model directory as cpu_mem_fraction/engine_args see it: config.json and shards."""
    path.mkdir(parents=True, exist_ok=True)
    hf = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "num_hidden_layers": 3, "vocab_size": 100, **config}
    (path / "config.json").write_text(json.dumps(hf))
    (path / "model-00001-of-00002.safetensors").write_bytes(b"\0" * (weights_bytes // 2))
    (path / "model-00002-of-00002.safetensors").write_bytes(b"\0" * (weights_bytes - weights_bytes // 2))
    (path / "notes.txt").write_bytes(b"\0" * 10 * MB)  # not weights
    return path


# --- engine_args ------------------------------------------------------------------------

def test_engine_args_on_cpu(tiny_path):
    cfg = make_cfg("rollout=sglang", "seed=77", "rollout.mem_fraction_static=0.3",
                   "rollout.max_total_tokens=1024")
    args = se.engine_args(cfg.rollout, engine_spec(cfg, tiny_path, [0]), base_gpu_id=3)
    assert args["model_path"] == str(tiny_path) and args["tp_size"] == 1
    assert args["random_seed"] == 77 and args["mem_fraction_static"] == 0.3
    assert args["dtype"] == cfg.model.dtype and args["skip_tokenizer_init"] is True
    assert args["device"] == "cpu" and args["attention_backend"] == "torch_native"
    assert args["disable_cuda_graph"] is True and args["sleep_on_idle"] is True
    assert args["max_total_tokens"] == 1024
    assert args["enable_return_routed_experts"] is False  # a dense model
    assert args["custom_weight_loader"] == [se.EXPORT_TENSORS, se.FINGERPRINT, se.RECORD_MODULES, se.faults.SGLANG_DROP_BUFFER]
    assert "base_gpu_id" not in args and "enable_memory_saver" not in args


def test_engine_args_on_cpu_size_the_memory_share_for_the_model(tmp_path, monkeypatch):
    fake_meminfo(monkeypatch, 64 * 2**30)
    model = write_model(tmp_path / "m", 4 * MB)
    cfg = make_cfg("rollout=sglang")
    assert se.engine_args(cfg.rollout, engine_spec(cfg, model, [0]))["mem_fraction_static"] == se.cpu_mem_fraction(cfg.rollout, engine_spec(cfg, model, [0]))


def test_engine_args_of_an_moe_model_ask_for_its_experts(tmp_path):
    model = write_model(tmp_path / "moe", MB, num_experts=4, num_experts_per_tok=2,
                        model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"])
    assert se.engine_args(make_cfg("rollout=sglang", "rollout.mem_fraction_static=0.3").rollout,
                          engine_spec(make_cfg(), model, [0]))["enable_return_routed_experts"] is True
    # routing replay needs a family's MoE: a Mixtral's engine records no experts
    mixtral = write_model(tmp_path / "mixtral", MB, num_local_experts=4, num_experts_per_tok=2,
                          model_type="mixtral", architectures=["MixtralForCausalLM"])
    assert se.engine_args(make_cfg("rollout=sglang", "rollout.mem_fraction_static=0.3").rollout,
                          engine_spec(make_cfg(), mixtral, [0]))["enable_return_routed_experts"] is False


def test_sglang_server_args_override_relaxs_and_keep_its_weight_loaders(tiny_path):
    cfg = make_cfg("rollout=sglang", "rollout.mem_fraction_static=0.3",
                   "+rollout.sglang_server_args.attention_backend=intel_amx",
                   "+rollout.sglang_server_args.sleep_on_idle=false",
                   "+rollout.sglang_server_args.custom_weight_loader=[my.loader]")
    args = se.engine_args(cfg.rollout, engine_spec(cfg, tiny_path, [0]))
    assert args["attention_backend"] == "intel_amx" and args["sleep_on_idle"] is False
    assert args["custom_weight_loader"] == [se.EXPORT_TENSORS, se.FINGERPRINT, se.RECORD_MODULES, se.faults.SGLANG_DROP_BUFFER, "my.loader"]


def test_engine_args_refuse_tensor_parallelism_on_cpu(tiny_path):
    for tp in (2, 4):
        cfg = make_cfg("rollout=sglang", f"rollout.rollout_num_gpus={tp}",
                       f"rollout.rollout_num_gpus_per_engine={tp}")
        with pytest.raises(ConfigError, match=f"rollout_num_gpus_per_engine={tp}"):
            se.engine_args(cfg.rollout, engine_spec(cfg, tiny_path, [0]))


def test_engine_args_on_gpu(tiny_path, monkeypatch):
    monkeypatch.setattr(se, "GPU", True)
    args = se.engine_args(make_cfg("rollout=sglang", "rollout.colocate=true").rollout, engine_spec(make_cfg(), tiny_path, [0]),
                          base_gpu_id=3)
    assert args["base_gpu_id"] == 3 and args["mem_fraction_static"] == 0.8
    assert args["enable_memory_saver"] is True
    assert "device" not in args and "disable_cuda_graph" not in args and "sleep_on_idle" not in args
    args = se.engine_args(make_cfg("rollout=sglang", "rollout.rollout_num_gpus=2",
                                   "rollout.rollout_num_gpus_per_engine=2").rollout, engine_spec(make_cfg(), tiny_path, [0]))
    assert args["tp_size"] == 2 and args["base_gpu_id"] == 0 and args["enable_memory_saver"] is False


# --- cpu_mem_fraction ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype,width", [("float32", 4), ("bfloat16", 2)])
def test_cpu_mem_fraction_is_twice_weights_and_kv_cache_over_available(tmp_path, monkeypatch, dtype, width):
    """Weights: the files read as 16-bit, in the engine's width; KV cache: K and V of every
    layer's kv heads of head_dim (32 here, not hidden/heads = 16) for max_total_tokens."""
    weights_bytes = 6 * MB
    model = write_model(tmp_path / "m", weights_bytes)
    cfg = make_cfg("rollout=sglang", f"rollout.dtype={dtype}", "rollout.max_total_tokens=4096")
    weights = weights_bytes * width / 2
    kv = 4096 * 2 * 3 * 2 * 32 * width
    available = 2**28
    fake_meminfo(monkeypatch, available)
    assert se.cpu_mem_fraction(cfg.rollout, engine_spec(cfg, model, [0])) == pytest.approx(2 * (weights + kv) / available)
    assert 0.05 < se.cpu_mem_fraction(cfg.rollout, engine_spec(cfg, model, [0])) < 0.9


def test_cpu_mem_fraction_without_head_dim_or_kv_heads(tmp_path, monkeypatch):
    model = write_model(tmp_path / "m", 2 * MB)
    hf = json.loads((model / "config.json").read_text())
    del hf["head_dim"], hf["num_key_value_heads"]
    (model / "config.json").write_text(json.dumps(hf))
    cfg = make_cfg("rollout=sglang", "rollout.dtype=float32", "rollout.max_total_tokens=1000")
    fake_meminfo(monkeypatch, 2**27)
    kv = 1000 * 2 * 3 * 4 * 16 * 4  # every head a kv head, head_dim = 64 / 4
    assert se.cpu_mem_fraction(cfg.rollout, engine_spec(cfg, model, [0])) == pytest.approx(2 * (2 * MB * 2 + kv) / 2**27)


def test_cpu_mem_fraction_is_bounded(tmp_path, monkeypatch):
    model = write_model(tmp_path / "m", 4 * MB)
    cfg = make_cfg("rollout=sglang", "rollout.dtype=float32")
    fake_meminfo(monkeypatch, 2**50)
    assert se.cpu_mem_fraction(cfg.rollout, engine_spec(cfg, model, [0])) == 0.05
    fake_meminfo(monkeypatch, 8 * MB)
    assert se.cpu_mem_fraction(cfg.rollout, engine_spec(cfg, model, [0])) == 0.9


# --- sglang_to_hf -------------------------------------------------------------------------

HF = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 10}


def rows(n: int, start: int = 0, width: int = 3) -> torch.Tensor:
    return torch.arange(start, start + n).float()[:, None].expand(n, width).clone()


def test_sglang_to_hf_splits_qkv_by_heads_kv_heads_and_head_dim():
    qkv = rows(4 * 8 + 2 * 8 + 2 * 8)  # head_dim 8, not hidden / heads = 16
    out = se.sglang_to_hf("model.layers.1.self_attn.qkv_proj.weight", qkv, HF)
    assert set(out) == {f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"}
    assert torch.equal(out["model.layers.1.self_attn.q_proj.weight"], rows(32))
    assert torch.equal(out["model.layers.1.self_attn.k_proj.weight"], rows(16, 32))
    assert torch.equal(out["model.layers.1.self_attn.v_proj.weight"], rows(16, 48))
    bias = se.sglang_to_hf("model.layers.0.self_attn.qkv_proj.bias", torch.arange(64.), HF)
    assert torch.equal(bias["model.layers.0.self_attn.v_proj.bias"], torch.arange(48., 64.))
    # without head_dim: hidden / heads
    hf = {k: v for k, v in HF.items() if k != "head_dim"}
    out = se.sglang_to_hf("model.layers.0.self_attn.qkv_proj.weight", rows(128), hf)
    assert [len(out[f"model.layers.0.self_attn.{p}_proj.weight"]) for p in "qkv"] == [64, 32, 32]


def test_sglang_to_hf_splits_gate_up_gate_first():
    out = se.sglang_to_hf("model.layers.0.mlp.gate_up_proj.weight", rows(20), HF)
    assert torch.equal(out["model.layers.0.mlp.gate_proj.weight"], rows(10))
    assert torch.equal(out["model.layers.0.mlp.up_proj.weight"], rows(10, 10))
    assert len(out) == 2


def test_sglang_to_hf_unfuses_each_expert():
    w13 = torch.stack([rows(8, 100 * e) for e in range(3)])  # [E, 2I, H]
    out = se.sglang_to_hf("model.layers.0.mlp.experts.w13_weight", w13, HF)
    assert len(out) == 6
    for e in range(3):
        assert torch.equal(out[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"], rows(4, 100 * e))
        assert torch.equal(out[f"model.layers.0.mlp.experts.{e}.up_proj.weight"], rows(4, 100 * e + 4))
    w2 = torch.stack([rows(5, 100 * e) for e in range(3)])
    out = se.sglang_to_hf("model.layers.0.mlp.experts.w2_weight", w2, HF)
    assert list(out) == [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(3)]
    assert torch.equal(out["model.layers.0.mlp.experts.2.down_proj.weight"], rows(5, 200))


def test_sglang_to_hf_follows_the_checkpoints_names_of_other_architectures():
    """Mixtral's experts are w1 (gate), w3 (up), w2 (down); Phi-3's checkpoint fuses q/k/v and
    gate/up as SGLang does, so they stay whole."""
    mixtral = {**HF, "architectures": ["MixtralForCausalLM"]}
    w13 = torch.stack([rows(8, 100 * e) for e in range(2)])
    out = se.sglang_to_hf("model.layers.0.block_sparse_moe.experts.w13_weight", w13, mixtral)
    assert torch.equal(out["model.layers.0.block_sparse_moe.experts.1.w1.weight"], rows(4, 100))
    assert torch.equal(out["model.layers.0.block_sparse_moe.experts.1.w3.weight"], rows(4, 104))
    out = se.sglang_to_hf("model.layers.0.block_sparse_moe.experts.w2_weight", w13, mixtral)
    assert list(out) == [f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight" for e in range(2)]
    phi3 = {**HF, "architectures": ["Phi3ForCausalLM"]}
    for name in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"):
        fused = rows(64)
        assert se.sglang_to_hf(name, fused, phi3) == {name: fused}


def test_sglang_to_hf_trims_the_padded_vocabulary_only():
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(se.sglang_to_hf(name, rows(16), HF)[name], rows(10))
    norm = rows(16)
    assert se.sglang_to_hf("model.norm.weight", norm, HF) == {"model.norm.weight": norm}


# --- sampling params ----------------------------------------------------------------------

def test_sglang_sampling_params_carry_every_setting_and_the_samples_seeds():
    sp = SamplingParams(0.7, 0.9, 12)
    params = se.sglang_sampling_params(sp, [2, 5], seed=7, n=3, deterministic=False)
    assert params == {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 12, "stop_token_ids": [2, 5]}
    later = se.sglang_sampling_params(sp, [2], seed=7, n=3, deterministic=True, first_index=5)
    assert [p["sampling_seed"] for p in later] == sample_seeds(7, range(5, 8))
    assert all(p["top_p"] == 0.9 and p["max_new_tokens"] == 12 for p in later)
    given = se.sglang_sampling_params(sp, [2], seed=[4, 9], n=2, deterministic=True)
    assert [p["sampling_seed"] for p in given] == [4, 9]


# --- check_config -------------------------------------------------------------------------

def check_config(cfg) -> None:
    SGLangEngine.check_config(cfg.rollout, cfg.model, cfg.algo, cfg.debug)


@pytest.mark.parametrize("n", [2, 3])
def test_several_engines_on_cpu_are_refused(n):
    with pytest.raises(ConfigError, match=f"rollout.num_engines={n}"):
        check_config(make_cfg("rollout=sglang", f"rollout.num_engines={n}"))


@pytest.mark.parametrize("gpus", [2, 4])
def test_the_weight_check_with_tensor_parallel_engines_is_refused(gpus):
    with pytest.raises(ConfigError, match="rollout_num_gpus_per_engine=1"):
        check_config(make_cfg("rollout=sglang", f"rollout.rollout_num_gpus={gpus}",
                              f"rollout.rollout_num_gpus_per_engine={gpus}", "debug.check_weight_update_equal=true"))


@pytest.mark.sglang
def test_routing_replay_is_refused_by_an_sglang_without_routed_experts(monkeypatch):
    pytest.importorskip("sglang")
    from sglang.srt.server_args import ServerArgs

    cfg = make_cfg("rollout=sglang", "algo.routing_replay=rollout")
    check_config(cfg)  # this SGLang has them
    monkeypatch.delattr(ServerArgs, "enable_return_routed_experts")
    with pytest.raises(ConfigError, match="enable_return_routed_experts"):
        check_config(cfg)


# --- the wrapper's calls, against a stand-in for sglang.Engine ------------------------------

class FakeEngine:
    def __init__(self, results=None, export=None):
        self.calls, self.results, self.export = [], results, export

    def generate(self, **kwargs):
        self.calls.append(("generate", kwargs))
        return self.results

    def __getattr__(self, name):  # begin/end_weight_update, flush_cache, update_weights_from_*...
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            self.calls.append((name, kwargs))
            if name == "update_weights_from_tensor" and kwargs.get("load_format") == se.EXPORT_TENSORS:
                self.export(se.loader_argument(kwargs["named_tensors"]))
            return True, "ok"
        return call


def wrapper(engine, hf_config=None, moe_layers=None, cfg=None) -> SGLangEngine:
    obj = SGLangEngine.__new__(SGLangEngine)
    obj.rollout, obj.eos, obj.engine = (cfg or make_cfg("rollout=sglang")).rollout, [2], engine
    obj.hf_config, obj.moe_layers, obj.deterministic = hf_config or HF, moe_layers, False
    return obj


def result(ids, log_probs, finish, **meta):
    return {"output_ids": ids, "meta_info": {
        "output_token_logprobs": [(lp, t, None) for lp, t in zip(log_probs, ids, strict=True)],
        "finish_reason": {"type": finish}, **meta}}


def test_generate_maps_sglangs_results_to_generations():
    engine = FakeEngine([result([5, 6], [-0.5, -1.5], "length"), result([7], [-0.25], "stop"),
                         result([], [], "abort")])
    gens = wrapper(engine).generate([[1, 2], [3], [4]], SamplingParams(0.5, 0.8, 2), seed=0)
    assert [(g.tokens, g.log_probs, g.status, g.routed_experts) for g in gens] == [
        ([5, 6], [-0.5, -1.5], "truncated", None), ([7], [-0.25], "completed", None),
        ([], [], "aborted", None)]
    (_, kwargs), = engine.calls
    assert kwargs["input_ids"] == [[1, 2], [3], [4]] and kwargs["return_logprob"] is True
    assert kwargs["sampling_params"]["top_p"] == 0.8 and "return_routed_experts" not in kwargs


def test_generate_keeps_the_moe_layers_of_sglangs_routed_experts():
    """[tokens, every layer, top_k] in SGLang's int32 base64, as the MoE layers' flattened."""
    hf = {**HF, "num_hidden_layers": 3, "num_experts_per_tok": 2}
    routed = np.arange(4 * 3 * 2, dtype=np.int32).reshape(4, 3, 2)
    engine = FakeEngine([result([5], [-1.0], "stop",
                                routed_experts=base64.b64encode(routed.tobytes()).decode())])
    gen, = wrapper(engine, hf, moe_layers=[1, 2]).generate([[1, 2, 3]], SamplingParams(1.0, 1.0, 1), 0)
    assert gen.routed_experts == routed[:, [1, 2]].flatten().tolist()
    (_, kwargs), = engine.calls
    assert kwargs["return_routed_experts"] is True and kwargs["routed_experts_start_len"] == 0


@pytest.mark.parametrize("mode", ["tensor", "disk"])
def test_a_weight_update_ends_by_dropping_the_prefix_cache(mode):
    engine = FakeEngine()
    named = {"a": torch.zeros(2), "b": torch.ones(3)}
    cfg = make_cfg("rollout=sglang", f"rollout.weight_update_mode={mode}")
    wrapper(engine, cfg=cfg).update_weights(named)
    names = [name for name, _ in engine.calls]
    assert names[-1] == "flush_cache" and names.count("flush_cache") == 1
    if mode == "tensor":
        assert names == ["begin_weight_update", "update_weights_from_tensor", "end_weight_update",
                         "flush_cache"]
        assert [n for n, _ in engine.calls[1][1]["named_tensors"]] == ["a", "b"]
        assert engine.calls[1][1]["flush_cache"] is False


def test_a_failed_sglang_call_raises():
    with pytest.raises(RuntimeError, match="SGLang update_weights_from_disk failed: no such file"):
        se._check((False, "no such file"), "update_weights_from_disk")
    se._check((True, "Succeeded"), "x")


@pytest.mark.parametrize("tied", [True, False])
def test_named_tensors_reads_the_schedulers_export_back_under_hf_names(tmp_path, tied):
    """The export directory reaches the scheduler as the loader's argument (a path with a space
    and a non-ASCII letter here); its tensors come back unfused, the vocabulary trimmed, and a
    tied lm_head left out."""
    exported = {"model.embed_tokens.weight": rows(16), "lm_head.weight": rows(16, 50),
                "model.layers.0.self_attn.qkv_proj.weight": rows(64),
                "model.layers.0.self_attn.rotary_emb.cos_sin_cache": rows(4)}
    seen = []

    def export(directory):
        seen.append(directory)
        save_file(exported, f"{directory}/tp0.safetensors")

    engine = FakeEngine(export=export)
    out = wrapper(engine, {**HF, "tie_word_embeddings": tied}).named_tensors()
    assert len(seen) == 1 and Path(seen[0]).name.startswith("relax-engine-weights-")
    expected = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                "model.layers.0.self_attn.rotary_emb.cos_sin_cache"} | (set() if tied else {"lm_head.weight"})
    assert set(out) == expected
    assert torch.equal(out["model.embed_tokens.weight"], rows(10))
    if not tied:
        assert torch.equal(out["lm_head.weight"], rows(10, 50))
    names = [name for name, _ in engine.calls]
    assert names == ["begin_weight_update", "update_weights_from_tensor", "end_weight_update"]


def test_the_loader_argument_round_trips():
    for text in ("/tmp/relax dir/é", ""):
        payload = [("relax.argument", torch.tensor(list(text.encode()), dtype=torch.uint8))]
        assert se.loader_argument(payload) == text


def test_sigterm_goes_back_to_the_handler_it_had():
    """SGLang's event loop takes SIGTERM when it starts; Relax starts it and takes SIGTERM back."""
    def previous(*_):
        pass

    loop = asyncio.new_event_loop()
    removed = []

    class Manager:
        event_loop = types.SimpleNamespace(remove_signal_handler=removed.append)

        def auto_create_handle_loop(self):
            assert asyncio.get_running_loop() is loop
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # SGLang's

    before = signal.signal(signal.SIGTERM, previous)
    try:
        wrapper(types.SimpleNamespace(tokenizer_manager=Manager(), loop=loop))._leave_sigterm_to_relax()
        assert signal.getsignal(signal.SIGTERM) is previous and removed == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)
        loop.close()


def test_shutdown_kills_the_engines_processes_and_only_those(monkeypatch):
    """SGLang's shutdown kills the tree of the calling process; Relax's narrows it to the
    engine's own children, then puts SGLang's function back and forgets the atexit hook."""
    killed = []

    def kill_process_tree(pid, include_parent=True, **kwargs):
        killed.append((pid, include_parent))

    engine_module = types.ModuleType("sglang.srt.entrypoints.engine")
    engine_module.kill_process_tree = kill_process_tree
    for name in ("sglang", "sglang.srt", "sglang.srt.entrypoints"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.entrypoints.engine", engine_module)
    monkeypatch.setattr(sys.modules["sglang.srt.entrypoints"], "engine", engine_module, raising=False)
    unregistered = []
    monkeypatch.setattr("atexit.unregister", unregistered.append)

    class Engine:
        def get_all_child_pids(self):
            return [1001, 1002]

        def shutdown(self):  # what SGLang's does
            engine_module.kill_process_tree(os.getpid(), include_parent=False)
            engine_module.kill_process_tree(4242)

    engine = Engine()
    obj = wrapper(engine)
    obj.shutdown()
    assert killed == [(1001, True), (1002, True), (4242, True)]
    assert engine_module.kill_process_tree is kill_process_tree
    assert unregistered == [engine.shutdown] and obj.engine is None
    obj.shutdown()  # a second time: nothing
    assert len(killed) == 3


def test_export_tensors_writes_parameters_and_buffers_to_the_ranks_file(tmp_path, monkeypatch):
    runtime = types.ModuleType("sglang.srt.runtime_context")
    runtime.get_parallel = lambda: types.SimpleNamespace(tp_rank=1)
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", runtime)
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    model.register_buffer("cache", torch.arange(4.), persistent=False)
    payload = [("relax.argument", torch.tensor(list(str(tmp_path).encode()), dtype=torch.uint8))]
    se.export_tensors(model, payload)
    out = load_file(str(tmp_path / "tp1.safetensors"))
    assert set(out) == {"weight", "bias", "cache"}
    assert out["weight"].dtype == torch.bfloat16 and torch.equal(out["weight"], model.weight.detach())
    assert torch.equal(out["cache"], torch.arange(4.))
