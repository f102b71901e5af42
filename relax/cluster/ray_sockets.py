"""cluster=ray, actors on the driver's node: calls through a Unix socket, weights through
shared memory, as cluster=local's processes have them (cluster.same_node_sockets).

Ray places, starts, supervises and kills every actor, but its calls and object store cost
a small job a large share of each rollout (docs/results.md). So once a group's actors are
built, all on the driver's node, each serves the driver's calls over a Unix socket of its own
(`serve`, one long Ray task) and weights cross as shared-memory tensors rewritten in place
(relax/cluster/shared_weights.py). How deaths and socket addresses work: docs/cluster.md.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import shutil
import sys
import threading
import time
from multiprocessing.connection import Client, Listener, wait

import ray

from relax.cluster.ranks import WEIGHTS, RankError
from relax.cluster.ray_hosts import RayHosts
from relax.cluster.shared_weights import SharedBucket, SharedWeights, on_cpu
from relax.distributed import free_port


def serve(host, path: str) -> None:
    """Inside the actor (Host.serve): run the calls that arrive at the socket `path` on
    `host`, until the driver closes it or asks for shutdown. The actor holds the driver's
    multiprocessing key (Host's `authkey`), which the socket's handshake checks, and which a
    shared-memory tensor needs: it crosses as a file descriptor handed over by the sender's
    resource sharer, which answers processes that hold its key only."""
    authkey = bytes(multiprocessing.current_process().authkey)
    inbox, outbox = SharedWeights(), SharedWeights()  # the engine's weights in; rank 0's out
    with Listener(path, family="AF_UNIX", authkey=authkey) as listener:
        conn = listener.accept()
    with conn:
        while True:
            try:
                method, args, kwargs, keep_result = conn.recv()
            except EOFError:  # the driver went away
                return
            args = [inbox.unpack(a) if isinstance(a, SharedBucket) else a for a in args]
            reply = host.call(method, args, kwargs, keep_result)
            if reply[0] == "ok" and method in WEIGHTS and on_cpu(reply[1]):
                reply = "ok", outbox.pack(reply[1])
            if method == "shutdown":
                remove_temp_dir()
                conn.send(reply)
                return
            conn.send(reply)


def remove_temp_dir() -> None:
    """multiprocessing's temporary folder in this process (where the resource sharer that sent
    rank 0's weights listens), removed before the driver stops the actor: Ray kills it, and its
    exit handlers, which would remove it, never run."""
    tempdir = multiprocessing.process.current_process()._config.pop("tempdir", None)
    if tempdir:
        shutil.rmtree(tempdir, ignore_errors=True)


def reach_by_socket(hosts: RayHosts, timeout_s: float = 60) -> RayHosts:
    """`hosts` as SocketHosts if every actor runs on the driver's node; else as they are (and
    always off Linux, and through Ray Client, `ray://`: its driver is not on the cluster's nodes)."""
    if sys.platform != "linux" or ray.util.client.ray.is_connected():
        return hosts
    node = ray.get_runtime_context().get_node_id()
    if not hosts.actors or any(w["node_id"] != node for w in hosts.where):
        return hosts
    authkey = bytes(multiprocessing.current_process().authkey)
    name = f"\0relax-{os.getpid()}-{secrets.token_hex(8)}"  # (abstract: no file)
    paths = [f"{name}-{hosts.role.split()[-1]}{i}" for i in range(len(hosts))]
    serving = [actor.serve.remote(path) for actor, path in zip(hosts.actors, paths, strict=True)]
    conns, deadline = [], time.monotonic() + timeout_s
    try:
        for i, (path, ref) in enumerate(zip(paths, serving, strict=True)):
            conns.append(_connect(hosts, i, path, ref, authkey, deadline))
    except BaseException:
        for conn in conns:
            conn.close()
        hosts.kill()
        raise
    return SocketHosts(hosts, conns, serving)


def _connect(hosts: RayHosts, i: int, path: str, serving, authkey: bytes, deadline: float):
    while True:
        try:
            return Client(path, family="AF_UNIX", authkey=authkey)
        except ConnectionRefusedError:  # not listening yet
            if ray.wait([serving], timeout=0.01)[0]:
                raise RankError(f"{hosts._where(i)} did not serve: {hosts._reply(serving, i)[1]}") from None
            if time.monotonic() > deadline:
                raise RankError(f"{hosts._where(i)} did not open its socket {path[1:]} in time (an actor "
                                "in a network namespace of its own, e.g. a container? cluster."
                                "same_node_sockets=false keeps Ray's calls)") from None


class SocketHosts(RayHosts):
    """RayHosts whose calls go through each actor's socket. A call is named by its actor's
    index (one call at a time per actor: `map` holds a lock, as train.async's rollout thread
    and the loop's thread both call the engines)."""
    reached_by = "socket"

    def __init__(self, hosts: RayHosts, conns: list, serving: list):
        super().__init__(hosts.role, hosts.actors, hosts.bundles)
        self.where, self.conns, self.serving = hosts.where, conns, serving
        self.inbox, self.shared = SharedWeights(), SharedWeights()  # rank 0's weights; the engines'
        self.lock = threading.Lock()

    def start(self, i: int, method: str, args, kwargs, keep_result: bool = True, bucket_bytes=None) -> int:
        if not self.conns:
            raise RankError(f"the {self.role}s were stopped (one failed earlier)")
        try:
            self.conns[i].send((method, args, kwargs, keep_result))
        except OSError:  # it died since its last call: next_reply reads the end of its socket
            pass
        return i

    def next_reply(self, pending: dict) -> tuple:
        ready = wait([self.conns[i] for _, i in pending.values()])
        i = next(i for _, i in pending.values() if self.conns[i] is ready[0])
        try:
            reply = self.conns[i].recv()
        except (EOFError, OSError):  # it died, or `serve` failed: its task's end says which
            ended = ray.wait([self.serving[i]], timeout=10)[0]
            reply = self._reply(self.serving[i], i) if ended else ("ok", None)
            if reply[0] == "ok":
                reply = "died", f"{self._where(i)} closed its socket"
        if reply[0] == "ok" and isinstance(reply[1], SharedBucket):
            reply = "ok", self.inbox.unpack(reply[1])
        return i, reply

    def watched(self, pending: dict) -> dict:
        return {self.serving[i]: i for _, i in pending.values()}

    def map(self, method: str, args: list[tuple], engines: list[int] | None = None) -> list:
        with self.lock:
            return super().map(method, args, engines)

    def share(self, named):
        """A weights bucket in shared memory, for every engine (fetched first if a trainer rank
        on another node put it into the object store)."""
        return self.shared.pack(ray.get(named) if isinstance(named, ray.ObjectRef) else named)

    def weights(self, result):
        return result  # already in the driver, from shared memory

    def address(self, i: int) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()  # (the actor runs on this node)

    def kill(self) -> None:
        for conn in self.conns:
            conn.close()
        self.conns = []
        super().kill()
