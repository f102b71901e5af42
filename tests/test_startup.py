"""Start-up refusals that come before anything is built or written: an option whose extra is
not installed, a cluster refusal with a dump dir, a `_target_` class that cannot take the call
the loop makes, and a run whose driver has exited but is not reaped yet (a zombie)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys
import time

import pytest

from relax.errors import ConfigError

from .conftest import FRESH, make_cfg, relax_cli, run_loop
from .extras import RAY, require

TINY = ["rollout.num_rollout=1", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
        "checkpoint.save_interval=null"]

# On PYTHONPATH as sitecustomize.py: the named modules look not installed, both to `import` and
# to importlib.util.find_spec, so the CLI runs its real code path without uninstalling anything.
HIDE = '''
import sys

HIDDEN = {hidden!r}


class Hide:
    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in HIDDEN):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, Hide())
'''


def relax_without(tmp_path, hidden: list[str], *args: str):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(HIDE.format(hidden=hidden))
    path = os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))
    # (a new interpreter: sitecustomize runs at start-up)
    return relax_cli(*args, cwd=tmp_path, entry=FRESH, env={"PYTHONPATH": path}, timeout=300)


@pytest.mark.parametrize("hidden,args,expected", [
    (["megatron"], ["train=megatron"], "train=megatron needs the module 'megatron.core'"),
    (["ray"], ["cluster=ray"], "cluster=ray needs the module 'ray'"),
    (["sglang"], ["rollout=sglang"], "rollout=sglang needs the module 'sglang'"),
], ids=["megatron", "ray", "sglang"])
def test_an_option_whose_extra_is_missing_names_the_extra_before_anything_is_written(
        tmp_path, hidden, args, expected):
    dump = tmp_path / "dump"
    proc = relax_without(tmp_path, hidden, *args, *TINY, f"debug.dump_details={dump}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert output.count(expected) == 1 and "Traceback" not in output  # one message, from Relax
    install = {"megatron": "pip install -c constraints.txt -e '.[megatron]'",
               "ray": "pip install -c constraints.txt -e '.[ray]'",
               "sglang": "scripts/setup_sglang_cpu.sh"}[hidden[0]]
    assert install in output
    if hidden == ["sglang"]:
        assert ".venv-sglang/bin/relax" in output
    assert "does not import" not in output  # not taken for a typo in the class path
    (run_dir,) = (tmp_path / "outputs" / "runs").iterdir()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and expected in status["error"]
    assert not (run_dir / "built.json").exists()
    assert not dump.exists()


def test_the_ray_launcher_without_the_ray_extra_names_it(tmp_path):
    proc = relax_without(tmp_path, ["ray", "hydra_plugins.hydra_ray_launcher"],
                         "-m", "hydra/launcher=ray", "seed=1,2")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert output.strip() == (
        "relax: error: hydra/launcher=ray needs the module 'hydra_plugins.hydra_ray_launcher', which is "
        f"not installed in this environment ({sys.prefix}): install the [ray] extra: "
        "pip install -c constraints.txt -e '.[ray]'")
    assert not (tmp_path / "outputs").exists()


def test_a_refused_cluster_leaves_the_dump_dir_absent_and_the_corrected_rerun_dumps(tmp_path, tiny_path):
    require("ray", RAY)  # cluster=ray's own refusals
    dump = tmp_path / "dump"
    with pytest.raises(ConfigError, match="cluster.num_cpus_per_engine=0.0"):
        run_loop(tmp_path / "refused", *TINY, "cluster=ray", "cluster.num_cpus_per_engine=0",
                 f"debug.dump_details={dump}")
    assert not dump.exists()
    assert not (tmp_path / "refused" / "built.json").exists()
    rollouts, _ = run_loop(tmp_path / "rerun", *TINY, f"debug.dump_details={dump}")
    assert [r["rollout_id"] for r in rollouts] == [0]
    assert sorted(p.name for p in dump.iterdir()) == ["config.yaml", "layers", "rollout_data", "tokenizer",
                                                      "train_data"]


# Classes written to an interface other than the call the loop makes (README: "The engine,
# trainer, task and logger are the classes ...").
class ReadmeLogger:  # the logger README used to document: no run_config=
    def __init__(self, run_dir, resume_from, backends=(), wandb_project="relax", wandb_entity=None):
        pass


class TwoArgEngine:  # takes no spec
    def __init__(self, rollout):
        pass


class OldEngine:  # the interface before EngineSpec
    def __init__(self, cfg, model_path, eos_token_ids, pad_token_id):
        pass


class OldCluster:  # the interface before the groups it reads
    def __init__(self, cfg, run_dir):
        pass


class RanklessTrainer:
    def __init__(self, train, algo, parallel, spec):
        pass


class OldTrainer:  # the interface before TrainerSpec
    def __init__(self, cfg, model_path, ref_model_path=None, pad_token_id=0, save_train_data=None, rank=0,
                 world_size=1):
        pass


class DatasetTask:
    def __init__(self, dataset, **keys):
        pass


class WorldlessTrainer:  # takes rank= but not world_size=
    def __init__(self, train, algo, parallel, spec, rank=0):
        pass


class KeylessLogger:  # takes the loop's keywords but not its group's keys (backends=, ...)
    def __init__(self, run_dir, resume_from, run_config):
        pass


NOT_A_CLASS = 3


@pytest.mark.parametrize("group,target,reason", [
    ("logger", "ReadmeLogger", "got an unexpected keyword argument 'run_config'"),
    ("rollout", "TwoArgEngine", "too many positional arguments"),
    ("train", "RanklessTrainer", "got an unexpected keyword argument 'rank'"),
    ("task", "DatasetTask", "missing a required argument: 'dataset'"),
    ("train", "WorldlessTrainer", "got an unexpected keyword argument 'world_size'"),
    ("logger", "KeylessLogger", "got an unexpected keyword argument 'backends'"),
])
def test_a_target_class_that_cannot_take_the_loops_call_is_refused_at_start_up(tmp_path, group, target,
                                                                                reason):
    from relax.startup import prepare

    path = f"tests.test_startup.{target}"
    with pytest.raises(ConfigError, match=rf"^{group}\._target_='{re.escape(path)}': the loop calls it as "
                                          rf"{target}\(.*\), which its signature \(.*\) refuses: "
                                          rf"{re.escape(reason)}\. "):
        prepare(make_cfg(f"{group}._target_={path}"), tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("group,target,retired,spec,call", [
    ("train", "OldTrainer", "cfg, model_path", "relax.train.spec.TrainerSpec",
     "train, algo, parallel, spec, rank=, world_size="),
    ("rollout", "OldEngine", "cfg, model_path", "relax.rollout.spec.EngineSpec", "rollout, spec"),
    ("cluster", "OldCluster", "cfg", "the groups it reads", "cluster, rollout, train, algo, parallel, run_dir")])
def test_a_class_of_the_interface_before_its_spec_is_refused_naming_the_new_call(tmp_path, group, target, retired,
                                                                                 spec, call):
    """Its (cfg, model_path, ...) would bind the new call to the wrong names, so binding alone
    cannot refuse it."""
    from relax.startup import prepare

    path = f"tests.test_startup.{target}"
    with pytest.raises(ConfigError, match=rf"^{group}\._target_='{re.escape(path)}': its signature \({retired}"
                                          rf".*\) takes {retired}, as the interface before "
                                          rf"{re.escape(spec)} did; the loop calls it as "
                                          rf"{target}\({re.escape(call)}\)"):
        prepare(make_cfg(f"{group}._target_={path}"), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_target_or_function_that_names_no_callable_is_refused_naming_the_key(tmp_path):
    """A dotted path to a constant or a module imports but cannot be called: a ConfigError naming
    the key, not a TypeError (or Hydra's ValueError) later."""
    from relax.startup import prepare
    from relax.targets import load_function

    with pytest.raises(ConfigError, match=r"^rollout\._target_='tests\.test_startup\.NOT_A_CLASS' does not "
                                          r"import: it names a int, not a class\."):
        prepare(make_cfg("rollout._target_=tests.test_startup.NOT_A_CLASS"), tmp_path)
    with pytest.raises(ConfigError, match=r"^task\.reward_fn='relax\.task' does not import: .*non-callable "
                                          r"of type 'module'.*Expected a dotted path to a function f\(x\)$"):
        load_function("relax.task", "task.reward_fn", "f(x)")


def test_require_extra_checks_every_module_and_takes_a_broken_parent_for_a_missing_one(monkeypatch):
    """Each module is looked up (not only the first); a parent package that is half installed
    (find_spec's ValueError) counts as missing; the error names the option and the install."""
    import importlib.util

    from relax.targets import require_extra

    def find_spec(name):
        if name == "gguf":
            raise ValueError("gguf.__spec__ is None")
        return None if name == "ray" else object()
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    require_extra("train=megatron", "megatron.core", "peft")  # both "installed"
    with pytest.raises(ConfigError, match=rf"^hydra/launcher=ray needs the module 'ray', which is not "
                                          rf"installed in this environment \({re.escape(sys.prefix)}\): "
                                          rf"install the \[ray\] extra"):
        require_extra("hydra/launcher=ray", "hydra_plugins.hydra_ray_launcher", "ray")
    with pytest.raises(ConfigError, match=r"^model.format=gguf needs the module 'gguf'.*\[real\] extra"):
        require_extra("model.format=gguf", "gguf")

def test_megatron_without_package_metadata_is_a_config_error(monkeypatch):
    import torch

    from relax.train.megatron import cpu_compat

    if torch.cuda.is_available():
        pytest.skip("the version is checked on CPU only")

    def no_distribution(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(cpu_compat.importlib.metadata, "version", no_distribution)
    with pytest.raises(ConfigError, match=r"megatron-core==0\.16\.1 .*found megatron\.core without an "
                                          r"installed megatron-core distribution"):
        cpu_compat.check_version()


def test_an_exited_unreaped_driver_is_dead_to_every_reader(tmp_path):
    """A zombie (exited, its parent has not waited on it) is no live run: status.json readers
    and the reaper agree, through the one /proc reader."""
    from relax.checkpoint import check_run_dir
    from relax.reaper import descendants
    from relax.process import HOST, describe, is_alive, live_elsewhere, proc_stat, start_time

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while proc_stat(pid)[0] != "Z":
            assert time.monotonic() < deadline, proc_stat(pid)
            time.sleep(0.01)
        state, ppid, started = proc_stat(pid)
        assert ppid == os.getpid() and started > 0
        status = {"status": "running", "pid": pid, "host": HOST, "pid_start": started}
        assert start_time(pid) is None
        assert is_alive(status) is False and not live_elsewhere(status)
        assert describe(status).startswith(f"died: status.json says running but its process (pid {pid}")
        assert pid not in [p for p, _ in descendants(os.getpid())]
        killed = tmp_path / "killed"
        killed.mkdir()
        (killed / "status.json").write_text(json.dumps(status))
        check_run_dir(tmp_path / "resumed", killed)  # its resume is not refused as "still running"
        me = {"status": "running", "pid": os.getpid(), "host": HOST, "pid_start": start_time(os.getpid())}
        assert is_alive(me) is True  # a running process still is
        assert is_alive({**me, "pid_start": me["pid_start"] - 1}) is False  # a reused pid is not the run's
    finally:
        os.waitpid(pid, 0)
    assert proc_stat(pid) is None and is_alive(status) is False
