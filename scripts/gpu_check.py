"""The one-script GPU check: what only a machine with an NVIDIA GPU can show about Relax.

Run by scripts/gpu_check.sh in the environment it installs (CUDA torch, SGLang, Transformer
Engine, Megatron-core); see docs/gpu-check.md. On a random-initialised Qwen2-shaped model of
~0.5B parameters (Qwen2.5-0.5B's shape) built here, each check prints PASS or FAIL with its
numbers, and every result goes into one JSON file (rewritten after each check, so a run cut
short still leaves what it measured):
  sglang_deterministic   SGLang's deterministic inference: two sampled runs identical
  sglang_cuda_graphs     SGLang with CUDA graphs: tokens/s
  weight_sync_nccl       rollout.weight_update_mode=distributed: Megatron -> SGLang over NCCL,
                         then every engine tensor compared with the checkpoint
  megatron_te            Megatron with Transformer Engine layers: step time, MFU
  colocate_memory        rollout.colocate=true with the memory saver: GPU memory per phase
                         (engine / release / train / resume), then a sync checked tensor by tensor
  rl_loop                `relax` itself: 5 rollouts, colocated, NCCL sync, first-step KL exactly 0
`--dry-run` (no GPU needed; CI runs it): every config composes, every command parses, the
model config is a supported family of the right size, the pins are exact, Python compiles.
"""

from __future__ import annotations

import argparse
import compileall
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Qwen2.5-0.5B's shape: 494M parameters with tied embeddings. The vocabulary is the real
# one (a random model then rarely samples the tiny tokenizer's end token, so responses run
# to max_new_tokens, a steady load); ids the tokenizer lacks decode to nothing.
MODEL = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=896,
             num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
             max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
             rms_norm_eps=1e-6, tie_word_embeddings=True)
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}  # dense, per GPU
MAX_NEW_TOKENS = 256
BASE = ["model=hf", "model.path={model}", "model.dtype=bfloat16", "rollout=sglang", "train=megatron",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}", "checkpoint.save_interval=null"]
COMMANDS = {  # the relax command lines this check runs (in-process ones: their composed config)
    "session": BASE + ["rollout.colocate=true", "rollout.weight_update_mode=distributed",
                       "train.micro_batch_size=8"],
    "deterministic": BASE + ["+rollout.sglang_server_args.enable_deterministic_inference=true"],
    "rl_loop": BASE + ["rollout.colocate=true", "rollout.weight_update_mode=distributed",
                       "rollout.num_rollout=5", "rollout.rollout_batch_size=32",
                       "rollout.n_samples_per_prompt=8", "train.micro_batch_size=16",
                       "debug.check_weight_update_equal=true"],
}
PINS = REPO / "scripts" / "gpu-requirements.txt"


# -- pieces the dry run checks too ---------------------------------------------------------
def compose(overrides: list[str]):
    """The config `relax <overrides>` composes (without Hydra's runtime node)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from relax import config
    from relax.cli import CONF_DIR, translate_args

    config.register()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=translate_args(overrides))


def num_params(c: dict) -> int:
    h, layers, d = c["hidden_size"], c["num_hidden_layers"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d
    attention = h * h * 2 + h * kv * 2 + h + 2 * kv  # q, o; k, v; q/k/v biases
    layer = attention + 3 * h * c["intermediate_size"] + 2 * h
    embeddings = c["vocab_size"] * h * (1 if c["tie_word_embeddings"] else 2)
    return layers * layer + embeddings + h


def train_flops_per_token(c: dict, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6 x the matmul weights (the tied lm_head counts,
    the embedding lookup does not) + causal attention scores and values."""
    untied_embedding = 0 if c["tie_word_embeddings"] else c["vocab_size"] * c["hidden_size"]
    matmul_weights = num_params(c) - untied_embedding
    attention = 6 * c["num_hidden_layers"] * c["hidden_size"] * seq_len  # 12 L h S, halved by the mask
    return 6 * matmul_weights + attention


def synthetic_samples(n: int, group: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    """A rollout's worth of Samples with random tokens and rewards that vary within each group."""
    from relax.sample import Sample

    rng = random.Random(seed)
    return [Sample(index=i, group_index=i // group, prompt="", tokens=[rng.randrange(vocab) for _ in
                   range(prompt_len + response_len)], response_length=response_len, reward=float(i % 2),
                   loss_mask=[1] * response_len, rollout_log_probs=[0.0] * response_len, status="truncated")
            for i in range(n)]


