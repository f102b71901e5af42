"""What a run builds and saves: the one place that interprets the `debug.*` keys (conf/debug/).

`resolve(cfg, ..., run_dir)` validates and derives, before anything expensive starts:
  load_rollout_data => train_only;  dump_details => both save templates (+ tokenizer, config);
  conflicting keys, or a trainer layout the model cannot be split into => ConfigError naming them.
What a run writes (save_rollout_data, save_train_data, dump_details, dump_layers, profile_dir)
given as a relative path lands in its own run dir, so each job of a sweep gets its own; what it
reads (load_rollout_data) is relative to the launch directory, as on the command line.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from relax.config import check_numbers
from relax.errors import ConfigError
from relax.model import model_config
from relax.replay import discover_rollout_ids
from relax.rollout import check_engine, check_rollout
from relax.rollout.partial import check_partial
from relax.rollout.prefetch import check_staleness
from relax.targets import load_target
from relax.train import check_batch_split, check_parallel_keys, check_train_keys, check_trainer


@dataclass
class Plan:
    builds_rollout: bool
    builds_train: bool
    rollout_ids: list[int]
    save_rollout_data: str | None = None
    load_rollout_data: str | None = None
    save_train_data: str | None = None
    dump_dir: Path | None = None
    dump_layers: str | None = None  # dir of the layer dumps (relax/debug/layers.py)
    dump_layers_rollouts: list[int] = field(default_factory=list)
    profile_dir: str | None = None  # where the trainer's profiles go (relax/train/profile.py)
    profile_rollouts: list[int] = field(default_factory=list)
    replay_files: dict[int, Path] = field(default_factory=dict)
    partial_sync: bool = False  # the trainer class sends what training changed (synced_weights)
    engine_records_layers: bool = False  # the engine class records layer outputs (record_layers)

    @property
    def replays(self) -> bool:
        return self.load_rollout_data is not None

    @property
    def mode(self) -> str:
        if not self.builds_train:
            return "rollout_only"
        return "train_only" if not self.builds_rollout else "full"

    def built(self, rollout, train, parallel) -> dict:
        """Which subsystems this run builds (logged and written to built.json)."""
        return {
            "mode": self.mode,
            "rollout_engine": rollout._target_ if self.builds_rollout else None,
            "trainer": train._target_ if self.builds_train else None,
            "parallel": parallel.name if self.builds_train else None,
            "world_size": parallel.world_size if self.builds_train else None,
            "replay_from": self.load_rollout_data,
            "save_rollout_data": self.save_rollout_data,
            "save_train_data": self.save_train_data,
            "dump_dir": str(self.dump_dir) if self.dump_dir else None,
            "dump_layers": self.dump_layers,
            "profile_dir": self.profile_dir,
        }


def _abs_template(template: str | None, base: Path = Path()) -> str | None:
    """`template` as an absolute path; a relative one relative to `base` (by default the launch
    directory: Hydra does not chdir)."""
    return None if template is None else os.path.abspath(Path(base) / os.path.expanduser(template))


def check_writable(key: str, template: str | None) -> None:
    """The directory a save template writes into (up to its first `{`) can be created and
    written: its nearest existing ancestor is a writable directory. Checked before the run,
    not at its first save; nothing is created here."""
    if template is None:
        return
    prefix = template.split("{")[0]
    folder = Path(prefix) if prefix.endswith("/") else Path(prefix).parent
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}={template!r}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={template!r}: cannot write into {existing} (permission denied)")


DUMP_PARTS = ("config.yaml", "tokenizer", "rollout_data", "train_data", "layers")  # what a dump writes


def check_dumps(plan: Plan, resumed_run: Path | None) -> None:
    """A dump (debug.dump_details), a layer dump (debug.dump_layers), a profile (debug.profile_dir)
    or saved replay data holds one run's files: a second run never writes into it (a resumed run
    continues the dumps of the run it resumes)."""
    built = Path(resumed_run or "") / "built.json"
    resumed = json.loads(built.read_text()) if resumed_run and built.is_file() else {}
    if plan.dump_dir:
        _check_dump("debug.dump_details", plan.dump_dir, resumed.get("dump_dir"),
                    [part for part in DUMP_PARTS if (plan.dump_dir / part).exists()])
    if plan.dump_layers:
        _check_dump("debug.dump_layers", plan.dump_layers, resumed.get("dump_layers"),
                    sorted(p.name for p in Path(plan.dump_layers).glob("*.pt")))
    if plan.profile_dir:
        _check_dump("debug.profile_dir", plan.profile_dir, resumed.get("profile_dir"),
                    sorted(p.name for p in Path(plan.profile_dir).glob("rollout_*_rank*")))
    for key, template in (("save_rollout_data", plan.save_rollout_data), ("save_train_data", plan.save_train_data)):
        found = _saved_files(template, plan.rollout_ids) if template and template != resumed.get(key) else []
        if found:  # (a resume rewrites the rollouts after its checkpoint: its own files)
            raise ConfigError(f"debug.{key}={template!r} would overwrite another run's files "
                              f"({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}): save into a new "
                              f"directory, or delete those files first")


def _saved_files(template: str, rollout_ids: list[int]) -> list[str]:
    """The files a save template names for these rollouts (any rank) that exist: one glob."""
    pattern = re.compile(re.escape(template).replace(re.escape("{rollout_id}"), r"(\d+)")
                         .replace(re.escape("{rank}"), r"\d+"))
    ids = set(rollout_ids)
    return [Path(f).name for f in sorted(glob.glob(glob.escape(template).replace("{rollout_id}", "*")
                                                   .replace("{rank}", "*")))
            if (m := pattern.fullmatch(f)) and (not m.groups() or int(m.group(1)) in ids)]


def _check_dump(key: str, folder, resumed_folder: str | None, found: list[str]) -> None:
    if found and str(folder) != resumed_folder:
        raise ConfigError(f"{key}={str(folder)!r} already holds a dump ({', '.join(found[:3])}"
                          f"{', ...' if len(found) > 3 else ''}): this run's files would mix with another "
                          f"run's. Dump into a new directory, or delete that one first")


def check_replay_ids(template: str, ids: list[int], start_rollout_id: int) -> None:
    """Replayed rollouts run in order without a hole: a missing file in the middle would
    silently skip a rollout (a resumed replay starts at its first rollout)."""
    low = start_rollout_id if start_rollout_id else ids[0]
    missing = sorted(set(range(low, ids[-1] + 1)) - set(ids))
    if missing:
        raise ConfigError(f"debug.load_rollout_data={template!r}: no file for rollout id(s) "
                          f"{missing[:10]}{' ...' if len(missing) > 10 else ''} between {low} and "
                          f"{ids[-1]}; restore them, or set rollout.num_rollout={missing[0]} to stop "
                          f"before the gap")


def check_dump_samples(d, num_samples: int, source: str) -> None:
    """debug.dump_layers_samples are sample indices of a rollout of `num_samples`."""
    beyond = [i for i in d.dump_layers_samples if i >= num_samples]
    if beyond:
        raise ConfigError(f"debug.dump_layers_samples: sample index(es) {beyond} beyond the {num_samples} "
                          f"samples per rollout of {source}")


def check_dump_layers(debug, train, dump_layers: str, rollout_ids: list[int],
                      builds_train: bool) -> list[int]:
    """The rollout ids whose first step debug.dump_layers records (default: the run's first)."""
    d = debug
    if not builds_train:
        raise ConfigError(f"debug.dump_layers={dump_layers!r} records the trainer's first step of a "
                          f"rollout, but debug.rollout_only builds no trainer")
    samples = list(d.dump_layers_samples)
    if not samples or any(not isinstance(i, int) or i < 0 for i in samples) or \
            len(set(samples)) < len(samples):
        raise ConfigError(f"debug.dump_layers_samples={samples}: expected distinct sample indices >= 0")
    if not hasattr(load_target(train, "train"), "dump_layers"):
        raise ConfigError(f"debug.dump_layers: train._target_={train._target_} records no layer dump "
                          f"(train=torch and train=megatron do)")
    wanted = rollout_ids[:1] if d.dump_layers_rollouts is None else list(d.dump_layers_rollouts)
    if not wanted:
        raise ConfigError(f"debug.dump_layers_rollouts={wanted}: expected one or more of this run's rollout "
                          f"ids, or null (its first)")
    return among_rollouts("debug.dump_layers_rollouts", wanted, rollout_ids)


def among_rollouts(key: str, wanted: list[int], rollout_ids: list[int]) -> list[int]:
    """`wanted` (the value of `key`), sorted and distinct, if each is one of the run's rollout ids."""
    outside = sorted(set(wanted) - set(rollout_ids))
    if outside:
        first, last = (rollout_ids[0], rollout_ids[-1]) if rollout_ids else ("-", "-")
        raise ConfigError(f"{key}={wanted}: rollout id(s) {outside} are not among this run's rollouts "
                          f"({first}..{last})")
    return sorted(set(wanted))


def check_profile(debug, train, rollout_ids: list[int], builds_train: bool) -> list[int]:
    """The rollout ids whose train() debug.profile_dir profiles (default: the run's second, whose
    step carries none of the first's one-time work, or its only one)."""
    if not builds_train:
        raise ConfigError("debug.profile_dir profiles the trainer, but debug.rollout_only builds no trainer")
    if not getattr(load_target(train, "train").train, "profiled", False):
        raise ConfigError(f"debug.profile_dir: train._target_={train._target_} is not profiled "
                          f"(decorate its train() with relax.train.profile.profiled, as train=torch and "
                          f"train=megatron do)")
    profile_rollouts = debug.profile_rollouts
    wanted = rollout_ids[1:2] or rollout_ids[:1] if profile_rollouts is None else list(profile_rollouts)
    if not wanted:
        raise ConfigError(f"debug.profile_rollouts={wanted}: expected one or more of this run's rollout ids")
    return among_rollouts("debug.profile_rollouts", wanted, rollout_ids)


def resolve(cfg, start_rollout_id: int = 0, hf_config: dict | None = None, run_dir: Path = Path()) -> Plan:
    """The run's plan, or a ConfigError. `hf_config`: the config.json of the model the trainer
    will load (a resumed run's); by default the one `cfg.model` names. `run_dir`: where relative
    output paths go (by default the launch directory)."""
    d, r = cfg.debug, cfg.rollout

    check_numbers(cfg)
    check_rollout(r)
    check_train_keys(cfg.train)  # (train.num_threads: every process's threads, a trainer's or not)
    check_parallel_keys(cfg.parallel)
    fraction = d.load_rollout_data_subsample
    if fraction is not None and not 0 < fraction <= 1:
        raise ConfigError(f"debug.load_rollout_data_subsample={fraction}: expected a fraction of the "
                          f"GRPO groups in (0, 1]")
    load = _abs_template(d.load_rollout_data)
    train_only = d.train_only or load is not None
    if d.rollout_only and train_only:
        why = "debug.load_rollout_data" if load and not d.train_only else "debug.train_only"
        raise ConfigError(f"debug.rollout_only conflicts with {why}: a rollout-only run builds "
                          f"no trainer, a train-only run no rollout engine")
    if train_only and load is None:
        raise ConfigError("debug.train_only needs debug.load_rollout_data=<path template>: "
                          "a train-only run replays saved rollouts")
    check_staleness(cfg.train, r, builds_rollout=not train_only, builds_train=not d.rollout_only)
    check_partial(r, cfg.train, builds_rollout=not train_only)

    dump_dir = Path(_abs_template(d.dump_details, run_dir)) if d.dump_details else None
    save_rollout = _abs_template(d.save_rollout_data, run_dir) or (
        str(dump_dir / "rollout_data" / "{rollout_id}.pt") if dump_dir else None)
    save_train = _abs_template(d.save_train_data, run_dir) or (
        str(dump_dir / "train_data" / "{rollout_id}_{rank}.pt") if dump_dir and not d.rollout_only
        else None)
    if d.rollout_only and d.save_train_data:
        raise ConfigError("debug.save_train_data is set but debug.rollout_only builds no trainer")

    builds_train = not d.rollout_only
    if load:
        replay_files = {i: p for i, p in discover_rollout_ids(load).items()
                        if start_rollout_id <= i < r.num_rollout}
        if not replay_files:
            raise ConfigError(f"debug.load_rollout_data={d.load_rollout_data!r}: no files match "
                              f"for rollout ids {start_rollout_id}..{r.num_rollout - 1}")
        rollout_ids = list(replay_files)
        check_replay_ids(d.load_rollout_data, rollout_ids, start_rollout_id)
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
    dump_layers = _abs_template(d.dump_layers, run_dir) or (str(dump_dir / "layers") if dump_dir else None)
    layer_rollouts = check_dump_layers(d, cfg.train, dump_layers, rollout_ids, builds_train) \
        if dump_layers else []
    profile_dir = _abs_template(d.profile_dir, run_dir)
    profile_rollouts = check_profile(d, cfg.train, rollout_ids, builds_train) if profile_dir else []
    if load and save_rollout and load == save_rollout:
        raise ConfigError(f"debug.save_rollout_data and debug.load_rollout_data both point at "
                          f"{load!r}: the replay would overwrite its own input")
    check_writable("debug.save_rollout_data", save_rollout)
    check_writable("debug.save_train_data", save_train if builds_train else None)
    check_writable("debug.dump_details", f"{dump_dir}/" if dump_dir else None)
    check_writable("debug.dump_layers", f"{dump_layers}/" if dump_layers else None)
    check_writable("debug.profile_dir", f"{profile_dir}/" if profile_dir else None)
    if builds_train:
        check_trainer(cfg.train, cfg.algo, cfg.parallel, r, cfg.model.dtype,
                      hf_config or model_config(cfg.model))
        if not load:  # a replay's sample counts are checked with its files (relax.startup.prepare)
            check_batch_split(cfg.train, cfg.parallel, r.rollout_batch_size * r.n_samples_per_prompt,
                              "rollout.rollout_batch_size x rollout.n_samples_per_prompt")
            if dump_layers:
                check_dump_samples(d, r.rollout_batch_size * r.n_samples_per_prompt,
                                   "rollout.rollout_batch_size x rollout.n_samples_per_prompt")
    if not train_only:
        check_engine(r, cfg.model, cfg.algo, cfg.debug)
    return Plan(builds_rollout=not train_only, builds_train=builds_train,
                rollout_ids=rollout_ids, save_rollout_data=save_rollout,
                load_rollout_data=load, save_train_data=save_train if builds_train else None,
                dump_dir=dump_dir, dump_layers=dump_layers, dump_layers_rollouts=layer_rollouts,
                profile_dir=profile_dir, profile_rollouts=profile_rollouts,
                replay_files=replay_files, partial_sync=builds_train and hasattr(
                    load_target(cfg.train, "train"), "synced_weights"),
                engine_records_layers=not train_only and hasattr(
                    load_target(cfg.rollout, "rollout"), "record_layers"))
