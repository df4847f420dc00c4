"""``AsyncLLM``: requests submitted and streamed from asyncio while one thread runs the engine.

The engine is not thread-safe, so everything that touches it runs on one engine thread: it
takes requests and aborts from an inbox, steps while any request is unfinished, and after
every step hands each request's new state to the asyncio task waiting for it (through the
task's event loop, thread-safely). A request that is refused (bad input) raises in the caller's
``generate``; the engine keeps serving. Cancelling the task that iterates ``generate`` (a client
that went away) aborts the request at once: its blocks are freed by the next engine-thread turn.
If a step fails, every request in flight ends with finish_reason "abort" and its stream raises
``GenerationError`` with what it had produced; requests that arrive afterwards run normally.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from deepinfer_core.api import LLM, GenerationError, RequestOutput, to_output
from deepinfer_core.config import ConfigError
from deepinfer_core.sampling.params import SamplingParams

log = logging.getLogger("deepinfer")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent: list[int] = field(default_factory=list)  # output tokens per sample already handed over


class AsyncLLM:
    """An asyncio front end over ``llm``'s engine (the offline ``LLM`` stays usable, but not while
    this front end runs: both would drive the same engine)."""

    def __init__(self, llm: LLM):
        if getattr(llm, "parallel", None) is not None:
            raise ConfigError("serving a data-parallel LLM is not supported yet (the server drives one engine; the ranks "
                              "step together only inside LLM.generate); serve with data_parallel_size=1")
        self.llm = llm
        self.engine = llm.engine
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
        engine = self.engine
        while True:
            if not self._take_inbox():
                return
            if not engine.has_unfinished():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                finished = engine.step()
            except Exception as e:  # the step failed: every request in flight ends, the engine goes on
                log.exception("engine step failed; aborting the %d requests in flight", len(engine.requests))
                for req in engine.abort_all():
                    out = self._ended(req)
                    self._deliver(req.request_id, GenerationError(f"generation failed: {type(e).__name__}: {e}", [out]))
                continue
            for req in finished:
                self._deliver(req.request_id, self._ended(req))
            for rid, req in engine.requests.items():
                stream = self._streams.get(rid)
                counts = [len(s.output_token_ids) for s in req.seqs]
                if stream is not None and counts != stream.sent:
                    stream.sent = counts
                    self._send(stream, self._partial(req))

    def _ended(self, req) -> RequestOutput:
        """A finished or aborted request's output, shown to the listeners."""
        out = to_output(req, self.engine.proposer is not None)
        for listener in self.listeners:
            try:
                listener(out)
            except Exception:  # a listener's bug must not stop the engine thread
                log.exception("request listener failed")
        return out

    def _partial(self, req) -> RequestOutput:
        """An unfinished request's output, its samples' text decoded so far. Text that may still
        change is held back: an incomplete UTF-8 character at the end, and the last characters
        a stop string could start with (the finished text is cut before the stop string)."""
        out = to_output(req, self.engine.proposer is not None)
        for c, seq in zip(out.outputs, req.seqs):
            if not seq.is_finished:
                text = self.engine.output.text_so_far(seq)
                hold = max(map(len, seq.params.stop)) - 1 if seq.params.stop and not seq.params.include_stop_str_in_output else 0
                c.text = text[: max(0, len(text) - hold)]
        return out

    def _take_inbox(self) -> bool:
        """Apply the queued adds and aborts; False when asked to stop."""
        engine = self.engine
        while self._inbox:
            item = self._inbox.popleft()
            if item[0] == "add":
                _, prompt, params, request_id, stream, added = item
                try:
                    rid = engine.add_request(prompt, params, request_id=request_id)
                except Exception as e:  # refused: the caller's error, the engine untouched
                    added.set_exception(e)
                    continue
                self._streams[rid] = stream
                added.set_result(rid)
            elif item[0] == "abort":
                rid = item[1]
                if rid in engine.requests:
                    self._ended(engine.abort(rid))
                self._streams.pop(rid, None)
            else:  # stop
                for req in engine.abort_all():
                    self._deliver(req.request_id, self._ended(req))
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
