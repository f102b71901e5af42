"""The SGLang rollout engine (rollout=sglang).

How it works in detail: docs/backends.md, "Inside `relax/rollout/sglang_engine.py`".
"""

from __future__ import annotations

import atexit
import base64
import json
import logging
import os
import signal
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from relax import faults
from relax.errors import ConfigError
from relax.model import families, model_config, read_hf_config, torch_dtype
from relax.model.sglang_support import SERVED, sglang_to_hf
from relax.process import engine_died, sigterm_left_to_the_driver
from relax.rollout import Generation, SamplingParams, buckets, num_engines, prompt_seeds
from relax.rollout.fingerprint import fingerprint
from relax.rollout.partial import in_chunks
from relax.rollout.sglang_layers import RECORD_MODULES, loader_argument, record
from relax.rollout.spec import EngineSpec
from relax.rollout.torch_base import TorchEngineBase
from relax.targets import require_extra

log = logging.getLogger(__name__)
GPU = torch.cuda.is_available()
FINISH = {"stop": "completed", "length": "truncated", "abort": "aborted"}
EXPORT_TENSORS = f"{__name__}.export_tensors"  # the custom weight loader that reads tensors back
FINGERPRINT = f"{__name__}.fingerprint_tensors"  # ... and the one that samples them (the sync check)


def engine_args(rollout, spec: EngineSpec, base_gpu_id: int = 0) -> dict:
    """sglang.Engine keyword arguments for one engine on GPUs base_gpu_id.. (of those visible)."""
    r, model_path = rollout, Path(spec.model_path)
    tp = r.rollout_num_gpus_per_engine
    if not GPU and tp > 1:
        raise ConfigError(f"rollout=sglang on CPU runs without tensor parallelism; "
                          f"got rollout_num_gpus_per_engine={tp}")
    memory = r.mem_fraction_static or (0.8 if GPU else cpu_mem_fraction(r, spec))
    common = dict(model_path=str(model_path), dtype=spec.dtype, tp_size=tp,
                  mem_fraction_static=memory, skip_tokenizer_init=True,
                  random_seed=spec.seed, log_level="error",
                  # a family's MoE: every request returns its tokens' experts (relax/train/routing.py)
                  enable_return_routed_experts=records_experts(read_hf_config(model_path)))
    if GPU:  # CUDA graphs stay on; the memory saver lets a colocated engine free GPU memory
        common.update(enable_memory_saver=r.colocate)
        if r.true_on_policy:  # batch-invariant kernels and a deterministic attention backend
            common.update(enable_deterministic_inference=True)
    else:  # sleep_on_idle: an idle scheduler otherwise polls for requests at 100% of a core,
        # which on CPU is a core taken from the trainer (and from everything else on the machine)
        common.update(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                      max_total_tokens=r.max_total_tokens, sleep_on_idle=True)
    common["custom_sigquit_handler"] = engine_died  # an engine process failing at start-up fails the run
    common.update(dict(r.sglang_server_args))  # anything else, passed through as-is
    # Relax's functions that run inside the scheduler (see export_tensors), kept beside any of yours.
    common["custom_weight_loader"] = [EXPORT_TENSORS, FINGERPRINT, RECORD_MODULES, faults.SGLANG_DROP_BUFFER,
                                      *(common.get("custom_weight_loader") or [])]
    return {**common, "base_gpu_id": base_gpu_id} if GPU else common


# Why SGLang's deterministic inference does not run on CPU (SGLang 0.5.23, read and tried)
NO_DETERMINISM_ON_CPU = (
    "SGLang runs its deterministic inference on GPUs only: its batch-invariant matmul, log-softmax "
    "and mean kernels are Triton's (\"No supported accelerator (CUDA/XPU) available\" on CPU), and "
    "its CPU attention backend, torch_native, is not one of its deterministic ones "
    "(docs/true-on-policy.md)")


