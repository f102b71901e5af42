"""The RL loop: build what the config asks for, then rollout -> train -> sync, then close."""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from collections import Counter
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm.contrib.logging import logging_redirect_tqdm

from relax import faults
from relax.checkpoint import adapter_only, save_checkpoint, scan
from relax.cluster import open_cluster
from relax.debug import strict, sync_check
from relax.debug.health import SAMPLES_FILE, response_health, sample_record
from relax.debug.weights import WeightCheck
from relax.errors import (CheckFailed, ConfigError, DiskFull, Interrupted, NonFiniteError, ReplayError,
                          RolloutError)
from relax.files import append_jsonl, atomic_save, fill
from relax.logger import lose_log_lines_on_a_full_disk, plot_run
from relax.logger.progress import Progress
from relax.logger.summary import log_summary
from relax.model import read_hf_config
from relax.process import Job, LogGuard, Stop, close_on_exit
from relax.replay import keep_groups, load_rollout, save_ahead, save_rollout
from relax.rollout import engine_dtype
from relax.rollout.partial import InFlight, generation_lag
from relax.rollout.prefetch import Rollouts, max_staleness
from relax.rollout.spec import EngineSpec
from relax.sample import Sample
from relax.startup import Run, prepare
from relax.targets import instantiate
from relax.task import check_rewards
from relax.train import check_train_keys, checkpoint_layout, layer_dump
from relax.train.spec import TrainerSpec

log = logging.getLogger("relax")


def zero_std_ratio(samples: list[Sample]) -> float:
    """The share of prompts whose samples all got the same reward: under a group baseline (GRPO,
    reinforce) their advantages are 0 and they add no gradient (TRL: frac_reward_zero_std)."""
    rewards: dict[int, set[float]] = {}
    for s in samples:
        rewards.setdefault(s.group_index, set()).add(s.reward)
    return sum(len(r) == 1 for r in rewards.values()) / len(rewards)


def rollout_stats(samples: list[Sample], seconds: float, tokenizer, answer_format) -> dict:
    n_tokens = sum(s.response_length for s in samples)
    model_lp = [lp for s in samples for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m]  # not a tool's
    return {
        **response_health(samples, tokenizer, answer_format),
        "rollout/raw_reward": sum(s.reward for s in samples) / len(samples),
        "rollout/zero_std_ratio": zero_std_ratio(samples),
        "rollout/response_len": n_tokens / len(samples),
        "rollout/truncated_ratio": sum(s.status == "truncated" for s in samples) / len(samples),
        "rollout/rollout_log_probs": sum(model_lp) / max(len(model_lp), 1),
        "perf/rollout_time": seconds,
        "perf/tokens_per_s": n_tokens / max(seconds, 1e-9),
    }


def log_finish_rollout(run: Run, rollout_id: int, samples: list[Sample]) -> None:
    """The rollout's example sample: a `Finish rollout` line for people, a samples.jsonl line
    for `relax doctor`."""
    s = sample_record(rollout_id, samples, run.tokenizer, run.cfg.task.answer_format)
    log.info("Finish rollout %d: %d samples, mean reward %.3f | prompt=%r response=%r reward=%g",
             rollout_id, s["num_samples"], s["mean_reward"], s["prompt"], s["response"], s["reward"])
    append_jsonl(run.dir / SAMPLES_FILE, s)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2))


