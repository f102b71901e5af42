"""The RL loop's own parts (relax/loop.py), by hand: a rollout's record and what it writes, the
colocated engine's memory around a step, the checkpoint schedule, the first step's record, the
weight sync's time, the non-finite report, the resume hint, run_job's status and exit codes,
and the shutdown that closes every part."""

from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from relax import loop, startup
from relax.cluster import LocalCluster
from relax.errors import ConfigError, Interrupted, NonFiniteError
from relax.files import safe_load
from relax.logger import MetricsLogger
from relax.process import close_on_exit
from relax.rollout.torch_engine import TorchEngine
from relax.sample import Sample
from relax.train.torch_trainer import TorchTrainer

from .conftest import make_cfg, run_loop, status_of


def hand_samples() -> list[Sample]:
    """Two groups of two: 8 response tokens, one of them a tool's (loss_mask 0, log-prob -9),
    one truncated and one aborted response."""
    def sample(i, response, mask, lps, reward, status):
        return Sample(index=i, group_index=i // 2, prompt=f"p{i}", tokens=[5, 6, *response],
                      response_length=len(response), loss_mask=mask, rollout_log_probs=lps, reward=reward,
                      status=status, response=f"r{i}", label="1")
    return [sample(0, [7, 8, 9], [1, 0, 1], [-1.0, -9.0, -3.0], 1.0, "completed"),
            sample(1, [7], [1], [-2.0], 0.0, "truncated"),
            sample(2, [8, 9], [1, 1], [-0.5, -0.5], 0.5, "aborted"),
            sample(3, [9, 7], [1, 1], [0.0, -1.0], 0.5, "completed")]


class FakeRollouts:
    """What Rollouts.get hands the loop: (samples, stats), seconds, policy_version."""

    def __init__(self, stats: dict, seconds: float, policy_version: int):
        self.made = (hand_samples(), stats), seconds, policy_version

    def get(self, rollout_id):
        return self.made


def hand_run(tmp_path: Path, tokenizer, replays: bool = False, save: str | None = None, **kw):
    plan = SimpleNamespace(replays=replays, save_rollout_data=save, rollout_ids=kw.pop("rollout_ids", [5]))
    return SimpleNamespace(cfg=kw.pop("cfg", None) or make_cfg(), dir=tmp_path, plan=plan,
                           tokenizer=tokenizer, manifest={"hand": 1}, checkpoint=kw.pop("checkpoint", None),
                           model_path=tmp_path, **kw)


def test_a_rollouts_record_by_hand_without_eval_time_and_its_files(tmp_path, tokenizer):
    """rollout/*: means over samples, log-probs of model tokens only (not a tool's), truncated
    (not aborted) share, the share of groups with equal rewards; perf/rollout_time without the
    evaluation's time (and tokens/s on it); staleness = rollout_id - policy_version, absent for
    replayed data; the saved rollout data and samples.jsonl line are this rollout's."""
    run = hand_run(tmp_path, tokenizer, save=f"{tmp_path}/data/{{rollout_id}}.pt")
    stats = {"perf/eval_time": 2.0, "eval/arithmetic/reward": 0.75, "rollout/generation_rounds": 1}
    samples, record = loop.rollout(run, FakeRollouts(stats, 6.0, policy_version=3), 5)
    assert [s.index for s in samples] == [0, 1, 2, 3]
    assert record["rollout_id"] == 5
    assert record["rollout/raw_reward"] == 0.5
    assert record["rollout/response_len"] == 2.0  # 8 tokens / 4 samples
    assert record["rollout/truncated_ratio"] == 0.25
    assert record["rollout/zero_std_ratio"] == 0.5  # group 1's rewards are 0.5 and 0.5: no gradient
    assert record["rollout/rollout_log_probs"] == pytest.approx(-8.0 / 7)  # 7 model tokens
    assert record["perf/rollout_time"] == 4.0 and record["perf/tokens_per_s"] == 2.0
    assert (record["perf/eval_time"], record["eval/arithmetic/reward"]) == (2.0, 0.75)
    assert record["rollout/staleness"] == 2
    saved = safe_load(tmp_path / "data" / "5.pt")
    assert saved["rollout_id"] == 5 and saved["manifest"] == {"hand": 1} and len(saved["samples"]) == 4
    line = json.loads((tmp_path / "samples.jsonl").read_text())
    assert (line["rollout_id"], line["num_samples"], line["mean_reward"], line["prompt"]) == (5, 4, 0.5, "p0")

    replayed = hand_run(tmp_path / "replay", tokenizer, replays=True)
    (tmp_path / "replay").mkdir()
    _, record = loop.rollout(replayed, FakeRollouts({}, 6.0, policy_version=0), 5)
    assert "rollout/staleness" not in record and record["perf/rollout_time"] == 6.0


