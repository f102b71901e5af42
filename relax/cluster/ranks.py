"""A trainer of N ranks behind one handle: the driver calls methods, every rank runs them.

How it works in detail: docs/cluster.md, "Inside `relax/cluster/ranks.py`".
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from relax import faults
from relax.cluster.shared_weights import SharedBucket, SharedWeights, on_cpu
from relax.distributed import free_port
from relax.errors import USER_ERRORS
from relax.process import start_time

log = logging.getLogger(__name__)


class RankError(RuntimeError):
    """A trainer rank or rollout engine failed or died; the message says which, where, and why."""


def local_device(index: int) -> str:
    return f"cuda:{index}" if torch.cuda.is_available() else "cpu"


def on_this_host(pid: int, device: str) -> dict:
    """Where a local rank or engine runs, in the keys a Ray actor's record has (built.json)."""
    return {"node_id": socket.gethostname(), "node_ip": "127.0.0.1", "bundle": None, "device": device,
            "pid": pid}


def open_store(world_size: int):
    """The rendezvous store, opened on a port the OS picks at bind time (a port found free
    earlier may be taken by then: Ray's workers open ports all the time). Ranks connect to
    it by address and `store.port`."""
    return dist.TCPStore("0.0.0.0", 0, world_size, is_master=True, wait_for_workers=False)


def start_rank(rank: int, world_size: int, address: str, port: int, log_dir: str | None,
               num_threads: int, device_index: int, store=None) -> None:
    """What every trainer rank does first, wherever it runs: logs, threads, its device, and
    the gloo process group, through the rendezvous store at address:port (`store`: where
    this process holds it)."""
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints a hung rank's stacks
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(device_index), WORLD_SIZE=str(world_size))
    log_file = os.path.join(log_dir, f"rank{rank}.log") if log_dir and os.path.isdir(log_dir) else None
    logging.basicConfig(
        level=logging.INFO, format=f"[%(asctime)s][rank{rank}][%(name)s] %(message)s",
        handlers=[logging.FileHandler(log_file)] if log_file else None, force=True)

    torch.set_num_threads(num_threads)
    backend = "gloo"
    if torch.cuda.is_available():  # CUDA tensors (Megatron, the trainer's collectives) need NCCL
        torch.cuda.set_device(device_index)
        backend = "cpu:gloo,cuda:nccl"
    store = store or dist.TCPStore(address, port, world_size, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def freeze_heap() -> None:
    """Once a process has built what it serves (a trainer rank, an engine): collect the
    start-up garbage, then freeze what is left. Torch, transformers and the model make hundreds
    of thousands of objects that live as long as the process, and every full collection walked
    them all, in a Ray trainer actor every few rollouts, inside the unpickling of the samples
    (docs/results.md). Frozen, they are never walked again."""
    gc.collect()
    gc.freeze()


def thread_lock_for_progress_bars() -> None:
    """In a process the driver started (a trainer rank, an engine): tqdm's first progress bar
    would make a multiprocessing lock, a POSIX semaphore that only the process's exit handlers
    unlink. The driver SIGKILLs these processes, and at the end of every run with local ranks
    the resource tracker warned of the semaphores left behind. Their bars, each process its own,
    need a lock between threads only."""
    tqdm.set_lock(threading.RLock())


def run_method(trainer, rank: int, method: str, args, kwargs):
    """One call on one rank (`sigkill_rank:<rank>:<rollout_id>`: the test fault of a rank
    killed with SIGKILL as its train step for that rollout starts)."""
    if method == "train" and faults.active(f"sigkill_rank:{rank}:{args[0]}"):
        os.kill(os.getpid(), signal.SIGKILL)
    return getattr(trainer, method)(*args, **kwargs)


def receive(conn, proc, who: str, log: str, kill) -> object:
    """A child process's reply to one call: its result; or, when it died or raised, `kill()`
    (every process of its group) and a RankError naming `who` and where its log is."""
    try:
        status, payload = conn.recv()
    except (EOFError, OSError):
        proc.join(timeout=5)
        code = proc.exitcode
        kill()
        raise RankError(f"{who} died (exit code {code}); see {log}") from None
    if status == "error":
        kill()
        if isinstance(payload, USER_ERRORS):  # raised as itself
            payload.add_note(f"in {who}")
            raise payload
        raise RankError(f"{who} failed:\n{payload}")
    return payload


def stop_processes(procs: list, conns: list) -> None:
    """SIGKILL (a SIGTERM from the living driver would be ignored: leave_stops_to_the_driver);
    close the pipes."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join()
    for conn in conns:
        conn.close()


def this_driver() -> tuple[int, int | None]:
    """The driver, as a process it starts knows it: (pid, start time; None where not Linux)."""
    return os.getpid(), start_time(os.getpid())


def leave_stops_to_the_driver(driver: tuple[int, int | None]) -> None:
    """In a process the driver started (a trainer rank, an engine). A stop of the whole job
    reaches it too: a terminal's Ctrl-C (SIGINT to the process group), `timeout` or
    `kill -- -PGID` (SIGTERM to it), a scheduler stopping the job (Slurm at its time limit,
    `systemctl stop`: SIGTERM to every process). The driver then finishes the rollout with this
    process and writes the checkpoint, so SIGINT is ignored here, and SIGTERM while the driver
    lives. Without the driver it ends: SIGTERM once the driver is gone, which the kernel sends
    when the parent dies (a local rank's parent is the fork server, which exits with the
    driver); the driver itself stops it with SIGKILL (stop_processes)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if driver[1] is None:  # not Linux: a driver's death cannot be told from here; SIGTERM ends it
        return

    def on_sigterm(signum, frame):
        if start_time(driver[0]) != driver[1]:  # the driver is gone (exited, or a zombie)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)  # ends here, as by default
            return
        log.warning("SIGTERM: left to the driver (pid %d), which stops this process after the current "
                    "rollout", driver[0])

    signal.signal(signal.SIGTERM, on_sigterm)


WEIGHTS = ("named_weights", "synced_weights")  # what rank 0 returns through shared memory


def _rank_main(conn, driver, environ, rank, world_size, port, factory, args, kwargs, log_dir, num_threads):
    os.environ.clear()  # the driver's environment now, not the fork server's when it started
    os.environ.update(environ)
    leave_stops_to_the_driver(driver)
    thread_lock_for_progress_bars()
    start_rank(rank, world_size, "127.0.0.1", port, log_dir, num_threads, rank)

    outbox = SharedWeights()  # rank 0's weights, in shared memory the driver maps
    try:
        trainer = factory(*args, rank=rank, world_size=world_size, **kwargs)
        freeze_heap()
        conn.send(("ok", None))
        while True:
            method, a, kw = conn.recv()
            result = run_method(trainer, rank, method, a, kw)
            if rank != 0:  # rank 0 answers for the group
                result = None
            elif method in WEIGHTS and on_cpu(result):
                result = outbox.pack(result)
            conn.send(("ok", result))
            if method == "shutdown":
                break
    except EOFError:  # the driver went away
        pass
    except USER_ERRORS as e:  # (a full disk under its train data, a non-finite loss) as itself
        conn.send(("error", e))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankGroup:
    """The trainer interface over ranks; subclasses give send, collect, rank0_address,
    placement and shutdown."""

    def call(self, method: str, *args, **kwargs):
        self.send(method, *args, **kwargs)
        return self.collect()

    def train(self, rollout_id, samples):
        return self.call("train", rollout_id, samples)

    def named_weights(self):
        return self.call("named_weights")

    def synced_weights(self):
        return self.call("synced_weights")

    def dump_layers(self, *args):
        return self.call("dump_layers", *args)

    def save_checkpoint(self, path):
        return self.call("save_checkpoint", path)

    def load_checkpoint(self, path):
        return self.call("load_checkpoint", path)


def rank_context(preload: tuple[str, ...]):
    """The multiprocessing context local ranks start in. Without CUDA, forkserver: its server
    process imports `preload` (the trainer's heavy modules: Megatron-core's import is the
    slowest, docs/results.md) once per driver, and every rank of every job of a sweep forks from it with them
    imported. Only the first call's `preload` counts (one server per driver). With CUDA,
    spawn: an import that asks CUDA anything in the server would break CUDA in its forks."""
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["relax.cluster.ranks", *preload])
    return ctx