def build(run: Run, cluster, parts: ExitStack):
    """The engines and/or trainer the plan asks for, where the cluster puts them (and the
    engine-weights check); `parts` shuts them down at the end, also when a later step fails."""
    cfg, plan, weight_check = run.cfg, run.plan, None
    built = {**plan.built(cfg.rollout, cfg.train, cfg.parallel), "cluster": cfg.cluster._target_,
             "model_path": str(run.model_path),  # (relax compare: the same model?)
             "model_fingerprint": run.manifest["model_fingerprint"]}
    log.info("Building %s", ", ".join(f"{k}={v}" for k, v in built.items() if v is not None))
    write_json(run.dir / "built.json", built)
    engine, trainer = cluster.build(
        EngineSpec.of(cfg.rollout, cfg.model, cfg.seed, run.actor_path, [run.tokenizer.eos_token_id],
                      run.tokenizer.pad_token_id) if plan.builds_rollout else None,
        TrainerSpec.of(cfg.model, cfg.rollout, cfg.debug, cfg.seed, run.actor_path, run.model_path,
                       run.tokenizer.pad_token_id, plan) if plan.builds_train else None)
    close_on_exit(parts, engine, "shutdown")  # (closed after the trainer: last in, first out)
    close_on_exit(parts, trainer, "shutdown")
    write_json(run.dir / "built.json", {**built, "placement": cluster.placement()})
    merged = None
    if trainer and run.checkpoint:
        trainer.load_checkpoint(str(run.checkpoint))
        log.info("Resumed from %s at rollout %d", run.checkpoint, run.start)
        if engine and adapter_only(run.checkpoint):  # the engine loaded the base: base + adapter in
            merged = trainer.named_weights()
            engine.update_weights(merged)
    if engine and cfg.debug.check_weight_update_equal:
        weight_check = WeightCheck(engine, run.actor_path, run.dir, merged)
        if trainer:
            weight_check.check_first_sync(engine, trainer, cfg.rollout.weight_update_mode == "distributed")
        if cfg.debug.strict_checks:
            strict.strict_weights({"checks": weight_check.results})
    return engine, trainer, weight_check


def make_rollout(run: Run, engine, in_flight: InFlight, rollout_id: int,
                 policy_version: int) -> tuple[list[Sample], dict]:
    """Evaluate if due, then generate and score (or replay) one rollout (with train.max_staleness,
    in a background thread: evaluation then sees the weights that generate). `policy_version`: how
    many rollouts the engine's weights have been trained on; `in_flight`: what partial rollouts
    carry from one to the next. Returns the samples and the rollout's metrics beyond
    rollout_stats (generation rounds, eval/*, perf/eval_time)."""
    cfg = run.cfg
    if run.plan.replays:
        source = run.plan.replay_files[rollout_id]
        _, samples = load_rollout(source, run.manifest, cfg.debug.allow_manifest_mismatch,
                                  cfg.debug.load_rollout_data_subsample, cfg.seed)
        check_rewards(samples, f"the replay file {source}")
        return samples, {}
    evals = {}
    if run.evaluator and run.evaluator.due(rollout_id):
        evals = run.evaluator.evaluate(engine, rollout_id)  # with perf/eval_time
    if cfg.rollout.partial:
        samples, stats, left = engine.generate_partial_rollout(
            run.task, run.tokenizer, cfg.rollout, rollout_id, cfg.seed, policy_version,
            in_flight.before(rollout_id), max_staleness(cfg.train))
        in_flight.put(rollout_id, left)
    else:
        samples, stats = engine.generate_rollout(run.task, run.tokenizer, cfg.rollout, rollout_id, cfg.seed)
    for s in samples:
        s.metadata.setdefault("policy_version", policy_version)
        if s.token_versions is None:
            s.token_versions = [policy_version] * s.response_length
    return samples, {**stats, **evals}


