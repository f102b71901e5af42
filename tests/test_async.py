"""train.async=true: rollout k+1 is generated (the engine in a process of its own) while the
driver trains on rollout k, one policy step behind; resume trains every rollout once; dumps
replay exactly; the settings where nothing can overlap are refused before anything starts."""

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from relax.errors import ConfigError, RolloutError
from relax.files import safe_load
from relax.rollout.generate import single_turn
from relax.train.torch_trainer import TorchTrainer

from .conftest import make_cfg, only_run_dir, relax_cli, run_loop

ASYNC = ["train.async=true", "rollout.rollout_batch_size=16"]


def cpu_ns(pid: int) -> int:
    """CPU time of a process's main thread, in nanoseconds (the scheduler's own count)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


async def late_generate(client, prompt, sampling_params):
    """single_turn, 0.2 s late: a rollout cannot be finished before the driver, on a loaded
    machine, starts training on the one before."""
    await asyncio.sleep(0.2)
    return await single_turn(client, prompt, sampling_params)


def test_generation_runs_in_the_engine_process_while_the_driver_trains(tmp_path, monkeypatch):
    """The engine process's CPU time grows inside trainer.train (0.3 s longer here, so that the
    whole of the next rollout's generation fits in it): the engine works while the driver trains."""
    during, train = [], TorchTrainer.train

    def timed_train(self, rollout_id, samples):
        pid = json.loads((tmp_path / "built.json").read_text())["placement"]["engines"][0]["pid"]
        before = cpu_ns(pid)
        out = train(self, rollout_id, samples)
        time.sleep(0.3)
        during.append((pid, cpu_ns(pid) - before))
        return out
    monkeypatch.setattr(TorchTrainer, "train", timed_train)
    rollouts, steps = run_loop(tmp_path, *ASYNC, "rollout.num_rollout=4", "checkpoint.save_interval=null",
                               "rollout.generate_fn=tests.test_async.late_generate")
    assert all(pid != os.getpid() for pid, _ in during)
    # rollouts 1..3 were generated during the training of 0..2 (a generation of 128 samples takes
    # ~10 ms of CPU); nothing is left to make during the last
    assert all(ns > 2e6 for _, ns in during[:-1]) and during[-1][1] < min(ns for _, ns in during[:-1]), during
    assert [r["rollout/staleness"] for r in rollouts] == [0, 1, 1, 1]
    assert [s["rollout_id"] for s in steps] == [0, 1, 2, 3]


async def pid_generate(client, prompt, sampling_params):
    """single_turn, recording the process that ran it."""
    sample = await single_turn(client, prompt, sampling_params)
    sample.metadata["pid"] = os.getpid()
    return sample


def test_the_whole_rollout_is_made_in_the_engine_process(tmp_path):
    """generate_fn, decoding and rewards run beside the engine: the driver only receives the
    finished samples, the same ones a synchronous run makes from the same weights."""
    pid_fn = "rollout.generate_fn=tests.test_async.pid_generate"
    run_loop(tmp_path / "async", *ASYNC, pid_fn, "rollout.num_rollout=2", "checkpoint.save_interval=null",
             f"debug.save_rollout_data={tmp_path}/async/data/{{rollout_id}}.pt")
    engine_pid = json.loads((tmp_path / "async" / "built.json").read_text())["placement"]["engines"][0]["pid"]
    made = safe_load(tmp_path / "async" / "data" / "0.pt")["samples"]
    assert engine_pid != os.getpid() and {s["metadata"]["pid"] for s in made} == {engine_pid}
    run_loop(tmp_path / "sync", "rollout.rollout_batch_size=16", pid_fn, "rollout.num_rollout=1",
             "checkpoint.save_interval=null",
             f"debug.save_rollout_data={tmp_path}/sync/data/{{rollout_id}}.pt")
    in_driver = safe_load(tmp_path / "sync" / "data" / "0.pt")["samples"]
    assert {s["metadata"]["pid"] for s in in_driver} == {os.getpid()}
    for a, b in zip(made, in_driver, strict=True):  # rollout 0: the same weights on both sides
        assert (a["tokens"], a["rollout_log_probs"], a["reward"]) == (b["tokens"], b["rollout_log_probs"],
                                                                      b["reward"])


def test_a_generate_fn_error_in_the_engine_process_stops_the_run_as_itself(tmp_path):
    with pytest.raises(RolloutError) as e:
        run_loop(tmp_path, *ASYNC, "rollout.generate_fn=tests.test_multi_turn.raising_generate",
                 "rollout.num_rollout=2", "checkpoint.save_interval=1")
    message = str(e.value)
    assert "rollout.generate_fn=tests.test_multi_turn.raising_generate at rollout 0 raised on sample 5" \
        in message
    assert "ValueError: the tool crashed" in message
    assert any(note.startswith("in rollout engine 0 (pid ") for note in e.value.__notes__)
    assert not (tmp_path / "checkpoints").exists()