class Recorder:
    def __init__(self, calls: list):
        self.calls = calls

    def __getattr__(self, name):
        return lambda *args: self.calls.append(name) or {"steps": []}


@pytest.mark.parametrize("colocate,expected", [
    (True, ["release_memory_occupation", "train", "resume_memory_occupation"]), (False, ["train"])])
def test_a_colocated_engine_gives_up_its_memory_for_the_step_only(colocate, expected):
    calls = []
    run = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(colocate=colocate)))
    loop.train(run, Recorder(calls), Recorder(calls), 0, [])
    assert calls == expected
    calls.clear()
    loop.train(run, Recorder(calls), None, 0, [])  # train_only: no engine
    assert calls == ["train"]


def test_checkpoints_every_interval_at_the_last_rollout_and_when_stopping(tmp_path, monkeypatch):
    """save_interval=3 over rollouts 2..7: after rollouts 2 and 5 ((id + 1) % 3 == 0), 7 (the
    last) and 3 (a stop was asked), with checkpoint.keep_last; save_interval=null: never, even
    at the last rollout or a stop."""
    saved = []
    monkeypatch.setattr(loop, "save_checkpoint", lambda trainer, tokenizer, run_dir, rollout_id, model_path,
                        keep_last, layout, experiment, write_more: saved.append((rollout_id, keep_last, run_dir,
                                                                                 experiment)))
    run = hand_run(tmp_path, None, cfg=make_cfg("checkpoint.save_interval=3", "checkpoint.keep_last=2"),
                   rollout_ids=list(range(2, 8)), overrides=["seed=3"])
    for rollout_id in run.plan.rollout_ids:
        loop.checkpoint_on_schedule(run, object(), None, None, rollout_id, stopping=rollout_id == 3)
    experiment = (run.cfg, ["seed=3"])  # what a resume composes again
    assert saved == [(i, 2, tmp_path, experiment) for i in (2, 3, 5, 7)]
    saved.clear()
    run.cfg = make_cfg("checkpoint.save_interval=null")
    for rollout_id in run.plan.rollout_ids:
        loop.checkpoint_on_schedule(run, object(), None, None, rollout_id, stopping=True)
    assert saved == []


def test_the_first_step_record_is_the_runs_first_rollouts_and_never_a_resumed_runs(tmp_path, tiny_path):
    (tmp_path / "config.json").write_text((tiny_path / "config.json").read_text())  # the run's model
    out = {"first_step_log_probs": {0: torch.tensor([-1.5])}, "steps": [{}]}
    run = hand_run(tmp_path, None, rollout_ids=[3, 4])
    loop.first_step(run, 4, [], {}, out)
    assert not (tmp_path / "first_step_log_probs.pt").exists()
    loop.first_step(run, 3, [], {}, out)
    assert torch.load(tmp_path / "first_step_log_probs.pt", weights_only=True)[0].tolist() == [-1.5]
    (tmp_path / "first_step_log_probs.pt").unlink()
    resumed = hand_run(tmp_path, None, rollout_ids=[3, 4],
                       checkpoint=tmp_path / "checkpoints" / "rollout_000002")
    loop.first_step(resumed, 3, [], {}, out)
    assert not (tmp_path / "first_step_log_probs.pt").exists()


class SyncedEngine:
    def update_weights(self, weights):
        self.weights = weights


class SlowCheck:
    """An engine-weights check that takes 0.5 s."""

    def __init__(self):
        self.checked = []

    def check_sync(self, engine, weights, rollout_id):
        time.sleep(0.5)
        self.checked.append(rollout_id)