def rollout(run: Run, rollouts: Rollouts, rollout_id: int) -> tuple[list[Sample], dict]:
    """One rollout's samples (made now, prefetched or replayed); save them if asked; log
    `Finish rollout`. rollout/staleness: how many rollouts the trainer is ahead of the policy
    that generated the oldest of their tokens (at most train.max_staleness)."""
    (samples, stats), seconds, policy_version = rollouts.get(rollout_id)
    seconds -= stats.get("perf/eval_time", 0.0)
    record = {"rollout_id": rollout_id, **rollout_stats(samples, seconds, run.tokenizer,
                                                        run.cfg.task.answer_format), **stats}
    versions = [v for s in samples for v in s.token_versions or ()]  # (replay data before format 3: none)
    if not run.plan.replays:  # the oldest token's: a partial rollout's carried responses are older
        record["rollout/staleness"] = rollout_id - min(versions, default=policy_version)
    if versions:  # per token: the mean and each staleness's share (a histogram); per sample: the mean
        record["rollout/token_staleness_mean"] = rollout_id - sum(versions) / len(versions)
        for v, count in sorted(Counter(versions).items()):
            record[f"rollout/token_share_at_staleness_{rollout_id - v}"] = count / len(versions)
        begun = [min(s.token_versions) for s in samples if s.token_versions]
        record["rollout/sample_staleness_mean"] = rollout_id - sum(begun) / len(begun)
    if run.plan.save_rollout_data:
        save_rollout(fill(run.plan.save_rollout_data, rollout_id), rollout_id, samples, run.manifest)
    log_finish_rollout(run, rollout_id, samples)
    return samples, record


def dump_layers(run: Run, trainer, engine, rollout_id: int, samples: list[Sample]) -> None:
    """debug.dump_layers: the trainer's view of the dumped samples before the rollout's first
    step, and the engine's of the same sequences (relax/debug/layers.py)."""
    cfg, indices = run.cfg, list(run.cfg.debug.dump_layers_samples)
    manifest = {"model_fingerprint": run.manifest["model_fingerprint"], "layout": cfg.parallel.name,
                "noise_ulp": cfg.parallel.noise_ulp}
    trainer.dump_layers(run.plan.dump_layers, rollout_id, samples, indices,
                        {**manifest, "backend": cfg.train._target_, "dtype": cfg.model.dtype})
    if engine:
        chosen = [samples[i] for i in indices]
        forward = engine.record_layers([s.tokens for s in chosen]) if run.plan.engine_records_layers else {}
        generated = [torch.tensor([lp for lp, m in zip(s.rollout_log_probs, s.loss_mask, strict=True) if m])
                     for s in chosen]
        layer_dump.save_dump(run.plan.dump_layers, rollout_id, "engine",
                             {**manifest, "backend": cfg.rollout._target_,
                              "dtype": engine_dtype(cfg.rollout, cfg.model)},
                             indices, forward, generated)


def train(run: Run, trainer, engine, rollout_id: int, samples: list[Sample]) -> dict:
    """The trainer's step(s) on one rollout; a colocated engine gives up its memory meanwhile."""
    colocated = engine is not None and run.cfg.rollout.colocate
    if colocated:
        engine.release_memory_occupation()
    out = trainer.train(rollout_id, samples)
    if colocated:
        engine.resume_memory_occupation()
    return out


def report_nonfinite(run: Run, rollout_id: int, samples: list[Sample], events: list[dict]) -> None:
    """train.on_nonfinite: the trainer skipped these steps; their offending micro-batches'
    GRPO groups go to <run dir>/nonfinite/<rollout_id>.pt as replay data. `error` stops."""
    if not events:
        return
    path = run.dir / "nonfinite" / f"{rollout_id}.pt"
    groups = {samples[i].group_index for e in events for i in e["indices"]}
    save_rollout(path, rollout_id, keep_groups(samples, groups), run.manifest)
    what = "; ".join(f"step {e['step']}: loss {e['loss']:.4g}, grad_norm {e['grad_norm']:.4g}, samples "
                     f"{e['indices'][:8]}{' ...' if len(e['indices']) > 8 else ''}" for e in events)
    message = (f"rollout {rollout_id}: non-finite training step ({what}); the step was not applied. Their "
               f"groups are in {path}: replay with relax debug=train_only debug.load_rollout_data={path}")
    if run.cfg.train.on_nonfinite == "error":
        raise NonFiniteError(message + " (train.on_nonfinite=skip trains on past such steps)")
    log.warning("%s", message)