def test_resumed_async_run_trains_every_rollout_once(tmp_path):
    common = [*ASYNC, "rollout.num_rollout=6", "checkpoint.save_interval=3", "checkpoint.keep_last=null"]
    full_rollouts, full_steps = run_loop(tmp_path / "full", *common)
    checkpoint = tmp_path / "full" / "checkpoints" / "rollout_000002"
    rollouts, steps = run_loop(tmp_path / "resumed", *common, f"resume={checkpoint}")
    assert [r["rollout_id"] for r in rollouts] == [s["rollout_id"] for s in steps] == list(range(6))
    samples = [json.loads(line)["rollout_id"] for line in (tmp_path / "resumed" / "samples.jsonl").open()]
    assert samples == list(range(6))
    # the history up to the checkpoint is the first run's; rollout 3 came from the checkpoint's weights
    assert rollouts[:3] == full_rollouts[:3] and steps[:3] == full_steps[:3]
    assert [r["rollout/staleness"] for r in rollouts] == [0, 1, 1, 0, 1, 1]
    # Adam counted one step per rollout, in both runs: none trained twice, none skipped
    for run in ("full", "resumed"):
        state = safe_load(tmp_path / run / "checkpoints" / "rollout_000005" / "trainer_state.pt")
        assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {6.0}


def test_async_dumps_replay_exactly_and_the_doctor_passes(tmp_path):
    from relax.debug.checks import FAIL, diagnose
    from relax.debug.run_data import load_run

    dump = tmp_path / "dump"
    _, steps = run_loop(tmp_path / "run", *ASYNC, "rollout.num_rollout=3", "checkpoint.save_interval=null",
                        f"debug.dump_details={dump}")
    saved = safe_load(dump / "rollout_data" / "2.pt")["samples"]
    assert {s["metadata"]["policy_version"] for s in saved} == {1}
    _, replayed = run_loop(tmp_path / "replay", "rollout.rollout_batch_size=16", "rollout.num_rollout=3",
                           "checkpoint.save_interval=null", f"debug.load_rollout_data={dump}/rollout_data/"
                           "{rollout_id}.pt")
    for a, b in zip(steps, replayed, strict=True):
        assert (a["train/loss"], a["train/grad_norm"]) == (b["train/loss"], b["train/grad_norm"])
    checks = diagnose(load_run(tmp_path / "run"))
    assert not [c for c in checks if c.verdict == FAIL]
    assert "2 stale rollouts of train.async left out" in checks[4].summary


@pytest.mark.parametrize("overrides,message", [
    (["debug=rollout_only"], "debug.rollout_only builds no trainer"),
    (["debug.load_rollout_data=/nowhere/{rollout_id}.pt"], "replays saved rollouts and generates none"),
    (["rollout.colocate=true"], "a colocated engine gives up its memory while the trainer runs"),
], ids=["rollout_only", "train_only", "colocate"])
def test_async_is_refused_where_nothing_can_overlap(overrides, message):
    from relax.debug.plan import resolve

    with pytest.raises(ConfigError, match=message):
        resolve(make_cfg("train.async=true", *overrides))


def test_async_refusal_stops_the_cli_before_anything_starts(tmp_path):
    proc = relax_cli("train.async=true", "debug=rollout_only", cwd=tmp_path)
    assert proc.returncode == 2 and "debug.rollout_only builds no trainer" in proc.stdout + proc.stderr
    assert not (only_run_dir(tmp_path) / "built.json").exists()


def test_weights_reach_the_engine_process_through_shared_memory(tmp_path, monkeypatch):
    """The first sync sends the engine process shared-memory tensors; every later one copies the
    new weights into them and sends only the bucket's key. The engine-weights check after
    every sync still finds the trainer's weights in the engine."""
    from relax.cluster.engine_processes import EngineProcesses

    sent, share = [], EngineProcesses.share

    def recording(self, named):
        bucket = share(self, named)
        sent.append(bucket.tensors is not None)
        return bucket
    monkeypatch.setattr(EngineProcesses, "share", recording)
    run_loop(tmp_path, *ASYNC, "rollout.num_rollout=3", "checkpoint.save_interval=null",
             "debug.check_weight_update_equal=true", "debug.check_weight_update_every_sync=true")
    # one bucket (the tiny model): the check's two syncs at start-up (random weights, then the
    # trainer's), then one per rollout
    assert sent == [True, False, False, False, False]
    report = json.loads((tmp_path / "weight_check.json").read_text())
    assert report["passed"] and [c["rollout_id"] for c in report["checks"]] == [None, None, 0, 1, 2]


def test_the_rollout_after_next_starts_at_the_weight_sync_on_its_weights():
    """Rollouts: get(k) starts k+1 (unless started); synced(k) starts k+2 at once, on the weights
    trained through k (policy version k + 1), before the loop takes up k+1."""
    import threading

    from relax.rollout.prefetch import Rollouts

    started, gate = [], threading.Event()

    def make(rollout_id, policy_version):
        started.append((rollout_id, policy_version))
        gate.wait(5)
        return [], {}
    rollouts = Rollouts(make, [3, 4, 5, 6], prefetch=True)
    gate.set()
    assert rollouts.get(3)[2] == 3 and rollouts.pending.keys() == {4}  # a resumed run's first: made now
    rollouts.wait()
    gate.clear()
    rollouts.synced(3)
    assert rollouts.pending.keys() == {4, 5}
    gate.set()
    assert rollouts.get(4)[2] == 3 and rollouts.pending.keys() == {5}  # 5 is not started twice
    rollouts.wait()
    rollouts.synced(4)
    assert rollouts.get(5)[2] == 4
    rollouts.synced(5)  # nothing after 6
    assert rollouts.get(6)[2] == 5 and not rollouts.pending
    rollouts.close()
    assert started == [(3, 3), (4, 3), (5, 4), (6, 5)]


def test_wait_and_close_let_the_generation_in_flight_finish():
    """wait() (before a weight sync) and close() (before the engine shuts down) return only once
    the prefetched generation has ended, so it never sees weights change or its engine go."""
    import threading

    from relax.rollout.prefetch import Rollouts

    done, gate, running = [], threading.Event(), threading.Event()

    def make(rollout_id, policy_version):
        if rollout_id:  # the prefetched ones wait for the gate
            running.set()
            gate.wait(5)
        done.append(rollout_id)
        return [], {}
    rollouts = Rollouts(make, [0, 1, 2], prefetch=True)
    rollouts.get(0)  # made now; starts 1
    threading.Timer(0.2, gate.set).start()
    rollouts.wait()
    assert done == [0, 1]
    gate.clear()
    running.clear()
    rollouts.get(1)  # starts 2
    assert running.wait(5)  # in flight (close() cancels a generation not yet begun)
    threading.Timer(0.2, gate.set).start()
    rollouts.close()
    assert done == [0, 1, 2] and not rollouts.pending


class EchoEngine:
    """A stand-in engine for EngineProcesses (built in the spawned process from its name)."""

    def __init__(self, name, base_gpu_id):
        self.name, self.base_gpu_id = name, base_gpu_id

    def who(self, x):
        return self.name, self.base_gpu_id, x, os.getpid()

    def process(self) -> dict:
        """The settings an engine process makes for itself."""
        import ctypes
        import gc

        import torch

        pdeathsig = ctypes.c_int()
        ctypes.CDLL("libc.so.6").prctl(2, ctypes.byref(pdeathsig))  # PR_GET_PDEATHSIG
        return {"threads": torch.get_num_threads(), "heap_frozen": gc.get_freeze_count() > 0,
                "dies_with_driver": pdeathsig.value == signal.SIGTERM}

    def exit(self, code):
        os._exit(code)

    def shutdown(self):
        pass


def test_engine_processes_answer_in_order_end_on_shutdown_and_name_a_dead_engine_and_its_log(tmp_path):
    """EngineProcesses without the loop: each engine's base_gpu_id and results in the order
    asked; its num_threads, frozen heap and death with the driver; shutdown ends a process by
    itself; a dead engine is named with its pid and its own log; later calls are refused."""
    from relax.cluster.engine_processes import EngineProcesses
    from relax.cluster.ranks import RankError

    engines = EngineProcesses(EchoEngine, ("e",), ["cpu", "cpu"], [0, 2], str(tmp_path), num_threads=2)
    try:
        (one, gpu1, x1, pid1), (zero, gpu0, x0, pid0) = engines.map("who", [(10,), (11,)], engines=[1, 0])
        assert (one, gpu1, x1) == ("e", 2, 10) and (zero, gpu0, x0) == ("e", 0, 11)
        assert engines.map("process", [()]) == [{"threads": 2, "heap_frozen": True, "dies_with_driver": True}]
        assert [(p["engine"], p["pid"]) for p in engines.placement()] == [(0, pid0), (1, pid1)]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["engine0.log", "engine1.log"]
        assert engines.map("shutdown", [()], engines=[0]) == [None]
        engines.procs[0].join(30)
        assert engines.procs[0].exitcode == 0  # it left its loop by itself
        with pytest.raises(RankError, match=rf"^rollout engine 1 \(pid {pid1}\) died \(exit code 3\); "
                                            rf"see {tmp_path}/engine1.log$"):
            engines.map("exit", [(3,)], engines=[1])
        with pytest.raises(RankError, match="the rollout engines were stopped"):
            engines.map("who", [(1,)])
    finally:
        engines.kill()