def check_determinism(rollout, model, algo, debug) -> None:
    """rollout.true_on_policy=true with rollout=sglang: SGLang's deterministic inference, on GPU
    (the torch engine's refusals too); on CPU it and enable_deterministic_inference are refused."""
    r = rollout
    if not GPU and r.true_on_policy:
        raise ConfigError(f"rollout.true_on_policy=true is refused with rollout=sglang on CPU: it needs "
                          f"SGLang's deterministic inference, and {NO_DETERMINISM_ON_CPU}; use rollout=torch")
    if not GPU and r.sglang_server_args.get("enable_deterministic_inference"):
        raise ConfigError(f"rollout.sglang_server_args.enable_deterministic_inference=true is refused on "
                          f"CPU: {NO_DETERMINISM_ON_CPU}")
    if r.true_on_policy:  # top_p < 1 and an engine dtype of its own, as the torch engine refuses them
        TorchEngineBase.check_config(rollout, model, algo, debug)


def cpu_mem_fraction(rollout, spec: EngineSpec) -> float:
    """On CPU SGLang sizes weights + KV cache as a share of the memory available when it starts:
    twice what this model needs (its weights in the engine dtype, bounded by reading the files as
    16-bit, and max_total_tokens of KV cache), at least 0.05. A fixed share that fits a tiny
    model leaves a real one no KV cache
    (SmolLM2-135M: 0.54 GB of fp32 weights + 0.38 GB of KV cache for 8192 tokens)."""
    hf = read_hf_config(spec.model_path)
    width = torch.finfo(torch_dtype(spec.dtype)).bits // 8
    weights = sum(f.stat().st_size for f in Path(spec.model_path).glob("*.safetensors")) * width / 2
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    kv_cache = rollout.max_total_tokens * 2 * hf["num_hidden_layers"] * kv_heads * head_dim * width
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    return min(0.9, max(0.05, 2 * (weights + kv_cache) / available))


def records_experts(hf: dict) -> bool:
    """Whether the engine returns each token's experts: a family's MoE (routing replay's)."""
    return (hf.get("architectures") or [None])[0] in families.FAMILIES and bool(families.num_experts(hf))


def sglang_sampling_params(sp: SamplingParams, eos: list[int], seed: int | list[int], n: int,
                           deterministic: bool, first_index: int = 0) -> dict | list[dict]:
    """SGLang sampling params: one dict for all prompts or, in SGLang's deterministic mode
    (`sglang_server_args.enable_deterministic_inference`, GPU attention backends only), one
    per prompt with its own `sampling_seed` (`prompt_seeds`: per sample and engine call), so a
    rollout is reproducible from `seed` and the samples of a GRPO group still differ. Elsewhere
    SGLang cannot seed sampling, and samples differ run to run."""
    params = {"temperature": sp.temperature, "top_p": sp.top_p,
              "max_new_tokens": sp.max_new_tokens, "stop_token_ids": eos}
    if not deterministic:
        return params
    return [{**params, "sampling_seed": s} for s in prompt_seeds(seed, n, first_index)]


