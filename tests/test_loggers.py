"""Metrics sinks (relax/logger/): a W&B run written offline, read back from its transaction log
with wandb's own protobuf records; TensorBoard's event files read with its EventAccumulator;
both together get metrics.jsonl's numbers; unknown backends are refused."""

import json
import struct
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from relax.errors import ConfigError, ReplayError

from .conftest import make_cfg, run_loop
from .extras import TENSORBOARD, WANDB, require

RUN = ["logger=wandb", "logger.backends=[tensorboard,wandb]", "rollout.num_rollout=2",
       "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2", "checkpoint.save_interval=null"]
BLOCK, FULL, LAST = 32 * 1024, 1, 4  # the LevelDB log format that .wandb files use


def wandb_records(path: Path) -> list:
    """The records of a .wandb transaction log (a 7-byte ':W&B' header, then LevelDB-log
    chunks of wandb.proto Record messages), as wandb sync replays them."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def of_type(records, kind: str) -> list:
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """A 2-rollout run logging to metrics.jsonl, TensorBoard and W&B (offline) at once."""
    require("wandb", WANDB)
    require("tensorboard", TENSORBOARD)
    run_dir = tmp_path_factory.mktemp("loggers") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")  # never the network
        mp.delenv("WANDB_DISABLED", raising=False)
        rollouts, steps = run_loop(run_dir, *RUN)
    scalars = {}  # rollout_id -> key -> the value last logged at that step
    for record in sorted(steps + rollouts, key=lambda r: r["rollout_id"]):
        scalars.setdefault(record["rollout_id"], {}).update(
            {k: v for k, v in record.items() if "/" in k and isinstance(v, (int, float))})
    return run_dir, rollouts, steps, scalars


def test_wandb_offline_run_holds_the_metrics_and_the_composed_config(logged):
    run_dir, rollouts, _, scalars = logged
    logs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1
    records = wandb_records(logs[0])
    (run,) = of_type(records, "run")
    assert run.display_name == run_dir.name and run.project == "relax"
    config = {i.key: json.loads(i.value_json) for i in run.config.update if i.key != "_wandb"}
    assert config == OmegaConf.to_container(make_cfg(*RUN), resolve=True)
    history = {h.step.num: {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in h.item}
               for h in of_type(records, "history")}
    assert sorted(history) == [0, 1]
    for rollout_id, expected in scalars.items():
        assert {k: history[rollout_id][k] for k in expected} == expected  # JSON floats: exact
    assert "rollout/raw_reward" in history[1] and "train/grad_norm" in history[1]
    assert len(of_type(records, "exit")) == 1  # the run was finished, not left open


def test_tensorboard_gets_the_same_numbers(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, _, scalars = logged
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {k for v in scalars.values() for k in v}
    for rollout_id, expected in scalars.items():
        for key, value in expected.items():
            last = [e.value for e in events.Scalars(key) if e.step == rollout_id][-1]
            assert last == pytest.approx(value, rel=1e-6, abs=1e-30), key  # stored as float32


def test_logger_wandb_selects_the_wandb_backend():
    assert list(make_cfg("logger=wandb").logger.backends) == ["wandb"]
    assert list(make_cfg().logger.backends) == []


def test_an_unknown_backend_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"backends has .mlflow.: expected any of tensorboard, wandb"):
        run_loop(tmp_path, "logger.backends=[tensorboard,mlflow]", "rollout.num_rollout=1")
    assert not (tmp_path / "built.json").exists()


def test_metrics_are_appended_to_the_restored_history_and_readable_before_close(tmp_path):
    """metrics.jsonl is opened for appending (a resumed run's history comes first) and each
    record is flushed as written, so a run killed at any moment keeps every logged record."""
    from relax.logger import MetricsLogger, read_metrics

    restored = {"rollout_id": 0, "rollout/raw_reward": 0.5}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(restored) + "\n")
    step = {"rollout_id": 1, "step": 0, "train/loss": 1.0, "train/grad_norm": 2.0}
    rollout = {"rollout_id": 1, "rollout/raw_reward": 0.25}
    logger = MetricsLogger(tmp_path)
    logger.log(step, "rollout_id")
    logger.log(rollout, "rollout_id")
    assert read_metrics(tmp_path) == ([restored, rollout], [step])
    logger.close()
    assert read_metrics(tmp_path / "no_run") == ([], [])
    bad = {"rollout_id": "1", "rollout/raw_reward": 0.5}  # a string rollout_id
    (tmp_path / "metrics.jsonl").write_text(json.dumps(bad) + "\n" + json.dumps(step) + "\n")
    with pytest.raises(ReplayError, match=r"metrics.jsonl: not a metrics record \(an integer rollout_id"):
        read_metrics(tmp_path)
    # what readers (doctor, compare, the plot) index without a check: a rollout's raw reward, a
    # step's loss and grad_norm, as numbers
    for bad, keys in (({"rollout_id": 0}, "rollout/raw_reward"),
                      ({**step, "train/grad_norm": None}, "train/loss, train/grad_norm"),
                      ({k: v for k, v in step.items() if k != "train/loss"}, "train/loss, train/grad_norm")):
        (tmp_path / "metrics.jsonl").write_text(json.dumps(restored) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ReplayError, match=f"numbers for {keys}\\): "):
            read_metrics(tmp_path)


def test_a_backend_whose_library_is_missing_is_refused_naming_the_extra(monkeypatch):
    from relax import logger

    monkeypatch.setattr(logger.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"backends has 'wandb', but wandb is not installed: "
                                          r"pip install -e '\.\[wandb\]'"):
        logger.check_backends(["wandb"])


def test_a_resumed_runs_tensorboard_replaces_the_steps_it_redoes(tmp_path):
    """resume_from purges what the first run logged at the steps the resumed one logs again."""
    require("tensorboard", TENSORBOARD)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from relax.logger import MetricsLogger

    for resume_from, rollout_ids, offset in ((0, range(4), 0.0), (2, range(2, 4), 10.0)):
        logger = MetricsLogger(tmp_path, ["tensorboard"], resume_from=resume_from)
        for i in rollout_ids:
            logger.log({"rollout_id": i, "rollout/raw_reward": offset + i}, "rollout_id")
        logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("rollout/raw_reward")]
    assert logged == [(0, 0), (1, 1), (2, 12), (3, 13)]
