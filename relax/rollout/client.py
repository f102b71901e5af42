"""The engine as a rollout.generate_fn sees it, and the concurrency that keeps rollouts batched.

How it works in detail: docs/rollouts.md, "Inside `relax/rollout/client.py`".
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from relax.rollout import Generation, SamplingParams, sample_seeds

QUIET_TURNS = 3  # event-loop turns without a new request before a partial batch goes out


@dataclass
class Request:
    index: int                 # the sample's index (its seed)
    call: int                  # the sample's how-manieth engine call
    tokens: list[int]
    sp: SamplingParams
    future: asyncio.Future


class EngineClient:
    """What a generate_fn gets: `await client.generate(token_ids, sampling_params)` -> Generation
    (response tokens, their log-probs, status); `client.tokenizer` is the run's tokenizer."""

    def __init__(self, batcher: "Batcher", index: int, tokenizer):
        self.batcher, self.index, self.tokenizer, self.calls = batcher, index, tokenizer, 0

    async def generate(self, tokens: list[int], sampling_params: SamplingParams) -> Generation:
        self.calls += 1
        return await self.batcher.request(self.index, self.calls - 1, list(tokens), sampling_params)

    def seed(self, call: int) -> int:
        """The engine seed of this sample's call number `call` (counted from 0)."""
        return sample_seeds(self.batcher.seed, [self.index], [call])[0]


class BlockingEngineClient(EngineClient):
    """A plain (not async) generate_fn's client: it runs in a worker thread and `generate` blocks."""

    def generate(self, tokens: list[int], sampling_params: SamplingParams) -> Generation:
        return asyncio.run_coroutine_threadsafe(super().generate(tokens, sampling_params),
                                                self.batcher.loop).result()


class Batcher:
    """Runs `jobs` concurrently on an event loop in a helper thread; their engine requests are
    answered in batches by the thread that calls `run`."""

    def __init__(self, engine, seed: int):
        self.engine, self.seed = engine, seed
        self.pending: list[Request] = []     # requests not yet sent
        self.inflight: list[Request] = []    # the batch the engine is answering
        self.live = 0                         # jobs still running
        self.outbox: queue.Queue = queue.Queue()  # (batch, answered future) to the engine thread; None: done
        self.loop = self.arrived = None

    def run(self, fn, records: list, sampling_params: SamplingParams, tokenizer, on_error,
            context=contextlib.nullcontext) -> list:
        """`fn(client, record, sampling_params)` for every record (its `index` seeds its engine
        calls), concurrently; the results in record order. The first failure stops the rest:
        an engine's error as it is, fn's as `on_error(record, error)`. `context()`, an async
        context manager, is entered on the event loop around the jobs (an agent's endpoint)."""
        outcome: dict = {}

        def loop_thread():
            try:
                outcome["value"] = asyncio.run(self._main(fn, records, sampling_params, tokenizer, on_error,
                                                          context))
            except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
                outcome["error"] = e
            finally:
                self.outbox.put(None)

        thread = threading.Thread(target=loop_thread, name="relax-rollout", daemon=True)
        thread.start()
        while (item := self.outbox.get()) is not None:
            batch, answered = item
            try:
                answer = self._generate(batch)
            except BaseException as e:  # noqa: BLE001 - handed to the loop, which stops every job
                answer = e
            try:
                self.loop.call_soon_threadsafe(_settle, answered, answer)
            except RuntimeError:  # the loop already stopped (a job failed meanwhile)
                pass
        thread.join()
        if "error" in outcome:
            error = outcome["error"]
            raise error.exceptions[0] if isinstance(error, BaseExceptionGroup) else error
        return outcome["value"]

    def _generate(self, batch: list[Request]) -> list[Generation]:
        """One engine call per distinct sampling params, prompts in sample order (a GRPO group
        stays on one engine); each prompt with its own seed."""
        answers: list = [None] * len(batch)
        by_params: dict[SamplingParams, list[int]] = {}
        for i in sorted(range(len(batch)), key=lambda i: (batch[i].index, batch[i].call)):
            by_params.setdefault(batch[i].sp, []).append(i)
        for sp, rows in by_params.items():
            seeds = sample_seeds(self.seed, [batch[i].index for i in rows], [batch[i].call for i in rows])
            generations = self.engine.generate([batch[i].tokens for i in rows], sp, seeds)
            for i, generation in zip(rows, generations, strict=True):
                answers[i] = generation
        return answers

    # -- on the event loop --------------------------------------------------------------------
    async def _main(self, fn, records, sampling_params, tokenizer, on_error, context) -> list:
        self.loop, self.arrived = asyncio.get_running_loop(), asyncio.Event()
        self.live = len(records)
        blocking = not inspect.iscoroutinefunction(fn)
        pool = ThreadPoolExecutor(max_workers=min(len(records), 256) or 1) if blocking else None

        async def job(record):
            try:
                if blocking:
                    client = BlockingEngineClient(self, record.index, tokenizer)
                    return await self.loop.run_in_executor(pool, fn, client, record, sampling_params)
                return await fn(EngineClient(self, record.index, tokenizer), record, sampling_params)
            except Exception as e:
                raise on_error(record, e) from None
            finally:
                self.live -= 1
                self.arrived.set()

        async with context():
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._dispatch())
                    tasks = [group.create_task(job(r)) for r in records]
            finally:  # after a failure (or an agent cut off): wake whoever still waits on the engine
                for request in self.pending + self.inflight:
                    request.future.cancel()
                if pool:
                    pool.shutdown(wait=False, cancel_futures=True)
        return [t.result() for t in tasks]

    async def request(self, index: int, call: int, tokens: list[int], sp: SamplingParams) -> Generation:
        future = self.loop.create_future()
        self.pending.append(Request(index, call, tokens, sp, future))
        self.arrived.set()
        return await future

    async def _dispatch(self) -> None:
        while self.live:
            await self.arrived.wait()
            self.arrived.clear()
            quiet = 0
            while self.pending and len(self.pending) < self.live and quiet < QUIET_TURNS:
                before = len(self.pending)
                await asyncio.sleep(0)
                quiet = quiet + 1 if len(self.pending) == before else 0
            if not self.pending:
                continue
            self.inflight, self.pending = self.pending, []
            answered = self.loop.create_future()
            self.outbox.put((self.inflight, answered))
            for request, generation in zip(self.inflight, await answered, strict=True):
                request.future.set_result(generation)
            self.inflight = []


def _settle(future: asyncio.Future, answer) -> None:
    if future.done():
        return
    if isinstance(answer, BaseException):
        future.set_exception(answer)
    else:
        future.set_result(answer)