@pytest.mark.parametrize("every_sync", [True, False])
def test_the_weight_sync_time_leaves_out_the_engine_weights_check(every_sync):
    """perf/weight_sync_time is the push alone; the check runs at every sync only when asked."""
    trainer = SimpleNamespace(named_weights=lambda: {"w": torch.zeros(1)})
    trainer.synced_weights = trainer.named_weights
    run = SimpleNamespace(cfg=make_cfg(f"debug.check_weight_update_every_sync={str(every_sync).lower()}"),
                          plan=SimpleNamespace(partial_sync=True))
    check, engine = SlowCheck(), SyncedEngine()
    seconds = loop.sync_weights(run, trainer, engine, check, 4)
    assert seconds < 0.4 and list(engine.weights) == ["w"]
    assert check.checked == ([4] if every_sync else [])


class BroadcastEngine:
    """rollout.weight_update_mode=distributed: the engine receives the trainer's NCCL broadcast."""

    def __init__(self):
        self.broadcasts = 0

    def update_weights(self, weights):
        raise AssertionError("a distributed sync pushes nothing by name")

    def update_weights_from_trainer(self, trainer):
        self.broadcasts += 1


def test_a_distributed_sync_is_checked_too_against_the_trainers_whole_model():
    """The reported bug: with weight_update_mode=distributed the sync returned before the
    every-sync check, which then never ran. It runs, against named_weights (nothing was
    gathered by name for the broadcast)."""
    trainer = SimpleNamespace(named_weights=lambda: {"w": torch.ones(1)})
    trainer.synced_weights = trainer.named_weights
    run = SimpleNamespace(cfg=make_cfg("rollout.weight_update_mode=distributed",
                                       "debug.check_weight_update_every_sync=true"),
                          plan=SimpleNamespace(partial_sync=True))
    checked = []
    check = SimpleNamespace(
        check_sync=lambda engine, weights, rollout_id: checked.append((dict(weights), rollout_id)))
    engine = BroadcastEngine()
    loop.sync_weights(run, trainer, engine, check, 7)
    assert engine.broadcasts == 1 and checked == [({"w": torch.ones(1)}, 7)]


def nonfinite_samples(n: int) -> list[Sample]:
    return [Sample(index=i, group_index=i // 2, prompt="", tokens=[5, 6, 7], response_length=1, loss_mask=[1],
                   rollout_log_probs=[-1.0]) for i in range(n)]


def test_a_nonfinite_step_saves_its_samples_groups_and_lists_at_most_8_samples(tmp_path, caplog):
    """Events naming samples 3 and 4 save groups 1 and 2 (samples 2..5, renumbered); a list of
    9 samples shows its first 8 and ' ...', one of 8 all of them; on_nonfinite=error stops."""
    run = hand_run(tmp_path, None, cfg=make_cfg("train.on_nonfinite=skip"))
    samples = nonfinite_samples(20)
    with caplog.at_level(logging.WARNING, logger="relax"):
        loop.report_nonfinite(run, 7, samples, [{"step": 0, "loss": float("nan"), "grad_norm": 1.0,
                                                 "indices": [3, 4]}])
        loop.report_nonfinite(run, 8, samples, [{"step": 1, "loss": 1.0, "grad_norm": float("inf"),
                                                 "indices": list(range(9))}])
        loop.report_nonfinite(run, 9, samples, [{"step": 2, "loss": 1.0, "grad_norm": float("inf"),
                                                 "indices": list(range(8))}])
        loop.report_nonfinite(run, 10, samples, [])
    kept = safe_load(tmp_path / "nonfinite" / "7.pt")["samples"]
    assert [s["metadata"]["replay_index"] for s in kept] == [2, 3, 4, 5]
    assert [s["group_index"] for s in kept] == [0, 0, 1, 1]
    assert not (tmp_path / "nonfinite" / "10.pt").exists()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3
    assert "rollout 7: non-finite training step (step 0: loss nan, grad_norm 1, samples [3, 4]);" \
        in messages[0]
    assert "samples [0, 1, 2, 3, 4, 5, 6, 7] ...)" in messages[1]
    assert "samples [0, 1, 2, 3, 4, 5, 6, 7])" in messages[2]
    run.cfg = make_cfg("train.on_nonfinite=error")
    with pytest.raises(NonFiniteError, match="train.on_nonfinite=skip trains on past such steps"):
        loop.report_nonfinite(run, 11, samples, [{"step": 0, "loss": 1.0, "grad_norm": float("nan"),
                                                  "indices": [0]}])


