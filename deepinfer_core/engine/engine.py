"""The engine: requests in, one scheduler/runner/sampler step at a time, finished outputs out.

A step: ``Scheduler.schedule()`` -> ``ModelRunner.run()`` -> ``sampler.launch()`` (tokens stay on
the device) -> ``resolve`` (the host copy) -> ``Scheduler.update()`` (append / roll back) ->
``OutputProcessor.process()`` (stops, logprobs, text). In overlapped mode the next step is
scheduled and launched before the previous one is resolved: its decode rows read their newest
token from the device, and stop checks run one step behind (a sequence that finished computed at
most one extra token, which is dropped).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine import startup
from deepinfer_core.engine.requests import (Request, RequestError, bad_words_token_ids, check_request,  # noqa: F401 (RequestError:
                                            encode_prompt)  # the engine's refusal, imported from here too)
from deepinfer_core.engine.runner import PrevTokens, StepOutput
from deepinfer_core.engine.scheduler import SchedulerOutput
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.hookspecs import StepStats
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import SampledBatch, SampleRow, launch, needs_history, probabilities, top_logprobs, verify
from deepinfer_core.sampling import structured
from deepinfer_core.engine.spec_decode import rejection
from deepinfer_core.engine.spec_decode.stats import AcceptanceStats

log = logging.getLogger("deepinfer")

TRANSFER_WAIT_S = 0.001  # a step with nothing to run but KV transfers waits this long before it looks again


def sample_seed(seed: int, index: int) -> int:
    """The random stream of sample ``index`` of a request with ``seed``: (seed, index) hashed, so
    the samples of one seed never repeat another seed's (with seed + index, seed 7's second
    sample was seed 8's first: a seed sweep drew the same samples again)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8, person=b"deepinfer-seed").digest()
    return int.from_bytes(digest, "little") % 2**63


@dataclass
class InFlight:
    """A launched step whose sampled tokens have not reached the host yet."""

    output: SchedulerOutput
    step: StepOutput
    sampled: SampledBatch | None
    t0: float
    prev_finished: list | None = None  # the previous step, resolved during this launch (grammar masks): what it finished