def sync_weights(run: Run, trainer, engine, weight_check, rollout_id: int) -> float:
    """The trainer's weights into the engine; returns the seconds it took (perf/weight_sync_time:
    gathering, merging and pushing, without the checks: the always-on one, relax/debug/sync_check.py)."""
    t0 = time.perf_counter()
    partial = run.plan.partial_sync  # what training changed (with LoRA: the merged projections)
    weights = None
    if run.cfg.rollout.weight_update_mode == "distributed":  # NCCL, trainer -> engine directly
        engine.update_weights_from_trainer(trainer)
    else:
        weights = trainer.synced_weights() if partial else trainer.named_weights()
        engine.update_weights(weights)
    seconds = time.perf_counter() - t0
    if run.cfg.debug.check_weight_sync:  # on by default: did it land?
        sync_check.after_sync(engine, trainer, weights, rollout_id)
    if weight_check and run.cfg.debug.check_weight_update_every_sync:  # the engine against the whole model
        weight_check.check_sync(engine, trainer.named_weights() if partial or weights is None else weights,
                                rollout_id)
    return seconds


def first_step(run: Run, rollout_id: int, samples, record: dict, out: dict) -> None:
    """The run's first training step: its per-token log-probs (for layout comparisons) and the
    guide's checks (relax/debug/strict.py): with debug.strict_checks a FAIL stops the run, without
    it garbage or a train-vs-rollout mismatch is a warning. A resumed run's first step is not the run's."""
    if rollout_id != run.plan.rollout_ids[0] or run.checkpoint:
        return
    atomic_save(out["first_step_log_probs"], run.dir / "first_step_log_probs.pt")
    cfg = run.cfg
    found = strict.first_step_run(record, out["steps"], cfg.train, cfg.algo, cfg.rollout,
                                  [s.prompt for s in samples], run.tokenizer,
                                  read_hf_config(run.model_path)["vocab_size"])
    strict.judge_first_step(found, cfg.debug.strict_checks, run.dir)


def checkpoint_on_schedule(run: Run, trainer, rollouts: Rollouts, in_flight: InFlight, rollout_id: int,
                           stopping: bool) -> None:
    """Every checkpoint.save_interval rollouts, at the last one and when the run is stopping,
    after the rollout's metrics are written (a checkpoint carries the run's history up to it),
    with the rollouts made ahead on older weights than its own (train.max_staleness) and what
    partial rollouts left in flight."""
    cfg = run.cfg
    interval = cfg.checkpoint.save_interval
    def keep_ahead(folder):
        ahead = rollouts.ahead()
        save_ahead(folder, ahead, in_flight.kept(max(ahead, default=rollout_id)), run.manifest)

    if interval and ((rollout_id + 1) % interval == 0 or rollout_id == run.plan.rollout_ids[-1] or stopping):
        save_checkpoint(trainer, run.tokenizer, run.dir, rollout_id, run.model_path, cfg.checkpoint.keep_last,
                        checkpoint_layout(cfg.train, cfg.parallel), (cfg, run.overrides), keep_ahead)


