"""The SGLang rollout engine (rollout=sglang).

Why the offline `sglang.Engine` and not server + HTTP: rollouts are generated from token
ids with per-token log-probs and weights are pushed as tensors, both of which the Engine
API takes directly (no serialisation over a socket, no port to manage), and Relax's
driver already owns the process lifecycle. `Engine.shutdown()` kills every child of the
calling process, so `shutdown()` below narrows it to the engine's own processes.

On a machine without CUDA, SGLang runs for real with the settings of
docs/measured-on-cpu.md (device cpu, torch_native attention, fp32, no CUDA graphs) in
the environment scripts/setup_sglang_cpu.sh builds. GPU-only paths (CUDA graphs, several
engines with tensor parallelism, the memory saver) are the same code with other
settings, exercised only where a GPU exists.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from relax import faults
from relax.distributed import free_port
from relax.errors import ConfigError
from relax.model import read_hf_config
from relax.rollout import Generation, SamplingParams, engine_dtype

log = logging.getLogger(__name__)
GPU = torch.cuda.is_available()
FINISH = {"stop": "completed", "length": "truncated", "abort": "aborted"}
EXPORT_TENSORS = f"{__name__}.export_tensors"  # the custom weight loader that reads tensors back


def engine_args(cfg, model_path: Path) -> list[dict]:
    """sglang.Engine keyword arguments, one dict per engine."""
    r = cfg.rollout
    tp = r.rollout_num_gpus_per_engine
    engines = r.rollout_num_gpus // tp
    if not GPU and (engines > 1 or tp > 1):
        raise ConfigError(f"rollout=sglang on CPU runs one engine without tensor parallelism; "
                          f"got rollout_num_gpus={r.rollout_num_gpus}, rollout_num_gpus_per_engine={tp}")
    memory = r.mem_fraction_static or (0.8 if GPU else 0.05)
    common = dict(model_path=str(model_path), dtype=engine_dtype(cfg), tp_size=tp,
                  mem_fraction_static=memory, skip_tokenizer_init=True,
                  random_seed=cfg.seed, log_level="error")
    if GPU:  # CUDA graphs stay on; the memory saver lets a colocated engine free GPU memory
        common.update(enable_memory_saver=r.colocate)
    else:
        common.update(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                      max_total_tokens=r.max_total_tokens)
    common.update(dict(r.sglang_server_args))  # anything else, passed through as-is
    # Relax's functions that run inside the scheduler (see export_tensors), kept beside any of yours.
    common["custom_weight_loader"] = [EXPORT_TENSORS, faults.SGLANG_DROP_BUFFER,
                                      *(common.get("custom_weight_loader") or [])]
    return [{**common, "base_gpu_id": i * tp} if GPU else common for i in range(engines)]


def sglang_to_hf(name: str, tensor: torch.Tensor, hf_config: dict) -> dict[str, torch.Tensor]:
    """SGLang's fused q/k/v and gate/up parameters back under HF names (TP = 1)."""
    pre, _, kind = name.rpartition(".")
    if ".qkv_proj" in name:
        heads, groups = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
        d = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
        q, k, v = tensor.split([heads * d, groups * d, groups * d])
        base = pre.removesuffix(".qkv_proj")
        return {f"{base}.q_proj.{kind}": q, f"{base}.k_proj.{kind}": k, f"{base}.v_proj.{kind}": v}
    if ".gate_up_proj" in name:
        gate, up = tensor.chunk(2)
        base = pre.removesuffix(".gate_up_proj")
        return {f"{base}.gate_proj.{kind}": gate, f"{base}.up_proj.{kind}": up}
    if name in ("model.embed_tokens.weight", "lm_head.weight"):  # SGLang pads the vocabulary
        return {name: tensor[:hf_config["vocab_size"]]}
    return {name: tensor}


def sglang_sampling_params(sp: SamplingParams, eos: list[int], seed: int, n: int,
                           deterministic: bool) -> dict | list[dict]:
    """SGLang sampling params: one dict for all prompts or, in SGLang's deterministic mode
    (`sglang_server_args.enable_deterministic_inference`, GPU attention backends only), one
    per prompt with its own `sampling_seed`, so a rollout is reproducible from `seed` and the
    samples of a GRPO group still differ. Elsewhere SGLang cannot seed sampling, and samples
    differ run to run."""
    params = {"temperature": sp.temperature, "top_p": sp.top_p,
              "max_new_tokens": sp.max_new_tokens, "stop_token_ids": eos}
    if not deterministic:
        return params
    return [{**params, "sampling_seed": (seed * 65_537 + i) % 2**62} for i in range(n)]


