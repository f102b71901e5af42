"""rollout=sglang against real SGLang on CPU (run from the environment that
scripts/setup_sglang_cpu.sh builds: `.venv-sglang/bin/python -m pytest -m sglang`).
One engine is shared by the module's in-process tests; assertions are on token ids and
log-probs, never on text."""

import json
import signal
import time

import pytest
import torch

pytest.importorskip("sglang", reason="needs the SGLang environment (scripts/setup_sglang_cpu.sh)")

from relax.cluster.engines import EngineGroup, InDriver  # noqa: E402
from relax.debug.weights import WeightCheck  # noqa: E402
from relax.model import load_safetensors_dir  # noqa: E402
from relax.rollout import SamplingParams  # noqa: E402
from relax.rollout.generate import generate_rollout  # noqa: E402
from relax.rollout.sglang_engine import SGLangEngine  # noqa: E402
from relax.rollout.torch_engine import TorchEngine  # noqa: E402
from relax.task import build_task  # noqa: E402

from .conftest import FRESH, engine_spec, local_trainer, make_cfg, relax_cli  # noqa: E402
from .extras import RAY, require  # noqa: E402
from .families import FAMILIES  # noqa: E402
from .test_engine import chat_prompts  # noqa: E402

pytestmark = pytest.mark.sglang
ROTARY_CACHE = "model.layers.0.self_attn.rotary_emb.cos_sin_cache"  # SGLang's one rotary buffer
GREEDY = SamplingParams(0.0, 1.0, 8)