class Engine:
    def __init__(self, model_dir: Path, engine_config: EngineConfig, backend_name: str | None, dtype: str | torch.dtype, progress: bool = True,
                 expert_parallel: tuple[int, int] | None = None):
        """Start up (``startup.start``: backend, model and weights, KV cache, graphs, warm-up).
        ``expert_parallel``: (this rank, EP size) when the MoE layers are sharded over a group."""
        startup.start(self, model_dir, engine_config, backend_name, dtype, progress, expert_parallel)

    # ---- state -------------------------------------------------------------------------------
    def _reset_counters(self) -> None:
        self.requests: dict[str, Request] = {}
        self.next_seq_id = 0  # sequence ids seed unseeded samples (see _seed)
        self.next_request_id = 0
        self._step = 0
        self.num_preemptions = 0  # total, for tests and metrics
        self.spec_stats = AcceptanceStats()  # speculative decoding since start-up: drafts verified / accepted by position

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Token ids that end a sequence (unless ignore_eos): the config's and the tokenizer's."""
        return self.output.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: tuple[int, ...]) -> None:
        self.output.eos_ids = tuple(ids)
        self._grammars = None  # grammars compiled from here on end at the new ids (the matchers' stop tokens)

    # ---- requests ------------------------------------------------------------------------------
    @property
    def grammars(self):
        """The grammar compiler (``sampling.structured.Grammars``), made on first use."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise RequestError("structured outputs (so_args) need the model's tokenizer, and this model directory has none")
            self._grammars = structured.Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_ids)
        return self._grammars

    def compile_grammar(self, params: SamplingParams, label: str = "prompt"):
        """The compiled grammar of ``params.so_args`` (cached by its text); RequestError if invalid."""
        try:
            return self.grammars.compile(params.so_args)
        except ValueError as e:
            raise RequestError(f"{label}: {e}") from None

    def validate(self, prompt: str | list[int] | dict, params: SamplingParams, label: str = "prompt") -> tuple[str | None, list[int]]:
        """Every check ``add_request`` makes, without queueing anything: (prompt text, token ids).
        Raises RequestError naming what is wrong (``engine/requests.py``)."""
        return self._checked(prompt, params, label)[:2]

    def _checked(self, prompt, params: SamplingParams, label: str) -> tuple[str | None, list[int], list[list[int]]]:
        """``validate``'s checks: (prompt text, token ids, the bad words' token ids they tokenised)."""
        text, ids = encode_prompt(self, prompt, label)
        check_request(self, ids, params, label)
        return text, ids, bad_words_token_ids(self, params, label)

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str | None = None,
                    label: str = "prompt") -> str:
        text, ids, bad_words = self._checked(prompt, params, label)
        params = self.resolve_params(params, len(ids))
        rid = request_id if request_id is not None else str(self.next_request_id)
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        exports, remote = False, None
        if params.kv_transfer_params is not None:
            exports, remote, params = self._disaggregated(params, ids, label)
            if exports:  # a prefill instance: the prompt but its last token, once (engine/kv_transfer.py)
                bad_words = []
        req = Request(rid, text, ids[:-1] if exports else ids, params)  # a prefill instance's prompt: what it computes
        first = self.next_seq_id
        compiled = self.compile_grammar(params, label) if params.so_args is not None else None  # cached by check()
        for i in range(params.n):
            seq = Sequence(first + i, rid, i, list(ids[:-1] if exports else ids), params, self._seed(params, i, first + i),
                           bad_words_token_ids=bad_words)
            if compiled is not None:
                seq.grammar = self.grammars.matcher(compiled)
            req.seqs.append(seq)
        req.seqs[0].exports = exports
        if remote is not None and remote.remote_num_tokens:
            req.seqs[0].remote, req.seqs[0].remote_since = remote, time.monotonic()
        for seq in req.seqs[1:]:
            seq.prefix_leader = req.seqs[0]
        self.requests[rid] = req  # known before queued: a withdraw always finds what was queued
        for seq in req.seqs:  # queued only once every sequence could be built
            self.scheduler.add(seq)
        self.next_seq_id += params.n
        if request_id is None:
            self.next_request_id += 1
        return rid

    def _disaggregated(self, params: SamplingParams, ids: list[int], label: str):
        """(whether this prefill instance parks the request's blocks for a decode instance, the
        prefill's blocks this decode instance reads, the params to run) of a request with
        ``kv_transfer_params``; RequestError when this instance cannot take them."""
        from deepinfer_core.engine.kv_transfer import parse_remote

        kv, transfer = params.kv_transfer_params, self.scheduler.transfer
        role = transfer.role if transfer is not None else None
        if params.prompt_logprobs is not None and (kv.get("do_remote_decode") or kv.get("do_remote_prefill")):
            raise RequestError(f"{label}: prompt_logprobs (echo with logprobs) need every prompt position's logits, and a "
                               "prefill/decode pair computes them on neither side; send this request to one instance "
                               "without kv_transfer_params")
        if kv.get("do_remote_decode"):
            if role != "prefill":
                raise RequestError(f"{label}: kv_transfer_params ask this instance to prefill for a decode instance, but it runs "
                                   f"{'as ' + role if role else 'without a role'}; send it to an instance started with --role prefill")
            if len(ids) < 2:
                raise RequestError(f"{label}: a one-token prompt has nothing to prefill (the decode instance computes the last "
                                   "prompt token); send it to the decode instance alone")
            return True, None, params.model_copy(update={
                "n": 1, "max_tokens": 1, "min_tokens": 0, "temperature": 0.0, "logprobs": None, "prompt_logprobs": None,
                "so_args": None, "stop": [], "stop_token_ids": [], "logit_bias": None, "allowed_token_ids": None, "bad_words": None,
                "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "kv_transfer_params": None})
        if kv.get("do_remote_prefill"):
            if role != "decode":
                raise RequestError(f"{label}: kv_transfer_params come from a prefill instance, but this instance runs "
                                   f"{'as ' + role if role else 'without a role'}; send them to an instance started with --role decode")
            try:
                remote = parse_remote(kv, label)
                transfer.check(remote, ids[:-1], label)
            except ValueError as e:
                raise RequestError(str(e)) from None
            return False, remote, params.model_copy(update={"kv_transfer_params": None})
        raise RequestError(f"{label}: kv_transfer_params set neither do_remote_decode (to a prefill instance) nor "
                           "do_remote_prefill (a prefill instance's answer, to a decode instance)")

    def poll_transfers(self) -> list[Request]:
        """Prefill/decode disaggregation's news: blocks that arrived join their sequences to the
        running ones, parked or abandoned blocks are freed, and a request whose blocks did not
        arrive ends (``Request.error``) and is returned."""
        transfer = self.scheduler.transfer
        if transfer is None:
            return []
        polled = transfer.poll()
        for seq in polled.freed:
            self.kv.free(seq)
        for seq in polled.received:
            self.scheduler.received(seq)
        ended = []
        for seq, why in polled.failed:
            self.scheduler.receiving.remove(seq)
            if seq.request_id not in self.requests:  # cannot happen: an aborted request's READ is abandoned, not failed
                continue
            req = self.abort(seq.request_id)
            req.error = f"the KV cache of the prompt did not arrive from the prefill instance: {why}"
            log.error("request %s: %s", seq.request_id, req.error)
            ended.append(req)
        return ended

    def resolve_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """vLLM's open values made concrete for this engine and a prompt of ``num_prompt_tokens``
        (checked by ``validate``): ``max_tokens=None`` is what the context leaves (max_model_len
        less the prompt), ``logprobs=-1`` / ``prompt_logprobs=-1`` the whole vocabulary."""
        update: dict = {}
        if params.max_tokens is None:
            update["max_tokens"] = self.max_model_len - num_prompt_tokens
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(params, name) == -1:
                update[name] = self.model_config.vocab_size
        return params.model_copy(update=update) if update else params

    def _seed(self, params: SamplingParams, index: int, seq_id: int) -> int:
        """Seeded requests: ``sample_seed(seed, sample index)``. Others: derived from the engine
        seed and the sequence id, so a run is reproducible for the same engine seed and request order."""
        if params.seed is not None:
            return sample_seed(params.seed, index)
        return (self.config.seed * 1_000_003 + seq_id) % 2**63

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def gauges(self) -> dict[str, float]:
        """What a server's metrics report, as counts that add up over data-parallel ranks:
        sequences waiting and running, KV blocks used and in all (tightest cache group), prompt
        tokens found in / looked up in the prefix cache (and of those found, how many came back
        from the host and disk tiers), the lower tiers' blocks held and capacity, draft tokens
        verified / accepted, and a prefill/decode instance's sequences parked or being read."""
        kv, tiers, transfer = self.kv, self.kv.tiers, self.scheduler.transfer
        usage = tiers.usage() if tiers is not None else {"kv_host_used_blocks": 0, "kv_host_blocks": 0,
                                                          "kv_disk_used_blocks": 0, "kv_disk_blocks": 0}
        return {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "kv_used_blocks": kv.num_blocks - kv.num_free, "kv_blocks": kv.num_blocks,
                "prefix_hit_tokens": kv.num_hit_tokens, "prefix_queried_tokens": kv.num_queried_tokens,
                "prefix_hit_tokens_host": kv.num_hit_tokens_by_tier["host"], "prefix_hit_tokens_disk": kv.num_hit_tokens_by_tier["disk"],
                **usage, "draft_tokens": self.spec_stats.num_draft_tokens, "accepted_tokens": self.spec_stats.num_accepted_tokens,
                "kv_parked": len(transfer.parked) if transfer else 0, "kv_receiving": len(transfer.receiving) if transfer else 0}

    def abort(self, request_id: str) -> Request:
        """Stop a request (unfinished samples get finish_reason "abort" and the text of the tokens
        they produced), free its blocks, return it."""
        req = self.requests.pop(request_id)
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
                seq.text = self.output.detokenize(seq)
        req.finished_time = time.time()
        return req

    def abort_all(self) -> list[Request]:
        aborted = [self.abort(rid) for rid in list(self.requests)]
        self.in_flight = None
        self.scheduler.reset()  # nothing is left: whatever a failed step left half-done is gone too
        return aborted

    def mark(self) -> tuple[frozenset[str], int, int]:
        """Where the engine stands (its requests, the next sequence and request ids): what
        ``withdraw_since`` takes back to."""
        return frozenset(self.requests), self.next_seq_id, self.next_request_id

    def withdraw_since(self, mark: tuple[frozenset[str], int, int]) -> None:
        """Take back every request added since ``mark`` (``withdraw``), even one whose id its caller
        had not stored yet when it was interrupted."""
        self.withdraw([rid for rid in self.requests if rid not in mark[0]], mark[1:])

    def withdraw(self, request_ids: list[str], ids_before: tuple[int, int]) -> None:
        """Take back requests whose caller will never see them (an interrupted ``generate``). When
        no other request remains, the engine is left as new: queues and block pool rebuilt (an
        interrupt may have landed between two bookkeeping steps) and the id counters where they
        were before the requests came (``ids_before``: next_seq_id, next_request_id), so a rerun
        samples exactly what the interrupted call would have."""
        for rid in request_ids:
            if rid in self.requests:
                self.abort(rid)
        if not self.requests:
            self.in_flight = None
            self.scheduler.reset()
            self.next_seq_id, self.next_request_id = ids_before

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one step; return the requests that finished in it (removed from the engine). In
        overlapped mode the step launched here is resolved by the next call."""
        ended = self.poll_transfers()
        return ended + self._run_step()

    def _run_step(self) -> list[Request]:
        prev, self.in_flight = self.in_flight, None
        if prev is None:
            self.scheduler.forget_pending()
        out = self.scheduler.schedule()
        if out.empty:
            if prev is not None:
                return self._resolve(prev)
            if self.scheduler.has_unfinished():
                transfer = self.scheduler.transfer
                if transfer is not None and transfer.busy:  # blocks on their way, or parked for a decode instance
                    time.sleep(TRANSFER_WAIT_S)
                    return []
                raise RuntimeError("scheduler could not schedule any work; KV cache too small for the waiting requests")
            return []
        finished = []
        if prev is not None and self._needs_host_tokens(out):
            finished, prev = self._resolve(prev), None
            out.prefills = [s for s in out.prefills if not s.seq.is_finished]  # finished by prev's tokens
            out.decodes = [s for s in out.decodes if not s.seq.is_finished]
            if out.empty:
                return finished
        flight = self._launch(out, prev)
        if not self.async_scheduling:
            return finished + self._resolve(flight)
        self.in_flight = flight
        if flight.prev_finished is not None:
            return finished + flight.prev_finished
        return finished + (self._resolve(prev) if prev is not None else [])

    def _needs_host_tokens(self, out: SchedulerOutput) -> bool:
        """Whether this step must see the previous step's tokens on the host before it launches:
        penalties and bad_words read the generated ids; prompt logprobs and verification rows are host work."""
        return any(needs_history(s.seq.params) or s.num_drafts for s in out.scheduled) or any(
            s.seq.wants_prompt_logprobs for s in out.prefills
        )

    def _launch(self, out: SchedulerOutput, prev: InFlight | None) -> InFlight:
        t0 = time.perf_counter()
        self.num_preemptions += out.num_preempted
        prev_tokens = None
        if prev is not None and prev.sampled is not None:
            rows = {s.seq.seq_id: r0 for s, r0, n in prev.step.samples if n == 1}
            prev_tokens = PrevTokens(prev.sampled.tokens, rows)
        self.kv.launching()
        step = self.runner.run(out, prev_tokens)
        prev_finished = None
        if prev is not None and any(s.seq.grammar is not None for s, _, _ in step.samples):
            # a grammar mask needs the previous tokens on the host: they arrive, and the matchers
            # advance, while the device runs this step's forward
            prev_finished = self._resolve(prev)
        for seq, first, logits in step.prompt_logits:
            self.output.record_prompt_logprobs(seq, first, logits)
        rows = []
        for s, _, n in step.samples:
            if n == 1:
                rows.append(SampleRow(s.seq, pending=s.seq.num_pending - 1))
            else:  # a verification row: position j follows drafts 0..j-1
                drafts = s.seq.draft_token_ids[: s.num_drafts]
                rows.extend(SampleRow(s.seq, drafts[:j]) for j in range(n))
        sampled = None
        if rows:
            bitmask = structured.bitmask(rows, self.model_config.vocab_size, pin=self.device.type != "cpu")
            sampled = launch(self.ops, step.sample_logits, rows, self.eos_ids, self.platform.copy_to_host, bitmask)
        return InFlight(out, step, sampled, t0, prev_finished)

    def _resolve(self, flight: InFlight) -> list[Request]:
        """Bring a launched step's tokens to the host: verify drafts, update the scheduler, check
        stops, propose the next drafts. Returns the requests that finished."""
        results = flight.sampled.resolve() if flight.sampled is not None else []
        accepted: dict[int, tuple[list[int], list]] = {}
        step_spec = AcceptanceStats()
        for s, r0, n in flight.step.samples:
            tokens = [results[r0 + j][0] for j in range(n)]
            logprobs = [results[r0 + j][1:] for j in range(n)]
            if s.num_drafts:
                drafts = s.seq.draft_token_ids[: s.num_drafts]
                if len(s.seq.draft_probs) >= s.num_drafts and rejection.uses_rejection(s.seq.params, self.speculative.acceptance):
                    mask = flight.sampled.bitmask
                    tokens, logprobs = self._rejection_verify(s.seq, flight.step.sample_logits[r0 : r0 + n], drafts, tokens, logprobs,
                                                              None if mask is None else mask[r0 : r0 + n])
                else:
                    tokens = verify(tokens, drafts)
                s.seq.spec_stats.add(s.num_drafts, len(tokens) - 1)
                step_spec.add(s.num_drafts, len(tokens) - 1)
            accepted[s.seq.seq_id] = (tokens, logprobs[: len(tokens)])

        def process(seq: Sequence, tokens: list[int]) -> bool:
            return self.output.process(seq, tokens, accepted[seq.seq_id][1])

        new_tokens = {sid: toks for sid, (toks, _) in accepted.items()}
        if self.proposer is not None:  # a draft model catches up while rejected positions still hold their blocks
            self.proposer.observe(flight.output, flight.step, new_tokens)
        self.scheduler.update(flight.output, new_tokens, process)
        if step_spec.num_verify_steps:
            self.spec_stats = self.spec_stats.merge(step_spec)
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        now = time.time()
        finished = []
        for req in self.requests.values():
            if req.first_token_time is None and any(s.output_token_ids for s in req.seqs):
                req.first_token_time = now
            if req.finished:
                req.finished_time = now
                finished.append(req)
        for req in finished:
            del self.requests[req.request_id]
        self._step += 1
        if self.observer is not None:
            out = flight.output
            self.observer(StepStats(
                step=self._step,
                num_prefill_tokens=sum(s.num_tokens for s in out.prefills),
                num_decode_tokens=sum(s.num_tokens for s in out.decodes),
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                num_preempted=out.num_preempted,
                free_kv_blocks=self.kv.num_free,
                seconds=time.perf_counter() - flight.t0,
                num_cached_tokens=out.num_cached_tokens,
                num_draft_tokens=step_spec.num_draft_tokens,
                num_accepted_tokens=step_spec.num_accepted_tokens,
                drafts_by_position=step_spec.proposed,
                accepted_by_position=step_spec.accepted,
                extra=self.stats_extra,
            ))
        self.stats_extra = {}
        return finished

    def _rejection_verify(self, seq: Sequence, logits: torch.Tensor, drafts: list[int], sampled: list[int], logprobs: list,
                          bitmask: torch.Tensor | None = None):
        """Speculative sampling of one verification row (``spec_decode.rejection``): its tokens and
        their (logprob, top logprobs), computed again where a token is not the row's own sample.
        ``bitmask``: the rows' grammar masks (the target's distribution p is the masked one)."""
        rows = [SampleRow(seq, drafts[:j]) for j in range(len(drafts) + 1)]
        q = torch.stack(seq.draft_probs[: len(drafts)])
        p = probabilities(logits, rows, self.eos_ids, bitmask)
        tokens = rejection.accept(p, q, drafts, seq.seed, len(seq.output_token_ids), sampled[-1])
        k = seq.params.logprobs
        for j, token in enumerate(tokens):
            if k is not None and token != sampled[j]:
                row = torch.log_softmax(logits[j].float(), dim=-1)
                logprobs[j] = (float(row[token]), top_logprobs(row, k, token))
        return tokens, logprobs

    def summary(self, gauges: dict[str, float] | None = None, preemptions: int | None = None) -> str:
        """One line on what the engine did since start-up: prefix-cache hits, speculative
        acceptance, preemptions. ``gauges`` / ``preemptions``: several engines' ``gauges()`` and
        preemptions summed (a data-parallel group's, ``DataParallel.summary``) instead of this one's."""
        g = self.gauges() if gauges is None else gauges
        hit, queried = int(g["prefix_hit_tokens"]), int(g["prefix_queried_tokens"])
        parts = [f"prefix cache: {hit} of {queried} prompt tokens reused" + (f" ({hit / queried:.0%})" if queried else "")
                 if self.kv.prefix_caching else "prefix cache: off"]
        if self.kv.tiers is not None:
            parts[0] += f", {int(g['prefix_hit_tokens_host'])} from host memory, {int(g['prefix_hit_tokens_disk'])} from disk"
        if self.proposer is not None:
            drafts, accepted = int(g["draft_tokens"]), int(g["accepted_tokens"])
            rate = f" ({accepted / drafts:.0%})" if drafts else ""
            parts.append(f"speculative: {accepted} of {drafts} draft tokens accepted{rate}")
        parts.append(f"preemptions: {self.num_preemptions if preemptions is None else preemptions}")
        return "; ".join(parts)

    @property
    def num_draft_tokens(self) -> int:
        """Drafts verified since start-up (speculative decoding)."""
        return self.spec_stats.num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        """Of those, accepted."""
        return self.spec_stats.num_accepted_tokens

    @property
    def prefix_hit_rate(self) -> float | None:
        """Tokens found in the prefix cache / tokens of the sequences admitted, since start-up (a
        sequence re-admitted after a preemption counts again, with the output it had)."""
        kv = self.kv
        return kv.num_hit_tokens / kv.num_queried_tokens if kv.prefix_caching and kv.num_queried_tokens else None