def rl_loop(cfg, run_dir: Path, stop: Stop | None = None, accept=lambda: None) -> None:
    """`stop`: the SIGINT/SIGTERM handler run_job installs (checked between rollouts); `accept`:
    called once the start-up checks passed (prepare)."""
    stop, log_setup = stop or Stop(), LogGuard()
    run = prepare(cfg, run_dir, accept)
    with ExitStack() as parts:  # closed last in, first out: each even when one before it raises
        cluster = open_cluster(cfg.cluster, cfg.rollout, cfg.train, cfg.algo, cfg.parallel, run_dir)
        close_on_exit(parts, cluster, "close")
        engine, trainer, weight_check = build(run, cluster, parts)
        metrics = close_on_exit(parts, instantiate(cfg.logger, "logger", run_dir=run_dir,
                                                   resume_from=run.start,
                                                   run_config=OmegaConf.to_container(cfg, resolve=True)),
                                "close")
        log_setup.restore()  # an engine or library that reconfigured logging keeps relax.log
        stop.install()  # ... and Relax's signal handlers
        stop.check("before the first rollout")  # (a signal while building)
        in_flight = InFlight(run.in_flight)
        rollouts = close_on_exit(parts, Rollouts(partial(make_rollout, run, engine, in_flight), run.plan.rollout_ids,
                                                 generation_lag(cfg.train, cfg.rollout), run.ahead), "close")
        progress = close_on_exit(parts, Progress(len(run.plan.rollout_ids)), "close")
        for rollout_id in run.plan.rollout_ids:
            samples, record = rollout(run, rollouts, rollout_id)
            if trainer:
                t0 = time.perf_counter()
                if rollout_id in run.plan.dump_layers_rollouts:
                    dump_layers(run, trainer, engine, rollout_id, samples)
                out = train(run, trainer, engine, rollout_id, samples)
                if engine:
                    rollouts.wait()  # rollouts made ahead end on the weights they began with
                    seconds = sync_weights(run, trainer, engine, weight_check, rollout_id)
                    record["perf/weight_sync_time"] = seconds
                    rollouts.synced(rollout_id)  # ... and those pinned to the new weights start
                record.update(out["rollout"], **{"perf/train_time": time.perf_counter() - t0})
                first_step(run, rollout_id, samples, record, out)
                for step, step_metrics in enumerate(out["steps"]):
                    metrics.log({"rollout_id": rollout_id, "step": step, **step_metrics}, "rollout_id")
                report_nonfinite(run, rollout_id, samples, out["nonfinite"])
            metrics.log(record, "rollout_id")
            faults.point("metrics_written")
            stopping = stop.requested  # one look: a signal after it stops after the next rollout
            if trainer:
                in_flight.trained(rollout_id)
                checkpoint_on_schedule(run, trainer, rollouts, in_flight, rollout_id, stopping)
            progress.update(rollout_id, record["rollout/raw_reward"])
            if stopping:
                stop.check(f"after rollout {rollout_id}")
    log_summary(run_dir, run.plan.mode, run.plan.dump_dir, run.plan.save_rollout_data, plot_run(run_dir))


def resume_hint(run_dir: Path) -> str:
    complete = scan(run_dir)[0]
    if not complete:
        return "no checkpoint was written"
    return f"newest checkpoint {complete[-1].name}: continue with resume={run_dir}"


def run_job(cfg) -> None:
    """One Hydra job: run the loop, record its status (pid and host with it), writing into its
    run dir only once accepted (relax.process.Job); user errors (exit 2; in a sweep, one line
    each) and SIGINT/SIGTERM stops (exit 128 + signal) end with a message, not a traceback."""
    job = Job(cfg)
    lose_log_lines_on_a_full_disk()  # (not logging's traceback for every line)
    try:
        with Stop() as stop, logging_redirect_tqdm():
            job.status.check()  # refuses a run dir that a live run is writing
            check_train_keys(cfg.train)  # (train.num_threads, for the start-up too: it may build a model)
            torch.set_num_threads(cfg.train.num_threads)
            rl_loop(cfg, job.run_dir, stop, job.accept)
    except (Interrupted, KeyboardInterrupt) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        what = str(e) if isinstance(e, Interrupted) else "aborted: the rollout in progress is lost"
        message = f"{what}; {resume_hint(job.run_dir)}"
        job.end("interrupted", error=message)
        log.warning("%s", message)
        sys.exit(128 + signum)
    except (ConfigError, ReplayError, CheckFailed, DiskFull, NonFiniteError, RolloutError) as e:
        job.user_error(e)
    except BaseException as e:
        job.end("failed", error=f"{type(e).__name__}: {e}")
        raise
    else:
        job.end("completed")
