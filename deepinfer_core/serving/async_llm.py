"""``AsyncLLM``: requests submitted and streamed from asyncio while one thread runs the engine.

The engine is not thread-safe, so everything that touches it runs on one engine thread: it
takes requests and aborts from an inbox, steps while any request is unfinished, and after
every step hands each request's new state to the asyncio task waiting for it (through the
task's event loop, thread-safely). What it steps is a driver (``drivers``): the LLM's one
engine, or, for a data-parallel LLM, the whole group from rank 0 (each request runs on the rank
with the least queued work; every rank steps together). A request that is refused (bad input)
raises in the caller's ``generate``; the engine keeps serving. Cancelling the task that iterates ``generate`` (a client
that went away) aborts the request at once: its blocks are freed by the next engine-thread turn.
If a step fails, every request in flight ends with finish_reason "abort" and its stream raises
``GenerationError`` with what it had produced; requests that arrive afterwards run normally
(unless a data-parallel rank died: then the group is gone, and every request in flight and
every new one raises ``drivers.Unavailable``, a 503 from the server).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from deepinfer_core.api import LLM, GenerationError, RequestOutput
from deepinfer_core.engine.output import KVTransferFailed
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.serving.drivers import LocalDriver, ParallelDriver, Unavailable

log = logging.getLogger("deepinfer")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLM:
    """An asyncio front end over ``llm``'s engine (the offline ``LLM`` stays usable, but not while
    this front end runs: both would drive the same engine)."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.engine = llm.engine  # rank 0's of a data-parallel LLM: tokenizer, limits, model config
        parallel = getattr(llm, "parallel", None)
        self.driver = ParallelDriver(parallel) if parallel is not None else LocalDriver(llm.engine)
        self._inbox: deque = deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self.listeners: list = []  # called with every request's final RequestOutput, on the engine thread (metrics)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ---- caller side (any event loop) -----------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every engine step that changed it, the last one with
        ``finished`` set. Raises the engine's RequestError/ValueError for a refused request."""
        if self._stopping:
            raise RuntimeError("this AsyncLLM is shut down")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        added: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("add", prompt, params, request_id, stream, added))
        rid = await asyncio.wrap_future(added)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # cancelled, or the caller stopped iterating: free the request's blocks now
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def num_unfinished(self) -> int:
        return len(self._streams)

    def unavailable(self) -> str | None:
        """Why requests cannot run (the server's /health); None while they can."""
        if not self._thread.is_alive():
            return "the engine thread is not running; restart the server"
        return self.driver.unavailable()

    def shutdown(self) -> None:
        """Abort what is running and stop the engine thread."""
        self._stopping = True
        self._post(("stop",))
        self._thread.join(timeout=30)

    def _post(self, item: tuple) -> None:
        self._inbox.append(item)
        self._wake.set()

    # ---- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        driver = self.driver
        while True:
            if not self._take_inbox():
                return
            if not driver.has_unfinished():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                driver.watch()  # a data-parallel rank that died while idle
                continue
            progress = driver.step()
            for out in progress.ended:
                self._ended(out)
                item = GenerationError(f"generation failed: {progress.failure}", [out]) if progress.failure else (
                    KVTransferFailed(out.error, [out]) if out.error else out)
                self._deliver(out.request_id, item)
            if progress.failure:  # requests the failure took without an output (a data-parallel rank died)
                gone = driver.unavailable()
                for rid in list(self._streams):
                    self._deliver(rid, Unavailable(gone) if gone else GenerationError(f"generation failed: {progress.failure}", []))
            for out in progress.partial:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    self._send(stream, out)

    def _ended(self, out: RequestOutput) -> RequestOutput:
        """Show a finished or aborted request's output to the listeners."""
        for listener in self.listeners:
            try:
                listener(out)
            except Exception:  # a listener's bug must not stop the engine thread
                log.exception("request listener failed")
        return out

    def _take_inbox(self) -> bool:
        """Apply the queued adds and aborts; False when asked to stop."""
        driver = self.driver
        while self._inbox:
            item = self._inbox.popleft()
            if item[0] == "add":
                _, prompt, params, request_id, stream, added = item
                try:
                    rid = driver.add(prompt, params, request_id)
                except Exception as e:  # refused: the caller's error, the engine untouched
                    added.set_exception(e)
                    continue
                self._streams[rid] = stream
                added.set_result(rid)
            elif item[0] == "abort":
                rid = item[1]
                for out in driver.abort(rid):
                    self._ended(out)
                self._streams.pop(rid, None)
            else:  # stop
                for out in driver.abort_all():
                    self._deliver(out.request_id, self._ended(out))
                return False
        return True

    def _deliver(self, rid: str, item) -> None:
        stream = self._streams.pop(rid, None)
        if stream is not None:
            self._send(stream, item)

    @staticmethod
    def _send(stream: _Stream, item) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass
