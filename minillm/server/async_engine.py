"""The engine behind an event loop (chapter: serving over HTTP).

HTTP handlers run on an asyncio event loop; ``LLMEngine`` is a plain object that moves one step at
a time. :class:`AsyncEngine` joins the two with one loop coroutine::

    while True:
        apply the requests that handlers added and aborted since the last step
        if nothing is unfinished: sleep until a handler wakes the loop
        run one engine step in a worker thread (the event loop keeps serving meanwhile)
        hand each output to the stream of the request it belongs to

Only the loop touches the engine, and only between steps, so the engine needs no lock. A handler
gets an :class:`OutputStream` from :meth:`AsyncEngine.add` and reads its requests' outputs step by
step. When it stops early (the client hung up, shutdown) it aborts what is left; the
abort reaches the engine before the next step, and the request's KV blocks go back to the pool.
After every step the loop takes the engine's snapshot (``LLMEngine.snapshot``: queues, KV pool,
counters) for ``/metrics`` and the queue bound, and hands the step's outputs to the histograms
(``ServerMetrics.observe``); nothing of the engine is reset, so a served run can be recorded too.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from minillm.engine.engine import LLMEngine
from minillm.engine.request import RequestOutput
from minillm.engine.sampling import SamplingParams
from minillm.server.metrics import ServerMetrics

logger = logging.getLogger("minillm.server")


class QueueFull(Exception):
    """The waiting queue is at ``max_queue``: come back later (503 with Retry-After)."""


class NotAccepting(Exception):
    """The server is shutting down, or its engine stopped after an internal error."""


class OutputStream:
    """The outputs of the requests one HTTP call added, step by step, as an async iterator.
    Outputs of a request that was ended early are dropped."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str]):
        self.request_ids = request_ids
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._unfinished = set(request_ids)

    def put(self, item: RequestOutput | Exception) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        while self._unfinished:
            item = await self._queue.get()
            if isinstance(item, Exception):
                raise item
            if item.request_id in self._unfinished:
                if item.finished:
                    self._unfinished.discard(item.request_id)
                return item
        raise StopAsyncIteration

    def abort(self) -> None:
        """End every request still unfinished; calling it again does nothing."""
        for request_id in list(self._unfinished):
            self._unfinished.discard(request_id)
            self._engine.abort(request_id)


class AsyncEngine:
    """One loop coroutine steps ``engine`` while there is work and sleeps when there is none.

    ``max_queue``: most requests waiting for their first step (None: no bound). ``model_name``
    labels the Prometheus metrics in ``metrics``.
    """

    def __init__(self, engine: LLMEngine, model_name: str, max_queue: int | None = None):
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue must be >= 1 or None, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = ServerMetrics(model_name, engine.snapshot(), engine.config)
        self.accepting = True  # False once shutting down
        self.error: Exception | None = None  # what stopped the loop, if a step failed
        self._streams: dict[str, OutputStream] = {}  # every unfinished request's stream
        self._to_add: list[tuple[str, list[int], SamplingParams, float, str | None]] = []
        self._to_abort: list[str] = []
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()  # nothing in flight
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="minillm-engine")
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="minillm-tokenize")
        self._task: asyncio.Task | None = None

    # -- the loop ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="minillm-engine-loop")

    async def _run(self) -> None:
        """Step until cancelled. Whatever escapes a step (a bug, out of memory) ends the loop
        through :meth:`_fail`: every waiting client gets an error, /health turns 503, ``serve``
        exits non-zero. Nothing a single request sends reaches here: it is checked before it is
        queued, and a request the engine still refuses fails alone (:meth:`_apply_inbox`)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_inbox()
                if not self.engine.has_unfinished():
                    self.metrics.observe(self.engine.snapshot(), [])
                    if not self._streams:
                        self._idle.set()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
                self.metrics.observe(self.engine.snapshot(), outputs)
                for output in outputs:
                    output.detokenize()  # here, between steps: handlers read the text while the next one runs
                    stream = self._streams.pop(output.request_id, None) if output.finished \
                        else self._streams.get(output.request_id)
                    if stream is not None:
                        stream.put(output)
        except Exception as err:
            logger.exception("the engine loop stopped; every request in flight gets an error")
            self._fail(err)

    def _apply_inbox(self) -> None:
        """Adds first, then aborts: a request aborted before it was ever added is still ended. A
        request the engine refuses fails alone: its stream gets the error, and if the engine took
        it before refusing, it is aborted by name."""
        to_add, self._to_add = self._to_add, []
        for request_id, prompt, params, arrival, prompt_of in to_add:
            try:
                self.engine.add_request(request_id, prompt, params, arrival_time=arrival, prompt_of=prompt_of)
            except Exception as err:  # the handler checked it all; this is the engine's last word
                logger.warning("the engine refused request %s: %r", request_id, err)
                self._to_abort.append(request_id)
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.put(err)
        to_abort, self._to_abort = self._to_abort, []
        for request_id in to_abort:
            try:
                self.engine.abort(request_id)
            except ValueError:  # finished meanwhile, or never taken
                pass

    def _fail(self, err: Exception) -> None:
        self.error = err
        self.accepting = False
        for stream in set(self._streams.values()):
            stream.put(NotAccepting(f"the engine stopped after an internal error: {err!r}"))
        self._streams.clear()
        self._idle.set()

    # -- requests in and out -------------------------------------------------------------------------
    def add(self, request_ids: list[str], prompts: list[list[int]], params: list[SamplingParams],
            arrival_time: float, prompt_of: list[str | None] | None = None) -> OutputStream:
        """Queue checked prompts for the next step; their outputs come on the returned stream.
        ``arrival_time`` is on the engine's clock; ``prompt_of``: per request, the earlier one whose
        prompt blocks it shares (``LLMEngine.add_request``). Raises NotAccepting or QueueFull."""
        if not self.accepting:
            raise NotAccepting("the server is shutting down" if self.error is None else
                               f"the engine stopped after an internal error: {self.error!r}")
        waiting = self.metrics.snapshot["num_waiting"] + len(self._to_add)  # as of the last step
        if self.max_queue is not None and waiting + len(prompts) > self.max_queue:
            raise QueueFull(f"{waiting} requests are waiting (max_queue={self.max_queue})")
        stream = OutputStream(self, request_ids)
        prompt_of = prompt_of or [None] * len(request_ids)
        for request_id, prompt, p, parent in zip(request_ids, prompts, params, prompt_of, strict=True):
            self._to_add.append((request_id, prompt, p, arrival_time, parent))
            self._streams[request_id] = stream
        firsts = [i for i, parent in enumerate(prompt_of) if parent is None]  # one per client prompt
        self.metrics.observe_added([params[i] for i in firsts],
                                   [1 + prompt_of.count(request_ids[i]) for i in firsts])
        self._idle.clear()
        self._wakeup.set()
        return stream

    async def tokenize(self, fn, *args):
        """``fn(*args)`` (tokenizing, rendering a chat template) in the tokenizer's thread: the
        tokenizer lets go of the GIL, so the event loop keeps answering meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def abort(self, request_id: str) -> None:
        """End a request before the next step (its KV blocks return to the pool)."""
        self._to_abort.append(request_id)
        self._wakeup.set()

    # -- shutdown ------------------------------------------------------------------------------------
    async def drain(self, timeout: float) -> tuple[int, int]:
        """Take no more requests; give those in flight ``timeout`` seconds to finish, then abort the
        rest (their streams end with finish_reason "abort"). Returns (finished, aborted)."""
        self.accepting = False
        in_flight = len(self._streams)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            pass
        aborted = len(self._streams)
        for request_id in list(self._streams):
            self.abort(request_id)
        await self._idle.wait()
        return in_flight - aborted, aborted

    async def stop(self) -> None:
        """Abort whatever is in flight, stop the loop and the worker thread."""
        if self._task is not None and not self._task.done():
            await self.drain(0)
            self._task.cancel()
        self._executor.shutdown(wait=True)
        self._tokenizer_thread.shutdown(wait=True)