def test_the_resume_hint_names_the_newest_complete_checkpoint(tmp_path):
    assert loop.resume_hint(tmp_path) == "no checkpoint was written"
    for rollout_id in (2, 5, 3):
        path = tmp_path / "checkpoints" / f"rollout_{rollout_id:06d}"
        path.mkdir(parents=True)
        (path / "relax_state.json").write_text(json.dumps({"rollout_id": rollout_id, "ref_model_path": "/m",
                                                           "files": {}}))
    (tmp_path / "checkpoints" / "rollout_000009").mkdir()  # incomplete: no state file
    assert loop.resume_hint(tmp_path) == f"newest checkpoint rollout_000005: continue with resume={tmp_path}"


@pytest.mark.parametrize("raised,code,status,error", [
    (None, None, "completed", None),
    (ConfigError("bad key"), 2, "failed", "bad key"),
    (Interrupted(15, "stopped by SIGTERM after rollout 3"), 128 + 15, "interrupted",
     "stopped by SIGTERM after rollout 3; no checkpoint was written"),
    (KeyboardInterrupt(), 130, "interrupted",
     "aborted: the rollout in progress is lost; no checkpoint was written"),
    (RuntimeError("boom"), "raised", "failed", "RuntimeError: boom"),
])
def test_run_job_records_the_status_and_exits_with_its_code(tmp_path, monkeypatch, raised, code, status,
                                                          error):
    """completed; a user error exits 2; a stop 128 + its signal (Ctrl-C twice: 130); any other
    error is raised again, its type in the status; the loop runs on train.num_threads threads."""
    cfg = make_cfg("train.num_threads=3", run_dir=tmp_path)
    seen = []

    def fake_loop(cfg, run_dir, stop, accept):
        accept()
        seen.append((run_dir, torch.get_num_threads(), status_of(run_dir)["status"]))
        if raised is not None:
            raise raised
    monkeypatch.setattr(loop, "rl_loop", fake_loop)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if code is None:
            loop.run_job(cfg)
        elif code == "raised":
            with pytest.raises(type(raised)):
                loop.run_job(cfg)
        else:
            with pytest.raises(SystemExit) as exit_:
                loop.run_job(cfg)
            assert exit_.value.code == code
    finally:
        torch.set_num_threads(threads)
    assert seen == [(tmp_path, 3, "running")]
    written = status_of(tmp_path)
    assert written["status"] == status and written.get("error") == error


