"""The CLI as users run it: entry points, Hydra output layout, clear errors before work starts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax.cli import UsageError, translate_args

from .conftest import REPO, only_run_dir, relax_cli, status_of

SHORT = ["rollout.num_rollout=2", "rollout.rollout_batch_size=8", "checkpoint.save_interval=null"]


def test_two_rollout_smoke_run(tmp_path, tiny_path):
    proc = relax_cli(*SHORT, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run_dir(tmp_path)
    assert run.name[:4].isdigit() and "_" in run.name  # outputs/runs/<date>_<time>
    assert status_of(run)["status"] == "completed"
    assert (run / ".hydra" / "config.yaml").is_file() and (run / ".hydra" / "overrides.yaml").is_file()
    log = (run / "relax.log").read_text()
    assert "Finish rollout 0" in log and "Finish rollout 1" in log
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in records if "step" not in r]
    steps = [r for r in records if "step" in r]
    assert [r["rollout_id"] for r in rollouts] == [0, 1] and len(steps) == 2
    first = rollouts[0]
    for key in ("rollout/log_probs", "rollout/ref_log_probs", "rollout/rollout_log_probs",
                "rollout/kl", "rollout/raw_reward", "rollout/response_len", "perf/rollout_time",
                "perf/train_time", "perf/tokens_per_s"):
        assert key in first, key
    assert first["rollout/log_probs"] == first["rollout/ref_log_probs"]
    assert steps[0]["train/ppo_kl"] == 0.0 and steps[0]["train/kl_loss"] == 0.0
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-4
    for key in ("train/loss", "train/pg_loss", "train/pg_clipfrac", "train/entropy_loss",
                "train/grad_norm"):
        assert key in steps[0], key
    assert (run / "reward.png").stat().st_size > 1000
    assert json.loads((run / "built.json").read_text())["trainer"] == "relax.train.torch_trainer.TorchTrainer"
    first_lp = torch.load(run / "first_step_log_probs.pt", weights_only=True)
    assert sorted(first_lp) == list(range(16))  # FIRST_STEP_SAMPLES of 64


def test_tensorboard_logger_writes_event_files(tmp_path, tiny_path):
    proc = relax_cli(*SHORT, "logger=tensorboard", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = list((only_run_dir(tmp_path) / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 100
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert len(acc.Scalars("rollout/raw_reward")) == 2


@pytest.mark.parametrize("entry", [
    ["relax"],
    [sys.executable, str(REPO / "relax" / "entrypoints" / "train.py")],
], ids=["console-script", "guide-script-path"])
def test_entry_points_run_the_same_app(tmp_path, tiny_path, entry):
    if entry == ["relax"]:  # the console script installed beside this interpreter
        entry = [str(Path(sys.executable).parent / "relax")]
    proc = relax_cli("rollout.num_rollout=1", "rollout.rollout_batch_size=4",
                     "checkpoint.save_interval=null", cwd=tmp_path, entry=entry)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert status_of(only_run_dir(tmp_path))["status"] == "completed"


def test_cfg_job_and_help_do_not_import_torch():
    code = ("import sys\nfrom relax.cli import main\n"
            "for args in (['--cfg', 'job'], ['--help']):\n"
            "    try:\n        main(args)\n    except SystemExit:\n        pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO_TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "rollout:" in out.stdout and "Configuration groups" in out.stdout
    assert "cluster: local, ray" in out.stdout
    assert out.stdout.strip().endswith("NO_TORCH")


# Refusals exit 2 (docs/reliability.md), what Hydra cannot compose included; a flag the CLI
# does not know (a SystemExit with the message) exits 1.
@pytest.mark.parametrize("args,message,code", [
    (["model=hf"], "model.path is not set for model=hf", 2),
    (["model.path=/nonexistent/dir"], "no config.json there", 2),
    (["task.reward_fn=not_a_module.reward"], "task.reward_fn='not_a_module.reward' does not import", 2),
    (["task=jsonl"], "task=jsonl needs task.data_path", 2),
    (["rollout._target_=nope.Engine"], "rollout._target_='nope.Engine' does not import", 2),
    (["--bogus-flag"], "unknown flag '--bogus-flag'", 1),
])
def test_bad_input_fails_fast_with_a_clear_error(tmp_path, args, message, code):
    proc = relax_cli(*args, cwd=tmp_path, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == code, output[-3000:]
    assert message in output
    assert "Traceback" not in output
    assert not list(tmp_path.glob("outputs/runs/*/built.json"))  # nothing was built


def test_empty_dataset_is_refused(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("\n")
    proc = relax_cli("task=jsonl", f"task.data_path={data}", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "the dataset is empty" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr + proc.stdout


def test_jsonl_task_with_custom_reward_runs(tmp_path, tiny_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n"
                            for a in range(10, 20)))
    proc = relax_cli(*SHORT, "task=jsonl", f"task.data_path={data}",
                     "task.reward_fn=relax.task.arithmetic.exact_match", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (only_run_dir(tmp_path) / "relax.log").read_text()
    assert "+1" in log.split("Finish rollout 0")[1].splitlines()[0]  # prompts came from the file


def test_translate_guide_flags():
    assert translate_args(["--debug-rollout-only", "--rollout-num-gpus", "8",
                           "--rollout-num-gpus-per-engine=8", "seed=3"]) == [
        "debug.rollout_only=true", "rollout.rollout_num_gpus=8",
        "rollout.rollout_num_gpus_per_engine=8", "seed=3"]
    assert translate_args(["--load-debug-rollout-data", "/x/data_{rollout_id}.pt", "-m"]) == [
        "debug.load_rollout_data='/x/data_{rollout_id}.pt'", "-m"]
    assert translate_args(["--cfg", "job", "debug.load_rollout_data=/x/{rollout_id}.pt"]) == [
        "debug.load_rollout_data='/x/{rollout_id}.pt'", "--cfg", "job"]
    with pytest.raises(UsageError, match="needs a value"):
        translate_args(["--dump-details"])
    with pytest.raises(UsageError, match="--debug-train-only"):
        translate_args(["--debug-train-onyl"])


def test_experiment_overrides_the_base_config_and_debug_overrides_the_experiment():
    from .conftest import make_cfg

    cfg = make_cfg("experiment=arith_grpo_v1")
    assert cfg.seed == 7 and cfg.train.lr == 4e-4 and cfg.algo.use_kl_loss and cfg.rollout.num_rollout == 300
    assert make_cfg().seed == 1234
    assert make_cfg("experiment=arith_grpo_v1", "debug=rollout_only").debug.rollout_only


def test_translate_args_quotes_only_templates_and_refuses_misused_flags():
    """Dicts and lists pass as Hydra values; a template holding a quote gets the other quotes; a
    flag without a value refuses one, one that needs a value does not take the next flag; a
    Hydra flag written `--cfg=job` does not swallow the override after it."""
    assert translate_args(["+x={a: 1}", "y=[1,2]", "z='{q}'", "p=it's_{id}"]) == [
        "+x={a: 1}", "y=[1,2]", "z='{q}'", "p=\"it's_{id}\""]
    assert translate_args(["--cfg=job", "seed=1"]) == ["seed=1", "--cfg=job"]
    with pytest.raises(UsageError, match="^relax: error: --debug-rollout-only takes no value$"):
        translate_args(["--debug-rollout-only=yes"])
    with pytest.raises(UsageError, match="^relax: error: --dump-details needs a value$"):
        translate_args(["--dump-details", "-m"])


def test_check_launcher_asks_for_the_ray_extra_for_both_ray_launchers(monkeypatch):
    """hydra/launcher=ray and ray_aws, also written +hydra/launcher=..., need the [ray] extra."""
    from relax import cli

    asked = []
    monkeypatch.setattr(cli.targets, "require_extra", lambda option, *modules: asked.append(option))
    cli.check_launcher(["hydra/launcher=basic", "+hydra/launcher=ray_aws", "seed=1", "hydra/launcher=ray"])
    assert asked == ["hydra/launcher=ray_aws", "hydra/launcher=ray"]


def test_main_sets_relax_argv_for_the_job_and_restores_the_environment(monkeypatch):
    """RELAX_ARGV holds the translated overrides while the app runs and is removed after (also
    after Ctrl-C, which exits with "relax: interrupted" rather than a traceback)."""
    from relax import cli

    seen = []

    def app():
        seen.append(os.environ["RELAX_ARGV"])
        if len(seen) == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(cli, "hydra_app", app)
    monkeypatch.setattr(sys, "argv", ["relax"])
    monkeypatch.delenv("RELAX_ARGV", raising=False)
    cli.main(["--debug-rollout-only", "seed=3"])
    assert seen == ['["debug.rollout_only=true", "seed=3"]'] and "RELAX_ARGV" not in os.environ
    with pytest.raises(SystemExit, match="^relax: interrupted$"):
        cli.main(["seed=4"])
    assert "RELAX_ARGV" not in os.environ


@pytest.mark.parametrize("override, line", [
    ("train.lr=abc", "relax: error: train.lr: Error merging override train.lr=abc; Value 'abc' of type "
                     "'str' could not be converted to Float"),
    ("train.lrr=1", "relax: error: train.lrr: Could not override 'train.lrr'.; To append to your config use "
                    "+train.lrr=1; Key 'lrr' not in 'TrainConfig'"),
    ("model=nope", "relax: error: In 'config': Could not find 'model/nope'; Available options in 'model': "
                   "hf, smollm2, tiny"),
])
def test_an_override_hydra_cannot_merge_is_one_line_and_exit_2(tmp_path, override, line):
    """Like every other refusal (docs/reliability.md), before Hydra makes a run dir."""
    done = relax_cli(override, cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", line + "\n")
    assert not (tmp_path / "outputs").exists()
