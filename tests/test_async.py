"""train.max_staleness=k (train.async=true: k=1): rollouts are generated (the engine in a process
of its own) while the driver trains, rollout j on policy version j - k; 0 is the synchronous
loop; a resumed run (the checkpoint keeps the rollouts made ahead) and a replay of its saved
data end with its weights, bit for bit; the settings where nothing can overlap are refused
before anything starts."""

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relax.errors import ConfigError, RolloutError
from relax.files import safe_load
from relax.logger import read_metrics
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


def last_weights(run_dir: Path, rollout_id: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"rollout_{rollout_id:06d}" / "hf" / "model.safetensors"))


def same_run(a: Path, b: Path, last: int) -> None:
    """Two runs' metrics (all but their timings) and last checkpoint's weights, bit for bit."""
    def untimed(records):
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]
    (rollouts_a, steps_a), (rollouts_b, steps_b) = read_metrics(a), read_metrics(b)
    assert untimed(rollouts_a) == untimed(rollouts_b) and untimed(steps_a) == untimed(steps_b)
    wa, wb = last_weights(a, last), last_weights(b, last)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("k,staleness", [(1, [0, 1, 1, 1, 1, 1]), (2, [0, 1, 2, 2, 2, 2])])
def test_a_resumed_run_is_the_uninterrupted_run(tmp_path, k, staleness):
    """The checkpoint after rollout 2 keeps rollouts 3.. made on older weights than its own: the
    resumed run trains them, not new ones, and ends with the uninterrupted run's weights."""
    common = [*ASYNC, f"train.max_staleness={k}", "rollout.num_rollout=6", "checkpoint.save_interval=3",
              "checkpoint.keep_last=null"]
    full_rollouts, _ = run_loop(tmp_path / "full", *common)
    checkpoint = tmp_path / "full" / "checkpoints" / "rollout_000002"
    assert sorted(p.name for p in (checkpoint / "rollouts_ahead").iterdir()) == [f"{3 + i}.pt" for i in range(k)]
    rollouts, steps = run_loop(tmp_path / "resumed", *common, f"resume={checkpoint}")
    assert [r["rollout_id"] for r in rollouts] == [s["rollout_id"] for s in steps] == list(range(6))
    samples = [json.loads(line)["rollout_id"] for line in (tmp_path / "resumed" / "samples.jsonl").open()]
    assert samples == list(range(6))
    assert [r["rollout/staleness"] for r in full_rollouts] == staleness
    # made ahead: how long the trainer waited for each, and the engine for its weights
    assert all(r["perf/train_idle_time"] >= 0 and r["perf/generation_idle_time"] >= 0 for r in full_rollouts)
    assert max(r["perf/rollouts_ready_ahead"] for r in full_rollouts) <= k
    same_run(tmp_path / "full", tmp_path / "resumed", 5)
    # Adam counted one step per rollout, in both runs: none trained twice, none skipped
    for run in ("full", "resumed"):
        state = safe_load(tmp_path / run / "checkpoints" / "rollout_000005" / "trainer_state.pt")
        assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {6.0}


def test_an_async_run_replays_to_the_bit(tmp_path):
    """debug=train_only on a k=2 run's saved rollouts trains the same samples in the same order:
    the same losses and the same final weights, bit for bit."""
    common = ["rollout.rollout_batch_size=16", "rollout.num_rollout=4", "checkpoint.save_interval=4"]
    run_loop(tmp_path / "run", *common, "train.max_staleness=2",
             f"debug.save_rollout_data={tmp_path}/data/{{rollout_id}}.pt")
    saved = [safe_load(tmp_path / "data" / f"{i}.pt")["samples"][0]["metadata"]["policy_version"]
             for i in range(4)]
    assert saved == [0, 0, 0, 1]
    run_loop(tmp_path / "replay", *common, "debug=train_only",
             f"debug.load_rollout_data={tmp_path}/data/{{rollout_id}}.pt")
    (_, steps), (_, replayed) = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "replay")
    assert [(s["train/loss"], s["train/grad_norm"]) for s in steps] == \
        [(s["train/loss"], s["train/grad_norm"]) for s in replayed]
    a, b = last_weights(tmp_path / "run", 3), last_weights(tmp_path / "replay", 3)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("spelling,same_as", [("train.max_staleness=0", []),
                                              ("train.async=true", ["train.max_staleness=1"])],
                         ids=["0-is-synchronous", "async-is-1"])
def test_max_staleness_0_is_the_synchronous_loop_and_async_spells_1(tmp_path, spelling, same_as):
    common = ["rollout.rollout_batch_size=16", "rollout.num_rollout=3", "checkpoint.save_interval=3"]
    run_loop(tmp_path / "a", *common, spelling)
    run_loop(tmp_path / "b", *common, *same_as)
    same_run(tmp_path / "a", tmp_path / "b", 2)
    staleness = [r["rollout/staleness"] for r in read_metrics(tmp_path / "a")[0]]
    assert staleness == ([0, 0, 0] if spelling.endswith("=0") else [0, 1, 1])


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
    assert "2 stale rollouts of train.max_staleness left out" in checks[4].summary


