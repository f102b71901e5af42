"""Rollout engines in local processes of their own (cluster=local with train.async=true).

How it works in detail: docs/cluster.md, "Inside `relax/cluster/engine_processes.py`".
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import traceback

import torch
import torch.multiprocessing as mp

from relax.cluster.ranks import (RankError, freeze_heap, leave_stops_to_the_driver, on_this_host, receive,
                                 stop_processes, this_driver, thread_lock_for_progress_bars)
from relax.cluster.shared_weights import SharedBucket, SharedWeights
from relax.errors import USER_ERRORS


def _engine_main(conn, driver, index: int, factory, args, kwargs, log_file: str | None,
                 num_threads: int) -> None:
    leave_stops_to_the_driver(driver)
    thread_lock_for_progress_bars()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints a hung engine's stacks
    logging.basicConfig(level=logging.INFO, format=f"[%(asctime)s][engine{index}][%(name)s] %(message)s",
                        handlers=[logging.FileHandler(log_file)] if log_file else None, force=True)

    torch.set_num_threads(num_threads)
    shared = SharedWeights()  # the driver's weight buckets, mapped from its memory

    def resolve(x):
        return shared.unpack(x) if isinstance(x, SharedBucket) else x

    try:
        engine = factory(*args, **kwargs)
        freeze_heap()
        conn.send(("ok", None))
        while True:
            method, a = conn.recv()
            conn.send(("ok", getattr(engine, method)(*map(resolve, a))))
            if method == "shutdown":
                break
    except EOFError:  # the driver went away
        pass
    except USER_ERRORS as e:  # (a rollout made here: a generate_fn's or reward's error) as itself
        conn.send(("error", e))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class EngineProcesses:
    """One spawned process per engine; `factory(*args, base_gpu_id=...)` builds each."""

    def __init__(self, factory, args: tuple, devices: list[str], base_gpu_ids: list[int],
                 log_dir: str | None, num_threads: int):
        ctx = mp.get_context("spawn")  # (not a daemon: an engine may start processes of its own, as SGLang)
        self.devices, self.conns, self.procs, self.ready = devices, [], [], []
        self.logs = [os.path.join(log_dir, f"engine{i}.log") if log_dir and os.path.isdir(log_dir) else None
                     for i in range(len(devices))]
        for i, gpu in enumerate(base_gpu_ids):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_engine_main, name=f"relax-engine{i}", args=(
                child, this_driver(), i, factory, args, {"base_gpu_id": gpu}, self.logs[i], num_threads))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
            self.ready.append(False)
        self.shared = SharedWeights()  # the weight buckets sent to every engine
        # one call at a time on the pipes: the loop's thread (e.g. a layer dump's forward) and
        # train.async's rollout thread both call the engines
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.procs)

    def _reply(self, i: int):
        return receive(self.conns[i], self.procs[i], f"rollout engine {i} (pid {self.procs[i].pid})",
                       self.logs[i] or "its output", self.kill)

    def map(self, method: str, args: list[tuple], engines: list[int] | None = None) -> list:
        """`method(*args[k])` on engine engines[k] (default: engine k), results in that order."""
        engines = list(engines or range(len(args)))
        with self.lock:
            if not self.conns:
                raise RankError("the rollout engines were stopped (an engine failed earlier)")
            for i, a in zip(engines, args, strict=True):
                if not self.ready[i]:  # its build's answer
                    self._reply(i)
                    self.ready[i] = True
                self.conns[i].send((method, a))
            return [self._reply(i) for i in engines]

    def share(self, named: dict) -> SharedBucket:
        """A weights bucket for every engine, in shared memory."""
        return self.shared.pack(named)

    def placement(self) -> list[dict]:
        return [{"engine": i, **on_this_host(proc.pid, device)}
                for i, (proc, device) in enumerate(zip(self.procs, self.devices, strict=True))]

    def kill(self) -> None:
        stop_processes(self.procs, self.conns)
        self.conns = []