def test_a_sweep_job_with_a_user_error_says_it_in_one_line_and_the_sweep_goes_on(tmp_path, monkeypatch,
                                                                                  caplog):
    """In a sweep (-m) run by Hydra's basic launcher (in this process) a user error is one line,
    noted for relax.cli's exit code at the sweep's end; a launcher that runs the job in another
    process gets it raised, to record."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from relax.process import take_failed_jobs

    def refused(cfg, run_dir, stop, accept):
        raise ConfigError("bad")
    monkeypatch.setattr(loop, "rl_loop", refused)
    job = tmp_path / "seed=2"
    job.mkdir()
    cfg = make_cfg("hydra.mode=MULTIRUN", run_dir=job)
    assert HydraConfig.get().mode == RunMode.MULTIRUN
    loop.run_job(cfg)
    assert take_failed_jobs() == ["seed=2"] and take_failed_jobs() == []
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == ["job seed=2: bad"]
    assert (status_of(job)["status"], status_of(job)["error"]) == ("failed", "bad")  # a dir it created
    cfg = make_cfg("hydra.mode=MULTIRUN", "hydra/launcher=ray", run_dir=tmp_path / "ray")
    (tmp_path / "ray").mkdir()
    with pytest.raises(ConfigError, match="bad"):
        loop.run_job(cfg)


class StartLogger(MetricsLogger):
    """The metrics logger, noting the rollout the loop says the run starts at (resume_from)."""
    starts: list[int] = []

    def __init__(self, run_dir, backends=(), resume_from=0, **kw):
        StartLogger.starts.append(resume_from)
        super().__init__(run_dir, backends, resume_from, **kw)


def test_a_run_logs_its_weight_sync_time_and_a_resume_at_the_last_rollout_runs_nothing(tmp_path, caplog):
    """Every trained rollout's record has perf/weight_sync_time; resuming a run from its last
    rollout's checkpoint warns that nothing is left and keeps its history as it was; a resume
    with another trainer layout (LoRA adapters) is refused before anything is built; the logger
    is told the rollout the run starts at (TensorBoard drops the steps from there)."""
    common = ["rollout.num_rollout=2", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
              "checkpoint.save_interval=2", "logger._target_=tests.test_loop.StartLogger"]
    StartLogger.starts.clear()
    rollouts, steps = run_loop(tmp_path / "run", *common)
    assert [r["rollout_id"] for r in rollouts] == [0, 1]
    assert all(0 < r["perf/weight_sync_time"] < r["perf/train_time"] for r in rollouts)
    with caplog.at_level(logging.WARNING, logger="relax"):
        again = run_loop(tmp_path / "again", *common, f"resume={tmp_path / 'run'}")
    assert again == (rollouts, steps) and StartLogger.starts == [0, 2]
    assert f"resume: {tmp_path / 'run' / 'checkpoints' / 'rollout_000001'} is at the run's last rollout " \
           "(rollout.num_rollout=2): nothing left to run" in caplog.text
    with pytest.raises(ConfigError, match=r"train.lora.rank=4 \(the run: 0\) would make another experiment"):
        startup.prepare(make_cfg(*common, f"resume={tmp_path / 'run'}", "train.lora.rank=4"), tmp_path / "lora")
    # allowed knowingly, the trainer state still cannot take it
    with pytest.raises(ConfigError, match=r"saved with train.lora=None \(this run: \{'rank': 4"):
        startup.prepare(make_cfg(*common, f"resume={tmp_path / 'run'}", "train.lora.rank=4",
                              "resume_allow_changes=[train.lora]"), tmp_path / "lora")


def test_a_layer_dump_gives_the_engine_the_chosen_samples_and_their_model_tokens_log_probs(tmp_path,
                                                                                            monkeypatch):
    """The engine's side of debug.dump_layers: the chosen samples' tokens in the order asked,
    and their generated log-probs of model tokens only (a tool's token is not the engine's)."""
    from relax.train import layer_dump

    saved, trained = {}, []
    def save_dump(path, rollout_id, side, manifest, indices, forward, generated):
        saved.update(path=path, rollout_id=rollout_id, side=side, manifest=manifest, indices=indices,
                     forward=forward, generated=[g.tolist() for g in generated])
    monkeypatch.setattr(layer_dump, "save_dump", save_dump)
    trainer = SimpleNamespace(dump_layers=lambda *args: trained.append(args))
    engine = SimpleNamespace(record_layers=lambda tokens: {"tokens": tokens})
    run = hand_run(tmp_path, None, cfg=make_cfg("debug.dump_layers_samples=[2,0]"))
    run.plan.dump_layers, run.manifest = tmp_path / "layers", {"model_fingerprint": "fp"}
    run.plan.engine_records_layers = True
    loop.dump_layers(run, trainer, engine, 4, hand_samples())
    assert (saved["path"], saved["rollout_id"], saved["side"], saved["indices"]) == (tmp_path / "layers", 4,
                                                                                     "engine", [2, 0])
    assert saved["forward"] == {"tokens": [[5, 6, 8, 9], [5, 6, 7, 8, 9]]}
    assert saved["generated"] == [[-0.5, -0.5], [-1.0, -3.0]]
    assert saved["manifest"]["model_fingerprint"] == "fp"
    assert len(trained) == 1 and trained[0][1:3] == (4, hand_samples()) and trained[0][3] == [2, 0]


def test_debug_dump_layers_rollouts_dumps_the_rollouts_asked_for(tmp_path):
    run_loop(tmp_path / "run", "rollout.num_rollout=2", "rollout.rollout_batch_size=2",
             "rollout.n_samples_per_prompt=2", "checkpoint.save_interval=null",
             f"debug.dump_layers={tmp_path}/layers", "debug.dump_layers_rollouts=[1]")
    assert sorted(p.name for p in (tmp_path / "layers").glob("*.pt")) == ["1_engine.pt", "1_ref.pt",
                                                                              "1_train.pt"]


class ShutdownEngine(TorchEngine):
    """The torch engine, counting its shutdowns."""
    shutdowns: list[int] = []

    def shutdown(self):
        ShutdownEngine.shutdowns.append(1)
        super().shutdown()


def test_the_engine_is_shut_down_when_the_run_ends(tmp_path):
    ShutdownEngine.shutdowns.clear()
    run_loop(tmp_path, "rollout.num_rollout=1", "rollout.rollout_batch_size=2",
             "rollout.n_samples_per_prompt=2", "checkpoint.save_interval=null",
             "rollout._target_=tests.test_loop.ShutdownEngine")
    assert ShutdownEngine.shutdowns == [1]


class FailingShutdownTrainer(TorchTrainer):
    """The torch trainer, whose shutdown raises."""

    def shutdown(self):
        raise RuntimeError("the trainer would not stop")


class CountingCluster(LocalCluster):
    """The local cluster, counting its closes."""
    closes: list[int] = []

    def close(self):
        CountingCluster.closes.append(1)
        super().close()


def test_every_part_is_closed_when_one_close_raises_and_its_error_is_raised(tmp_path):
    """The trainer closes before the engine and the cluster: its shutdown raising leaves neither
    open, and the run ends with the trainer's error (the first), not a later one or none."""
    ShutdownEngine.shutdowns.clear()
    CountingCluster.closes.clear()
    with pytest.raises(RuntimeError, match="the trainer would not stop"):
        run_loop(tmp_path, "rollout.num_rollout=1", "rollout.rollout_batch_size=2",
                 "rollout.n_samples_per_prompt=2", "checkpoint.save_interval=null",
                 "rollout._target_=tests.test_loop.ShutdownEngine",
                 "train._target_=tests.test_loop.FailingShutdownTrainer",
                 "cluster._target_=tests.test_loop.CountingCluster")
    assert ShutdownEngine.shutdowns == [1] and CountingCluster.closes == [1]