class SGLangEngine:
    """Rollout engine interface (relax/rollout/__init__.py), with colocation and NCCL weight sync."""

    @staticmethod
    def check_config(rollout, model, algo, debug) -> None:
        r = rollout
        if r.mem_fraction_static is not None and not 0 < r.mem_fraction_static < 1:
            raise ConfigError(f"rollout.mem_fraction_static={r.mem_fraction_static}: expected a fraction of "
                              f"the memory in (0, 1), or null")
        if r.max_total_tokens < 1:
            raise ConfigError(f"rollout.max_total_tokens={r.max_total_tokens}: expected a positive integer")
        if debug.check_weight_update_equal and r.rollout_num_gpus_per_engine > 1:
            raise ConfigError("debug.check_weight_update_equal reads the engine's tensors back "
                              "unsharded: run it with rollout.rollout_num_gpus_per_engine=1")
        if not GPU and num_engines(r) > 1:
            raise ConfigError(f"rollout=sglang on CPU runs one engine; got rollout.num_engines="
                              f"{r.num_engines} (rollout=torch runs several)")
        check_determinism(r, model, algo, debug)
        hf = model_config(model)
        why = families.sglang_blocker(hf)
        if why:
            served = ", ".join([*families.SUPPORTED_ARCHITECTURES, *sorted(SERVED)])
            raise ConfigError(f"rollout=sglang: SGLang on CPU here serves {served} (each tested with it), "
                              f"and this model is {hf['architectures'][0]} ({why}): use rollout=torch, which "
                              f"runs any transformers causal LM")
        require_extra("rollout=sglang", "sglang")  # at start-up, not when the engine is built
        if algo.routing_replay == "rollout":
            # optional: sglang (its own environment: scripts/setup_sglang_cpu.sh)
            from sglang.srt.server_args import ServerArgs

            if not hasattr(ServerArgs, "enable_return_routed_experts"):
                # optional: sglang (its own environment: scripts/setup_sglang_cpu.sh)
                import sglang

                raise ConfigError(f"algo.routing_replay=rollout trains on the engine's experts, which SGLang "
                                  f"{sglang.__version__} cannot return (no enable_return_routed_experts; "
                                  f"0.5.23 can): upgrade SGLang, or use rollout=torch")

    def __init__(self, rollout, spec: EngineSpec, base_gpu_id: int = 0):
        """(spec.pad_token_id is unused: SGLang batches prompts of any length without padding.)"""
        import sglang  # (check_config made sure it is installed)
        self.rollout, self.eos = rollout, list(spec.eos_token_ids)
        self.hf_config = read_hf_config(spec.model_path)
        with sigterm_left_to_the_driver():  # (its scheduler dying of one would kill the driver: SIGKILL)
            self.engine = sglang.Engine(**engine_args(rollout, spec, base_gpu_id))
        self._leave_sigterm_to_relax()
        moe = families.moe_layers(self.hf_config) if records_experts(self.hf_config) else None
        self.moe_layers = None if moe is None else [i for i, sparse in enumerate(moe) if sparse]
        self.deterministic = bool(rollout.sglang_server_args.get("enable_deterministic_inference",
                                                                 GPU and rollout.true_on_policy))
        log.info("SGLang %s engine on %s", sglang.__version__,
                 f"GPUs {base_gpu_id}.." if GPU else "CPU")

    def _leave_sigterm_to_relax(self) -> None:
        """SGLang's tokenizer manager starts its event loop at the first request and, in a main
        thread, makes SIGTERM its own there: drain the requests, then exit (status `failed`:
        SystemExit). Started here instead, before the run's handlers are set (relax/process.py
        Stop, or leave_stops_to_the_driver), SIGTERM goes back to the handler it had."""
        if threading.current_thread() is not threading.main_thread():
            return  # (SGLang sets none there)
        previous = signal.getsignal(signal.SIGTERM)
        manager = self.engine.tokenizer_manager

        async def start():
            manager.auto_create_handle_loop()

        self.engine.loop.run_until_complete(start())
        manager.event_loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)

    def generate(self, prompts: list[list[int]], sp: SamplingParams, seed: int | list[int],
                 first_index: int = 0, done: list[int] | None = None,
                 until: tuple[list[int], int] | None = None) -> list[Generation]:
        """`done`, `until`: a partial rollout's (relax/rollout/partial.py), decoded in chunks."""
        if done is not None:
            return in_chunks(self.generate, prompts, sp, prompt_seeds(seed, len(prompts), first_index), done, until)
        params = sglang_sampling_params(sp, self.eos, seed, len(prompts), self.deterministic, first_index)
        routed = {"return_routed_experts": True, "routed_experts_start_len": 0} if self.moe_layers else {}
        results = self.engine.generate(input_ids=prompts, return_logprob=True, sampling_params=params,
                                       **routed)
        return [Generation(r["output_ids"], [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]],
                           FINISH[r["meta_info"]["finish_reason"]["type"]],
                           self._routed_experts(r["meta_info"]) if self.moe_layers else None)
                for r in results]

    def _routed_experts(self, meta_info: dict) -> list[int]:
        """SGLang's `routed_experts`: base64 of int32 [prompt + output - 1, every layer, top_k]
        (top-k in router order), as Sample.routed_experts (the MoE layers only, flattened)."""
        ids = np.frombuffer(base64.b64decode(meta_info["routed_experts"]), dtype=np.int32)
        layers, top_k = self.hf_config["num_hidden_layers"], self.hf_config["num_experts_per_tok"]
        return ids.reshape(-1, layers, top_k)[:, self.moe_layers].flatten().tolist()

    def record_layers(self, sequences: list[list[int]]) -> dict[str, list[torch.Tensor]]:
        """debug.dump_layers: each sequence prefilled alone in the engine, the outputs of the
        layer dump's modules (relax/train/layer_dump.py) recorded in its scheduler, by HF name."""
        names = ["model.embed_tokens", "model.norm"]
        for i in range(self.hf_config["num_hidden_layers"]):
            names += [f"model.layers.{i}.{part}" for part in ("self_attn", "mlp")] + [f"model.layers.{i}"]
        return record(self.engine, lambda loader, argument: _run_in_scheduler(self.engine, loader, argument),
                      sequences, names)

    def update_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Push trainer weights by HF name: tensors in buckets, or via disk
        (`rollout.weight_update_mode=disk`); then drop the prefix cache."""
        named = faults.skip_sync(faults.perturb_sync(named))
        if faults.active("drop_buffer"):
            _run_in_scheduler(self.engine, faults.SGLANG_DROP_BUFFER)
        if self.rollout.weight_update_mode == "disk":
            self._update_from_disk(named)
        else:
            self._update_from_tensors(named)
        self.engine.flush_cache()

    # rollout.weight_update_mode=distributed (GPU): an NCCL group per engine with trainer rank 0,
    # which broadcasts (relax.train.weight_sync); relax.cluster's EngineGroup drives both sides.
    def init_weight_sync(self, address: str, port: int, world_size: int, group_name: str) -> None:
        _check(self.engine.init_weights_update_group(
            master_address=address, master_port=port, rank_offset=1, world_size=world_size,
            group_name=group_name, backend="nccl"), "init_weights_update_group")

    def receive_weights(self, metadata: list[tuple[str, str, list[int]]], group_name: str) -> None:
        names, dtypes, shapes = map(list, zip(*metadata))
        _check(self.engine.begin_weight_update(), "begin_weight_update")
        _check(self.engine.update_weights_from_distributed(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=True),
            "update_weights_from_distributed")
        _check(self.engine.end_weight_update(), "end_weight_update")

    def _update_from_tensors(self, named: dict[str, torch.Tensor]) -> None:
        _check(self.engine.begin_weight_update(), "begin_weight_update")
        for bucket in buckets(named, self.rollout.weight_update_bucket_mb * 2**20):
            tensors = [(name, t.detach().contiguous()) for name, t in bucket.items()]
            _check(self.engine.update_weights_from_tensor(named_tensors=tensors, flush_cache=False),
                   "update_weights_from_tensor")
        _check(self.engine.end_weight_update(), "end_weight_update")

    def _update_from_disk(self, named: dict[str, torch.Tensor]) -> None:
        with tempfile.TemporaryDirectory(prefix="relax-sync-") as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(self.hf_config))
            save_file({k: v.contiguous() for k, v in named.items()}, f"{tmp}/model.safetensors")
            _check(self.engine.update_weights_from_disk(tmp), "update_weights_from_disk")

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the engine computes with — parameters and buffers (the rotary cos/sin
        cache) — under HF names, exported from its scheduler process. Unsharded engines only:
        check_config refuses the check for TP engines at start-up."""
        with tempfile.TemporaryDirectory(prefix="relax-engine-weights-") as tmp:
            _run_in_scheduler(self.engine, EXPORT_TENSORS, tmp)
            out = {}
            for name, tensor in load_file(f"{tmp}/tp0.safetensors").items():
                out.update(sglang_to_hf(name, tensor, self.hf_config))
        if self.hf_config.get("tie_word_embeddings"):
            out.pop("lm_head.weight", None)
        return out

    def weight_fingerprints(self, names: list[str], salt: int) -> dict | None:
        """The weight-sync check's sample of `names` under HF names, taken in the scheduler process
        from the served model's own tensors (`fingerprint_tensors`); None for a TP engine, whose
        shards no HF tensor matches (the check then skips it)."""
        if self.rollout.rollout_num_gpus_per_engine > 1:
            return None
        with tempfile.TemporaryDirectory(prefix="relax-fingerprint-") as tmp:
            _run_in_scheduler(self.engine, FINGERPRINT, json.dumps(
                {"dir": tmp, "names": names, "salt": salt, "hf_config": self.hf_config}))
            return torch.load(f"{tmp}/tp0.pt")

    def release_memory_occupation(self) -> None:
        self.engine.release_memory_occupation()

    def resume_memory_occupation(self) -> None:
        self.engine.resume_memory_occupation()

    def shutdown(self) -> None:
        """Stop the engine's processes, and only those: SGLang's own shutdown SIGKILLs every
        child of this process (trainer ranks, other engines, multiprocessing's resource tracker...)."""
        # optional: sglang (its own environment: scripts/setup_sglang_cpu.sh)
        from sglang.srt.entrypoints import engine as engine_module

        if self.engine is None:
            return
        kill = engine_module.kill_process_tree
        own = self.engine.get_all_child_pids()

        def kill_own(pid, include_parent=True, **kwargs):
            if pid != os.getpid():
                return kill(pid, include_parent, **kwargs)
            for child in own:
                kill(child, include_parent=True, **kwargs)

        engine_module.kill_process_tree = kill_own
        try:
            self.engine.shutdown()
        finally:
            engine_module.kill_process_tree = kill
        atexit.unregister(self.engine.shutdown)
        self.engine = None