@pytest.fixture(scope="module")
def sglang_engine(tiny_path, tokenizer):
    engine = SGLangEngine(make_cfg("rollout=sglang").rollout,
                          engine_spec(make_cfg(), tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    yield engine
    engine.shutdown()


@pytest.fixture
def reset_weights(sglang_engine, tiny_path):
    """Tests that push weights put the checkpoint back afterwards."""
    yield
    from safetensors.torch import load_file

    sglang_engine.update_weights(load_file(str(tiny_path / "model.safetensors")))


def torch_engine(tiny_path, tokenizer):
    return TorchEngine(make_cfg().rollout, engine_spec(make_cfg(), tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))


def test_greedy_tokens_and_log_probs_match_the_torch_engine(sglang_engine, tiny_path, tokenizer):
    prompts = chat_prompts(tokenizer, 16, 1, 999)
    ours = sglang_engine.generate(prompts, GREEDY, seed=0)
    reference = torch_engine(tiny_path, tokenizer).generate(prompts, GREEDY, seed=0)
    assert [g.tokens for g in ours] == [g.tokens for g in reference]
    assert [g.status for g in ours] == [g.status for g in reference]
    worst = max(abs(a - b) for g, h in zip(ours, reference, strict=True)
                for a, b in zip(g.log_probs, h.log_probs, strict=True))
    assert worst < 1e-5


def test_sampled_log_probs_are_the_trainers(sglang_engine, tiny_path, tokenizer):
    """Sampled at temperature 0.7: SGLang's log-probs equal a teacher-forced forward of
    the trainer's model with logits / 0.7 (the contract train_rollout_logprob_abs_diff checks)."""
    from relax.algo import token_log_probs
    from relax.model import load_causal_lm

    prompts = chat_prompts(tokenizer, 16, repeat=4)
    gens = sglang_engine.generate(prompts, SamplingParams(0.7, 1.0, 8), seed=0)
    model = load_causal_lm(tiny_path, "float32")
    for prompt, gen in zip(prompts, gens, strict=True):
        tokens = torch.tensor([prompt + gen.tokens])
        with torch.no_grad():
            lp, _ = token_log_probs(model(tokens).logits[:, :-1], tokens[:, 1:], 0.7)
        assert (lp[0, len(prompt) - 1:] - torch.tensor(gen.log_probs)).abs().max() < 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_matches_the_torch_engine_and_syncs_by_checkpoint_names(family_model, tokenizer,
                                                                            family, tmp_path):
    """Per family (tests/families.py, sharded fp32 checkpoints): greedy tokens equal the torch
    engine's, and so do an MoE's recorded experts (SGLang's return_routed_experts); the engine's
    tensors (MoE experts unfused back to per-expert names) equal the checkpoint's after load and
    after a sync from the torch trainer."""
    path = family_model(family)
    cfg = make_cfg("rollout=sglang")
    engine = SGLangEngine(cfg.rollout, engine_spec(cfg, path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    try:
        prompts = chat_prompts(tokenizer, 8, 1, 999)
        ours = engine.generate(prompts, GREEDY, seed=0)
        reference = torch_engine(path, tokenizer).generate(prompts, GREEDY, seed=0)
        assert [g.tokens for g in ours] == [g.tokens for g in reference]
        if "moe" in family:
            top_k = FAMILIES[family][1]["num_experts_per_tok"]
            for a, b in zip(ours, reference, strict=True):
                assert a.routed_experts is not None and len(a.routed_experts) == len(b.routed_experts)
            routed = [torch.tensor(g.routed_experts).view(-1, top_k).sort(-1).values for g in ours]
            expected = [torch.tensor(g.routed_experts).view(-1, top_k).sort(-1).values for g in reference]
            same = torch.cat([(a == b).all(-1) for a, b in zip(routed, expected, strict=True)])
            assert same.float().mean() > 0.98, same.float().mean()  # fp32: a near-tie may flip
        else:
            assert all(g.routed_experts is None for g in ours)
        engines = EngineGroup(InDriver([engine], ["cpu"]), cfg.rollout)
        check = WeightCheck(engines, path, tmp_path)
        trainer = local_trainer(make_cfg(), str(path), ref_model_path=str(path),
                               pad_token_id=tokenizer.pad_token_id)
        sync, = check.check_first_sync(engines, trainer)
    finally:
        engine.shutdown()
    assert check.results[0]["passed"] and sync["passed"]
    assert sync["compared"] == len(load_safetensors_dir(path)) + 1  # and the rotary cache


def test_an_idle_engine_leaves_the_cpu_alone(sglang_engine):
    """Between rollouts (while the trainer trains) SGLang's scheduler would poll for requests at
    100% of a core; with sleep_on_idle (set by Relax on CPU) it waits on its sockets."""
    import psutil

    scheduler = next(p for p in psutil.Process().children(recursive=True)
                     if "sglang::scheduler" in " ".join(p.cmdline()))
    before = sum(scheduler.cpu_times()[:2])
    time.sleep(3)
    # measured: ~0 s; polling: ~3 s (~1.5 s on a busy machine)
    assert sum(scheduler.cpu_times()[:2]) - before < 0.5


def test_truncated_status(sglang_engine, tokenizer):
    gens = sglang_engine.generate(chat_prompts(tokenizer, 4), SamplingParams(0.0, 1.0, 1), seed=0)
    assert all(g.status == "truncated" and len(g.tokens) == 1 for g in gens)


def test_after_a_train_step_and_sync_sglang_generates_the_trainers_policy(
        sglang_engine, tiny_path, tokenizer, reset_weights):
    cfg = make_cfg("rollout.rollout_batch_size=8", "train.lr=0.02")
    trainer = local_trainer(cfg, str(tiny_path), ref_model_path=str(tiny_path),
                           pad_token_id=tokenizer.pad_token_id)
    task = build_task(cfg.task, cfg.seed)
    for rollout_id in range(3):
        samples, _ = generate_rollout(sglang_engine, task, tokenizer, cfg.rollout, rollout_id, cfg.seed)
        trainer.train(rollout_id, samples)
    prompts = chat_prompts(tokenizer, 8)
    before = [g.tokens for g in sglang_engine.generate(prompts, GREEDY, 0)]
    sglang_engine.update_weights(trainer.named_weights())
    after = [g.tokens for g in sglang_engine.generate(prompts, GREEDY, 0)]
    assert after != before
    with torch.no_grad():
        for prompt, tokens in zip(prompts, after, strict=True):
            x = torch.tensor([prompt + tokens[:-1]])
            assert tokens == trainer.model(x).logits[0, len(prompt) - 1:].argmax(-1).tolist()


def test_engine_weights_check_passes_and_names_a_corrupted_tensor(
        sglang_engine, tiny_path, tokenizer, tmp_path, monkeypatch, reset_weights):
    cfg = make_cfg()
    trainer = local_trainer(cfg, str(tiny_path), ref_model_path=str(tiny_path),
                           pad_token_id=tokenizer.pad_token_id)
    engines = EngineGroup(InDriver([sglang_engine], ["cpu"]), cfg.rollout)
    check = WeightCheck(engines, tiny_path, tmp_path)
    assert check.results[0]["passed"] and check.results[0]["compared"] == 27  # load
    buffers, = check.buffers
    assert list(buffers) == [ROTARY_CACHE]  # read from inside the engine, with the parameters
    assert buffers[ROTARY_CACHE].abs().max() > 0.5  # cos/sin values, not an empty allocation
    sync, = check.check_first_sync(engines, trainer)  # random -> synced -> equal
    assert sync["passed"] and sync["compared"] == 28
    monkeypatch.setenv("RELAX_FAULT", "sync_perturb")
    report, = check.check_first_sync(engines, trainer)
    assert not report["passed"]
    assert [m["name"] for m in report["mismatches"]] == ["model.layers.0.mlp.down_proj.weight"]


def test_disk_weight_update_mode(tiny_path, tokenizer, sglang_engine, reset_weights):
    from safetensors.torch import load_file

    scaled = {k: v * 1.5 for k, v in load_file(str(tiny_path / "model.safetensors")).items()}
    sglang_engine.rollout = make_cfg("rollout=sglang", "rollout.weight_update_mode=disk").rollout
    try:
        sglang_engine.update_weights(scaled)
    finally:
        sglang_engine.rollout = make_cfg("rollout=sglang").rollout
    reference = torch_engine(tiny_path, tokenizer)
    reference.update_weights(scaled)
    prompts = chat_prompts(tokenizer, 8)
    assert [g.tokens for g in sglang_engine.generate(prompts, GREEDY, 0)] == \
        [g.tokens for g in reference.generate(prompts, GREEDY, 0)]


def sglang_processes(run_dir) -> list[str]:
    """SGLang's processes started from `run_dir` (they keep the run's working directory), so a test
    beside this one (pytest -n 2) that runs SGLang too does not count."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
        cmdline, cwd = " ".join(p.info["cmdline"] or []), p.info["cwd"] or ""
        if "sglang::" in cmdline and (cwd + "/").startswith(f"{run_dir}/"):
            found.append(f"{p.info['pid']} {cmdline}")
    return found


def test_rollout_only_then_train_only(tmp_path, tiny_path):
    """The CLI with rollout=sglang: save replay data, with no SGLang process left behind, then
    train on it (the full loop: the real model's test below, and on Ray)."""
    proc = relax_cli("rollout=sglang", "rollout.num_rollout=2", "rollout.rollout_batch_size=4",
                     "checkpoint.save_interval=null", "debug=rollout_only",
                     f"debug.save_rollout_data={tmp_path}/rd/{{rollout_id}}.pt",
                     "hydra.run.dir=outputs/rollout", cwd=tmp_path, entry=FRESH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sglang_processes(tmp_path) == []  # no orphan scheduler/detokenizer processes
    assert sorted(p.name for p in (tmp_path / "rd").iterdir()) == ["0.pt", "1.pt"]
    # SGLang's engine reconfigures logging at start-up; relax.log keeps every line after it
    log = (tmp_path / "outputs/rollout/relax.log").read_text()
    assert "Finish rollout 0" in log and "Finish rollout 1" in log
    proc = relax_cli("debug=train_only", f"debug.load_rollout_data={tmp_path}/rd/{{rollout_id}}.pt",
                     "checkpoint.save_interval=null", "hydra.run.dir=outputs/train", cwd=tmp_path,
                     entry=FRESH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "outputs/train/metrics.jsonl").read_text().splitlines()
             if '"step"' in line]
    assert len(steps) == 2 and steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-4


def test_an_agent_trains_through_the_endpoint_on_sglang(tmp_path):
    """rollout.agent with rollout=sglang: the OpenAI-compatible endpoint serves SGLang's completions;
    each sample is the agent's conversation with the environment's turn masked, and the trainer's
    log-probs of the model's tokens are SGLang's."""
    proc = relax_cli("rollout=sglang", "rollout.agent=relax.rollout.calculator_agent.agent", "rollout.num_rollout=2",
                     "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "checkpoint.save_interval=null",
                     f"debug.save_rollout_data={tmp_path}/rd/{{rollout_id}}.pt", "hydra.run.dir=outputs/run",
                     cwd=tmp_path, entry=FRESH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "outputs/run/metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in records if "step" not in r]
    assert [r["rollout/agent_errors"] for r in rollouts] == [0, 0]
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-4 for r in records if "step" in r)
    for sample in torch.load(tmp_path / "rd" / "0.pt", weights_only=True)["samples"]:
        mask = sample["loss_mask"]
        assert 0 < sum(mask) < len(mask)  # the model's turns trained, the calculator's answer masked
        assert len(sample["metadata"]["agent_io"]) == sample["metadata"]["agent_turns"] >= 2


def test_partial_rollouts_on_sglang_carry_responses_in_chunks(tmp_path):
    """rollout.partial=continue with rollout=sglang (relax/rollout/partial.py in_chunks): a
    rollout's unfinished responses go on in the next one, their tokens from two policies, and
    every rollout trains rollout_batch_size complete groups."""
    proc = relax_cli("rollout=sglang", "rollout.num_rollout=3", "rollout.rollout_batch_size=8",
                     "rollout.max_new_tokens=96", "train.max_staleness=1", "rollout.partial=continue",
                     "model.tiny.warmup_max_steps=0", "checkpoint.save_interval=null",
                     f"debug.save_rollout_data={tmp_path}/rd/{{rollout_id}}.pt", "hydra.run.dir=outputs/run",
                     cwd=tmp_path, entry=FRESH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "outputs/run/metrics.jsonl").read_text().splitlines()
               if '"step"' not in line]
    assert [r["rollout/partial_in_flight_groups"] for r in records] == [4, 4, 4]  # 12 decoded, 8 taken
    # max_staleness=1: each rollout made on the weights that train it, what it carries one version older
    assert [r["rollout/staleness"] for r in records][0] == 0 and max(r["rollout/staleness"] for r in records) <= 1
    versions = [s["token_versions"] for i in range(3)
                for s in torch.load(tmp_path / "rd" / f"{i}.pt", weights_only=True)["samples"]]
    assert all(len(s) for s in versions) and any(len(set(v)) > 1 for v in versions)


@pytest.mark.parametrize("to", ["the driver", "every process of the job"])
def test_sigterm_stops_a_run_cleanly_and_leaves_no_sglang_process(tmp_path, to):
    """`kill <pid>`, or `timeout`, `kill -- -PGID`, Slurm (every process, SGLang's scheduler
    too). Before: SGLang's own SIGTERM handler in the driver drained and exited (status
    `failed`), and a scheduler killed by it made SGLang SIGKILL the driver (status `running`)."""
    from .test_process import signalled_run, stopped_cleanly

    proc = signalled_run(tmp_path, "rollout=sglang", signum=signal.SIGTERM, group=to != "the driver",
                         timeout=600)
    stopped_cleanly(tmp_path, signal.SIGTERM, proc.returncode)
    time.sleep(1)  # the scheduler's exit after the driver's
    assert sglang_processes(tmp_path) == []


def test_a_dropped_engine_buffer_is_named_and_stops_a_strict_run(tmp_path):
    """The rotary cache zeroed inside the engine (as a buffer lost across release/resume
    would be): the check names it, strict mode stops the run, and no SGLang process is left."""
    proc = relax_cli("rollout=sglang", "rollout.num_rollout=2", "rollout.rollout_batch_size=4",
                     "debug.check_weight_update_equal=true", "debug.strict_checks=true",
                     "hydra.run.dir=outputs/drop", cwd=tmp_path, entry=FRESH,
                     env={"RELAX_FAULT": "drop_buffer"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ROTARY_CACHE in proc.stderr + proc.stdout
    load, sync = json.loads((tmp_path / "outputs/drop/weight_check.json").read_text())["checks"]
    assert load["passed"] and not sync["passed"]
    assert [m["name"] for m in sync["mismatches"]] == [ROTARY_CACHE]
    assert sync["mismatches"][0]["max_abs_diff"] > 0.5
    assert not (tmp_path / "outputs/drop/metrics.jsonl").exists()  # stopped before rollout 0
    assert sglang_processes(tmp_path) == []


def test_an_engine_that_fails_to_start_fails_the_run_with_a_message(tmp_path):
    """SGLang's scheduler refuses a KV cache too small for the weights: the driver gets SIGQUIT,
    which SGLang's own handler answered by SIGKILLing it (exit 137, status `running`, no message)."""
    proc = relax_cli("rollout=sglang", "rollout.mem_fraction_static=0.00001", "rollout.num_rollout=1",
                     "hydra.run.dir=outputs/run", cwd=tmp_path, entry=FRESH)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Raise --mem-fraction-static above" in proc.stderr  # the scheduler's own error
    status = json.loads((tmp_path / "outputs/run/status.json").read_text())
    assert status["status"] == "failed" and status["error"].startswith("EngineDied: an SGLang process")
    assert "rollout.mem_fraction_static" in status["error"]
    assert sglang_processes(tmp_path) == []


def test_a_colocated_engine_is_unchanged_by_release_and_resume(tiny_path, tokenizer):
    """rollout.colocate=true: the engine gives its memory up while the trainer runs
    (relax.loop.train). On GPU the setting reaches SGLang as its memory saver; on CPU there is no
    accelerator memory to give up, SGLang runs without it, and release/resume keep every tensor.
    Either way, once resumed (on GPU: and given the weights again, as the loop's sync after
    training does), the engine holds the tensors it had, buffers included (SGLang stashes them
    across a release), and generates what it did before."""
    gpu = torch.cuda.is_available()
    engine = SGLangEngine(make_cfg("rollout=sglang", "rollout.colocate=true").rollout,
                          engine_spec(make_cfg(), tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    try:
        assert engine.engine.server_args.enable_memory_saver is gpu
        prompts = chat_prompts(tokenizer, 8, 1, 999)
        before, tensors = engine.generate(prompts, GREEDY, seed=0), engine.named_tensors()
        engine.release_memory_occupation()
        engine.resume_memory_occupation()
        if gpu:  # the memory saver gave the weights' memory up: the sync after training refills it
            engine.update_weights(load_safetensors_dir(tiny_path))
        after, tensors_after = engine.generate(prompts, GREEDY, seed=0), engine.named_tensors()
    finally:
        engine.shutdown()
    assert tensors_after.keys() == tensors.keys() and ROTARY_CACHE in tensors
    assert [k for k, t in tensors.items() if not torch.equal(tensors_after[k], t)] == []
    # the same tensors and prompts: the same tokens and log-probs, bit for bit (measured on CPU)
    assert [(g.tokens, g.log_probs) for g in after] == [(g.tokens, g.log_probs) for g in before]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs, memory saver)")
def test_colocated_loop_on_gpu(tmp_path):
    """On GPU: CUDA graphs on, and the memory saver releases the engine around training; after
    each resume and sync the engine's tensors, buffers included, equal the trainer's."""
    proc = relax_cli("rollout=sglang", "rollout.colocate=true", "rollout.num_rollout=2",
                     "rollout.rollout_batch_size=4", "checkpoint.save_interval=null",
                     "debug.check_weight_update_equal=true", "debug.check_weight_update_every_sync=true",
                     "hydra.run.dir=outputs/colocated", cwd=tmp_path, entry=FRESH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "outputs/colocated/weight_check.json").read_text())
    assert report["passed"] and [(c["stage"], c["rollout_id"]) for c in report["checks"]] == [
        ("load", None), ("sync", None), ("sync", 0), ("sync", 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU attention backend")
def test_deterministic_mode_reproduces_a_sampled_rollout(tiny_path, tokenizer):
    cfg = make_cfg("rollout=sglang", "+rollout.sglang_server_args.enable_deterministic_inference=true")
    engine = SGLangEngine(cfg.rollout, engine_spec(cfg, tiny_path, [tokenizer.eos_token_id], tokenizer.pad_token_id))
    try:
        prompts = chat_prompts(tokenizer, 8, repeat=4)
        first, again, other = (engine.generate(prompts, SamplingParams(1.0, 1.0, 8), seed)
                               for seed in (3, 3, 4))
    finally:
        engine.shutdown()
    assert [g.tokens for g in first] == [g.tokens for g in again]
    assert [g.tokens for g in first] != [g.tokens for g in other]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs (NCCL)")
@pytest.mark.parametrize("lora", [[], ["train.lora.rank=8"]], ids=["full", "lora"])
def test_nccl_weight_sync_on_gpu(tmp_path, lora):
    """On GPU: trainer rank 0 broadcasts the weights into SGLang over NCCL each rollout (with
    LoRA, the merged projections only)."""
    proc = relax_cli("rollout=sglang", "rollout.weight_update_mode=distributed", "rollout.num_rollout=3",
                     "rollout.rollout_batch_size=4", "checkpoint.save_interval=null", *lora,
                     "hydra.run.dir=outputs/nccl", cwd=tmp_path, entry=FRESH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "outputs/nccl/metrics.jsonl").read_text().splitlines()
             if '"step"' in line]
    # the engine generated rollout 2 with the weights broadcast after step 1
    assert steps[2]["train/train_rollout_logprob_abs_diff"] < 1e-3


def test_sglang_engine_as_a_ray_actor(tmp_path):
    """cluster=ray (a private instance): the SGLang engine runs in its own Ray actor, weights reach
    it through Ray's object store, the engine-weights check passes after every sync, and no
    SGLang or Ray process is left."""
    require("ray", RAY)  # (scripts/sglang-cpu-requirements.txt installs it)
    proc = relax_cli("rollout=sglang", "cluster=ray", "rollout.num_rollout=2", "rollout.rollout_batch_size=4",
                     "checkpoint.save_interval=null", "debug.check_weight_update_equal=true",
                     "debug.check_weight_update_every_sync=true", "hydra.run.dir=outputs/ray", cwd=tmp_path,
                     entry=FRESH, env={"RAY_AUTH_MODE": "disabled"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "outputs" / "ray"
    placement = json.loads((run / "built.json").read_text())["placement"]
    assert placement["private_instance"] and [e["engine"] for e in placement["engines"]] == [0]
    report = json.loads((run / "weight_check.json").read_text())
    assert report["passed"] and [(c["stage"], c["rollout_id"]) for c in report["checks"]] == [
        ("load", None), ("sync", None), ("sync", 0), ("sync", 1)]
    assert sglang_processes(tmp_path) == []


def test_the_real_model_on_sglang_strict_weight_check_after_every_sync(tmp_path, smollm2_path):
    """SmolLM2 (30 layers, tied embeddings: the output layer must follow the embedding) served by
    SGLang in a full loop: first-step log_probs == ref_log_probs exactly, the engine equal to the
    trainer's weights at load and after every sync, and the engine's log-probs near the trainer's.
    In this process (SGLang already imported: a CLI would import it again, ~15 s)."""
    from .conftest import run_loop
    from .test_real_model import REAL

    rollouts, steps = run_loop(tmp_path, *REAL, "rollout=sglang", "rollout.num_rollout=2",
                               "debug.check_weight_update_equal=true",
                               "debug.check_weight_update_every_sync=true", "debug.strict_checks=true")
    first = rollouts[0]
    assert first["rollout/log_probs"] == first["rollout/ref_log_probs"] and first["rollout/kl"] == 0.0
    assert len(steps) == 2 and all(s["train/grad_norm"] > 0 for s in steps)
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3  # two fp32 implementations, 30 layers
    report = json.loads((tmp_path / "weight_check.json").read_text())
    assert report["passed"] and [c["stage"] for c in report["checks"]] == ["load", "sync", "sync", "sync"]
    assert json.loads((tmp_path / "built.json").read_text())["rollout_engine"] == \
        "relax.rollout.sglang_engine.SGLangEngine"


def test_r3_trains_on_the_experts_sglang_routed(tmp_path):
    """A loop on a tiny MoE with rollout=sglang and algo.routing_replay=rollout: SGLang's recorded
    experts reach the trainer, which runs every replayed (token, layer) pair on them."""
    from .conftest import run_loop

    rollouts, _ = run_loop(tmp_path, "rollout=sglang", "model.tiny.num_experts=4",
                           "model.tiny.warmup_max_steps=0", "model.tiny.shared_expert_intermediate_size=64",
                           "algo.routing_replay=rollout",
                           "rollout.num_rollout=1", "rollout.rollout_batch_size=4",
                           "checkpoint.save_interval=null")
    assert rollouts[0]["train/routing_replayed"] == 1.0
    assert rollouts[0]["train/routing_agreement"] > 0.98