def model_config():
    """The transformers config of the check's model (the tiny model's tokenizer's end token)."""
    import transformers

    from relax.model.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    fields = {k: v for k, v in MODEL.items() if k not in ("architectures", "model_type")}
    config = transformers.Qwen2Config(**fields, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    config.architectures = MODEL["architectures"]
    return config, tokenizer


def dry_run(out: dict) -> None:
    from packaging.requirements import Requirement

    from relax.model import families

    ok = all(compileall.compile_dir(str(d), quiet=1) for d in (REPO / "relax", REPO / "scripts"))
    out["checks"]["python_compiles"] = {"status": "PASS" if ok else "FAIL"}
    for name, overrides in COMMANDS.items():
        cfg = compose([o.format(model="/gpu-check/model") for o in overrides])
        out["checks"][f"config_{name}"] = {"status": "PASS", "command": "relax " + " ".join(overrides),
                                           "world_size": cfg.parallel.world_size}
    families.check(model_config()[0].to_dict())
    params = num_params(MODEL)
    assert 0.45e9 < params < 0.55e9, params
    samples = synthetic_samples(8, 4, 16, 16, MODEL["vocab_size"])
    assert len(samples) == 8 and samples[0].prompt_length == 16
    out["checks"]["model"] = {"status": "PASS", "params": params,
                              "train_flops_per_token": train_flops_per_token(MODEL, 512)}
    pins = [Requirement(line.split("#")[0]) for line in PINS.read_text().splitlines()
            if line.split("#")[0].strip()]
    loose = [str(r) for r in pins if not str(r.specifier).startswith("==")]
    out["checks"]["pins"] = {"status": "FAIL" if loose else "PASS", "pins": [str(r) for r in pins],
                             **({"not_exact": loose} if loose else {})}


# -- the real run ----------------------------------------------------------------------------
def build_model(path: Path) -> dict:
    import torch
    import transformers

    t0 = time.perf_counter()
    if not (path / "model.safetensors.index.json").is_file():
        config, tokenizer = model_config()
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(path, max_shard_size="200MB")
        tokenizer.save_pretrained(path, save_jinja_files=False)
    return {"params": num_params(MODEL), "seconds": time.perf_counter() - t0}


def used_gib() -> float:
    """GPU memory in use on the device, by every process (SGLang's scheduler included)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def chat_prompts(cfg, tokenizer, n: int) -> list[list[int]]:
    from relax.task import build_task

    return [p.tokens for p in build_task(cfg.task, cfg.seed).prompts(0, n, tokenizer)]


def check_deterministic(model: Path) -> dict:
    from relax.model import load_tokenizer
    from relax.rollout import SamplingParams
    from relax.rollout.sglang_engine import SGLangEngine
    from relax.rollout.spec import EngineSpec

    cfg = compose([o.format(model=model) for o in COMMANDS["deterministic"]])
    tokenizer = load_tokenizer(model)
    engine = SGLangEngine(cfg.rollout, EngineSpec.of(cfg.rollout, cfg.model, cfg.seed, model,
                                                       [tokenizer.eos_token_id], tokenizer.pad_token_id))
    try:
        prompts = chat_prompts(cfg, tokenizer, 64)
        sampled = SamplingParams(1.0, 1.0, 64)
        first, again, other = (engine.generate(prompts, sampled, seed) for seed in (3, 3, 4))
    finally:
        engine.shutdown()
    same = sum(a.tokens == b.tokens for a, b in zip(first, again, strict=True))
    differ = sum(a.tokens != b.tokens for a, b in zip(first, other, strict=True))
    return {"passed": same == len(prompts) and differ > 0, "identical_samples": f"{same}/{len(prompts)}",
            "samples_differing_with_another_seed": differ}


def check_throughput(engine, cfg, tokenizer) -> dict:
    from relax.rollout import SamplingParams
    from relax.rollout.sglang_engine import engine_args
    from relax.rollout.spec import EngineSpec

    prompts = chat_prompts(cfg, tokenizer, 512)
    engine.generate(prompts[:8], SamplingParams(1.0, 1.0, 8), seed=0)  # warm-up
    t0 = time.perf_counter()
    gens = engine.generate(prompts, SamplingParams(1.0, 1.0, MAX_NEW_TOKENS), seed=1)
    seconds = time.perf_counter() - t0
    tokens = sum(len(g.tokens) for g in gens)
    graphs = not engine_args(cfg.rollout, EngineSpec(str(cfg.model.path), (0,))).get("disable_cuda_graph", False)
    return {"passed": graphs and tokens > 0, "cuda_graphs": graphs, "tokens_per_s": tokens / seconds,
            "prompts": len(prompts), "mean_response_len": tokens / len(prompts)}


def check_weight_sync(engine, trainer, model: Path, run_dir: Path) -> dict:
    """The engine-weights check over NCCL: randomise the engine, broadcast from Megatron, compare."""
    import torch

    from relax.debug.weights import WeightCheck, compare_tensors, snapshot

    check = WeightCheck(engine, model, run_dir)
    generator = torch.Generator().manual_seed(0)
    engine.update_weights({k: torch.randn(v.shape, generator=generator).to(v.dtype)
                           for k, v in check.reference.items() if k in check.loaded})
    t0 = time.perf_counter()
    engine.update_weights_from_trainer(trainer)
    seconds = time.perf_counter() - t0
    report = compare_tensors(snapshot(engine), {**check.reference, **check.buffers})
    nbytes = sum(v.numel() * v.element_size() for v in check.reference.values())
    return {"passed": check.results[0]["passed"] and report["passed"], "compared": report["compared"],
            "mismatches": report["mismatches"][:5], "sync_seconds": seconds,
            "sync_gb_per_s": nbytes / seconds / 1e9}


def check_colocate_and_megatron(engine, trainer, base_gib: float, gpu_name: str) -> tuple[dict, dict]:
    """Release the engine, train Megatron (its step time and MFU), resume, sync, compare.
    `base_gib`: memory in use before the engine started."""
    import torch

    from relax.debug.weights import compare_tensors, snapshot

    buffers = {k: v for k, v in snapshot(engine).items() if "rotary" in k or "cos_sin" in k}
    memory = {"engine": used_gib()}
    engine.release_memory_occupation()
    memory["release"] = used_gib()
    seq = 512
    samples = synthetic_samples(64, 8, 64, seq - 64, MODEL["vocab_size"])
    results = [trainer.train(i, samples) for i in range(3)]
    memory["train"] = used_gib()
    engine.resume_memory_occupation()
    memory["resume"] = used_gib()
    engine.update_weights_from_trainer(trainer)
    weights = {k: v.to("cpu", torch.bfloat16) for k, v in trainer.named_weights().items()}
    report = compare_tensors(snapshot(engine), {**weights, **buffers})
    freed = memory["engine"] - memory["release"]
    colocate = {"passed": freed > 0.5 * (memory["engine"] - base_gib) and report["passed"],
                "memory_gib": {"before_engine": base_gib, **memory}, "freed_by_release_gib": freed,
                "peak_train_memory_mb": results[-1]["steps"][0]["perf/peak_memory_mb"],
                "synced_tensors_equal": report["passed"], "mismatches": report["mismatches"][:5]}
    step_time = statistics.median(r["steps"][0]["perf/step_time"] for r in results[1:])
    tokens = len(samples) * seq
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in gpu_name), None)
    flops = train_flops_per_token(MODEL, seq) * tokens / step_time
    first = results[0]["rollout"]
    megatron = {"passed": first["rollout/log_probs"] == first["rollout/ref_log_probs"]
                and all(math.isfinite(r["steps"][0]["train/grad_norm"]) for r in results),
                "step_time_s": step_time, "tokens_per_step": tokens, "tflops": flops / 1e12,
                "mfu": flops / (peak * 1e12) if peak else None, "grad_norms": [
                    r["steps"][0]["train/grad_norm"] for r in results]}
    return colocate, megatron


def check_rl_loop(model: Path, run_dir: Path) -> dict:
    overrides = [o.format(model=model) for o in COMMANDS["rl_loop"]]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "relax", *overrides, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=360, cwd=REPO)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").is_file() else []
    rollouts = [r for r in records if "step" not in r]
    steps = [r for r in records if "step" in r]
    weight_check = json.loads((run_dir / "weight_check.json").read_text()) \
        if (run_dir / "weight_check.json").is_file() else {"passed": False}
    first_kl = steps[0]["train/ppo_kl"] if steps else None
    diffs = [s["train/train_rollout_logprob_abs_diff"] for s in steps]
    return {"passed": proc.returncode == 0 and len(rollouts) == 5 and first_kl == 0.0
            and weight_check["passed"] and all(d < 0.05 for d in diffs),
            "exit_code": proc.returncode, "seconds": time.perf_counter() - t0, "rollouts": len(rollouts),
            "first_step_kl": first_kl, "train_rollout_logprob_abs_diff": diffs,
            "rollout_tokens_per_s": [r.get("perf/tokens_per_s") for r in rollouts],
            "train_time_s": [r.get("perf/train_time") for r in rollouts],
            **({"stderr_tail": proc.stderr[-2000:]} if proc.returncode else {})}


def wait_for_transformer_engine(rc_file: str | None, limit_s: float = 900) -> None:
    """gpu_check.sh builds Transformer Engine in the background; Megatron needs it."""
    deadline = time.monotonic() + limit_s
    while rc_file and not Path(rc_file).is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"Transformer Engine still installing after {limit_s:.0f} s")
        time.sleep(5)
    if rc_file and Path(rc_file).read_text().strip() != "0":
        raise RuntimeError(f"the Transformer Engine install failed (see {Path(rc_file).with_suffix('.log')})")
    import transformer_engine.pytorch  # noqa: F401


def real_run(out: dict, save, work: Path, te_rc: str | None) -> None:
    import torch

    from relax.model import load_tokenizer
    from relax.rollout.sglang_engine import SGLangEngine
    from relax.rollout.spec import EngineSpec
    from relax.train import build_trainer

    out["gpu"] = torch.cuda.get_device_name(0)
    model = work / "qwen2-0.5b-random"
    run(out, save, "build_model", lambda: {"passed": True, **build_model(model)})
    run(out, save, "sglang_deterministic", lambda: check_deterministic(model))
    cfg = compose([o.format(model=model) for o in COMMANDS["session"]])
    tokenizer = load_tokenizer(model)
    engine = trainer = None
    megatron: dict = {}

    def colocate():
        result, measured = check_colocate_and_megatron(engine, trainer, base, out["gpu"])
        megatron.update(measured)
        return result

    try:
        base = used_gib()
        engine = SGLangEngine(cfg.rollout, EngineSpec.of(cfg.rollout, cfg.model, cfg.seed, model,
                                                           [tokenizer.eos_token_id], tokenizer.pad_token_id))
        run(out, save, "sglang_cuda_graphs", lambda: check_throughput(engine, cfg, tokenizer))
        wait_for_transformer_engine(te_rc)
        trainer = build_trainer(cfg, model, model, tokenizer.pad_token_id, None, str(work))
        run(out, save, "weight_sync_nccl", lambda: check_weight_sync(engine, trainer, model, work))
        run(out, save, "colocate_memory", colocate)
        run(out, save, "megatron_te", lambda: megatron or {
            "passed": False, "error": "not measured: the colocate_memory check stopped before training"})
    except Exception:  # a check that could not even start: recorded, the loop check still runs
        out["checks"].setdefault("session", {"status": "FAIL", "error": traceback.format_exc()[-3000:]})
    finally:
        for part in (trainer, engine):
            if part is not None:
                part.shutdown()
    run(out, save, "rl_loop", lambda: check_rl_loop(model, work / "rl_loop"))


def run(out: dict, save, name: str, check) -> None:
    t0 = time.perf_counter()
    try:
        result = check()
        status = "PASS" if result.pop("passed") else "FAIL"
    except Exception:
        result, status = {"error": traceback.format_exc()[-3000:]}, "FAIL"
    out["checks"][name] = {"status": status, "seconds": round(time.perf_counter() - t0, 1), **result}
    numbers = {k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    print(f"[gpu-check] {status} {name}: {json.dumps(numbers, default=str)}", flush=True)
    save()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="check what can be checked without a GPU")
    parser.add_argument("--out", default="gpu_check_results.json", help="where the JSON of results goes")
    parser.add_argument("--work", default="outputs/gpu_check", help="model and run directories")
    parser.add_argument("--te-rc", help="where gpu_check.sh writes TE's install exit code")
    args = parser.parse_args(argv)
    out = {"dry_run": args.dry_run, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "checks": {}}
    path = Path(args.out)

    def save():
        path.write_text(json.dumps(out, indent=2, default=str))

    if args.dry_run:
        dry_run(out)
    else:
        work = Path(args.work).resolve()
        work.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        real_run(out, save, work, args.te_rc)
    save()
    failed = [name for name, c in out["checks"].items() if c["status"] != "PASS"]
    print(f"[gpu-check] {len(out['checks']) - len(failed)}/{len(out['checks'])} PASS"
          + (f"; FAIL: {', '.join(failed)}" if failed else "") + f"; results in {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