def export_tensors(model, named_tensors) -> None:
    """Runs inside SGLang's scheduler process as a `custom_weight_loader` that writes instead
    of loading: every parameter and buffer of the served model, to <dir>/tp<rank>.safetensors
    (<dir> is the request's argument). SGLang 0.5.23 has no call that reads buffers:
    `get_weights_by_name` sees parameters only, and `save_sharded_model` a state_dict, which
    leaves out non-persistent buffers such as the rotary cos/sin cache."""
    # optional: sglang (its own environment: scripts/setup_sglang_cpu.sh)
    from sglang.srt.runtime_context import get_parallel

    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()},
              f"{loader_argument(named_tensors)}/tp{get_parallel().tp_rank}.safetensors")


def fingerprint_tensors(model, named_tensors) -> None:
    """Runs inside SGLang's scheduler process like export_tensors: relax.rollout.fingerprint's
    sample of every parameter and buffer of the served model, under HF names (sglang_to_hf's
    views), to <dir>/tp<rank>.pt; a few KB where export_tensors copies the whole model."""
    # optional: sglang (its own environment: scripts/setup_sglang_cpu.sh)
    from sglang.srt.runtime_context import get_parallel

    request = json.loads(loader_argument(named_tensors))
    tensors = {}
    for name, tensor in (dict(model.named_parameters()) | dict(model.named_buffers())).items():
        tensors.update(sglang_to_hf(name, tensor.detach(), request["hf_config"]))
    if request["hf_config"].get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    torch.save(fingerprint(tensors, request["names"], request["salt"]),
               f"{request['dir']}/tp{get_parallel().tp_rank}.pt")


