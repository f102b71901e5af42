"""A trainer of N ranks behind one handle: the driver calls methods, every rank runs them.

`TrainerGroup` spawns one process per rank (torch.multiprocessing, gloo on 127.0.0.1),
builds the trainer class in each, and forwards every method call to all ranks (SPMD),
returning rank 0's result. An error on any rank stops the whole group and is raised in
the driver with that rank's traceback. Ranks die with the job: on shutdown, on error,
on Ctrl-C (the driver's `finally`), and when the driver itself dies (parent-death signal
plus EOF on the command pipe). A Ray actor group can later replace this class 1:1.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys
import traceback
from multiprocessing.connection import wait

import torch.multiprocessing as mp

from relax.distributed import free_port

log = logging.getLogger(__name__)


class RankError(RuntimeError):
    pass


def _die_with_parent() -> None:
    try:  # Linux: SIGTERM this rank when the driver process dies, however it dies
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _rank_main(conn, rank, world_size, port, factory, args, kwargs, log_dir):
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process: the driver stops the ranks
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints a hung rank's stacks
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    logging.basicConfig(
        level=logging.INFO, format=f"[%(asctime)s][rank{rank}][%(name)s] %(message)s",
        handlers=[logging.FileHandler(os.path.join(log_dir, f"rank{rank}.log"))] if log_dir else None)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("RELAX_NUM_THREADS", "1")))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        trainer = factory(*args, rank=rank, world_size=world_size, **kwargs)
        conn.send(("ok", None))
        while True:
            method, a, kw = conn.recv()
            result = getattr(trainer, method)(*a, **kw)
            conn.send(("ok", result if rank == 0 else None))
            if method == "shutdown":
                break
    except EOFError:  # the driver went away
        pass
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class TrainerGroup:
    def __init__(self, factory, world_size: int, args=(), kwargs=None, log_dir: str | None = None):
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs, self.busy = [], [], True
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, daemon=True, name=f"relax-rank{rank}",
                               args=(child, rank, world_size, port, factory, args,
                                     kwargs or {}, log_dir))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self._collect()

    def _collect(self):
        results: list = [None] * len(self.conns)
        pending = dict(enumerate(self.conns))
        while pending:
            for conn in wait(list(pending.values())):
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    status, payload = conn.recv()
                except EOFError:
                    self.procs[rank].join(timeout=5)
                    exitcode = self.procs[rank].exitcode
                    self.kill()
                    raise RankError(f"trainer rank {rank} died (exit code {exitcode}); "
                                    f"see its rank{rank}.log") from None
                if status == "error":
                    self.kill()
                    raise RankError(f"trainer rank {rank} failed:\n{payload}")
                results[rank] = payload
                del pending[rank]
        self.busy = False
        return results[0]

    def send(self, method: str, *args, **kwargs) -> None:
        """Start `method` on every rank without waiting (pair with `collect`)."""
        self.busy = True
        for conn in self.conns:
            conn.send((method, args, kwargs))

    def collect(self):
        """Wait for the method `send` started; rank 0's result."""
        return self._collect()

    def call(self, method: str, *args, **kwargs):
        self.send(method, *args, **kwargs)
        return self._collect()

    def train(self, rollout_id, samples):
        return self.call("train", rollout_id, samples)

    def named_weights(self):
        return self.call("named_weights")

    def save_checkpoint(self, path):
        return self.call("save_checkpoint", path)

    def load_checkpoint(self, path):
        return self.call("load_checkpoint", path)

    def shutdown(self):
        if not self.busy and any(p.is_alive() for p in self.procs):  # busy: aborted mid-call (Ctrl-C twice)
            try:
                self.call("shutdown")
            except (RankError, BrokenPipeError, OSError):
                pass
        self.kill()

    def kill(self):
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], [p for p in self.procs if p.is_alive()]
        if self.procs:
            print(f"relax: could not stop {len(self.procs)} trainer ranks", file=sys.stderr)
