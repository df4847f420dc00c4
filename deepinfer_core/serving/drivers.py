"""What ``AsyncLLM``'s engine thread drives: one engine (``LocalDriver``) or a data-parallel
group from its rank 0 (``ParallelDriver``). Both take requests and aborts, step, and report each
step's ``Progress``: the requests that ended (finished, or aborted) and the unfinished ones whose
output changed, as ``RequestOutput`` (the partial ones with text that may still change held
back, ``partial_output``).

A driver never raises for a failed step: the failure is in ``Progress.failure``, the requests it
ended are in ``Progress.ended``, and every other request it had is lost (the group is gone).
"""

from __future__ import annotations

import dataclasses
import logging

from deepinfer_core.engine.engine import RequestError
from deepinfer_core.engine.output import RequestOutput, to_output
from deepinfer_core.engine.progress import Progress, step_progress
from deepinfer_core.sampling.params import SamplingParams

log = logging.getLogger("deepinfer")


class Unavailable(RuntimeError):
    """The driver can take no more requests: its data-parallel group is gone (a rank died)."""


class LocalDriver:
    """One engine, stepped on the caller's (the engine) thread."""

    def __init__(self, engine):
        self.engine = engine
        self._sent: dict[str, list[int]] = {}  # output tokens per sample already reported

    def add(self, prompt, params: SamplingParams, request_id: str | None) -> str:
        return self.engine.add_request(prompt, params, request_id=request_id)

    def abort(self, rid: str) -> list[RequestOutput]:
        """The request's final output (now), or nothing when it had already ended."""
        self._sent.pop(rid, None)
        if rid not in self.engine.requests:
            return []
        return [to_output(self.engine.abort(rid), self.engine.proposer is not None)]

    def abort_all(self) -> list[RequestOutput]:
        self._sent.clear()
        return [to_output(req, self.engine.proposer is not None) for req in self.engine.abort_all()]

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> Progress:
        try:
            finished = self.engine.step()
        except Exception as e:  # noqa: BLE001 - every request in flight ends; the engine goes on
            log.exception("engine step failed; aborting the %d requests in flight", len(self.engine.requests))
            return Progress(ended=self.abort_all(), failure=f"{type(e).__name__}: {e}")
        return step_progress(self.engine, finished, self._sent)

    def gauges(self) -> dict[str, float]:
        return self.engine.gauges()

    def unavailable(self) -> str | None:
        """Why no request can run any more (None: it can)."""
        return None

    def watch(self) -> None:
        """Called by the engine thread while idle: a prefill instance frees the blocks its decode
        instances have read (or that nobody read in time)."""
        self.engine.poll_transfers()


class ParallelDriver:
    """Rank 0 of a spawned data-parallel group (``parallel.data_parallel.DataParallel``): it checks
    each request, gives it its ids, and at the next step hands it to a rank (``Router``: the
    least queued work, with prefix affinity by default); every step is one ``serve_step`` of the whole group, which returns
    every rank's news. The gauges are summed over the ranks, as of the last step."""

    def __init__(self, dp):
        if not dp.group.spawned and dp.group.size > 1:
            from deepinfer_core.config import ConfigError

            raise ConfigError("serving a data-parallel LLM launched by torchrun is not supported (its other ranks run your "
                              "script, not the server's steps): let the LLM start its ranks itself (no torchrun)")
        self.dp, self.engine = dp, dp.engine
        self._work: list = []  # checked, not yet handed to a rank
        self._aborts: list[str] = []
        self._live: dict[str, str | None] = {}  # request id -> its prompt text, until it ends
        self._gauges: dict[str, float] = self.engine.gauges()
        self._loads = [(0, self.engine.kv.num_free)] * dp.group.size  # (queued tokens, free KV blocks) per rank

    def add(self, prompt, params: SamplingParams, request_id: str | None) -> str:
        from deepinfer_core.parallel.data_parallel import Work

        engine = self.engine
        why = self.unavailable()
        if why:
            raise Unavailable(why)
        text, ids = engine.validate(prompt, params)
        rid = request_id if request_id is not None else str(engine.next_request_id)
        if rid in self._live:
            raise RequestError(f"request id {rid!r} is already in use")
        if request_id is None:
            engine.next_request_id += 1
        self._work.append(Work(rid, text, ids, params, engine.next_seq_id))
        engine.next_seq_id += params.n
        self._live[rid] = text
        return rid

    def abort(self, rid: str) -> list[RequestOutput]:
        """Nothing now: the owner rank aborts it at the next step, which reports its output."""
        if rid in self._live and rid not in self._aborts:
            self._aborts.append(rid)
        return []

    def abort_all(self) -> list[RequestOutput]:
        for rid in self._live:
            self.abort(rid)
        return self._step(run=False).ended if self._live and not self.dp.group.broken else []

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def step(self) -> Progress:
        return self._step(run=True)

    def _step(self, run: bool) -> Progress:
        from deepinfer_core.parallel.data_parallel import STEP

        dp, work, aborts = self.dp, self._work, self._aborts
        self._work, self._aborts = [], []
        dp.router.route(work, [q for q, _ in self._loads], [f for _, f in self._loads])
        try:
            dp.command((STEP, work, aborts, run))
            progress, loads, gauges = dp.serve_step(work, aborts, run)
        except Exception as e:  # noqa: BLE001 - a collective failed: a rank died; every request is lost
            failure = dp.group.failure(e)
            log.error("%s", failure)
            self._live.clear()
            return Progress(failure=str(failure))
        self._loads, self._gauges = loads, gauges
        ended = [dataclasses.replace(out, prompt=self._live.pop(out.request_id, None)) for out in progress.ended]
        partial = [dataclasses.replace(out, prompt=self._live.get(out.request_id)) for out in progress.partial]
        if progress.failure:
            self._live.clear()  # every rank aborted what it had: all of it is in ``ended``
        return Progress(ended, partial, progress.failure)

    def gauges(self) -> dict[str, float]:
        return self._gauges

    def unavailable(self) -> str | None:
        """Why no request can run (None: it can): the group broke, or one of its ranks exited
        (seen at once, from any thread, before a step fails on it)."""
        group = self.dp.group
        broken = group.broken or group.exited()
        return f"the data-parallel group is gone ({broken}); restart the server" if broken else None

    def watch(self) -> None:
        """The engine thread, while idle: a rank that exited breaks the group now (the other ranks
        are stopped), not when the next request's step fails on it."""
        group = self.dp.group
        if group.broken is None:
            gone = group.exited()
            if gone:
                log.error("%s", group.failure(RuntimeError(gone)))
