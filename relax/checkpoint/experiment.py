"""A resumed run is the same experiment: it composes the run's own config, and may change only
what keeps the experiment.

Every checkpoint holds the run's config (`config.yaml`, as Hydra composed it, unresolved) and
the command-line overrides it was composed from (`overrides.yaml`). `relax resume=<run or
checkpoint>` puts those overrides before the new command line (relax/cli.py), so Hydra
composes the run's config again and the new overrides apply on top; `check_same_experiment`
then compares the result with the saved config, logs every change, and refuses the changes
that would make another experiment unless `resume_allow_changes` names them.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import OmegaConf

from relax.errors import ConfigError

log = logging.getLogger(__name__)
CONFIG, OVERRIDES = "config.yaml", "overrides.yaml"  # in a checkpoint, and in a run's .hydra/
# Keys (and groups, as prefixes) a resume may change freely: how long, where and how observed
# the run is, not what it computes.
KEEPS_EXPERIMENT = (
    "rollout.num_rollout", "debug", "logger", "eval", "checkpoint", "cluster", "parallel",
    "train.num_threads", "train.on_nonfinite", "model.cache_dir",
    "rollout.rollout_num_gpus", "rollout.rollout_num_gpus_per_engine", "rollout.num_engines",
    "rollout.weight_update_mode", "rollout.weight_update_bucket_mb", "rollout.colocate",
    "rollout.mem_fraction_static", "rollout.max_total_tokens", "task.reward_batch_size",
    "task.reward_timeout_s", "task.reward_retries")
# Never changed on resume: the checkpoint's weights are the actor and the run's model its
# reference, whatever these say.
FIXED_BY_CHECKPOINT = ("model.name", "model.path", "model.tiny", "model.package", "model.gguf_file",
                       "model.model_sha256")
NOT_CARRIED = ("resume", "resume_allow_changes")  # a resume's own choices, not the run's


def override_key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def _under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def save_experiment(folder: Path, cfg, overrides: list[str]) -> None:
    """The run's config and overrides into a checkpoint being written (`folder`)."""
    (Path(folder) / CONFIG).write_text(OmegaConf.to_yaml(cfg))
    (Path(folder) / OVERRIDES).write_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))))


def saved_in(folder: Path) -> Path | None:
    """Where a run or checkpoint folder keeps its config and overrides: a checkpoint itself, or
    a run's newest `.hydra/` (`.hydra/restart_<n>` after resumes into the run's own dir)."""
    folder = Path(folder)
    if (folder / CONFIG).is_file():
        return folder
    hydra = folder / ".hydra"
    restarts = sorted((p for p in hydra.glob("restart_*") if p.name[8:].isdigit()), key=lambda p: int(p.name[8:]))
    for candidate in [*reversed(restarts), hydra]:
        if (candidate / CONFIG).is_file():
            return candidate
    return None


def _read(path: Path):
    try:
        return OmegaConf.load(path)
    except Exception as e:  # a YAML error, or a file that is not one
        raise ConfigError(f"resume: {path}: not a Relax config ({type(e).__name__}: {e})") from None


def run_overrides(experiment: Path | None) -> list[str]:
    """The overrides the run was composed from, without its own resume choices ([] if none
    were saved: the run ran the defaults, or predates saved overrides)."""
    if experiment is None or not (experiment / OVERRIDES).is_file():
        return []
    saved = _read(experiment / OVERRIDES)
    if not OmegaConf.is_list(saved) or not all(isinstance(o, str) for o in saved):
        raise ConfigError(f"resume: {experiment / OVERRIDES}: expected a list of overrides")
    return [o for o in saved if override_key(o) not in NOT_CARRIED]


def resume_argv(overrides: list[str], experiment: Path | None) -> list[str]:
    """The command line a resume composes: the run's overrides, then the new ones (which win)."""
    given = {override_key(o) for o in overrides}
    return [o for o in run_overrides(experiment) if override_key(o) not in given] + overrides


def _flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def changes(old_cfg, new_cfg) -> dict[str, tuple]:
    """key -> (the run's value, this run's value) for every leaf that differs (keys only one
    side has are left out: a schema that gained or lost a key between Relax versions)."""
    old = _flat(OmegaConf.to_container(old_cfg, resolve=False))
    new = _flat(OmegaConf.to_container(new_cfg, resolve=False))
    return {k: (old[k], new[k]) for k in new if k in old and old[k] != new[k]}


def check_same_experiment(cfg, experiment: Path | None) -> None:
    """Log this resume's changes from the run (`experiment`: where its config is saved) and
    refuse those that would make another experiment, unless resume_allow_changes names them."""
    if experiment is None:
        log.warning("resume: the run saved no config (%s): this run's config cannot be compared "
                    "with the run's", CONFIG)
        return
    diff = {k: v for k, v in changes(_read(experiment / CONFIG), cfg).items() if not _under(k, NOT_CARRIED)}
    log.info("resume: changes from the run: %s", len(diff) or "none")
    for key, (old, new) in diff.items():
        log.info("resume: %s=%s (the run: %s)", key, new, old)
    allowed = list(cfg.resume_allow_changes)
    fixed = [k for k in diff if _under(k, FIXED_BY_CHECKPOINT)]
    if fixed:
        key, (old, new) = fixed[0], diff[fixed[0]]
        raise ConfigError(f"resume: {key}={new} differs from the run's {old} ({experiment / CONFIG}): a resumed "
                          f"run trains its checkpoint's weights against its run's reference model, so "
                          f"{key} cannot change; start a new run for another model")
    refused = [k for k in diff if not _under(k, KEEPS_EXPERIMENT) and not _under(k, allowed)]
    if refused:
        what = ", ".join(f"{k}={diff[k][1]} (the run: {diff[k][0]})" for k in refused)
        raise ConfigError(f"resume: {what} would make another experiment than the run "
                          f"({experiment / CONFIG}); resume with the run's values, or change them "
                          f"knowingly with resume_allow_changes=[{','.join(refused)}]")
