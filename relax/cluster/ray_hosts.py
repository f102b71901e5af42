"""cluster=ray: the driver's end of a group of Host actors (relax/cluster/ray_cluster.py), one
method run on several of them at a time, through Ray's calls and object store
(relax/cluster/ray_sockets.py's SocketHosts: through Unix sockets).
"""

from __future__ import annotations

import ray

from relax.cluster.ranks import RankError
from relax.cluster.ray_weights import StoredWeights, Tensors


class RayHosts:
    """A list of Host actors: run one method on several of them, raise the first failure."""
    reached_by = "ray"  # how the driver calls them (built.json); ray_sockets.SocketHosts: "socket"

    def __init__(self, role: str, actors: list, bundles: list[int]):
        self.role, self.actors, self.bundles = role, actors, bundles
        self.where: list[dict] = []

    def __len__(self) -> int:
        return len(self.actors)

    def _describe(self, i: int) -> str:
        w = self.where[i] if i < len(self.where) else {}
        return f"node {w.get('node_ip', '?')} ({w.get('node_id', '?')[:8]}), pid {w.get('pid', '?')}"

    def send(self, method: str, args: list[tuple], engines: list[int] | None = None) -> list:
        return [self.start(i, method, a, {}) for i, a in zip(engines or range(len(args)), args, strict=True)]

    def start(self, i: int, method: str, args, kwargs, keep_result: bool = True, bucket_bytes=None):
        """Start one call on actor i; what `collect` waits for (here its ref)."""
        return self.actors[i].call.remote(method, args, kwargs, keep_result, bucket_bytes)

    def next_reply(self, pending: dict) -> tuple:
        """(call, reply) of the first of `pending` (call -> (position, actor index)) to finish."""
        (ref,), _ = ray.wait(list(pending), num_returns=1)
        return ref, self._reply(ref, pending[ref][1])

    def watched(self, pending: dict) -> dict:
        """The refs that tell a pending call's actor died (ref -> actor index)."""
        return {ref: i for ref, (_, i) in pending.items()}

    def collect(self, calls: list, engines: list[int] | None = None) -> list:
        """Results in order; on the first error or death, every actor is stopped and it is raised.
        A failure is often the echo of a peer's death (a collective's connection reset): a death
        among the others within a few seconds is reported as the cause."""
        engines = engines or list(range(len(calls)))
        pending = {call: (k, i) for k, (call, i) in enumerate(zip(calls, engines, strict=True))}
        results = [None] * len(calls)
        while pending:
            call, reply = self.next_reply(pending)
            k, i = pending.pop(call)
            if reply[0] == "ok":
                results[k] = reply[1]
                continue
            user_error = reply[2] if reply[0] == "error" else None
            peer_died = reply[0] == "error" and not user_error and self._first_death(self.watched(pending))
            self.kill()
            if user_error is not None:  # raised as itself
                user_error.add_note(f"in {self._where(i)}")
                raise user_error
            if reply[0] == "died":
                raise RankError(reply[1])
            failed = f"{self._where(i)} failed:\n{reply[1]}"
            raise RankError(f"{peer_died}\nThen {failed}" if peer_died else failed)
        return results

    def _where(self, i: int) -> str:
        return f"{self.role} {i} ({self._describe(i)})"

    def _reply(self, ref, i: int) -> tuple:
        """The actor's reply: ("ok", result), ("error", traceback, user error or None), or
        ("died", what to report)."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return "died", (f"{self._where(i)} died: {reason}. Its log: `ray logs` on that node, "
                            f"or the driver's output")

    def _first_death(self, watched: dict, wait_s: float = 5.0) -> str | None:
        ready, _ = ray.wait(list(watched), num_returns=len(watched), timeout=wait_s)
        deaths = [r[1] for r in (self._reply(ref, watched[ref]) for ref in ready) if r[0] == "died"]
        return deaths[0] if deaths else None

    def map(self, method: str, args: list[tuple], engines: list[int] | None = None) -> list:
        return self.collect(self.send(method, args, engines), engines)

    def share(self, named):
        """A weights bucket, put once into the object store for every engine to read (unless
        a trainer rank put it there: StoredWeights)."""
        return named if isinstance(named, ray.ObjectRef) else ray.put(Tensors(named))

    def weights(self, result) -> StoredWeights:
        """Trainer rank 0's weights, from what its weights call returned (the buckets' refs)."""
        return StoredWeights(result)

    def address(self, i: int) -> tuple[str, int]:
        return ray.get(self.actors[i].address.remote())

    def placement(self) -> list[dict]:
        key = "rank" if self.role == "trainer rank" else "engine"
        return [{key: i, "bundle": b, **w, "reached_by": self.reached_by}
                for i, (b, w) in enumerate(zip(self.bundles, self.where, strict=True))]

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