class SGLangEngine:
    """Rollout engine interface (relax/rollout/__init__.py), with colocation and NCCL weight sync."""

    @staticmethod
    def check_config(cfg) -> None:
        if cfg.debug.check_weight_update_equal and cfg.rollout.rollout_num_gpus_per_engine > 1:
            raise ConfigError("debug.check_weight_update_equal reads the engine's tensors back "
                              "unsharded: run it with rollout.rollout_num_gpus_per_engine=1")

    def __init__(self, cfg, model_path: Path, eos_token_ids: list[int], pad_token_id: int):
        """`pad_token_id` is unused: SGLang batches prompts of any length without padding."""
        try:
            import sglang
        except ImportError:
            raise ConfigError("rollout=sglang needs SGLang: build its environment with "
                              "scripts/setup_sglang_cpu.sh (CPU) or pip install sglang (GPU), then "
                              "run relax from that environment (.venv-sglang/bin/relax)") from None
        self.cfg, self.eos = cfg, eos_token_ids
        self.hf_config = read_hf_config(model_path)
        self.engines = [sglang.Engine(**kwargs) for kwargs in engine_args(cfg, model_path)]
        self._sync_metadata = None  # (name, dtype, shape) of what NCCL weight sync broadcasts
        self.deterministic = bool(cfg.rollout.sglang_server_args.get("enable_deterministic_inference"))
        log.info("SGLang %s: %d engine(s) on %s", sglang.__version__, len(self.engines),
                 "GPU" if GPU else "CPU")

    def generate(self, prompts: list[list[int]], sp: SamplingParams, seed: int) -> list[Generation]:
        params = sglang_sampling_params(sp, self.eos, seed, len(prompts), self.deterministic)
        n = len(self.engines)
        shares = [prompts[i::n] for i in range(n)]
        results = [e.generate(input_ids=share, return_logprob=True,
                              sampling_params=params[i::n] if self.deterministic else params)
                   for i, (e, share) in enumerate(zip(self.engines, shares)) if share]
        merged = [None] * len(prompts)
        for i, result in enumerate(results):
            merged[i::n] = result
        return [Generation(r["output_ids"], [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]],
                           FINISH[r["meta_info"]["finish_reason"]["type"]]) for r in merged]

    def update_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Push trainer weights by HF name: tensors in buckets, or via disk
        (`rollout.weight_update_mode=disk`); then drop the prefix cache."""
        named = faults.perturb_sync(named)
        for engine in self.engines:
            if faults.active("drop_buffer"):
                _run_in_scheduler(engine, faults.SGLANG_DROP_BUFFER)
            if self.cfg.rollout.weight_update_mode == "disk":
                self._update_from_disk(engine, named)
            else:
                self._update_from_tensors(engine, named)
            engine.flush_cache()

    def update_weights_from_trainer(self, trainer) -> None:
        """rollout.weight_update_mode=distributed (GPU): NCCL broadcast from trainer rank 0
        into each engine (see relax.train.weight_sync)."""
        if self._sync_metadata is None:
            self._sync_metadata = trainer.call("weight_metadata")
            tp = self.cfg.rollout.rollout_num_gpus_per_engine
            for i, engine in enumerate(self.engines):
                port = free_port()
                trainer.send("init_weight_sync_group", "127.0.0.1", port, 1 + tp, f"relax_sync_{i}")
                _check(engine.init_weights_update_group(
                    master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=1 + tp,
                    group_name=f"relax_sync_{i}", backend="nccl"), "init_weights_update_group")
                trainer.collect()
        names, dtypes, shapes = map(list, zip(*self._sync_metadata))
        for i, engine in enumerate(self.engines):
            _check(engine.begin_weight_update(), "begin_weight_update")
            trainer.send("broadcast_weights", f"relax_sync_{i}")
            _check(engine.update_weights_from_distributed(
                names=names, dtypes=dtypes, shapes=shapes, group_name=f"relax_sync_{i}",
                flush_cache=True), "update_weights_from_distributed")
            trainer.collect()
            _check(engine.end_weight_update(), "end_weight_update")

    def _update_from_tensors(self, engine, named: dict[str, torch.Tensor]) -> None:
        limit = self.cfg.rollout.weight_update_bucket_mb * 2**20
        buckets, size = [[]], 0
        for name, tensor in named.items():
            if buckets[-1] and size + tensor.nbytes > limit:
                buckets.append([])
                size = 0
            buckets[-1].append((name, tensor.detach().contiguous()))
            size += tensor.nbytes
        _check(engine.begin_weight_update(), "begin_weight_update")
        for bucket in buckets:
            _check(engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False),
                   "update_weights_from_tensor")
        _check(engine.end_weight_update(), "end_weight_update")

    def _update_from_disk(self, engine, named: dict[str, torch.Tensor]) -> None:
        with tempfile.TemporaryDirectory(prefix="relax-sync-") as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(self.hf_config))
            save_file({k: v.contiguous() for k, v in named.items()}, f"{tmp}/model.safetensors")
            _check(engine.update_weights_from_disk(tmp), "update_weights_from_disk")

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the first engine computes with — parameters and buffers (the rotary
        cos/sin cache) — under HF names, exported from its scheduler process. Unsharded
        engines only: check_config refuses the check for TP engines at start-up."""
        with tempfile.TemporaryDirectory(prefix="relax-engine-weights-") as tmp:
            _run_in_scheduler(self.engines[0], EXPORT_TENSORS, tmp)
            out = {}
            for name, tensor in load_file(f"{tmp}/tp0.safetensors").items():
                out.update(sglang_to_hf(name, tensor, self.hf_config))
        if self.hf_config.get("tie_word_embeddings"):
            out.pop("lm_head.weight", None)
        return out

    def release_memory_occupation(self) -> None:
        for engine in self.engines:
            engine.release_memory_occupation()

    def resume_memory_occupation(self) -> None:
        for engine in self.engines:
            engine.resume_memory_occupation()

    def shutdown(self) -> None:
        """Stop the engines' processes, and only those: SGLang's own shutdown SIGKILLs every
        child of this process (trainer ranks, multiprocessing's resource tracker...)."""
        import atexit

        from sglang.srt.entrypoints import engine as engine_module

        kill = engine_module.kill_process_tree
        for engine in self.engines:
            own = engine.get_all_child_pids()

            def kill_own(pid, include_parent=True, **kwargs):
                if pid != os.getpid():
                    return kill(pid, include_parent, **kwargs)
                for child in own:
                    kill(child, include_parent=True, **kwargs)

            engine_module.kill_process_tree = kill_own
            try:
                engine.shutdown()
            finally:
                engine_module.kill_process_tree = kill
            atexit.unregister(engine.shutdown)
        self.engines = []