@pytest.mark.parametrize("overrides,message", [
    (["train.async=true", "debug=rollout_only"], r"^train.async=true overlaps .* debug.rollout_only builds no trainer"),
    (["train.max_staleness=2", "debug=rollout_only"], r"^train.max_staleness=2 overlaps .* builds no trainer"),
    (["train.async=true", "debug.load_rollout_data=/nowhere/{rollout_id}.pt"],
     "replays saved rollouts and generates none"),
    (["train.async=true", "rollout.colocate=true"], "a colocated engine gives up its memory while the trainer runs"),
    (["train.max_staleness=-1"], r"^train.max_staleness=-1: expected a whole number >= 0"),
    (["train.async=true", "train.max_staleness=0"], "train.async means train.max_staleness=1; set one of them"),
], ids=["rollout_only", "rollout_only-k", "train_only", "colocate", "negative", "async-and-0"])
def test_async_is_refused_where_nothing_can_overlap(overrides, message):
    from relax.debug.plan import resolve

    with pytest.raises(ConfigError, match=message):
        resolve(make_cfg(*overrides))


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


def recording_make(gate):
    """A `make` for Rollouts that records (rollout_id, policy_version) and waits for `gate`."""
    started = []

    def make(rollout_id, policy_version):
        started.append((rollout_id, policy_version))
        gate.wait(5)
        return [rollout_id], {}
    return make, started


@pytest.mark.parametrize("k", [1, 2])
def test_rollout_j_is_made_on_version_j_minus_k_as_soon_as_the_engine_holds_it(k):
    """A run resumed at rollout 3: rollouts 3..3+k are pinned to the checkpoint's version 3 and
    start at once; synced(j) (the engine now holds version j + 1) starts j + 1 + k. wait() lets
    the generations in flight end; ahead() is what a checkpoint then keeps."""
    import threading

    from relax.rollout.prefetch import Rollouts

    gate = threading.Event()
    make, started = recording_make(gate)
    ids = list(range(3, 9))
    rollouts = Rollouts(make, ids, max_staleness=k)
    assert rollouts.pending.keys() == set(range(3, 4 + k))
    gate.set()
    for j in ids:
        assert rollouts.get(j)[0][0] == [j]
        rollouts.wait()
        rollouts.synced(j)
        assert set(rollouts.ahead()) == set(range(j + 1, min(j + 1 + k, 9)))  # made on older weights
    rollouts.close()
    assert started == [(j, max(3, j - k)) for j in ids]


def test_a_checkpoints_rollouts_made_ahead_are_not_made_again(caplog):
    import threading

    from relax.rollout.prefetch import Rollouts

    gate = threading.Event()
    gate.set()
    make, started = recording_make(gate)
    kept = {4: (([4], {}), 0.5, 2), 5: (([5], {}), 0.5, 3)}  # from a k=2 run's checkpoint after rollout 3
    rollouts = Rollouts(make, [4, 5, 6, 7], max_staleness=2, made=kept)
    assert rollouts.get(4) == kept[4] and rollouts.get(5) == kept[5]
    assert rollouts.get(6)[2] == 4
    rollouts.close()
    assert started[0] == (6, 4)
    # resumed with k=1 (resume_allow_changes): both are 2 versions behind, so made again, said
    assert Rollouts(make, [4, 5], max_staleness=1, made=kept).made == {}
    assert "the checkpoint's rollouts [4, 5] were made further behind than train.max_staleness=1" \
        in caplog.text
    assert Rollouts(make, [4, 5], max_staleness=3, made=kept).made == kept


def test_without_staleness_each_rollout_is_made_when_asked():
    from relax.rollout.prefetch import Rollouts

    rollouts = Rollouts(lambda j, v: ([j], {}), [0, 1], max_staleness=0)
    assert rollouts.pool is None and not rollouts.pending
    assert rollouts.get(0)[2] == 0
    rollouts.synced(0)
    assert rollouts.get(1)[2] == 1 and rollouts.ahead() == {}


def test_wait_and_close_let_the_generation_in_flight_finish():
    """wait() (before a weight sync) and close() (before the engine shuts down) return only once
    the generation made ahead has ended, so it never sees weights change or its engine go."""
    import threading

    from relax.rollout.prefetch import Rollouts

    done, gate, running = [], threading.Event(), threading.Event()

    def make(rollout_id, policy_version):
        if rollout_id:  # the ones made ahead wait for the gate
            running.set()
            gate.wait(5)
        done.append(rollout_id)
        return [], {}
    rollouts = Rollouts(make, [0, 1, 2], max_staleness=1)  # starts 0 and 1
    rollouts.get(0)
    threading.Timer(0.2, gate.set).start()
    rollouts.wait()
    assert done == [0, 1]
    gate.clear()
    running.clear()
    rollouts.synced(0)  # starts 2
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
