"""What a run builds and saves: the one place that interprets the `debug.*` keys (conf/debug/).

`resolve(cfg)` validates and derives, before anything expensive starts:
  load_rollout_data => train_only;  dump_details => both save templates (+ tokenizer, config);
  conflicting keys, or a trainer layout the model cannot be split into => ConfigError naming them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from relax.errors import ConfigError


@dataclass
class Plan:
    builds_rollout: bool
    builds_train: bool
    rollout_ids: list[int]
    save_rollout_data: str | None = None
    load_rollout_data: str | None = None
    save_train_data: str | None = None
    dump_dir: Path | None = None
    replay_files: dict[int, Path] = field(default_factory=dict)

    @property
    def replays(self) -> bool:
        return self.load_rollout_data is not None

    @property
    def mode(self) -> str:
        if not self.builds_train:
            return "rollout_only"
        return "train_only" if not self.builds_rollout else "full"

    def built(self, cfg) -> dict:
        """Which subsystems this run builds (logged and written to built.json)."""
        return {
            "mode": self.mode,
            "rollout_engine": cfg.rollout._target_ if self.builds_rollout else None,
            "trainer": cfg.train._target_ if self.builds_train else None,
            "parallel": cfg.parallel.name if self.builds_train else None,
            "world_size": cfg.parallel.world_size if self.builds_train else None,
            "replay_from": self.load_rollout_data,
            "save_rollout_data": self.save_rollout_data,
            "save_train_data": self.save_train_data,
            "dump_dir": str(self.dump_dir) if self.dump_dir else None,
        }


def _abs_template(template: str | None) -> str | None:
    # Relative paths are relative to the launch directory (Hydra does not chdir).
    return None if template is None else os.path.abspath(os.path.expanduser(template))


def resolve(cfg, start_rollout_id: int = 0, hf_config: dict | None = None) -> Plan:
    """The run's plan, or a ConfigError. `hf_config`: the config.json of the model the trainer
    will load (a resumed run's); by default the one `cfg.model` names."""
    d, r = cfg.debug, cfg.rollout
    load = _abs_template(d.load_rollout_data)
    train_only = d.train_only or load is not None
    if d.rollout_only and train_only:
        why = "debug.load_rollout_data" if load and not d.train_only else "debug.train_only"
        raise ConfigError(f"debug.rollout_only conflicts with {why}: a rollout-only run builds "
                          f"no trainer, a train-only run no rollout engine")
    if train_only and load is None:
        raise ConfigError("debug.train_only needs debug.load_rollout_data=<path template>: "
                          "a train-only run replays saved rollouts")
    if cfg.train["async"]:
        from relax.rollout.prefetch import check_async

        check_async(cfg, builds_rollout=not train_only, builds_train=not d.rollout_only)
    if r.rollout_num_gpus < 1 or r.rollout_num_gpus_per_engine < 1 or \
            r.rollout_num_gpus % r.rollout_num_gpus_per_engine:
        raise ConfigError(f"rollout.rollout_num_gpus={r.rollout_num_gpus} must be a positive "
                          f"multiple of rollout.rollout_num_gpus_per_engine="
                          f"{r.rollout_num_gpus_per_engine}")

    dump_dir = Path(_abs_template(d.dump_details)) if d.dump_details else None
    save_rollout = _abs_template(d.save_rollout_data) or (
        str(dump_dir / "rollout_data" / "{rollout_id}.pt") if dump_dir else None)
    save_train = _abs_template(d.save_train_data) or (
        str(dump_dir / "train_data" / "{rollout_id}_{rank}.pt") if dump_dir and not d.rollout_only
        else None)
    if d.rollout_only and d.save_train_data:
        raise ConfigError("debug.save_train_data is set but debug.rollout_only builds no trainer")

    builds_train = not d.rollout_only
    if load:
        from relax.replay import discover_rollout_ids

        replay_files = {i: p for i, p in discover_rollout_ids(load).items()
                        if start_rollout_id <= i < r.num_rollout}
        if not replay_files:
            raise ConfigError(f"debug.load_rollout_data={d.load_rollout_data!r}: no files match "
                              f"for rollout ids {start_rollout_id}..{r.num_rollout - 1}")
        rollout_ids = list(replay_files)
    else:
        replay_files = {}
        rollout_ids = list(range(start_rollout_id, r.num_rollout))

    if save_rollout and "{rollout_id}" not in save_rollout and len(rollout_ids) > 1:
        raise ConfigError(f"debug.save_rollout_data={save_rollout!r} has no {{rollout_id}} but "
                          f"{len(rollout_ids)} rollouts would overwrite one file")
    if save_train and "{rollout_id}" not in save_train and len(rollout_ids) > 1:
        raise ConfigError(f"debug.save_train_data={save_train!r} has no {{rollout_id}} but "
                          f"{len(rollout_ids)} rollouts would overwrite one file")
    if save_train and builds_train and "{rank}" not in save_train and cfg.parallel.dp > 1:
        raise ConfigError(f"debug.save_train_data={save_train!r} has no {{rank}} but "
                          f"{cfg.parallel.dp} data-parallel ranks would overwrite each other")
    if load and save_rollout and load == save_rollout:
        raise ConfigError(f"debug.save_rollout_data and debug.load_rollout_data both point at "
                          f"{load!r}: the replay would overwrite its own input")
    if builds_train:
        from relax.model import model_config
        from relax.train import check_trainer

        check_trainer(cfg, hf_config or model_config(cfg.model))
    if not train_only:
        from relax.rollout import check_engine

        check_engine(cfg)
    return Plan(builds_rollout=not train_only, builds_train=builds_train,
                rollout_ids=rollout_ids, save_rollout_data=save_rollout,
                load_rollout_data=load, save_train_data=save_train if builds_train else None,
                dump_dir=dump_dir, replay_files=replay_files)