def cpu_plugin() -> None:
    """An SGLang plugin (setup.cfg's `sglang.srt.plugins` entry point): SGLang runs it at the
    start of each of its processes, the scheduler's included, before a model is built. On CPU it
    replaces two things SGLang 0.5.23 has only for CUDA: the routed-experts capturer's host
    buffer, which it allocates pinned through cudart ("Torch not compiled with CUDA enabled" at
    start-up with enable_return_routed_experts), by a plain CPU tensor; and Qwen2-MoE's gated
    shared expert, a Triton kernel even off CUDA (Triton has no CPU driver), by the same
    arithmetic in torch, HF's."""
    if torch.cuda.is_available():
        return
    # optional: sglang (its own environment: scripts/setup_sglang_cpu.sh)
    from sglang.srt.mem_cache.pool_host import common
    from sglang.srt.models import qwen2_moe

    common.ALLOC_MEMORY_FUNCS["cpu"] = lambda dims, dtype, *args, **kwargs: torch.empty(dims, dtype=dtype)

    def gated(hidden, gate_weight, shared):
        return torch.sigmoid(hidden @ gate_weight)[:, None] * shared

    qwen2_moe.fused_gate_sigmoid_mul = gated
    qwen2_moe.fused_gate_sigmoid_mul_add = lambda hidden, gate_weight, shared, out: out.add_(
        gated(hidden, gate_weight, shared))


def _run_in_scheduler(engine, loader: str, argument: str = "") -> None:
    """Call `loader(model, [("relax.argument", bytes)])` in each of the engine's scheduler
    processes, through the custom-weight-loader hook of `update_weights_from_tensor` (the one
    way in that SGLang offers; the loader must be listed in `custom_weight_loader`)."""
    payload = [("relax.argument", torch.tensor(list(argument.encode()), dtype=torch.uint8))]
    _check(engine.begin_weight_update(), "begin_weight_update")
    _check(engine.update_weights_from_tensor(named_tensors=payload, load_format=loader,
                                             flush_cache=False), loader)
    _check(engine.end_weight_update(), "end_weight_update")


def _check(result, what: str) -> None:
    ok, message = result[0], result[1]
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {message}")
