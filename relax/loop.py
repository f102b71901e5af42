"""The RL loop: build what the config asks for, then rollout -> train -> sync, then close."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from relax.checkpoint import find_checkpoint, read_state, save_checkpoint
from relax.debug import doctor
from relax.debug.health import response_health
from relax.debug.plan import Plan, resolve
from relax.debug.weights import WeightCheck
from relax.errors import CheckFailed, ConfigError, ReplayError
from relax.logger import MetricsLogger, plot_run
from relax.model import load_tokenizer, resolve_model_path
from relax.replay import build_manifest, fill, load_rollout, save_rollout
from relax.sample import Sample
from relax.task import Task

log = logging.getLogger("relax")


def rollout_stats(samples: list[Sample], seconds: float, tokenizer, answer_format) -> dict:
    n_tokens = sum(s.response_length for s in samples)
    return {
        **response_health(samples, tokenizer, answer_format),
        "rollout/raw_reward": sum(s.reward for s in samples) / len(samples),
        "rollout/response_len": n_tokens / len(samples),
        "rollout/truncated_ratio": sum(s.status == "truncated" for s in samples) / len(samples),
        "rollout/rollout_log_probs": sum(sum(s.rollout_log_probs) for s in samples) / max(n_tokens, 1),
        "perf/rollout_time": seconds,
        "perf/tokens_per_s": n_tokens / max(seconds, 1e-9),
    }


def log_finish_rollout(rollout_id: int, samples: list[Sample]) -> None:
    s = samples[0]
    mean = sum(x.reward for x in samples) / len(samples)
    log.info("Finish rollout %d: %d samples, mean reward %.3f | prompt=%r response=%r reward=%g",
             rollout_id, len(samples), mean, s.prompt, s.response, s.reward)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2))


def rl_loop(cfg, run_dir: Path) -> None:
    checkpoint = find_checkpoint(cfg.resume, run_dir.parent)
    start = read_state(checkpoint)["rollout_id"] + 1 if checkpoint else 0
    plan: Plan = resolve(cfg, start)
    task = Task(cfg.task, cfg.seed) if plan.builds_rollout else None
    model_path = Path(read_state(checkpoint)["ref_model_path"]) if checkpoint \
        else resolve_model_path(cfg.model)
    actor_path = checkpoint / "hf" if checkpoint else model_path
    tokenizer = load_tokenizer(model_path)
    manifest = build_manifest(cfg, model_path, tokenizer)
    if plan.dump_dir:  # with the rollout/train data, enough to reproduce the run
        tokenizer.save_pretrained(plan.dump_dir / "tokenizer")
        (plan.dump_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))

    built = {**plan.built(cfg), "model_path": str(model_path)}
    log.info("Building %s", ", ".join(f"{k}={v}" for k, v in built.items() if v is not None))
    write_json(run_dir / "built.json", built)
    engine = trainer = metrics = None
    try:
        if plan.builds_rollout:
            from relax.rollout import build_engine, generate_rollout

            engine = build_engine(cfg, actor_path, tokenizer)
        if plan.builds_train:
            from relax.train import build_trainer

            trainer = build_trainer(cfg, actor_path, model_path, tokenizer.pad_token_id,
                                    plan.save_train_data, str(run_dir))
            if checkpoint:
                trainer.load_checkpoint(str(checkpoint))
                log.info("Resumed from %s at rollout %d", checkpoint, start)
        weight_check = None
        if engine and cfg.debug.check_weight_update_equal:
            weight_check = WeightCheck(engine, actor_path, run_dir)
            if trainer:
                weight_check.check_first_sync(engine, trainer)
            if cfg.debug.strict_checks:
                doctor.strict_weights({"checks": weight_check.results})
        metrics = MetricsLogger(run_dir, cfg.logger, resume_from=start)

        bar = tqdm(plan.rollout_ids, desc="rollouts", unit="rollout")
        for rollout_id in bar:
            t0 = time.perf_counter()
            if plan.replays:
                _, samples = load_rollout(
                    plan.replay_files[rollout_id], manifest, cfg.debug.allow_manifest_mismatch,
                    cfg.debug.load_rollout_data_subsample, cfg.seed)
            else:
                samples = generate_rollout(engine, task, tokenizer, cfg.rollout, rollout_id, cfg.seed)
            record = {"rollout_id": rollout_id, **rollout_stats(
                samples, time.perf_counter() - t0, tokenizer, cfg.task.answer_format)}
            if plan.save_rollout_data:
                save_rollout(fill(plan.save_rollout_data, rollout_id), rollout_id, samples, manifest)
            log_finish_rollout(rollout_id, samples)

            if trainer:
                t0 = time.perf_counter()
                if engine and cfg.rollout.colocate:
                    engine.release_memory_occupation()
                out = trainer.train(rollout_id, samples)
                if engine:
                    if cfg.rollout.colocate:
                        engine.resume_memory_occupation()
                    weights = trainer.named_weights()
                    engine.update_weights(weights)
                    if weight_check and cfg.debug.check_weight_update_every_sync:
                        weight_check.check_sync(engine, weights, rollout_id)
                record.update(out["rollout"], **{"perf/train_time": time.perf_counter() - t0})
                for step, step_metrics in enumerate(out["steps"]):
                    metrics.log({"rollout_id": rollout_id, "step": step, **step_metrics}, "rollout_id")
                if cfg.debug.strict_checks and rollout_id == plan.rollout_ids[0]:
                    doctor.strict_first_step(record, out["steps"], cfg, [s.prompt for s in samples],
                                             tokenizer)
                if rollout_id == plan.rollout_ids[0]:
                    torch.save(out["first_step_log_probs"], run_dir / "first_step_log_probs.pt")
                interval = cfg.checkpoint.save_interval
                if interval and ((rollout_id + 1) % interval == 0 or rollout_id == plan.rollout_ids[-1]):
                    save_checkpoint(trainer, tokenizer, run_dir, rollout_id, model_path,
                                    cfg.checkpoint.keep_last)
            metrics.log(record, "rollout_id")
            bar.set_postfix(reward=f"{record['rollout/raw_reward']:.3f}")
    finally:  # trainer ranks first: SGLang's shutdown kills the driver's child processes
        if metrics:
            metrics.close()
        if trainer:
            trainer.shutdown()
        if engine:
            engine.shutdown()
    plot_run(run_dir)


def run_job(cfg) -> None:
    """One Hydra job: run the loop, record its status; user errors exit with a clear message."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    torch.set_num_threads(cfg.train.num_threads)
    status = run_dir / "status.json"
    write_json(status, {"status": "running"})
    try:
        with logging_redirect_tqdm():
            rl_loop(cfg, run_dir)
    except (ConfigError, ReplayError, CheckFailed) as e:
        write_json(status, {"status": "failed", "error": str(e)})
        if hydra_cfg.mode == RunMode.MULTIRUN:
            raise  # Hydra records the failed job and the sweep goes on
        log.error("%s", e)
        sys.exit(2)
    except BaseException as e:
        write_json(status, {"status": "failed", "error": f"{type(e).__name__}: {e}"})
        raise
    write_json(status, {"status": "completed"})
