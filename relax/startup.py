"""Start-up: everything a run checks and resolves before anything expensive is built, in one
order (`prepare`, which calls relax/debug/plan.py's `resolve` for the debug keys and the checks
of each subsystem), then the first writes into the run dir. docs/architecture.md lists the order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from relax.checkpoint import (adapter_only, check_config, check_layout, check_run_dir, experiment_of,
                              find_checkpoint, read_state, reference_model, restore_history, resumed_run)
from relax.checkpoint.experiment import check_same_experiment
from relax.cluster import check_cluster
from relax.debug.plan import Plan, check_dump_samples, check_dumps, resolve
from relax.errors import ConfigError
from relax.eval import Evaluator, build_evaluator
from relax.logger import check_backends
from relax.model import load_tokenizer, read_hf_config, resolve_model_path
from relax.replay import build_manifest, check_replay_files, load_ahead, load_in_flight
from relax.targets import load_target
from relax.task import Task, build_task
from relax.train import check_batch_split, checkpoint_layout

log = logging.getLogger("relax")


@dataclass
class Run:
    """What one run is made of, resolved before anything is built."""
    cfg: DictConfig
    dir: Path
    plan: Plan
    start: int                  # first rollout_id (after a resumed checkpoint)
    checkpoint: Path | None     # resumed from
    model_path: Path            # the reference model (and the actor, unless resumed)
    actor_path: Path
    tokenizer: object
    manifest: dict              # what replay data records about this run
    task: Task | None
    evaluator: Evaluator | None  # the eval section (relax/eval/)
    overrides: list[str]        # the command line the config was composed from (checkpoints keep it)
    ahead: dict                 # rollouts the resumed checkpoint made ahead of training (prefetch.Rollouts)
    in_flight: dict             # ... and the responses its partial rollouts left in flight (partial.InFlight)


def prepare(cfg, run_dir: Path, accept=lambda: None) -> Run:
    """Validate and resolve (plan, model, tokenizer, data) before anything expensive is built;
    nothing in the run dir changes until all of it passed and `accept()` (run_job: the job takes
    the run dir) returned."""
    check_config(cfg.checkpoint)
    checkpoint = find_checkpoint(cfg.resume, run_dir.parent)
    source = resumed_run(cfg.resume, checkpoint)
    check_run_dir(run_dir, source)
    if cfg.resume:
        check_same_experiment(cfg, experiment_of(checkpoint, source))
    saved = read_state(checkpoint) if checkpoint else None
    start = saved["rollout_id"] + 1 if saved else 0
    ref_model = reference_model(checkpoint, saved) if saved else None
    plan = resolve(cfg, start, read_hf_config(ref_model) if saved else None, run_dir)
    if saved and adapter_only(checkpoint) and not plan.builds_train:
        raise ConfigError(f"resume: {checkpoint} holds a LoRA adapter without the merged model, which only "
                          f"a trainer merges, and debug.rollout_only builds none: resume with the trainer, "
                          f"or from a checkpoint saved with train.lora.save_merged=true")
    if saved and plan.builds_train:
        check_layout(checkpoint, saved, checkpoint_layout(cfg.train, cfg.parallel))
    keeps = saved and plan.builds_rollout and plan.builds_train
    ahead, in_flight = (load_ahead(checkpoint), load_in_flight(checkpoint)) if keeps else ({}, {})
    check_dumps(plan, source)
    task = build_task(cfg.task, cfg.seed) if plan.builds_rollout else None
    load_target(cfg.logger, "logger")  # a logger._target_ that does not import stops the run here
    check_backends(cfg.logger.backends)
    model_path = ref_model or resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(model_path)
    manifest = build_manifest(cfg, model_path, tokenizer)
    if task:
        task.check_prompts(tokenizer, read_hf_config(model_path).get("max_position_embeddings"),
                           cfg.rollout.max_new_tokens)
    if plan.replays:
        counts = check_replay_files(plan.replay_files, manifest, cfg.debug.allow_manifest_mismatch,
                                    cfg.debug.load_rollout_data_subsample, cfg.seed, cfg.algo.routing_replay)
        for rollout_id, n in counts.items():
            check_batch_split(cfg.train, cfg.parallel, n, f"the replay file {plan.replay_files[rollout_id]}")
            if rollout_id in plan.dump_layers_rollouts:
                check_dump_samples(cfg.debug, n, f"the replay file {plan.replay_files[rollout_id]}")
    evaluator = build_evaluator(cfg.eval, cfg.rollout, cfg.seed, task, tokenizer, plan)
    check_cluster(cfg.cluster, cfg.rollout, cfg.train)  # a refused cluster leaves the dump dir as it was
    accept()
    if plan.dump_dir:  # with the rollout/train data, enough to reproduce the run
        tokenizer.save_pretrained(plan.dump_dir / "tokenizer")
        (plan.dump_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if source:  # the run's metrics and first-step records as they were at the checkpoint (last:
        restore_history(checkpoint, run_dir)  # a run refused above leaves the run dir untouched)
        if not plan.rollout_ids:
            log.warning("resume: %s is at the run's last rollout (rollout.num_rollout=%d): nothing "
                        "left to run", checkpoint, cfg.rollout.num_rollout)
    # the engine's weights: the checkpoint's, or for a LoRA adapter alone the base, synced in build()
    actor_path = checkpoint / "hf" if checkpoint and not adapter_only(checkpoint) else model_path
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    return Run(cfg, run_dir, plan, start, checkpoint, model_path, actor_path, tokenizer, manifest, task,
               evaluator, overrides, ahead, in_flight)