class Part:
    def __init__(self, name: str, closed: list, error: Exception | None = None):
        self.name, self.closed, self.error = name, closed, error

    def close(self):
        self.closed.append(self.name)
        if self.error:
            raise self.error


def test_close_on_exit_closes_last_in_first_out_and_keeps_the_first_error(caplog):
    """relax.process.close_on_exit: every part closes, in reverse order of registration, whatever raises; the loop's own error
    propagates and the close errors behind it are logged; without one, the first close's error
    propagates and a later one is logged."""
    closed: list[str] = []
    with pytest.raises(ValueError, match="the loop's"), caplog.at_level(logging.ERROR, "relax"):
        with ExitStack() as parts:
            for name, error in (("cluster", None), ("engine", OSError("engine's")), ("metrics", None),
                                ("trainer", RuntimeError("trainer's"))):
                close_on_exit(parts, Part(name, closed, error), "close")
            assert close_on_exit(parts, None, "close") is None
            raise ValueError("the loop's")
    assert closed == ["trainer", "metrics", "engine", "cluster"]
    assert [r.exc_info[1].args[0] for r in caplog.records] == ["trainer's", "engine's"]
    assert all("while ValueError propagates" in r.getMessage() for r in caplog.records)

    closed.clear()
    caplog.clear()
    with pytest.raises(RuntimeError, match="trainer's"), caplog.at_level(logging.ERROR, "relax"):
        with ExitStack() as parts:
            for name, error in (("engine", OSError("engine's")), ("trainer", RuntimeError("trainer's"))):
                close_on_exit(parts, Part(name, closed, error), "close")
    assert closed == ["trainer", "engine"]
    assert [r.exc_info[1].args[0] for r in caplog.records] == ["engine's"]


def test_prompts_are_checked_against_the_positions_max_new_tokens_leaves(tmp_path):
    """The tiny model has 128 positions: rollout.max_new_tokens=128 leaves none for a prompt."""
    with pytest.raises(ConfigError, match="rollout.max_new_tokens=128 leaves no room"):
        startup.prepare(make_cfg("rollout.max_new_tokens=128"), tmp_path)
    assert not (tmp_path / "built.json").exists()