class LocalRanks(RankGroup):
    """One process per rank on this host (torch.multiprocessing, gloo on 127.0.0.1), forked
    from a server that has the trainer's modules imported (rank_context)."""

    def __init__(self, factory, world_size: int, args=(), kwargs=None, log_dir: str | None = None,
                 num_threads: int = 1, preload: tuple[str, ...] = ()):
        ctx = rank_context(preload)
        self.store = open_store(world_size)  # held by the driver while the ranks live
        port = self.store.port
        self.conns, self.procs, self.busy = [], [], True
        self.inbox = SharedWeights()  # rank 0's weights (valid until its next weights call)
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, daemon=True, name=f"relax-rank{rank}",
                               args=(child, this_driver(), dict(os.environ), rank, world_size, port, factory,
                                     args, kwargs or {}, log_dir, num_threads))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.pids = [p.pid for p in self.procs]
        self._collect()

    def _where(self, rank: int) -> str:
        return f"node {socket.gethostname()}, pid {self.pids[rank]}"

    def _collect(self):
        results: list = [None] * len(self.conns)
        pending = dict(enumerate(self.conns))
        while pending:
            for conn in wait(list(pending.values())):
                rank = next(r for r, c in pending.items() if c is conn)
                results[rank] = receive(conn, self.procs[rank], f"trainer rank {rank} ({self._where(rank)})",
                                        f"its rank{rank}.log", self.kill)
                del pending[rank]
        self.busy = False
        return self.inbox.unpack(results[0]) if isinstance(results[0], SharedBucket) else results[0]

    def send(self, method: str, *args, **kwargs) -> None:
        """Start `method` on every rank without waiting (pair with `collect`)."""
        self.busy = True
        for conn in self.conns:
            conn.send((method, args, kwargs))

    def collect(self):
        """Wait for the method `send` started; rank 0's result."""
        return self._collect()

    def rank0_address(self) -> tuple[str, int]:
        return "127.0.0.1", free_port()

    def placement(self) -> list[dict]:
        return [{"rank": r, **on_this_host(pid, local_device(r))} for r, pid in enumerate(self.pids)]

    def shutdown(self):
        if not self.busy and any(p.is_alive() for p in self.procs):  # busy: aborted mid-call (Ctrl-C twice)
            try:
                self.call("shutdown")
            except (RankError, BrokenPipeError, OSError):
                pass
        self.kill()

    def kill(self):
        stop_processes(self.procs, self.conns)
        self.conns, self.procs, self.store = [], [p for p in self.procs if p.is_alive()], None
        if self.procs:
            print(f"relax: could not stop {len(self.procs)} trainer ranks", file=sys.stderr)