def export_tensors(model, named_tensors) -> None:
    """Runs inside SGLang's scheduler process as a `custom_weight_loader` that writes instead
    of loading: every parameter and buffer of the served model, to <dir>/tp<rank>.safetensors
    (<dir> is the request's argument). SGLang 0.5.23 has no call that reads buffers:
    `get_weights_by_name` sees parameters only, and `save_sharded_model` a state_dict, which
    leaves out non-persistent buffers such as the rotary cos/sin cache."""
    from sglang.srt.runtime_context import get_parallel

    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()},
              f"{_argument(named_tensors)}/tp{get_parallel().tp_rank}.safetensors")


def _run_in_scheduler(engine, loader: str, argument: str = "") -> None:
    """Call `loader(model, [("relax.argument", bytes)])` in each of the engine's scheduler
    processes, through the custom-weight-loader hook of `update_weights_from_tensor` (the one
    way in that SGLang offers; the loader must be listed in `custom_weight_loader`)."""
    payload = [("relax.argument", torch.tensor(list(argument.encode()), dtype=torch.uint8))]
    _check(engine.begin_weight_update(), "begin_weight_update")
    _check(engine.update_weights_from_tensor(named_tensors=payload, load_format=loader,
                                             flush_cache=False), loader)
    _check(engine.end_weight_update(), "end_weight_update")


def _argument(named_tensors) -> str:
    (_, encoded), = named_tensors
    return bytes(encoded.tolist()).decode()


def _check(result, what: str) -> None:
    ok, message = result[0], result[1]
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {message}")
