"""Attention data parallelism with the MoE layers expert-parallel: N ranks, each with its own
engine (scheduler, KV cache, its share of the requests), stepping together.

``DataParallel.generate`` is one collective call on every rank:

1. **Requests.** Rank 0 checks every request (a bad one raises on every rank, nothing queued),
   gives them their ids and sequence ids (so seeds are what one engine would give), and spreads
   them over the ranks (``Router``, ``DEEPINFER_DP_POLICY``): by default heaviest first
   (prompt + max_tokens, times n), each to the rank with the least queued work, ties to the rank
   with the most free KV blocks, then the lowest rank, with **prefix affinity**: rank 0
   remembers which rank it last gave each full-block chain hash of the prompts it assigned (the
   prefix cache's own keys, ``KVCacheManager.prompt_hashes``; an LRU map of
   ``DEEPINFER_DP_AFFINITY_ENTRIES`` hashes), and a request whose prompt starts with a remembered
   prefix goes to the rank given the longest such prefix, whose cache most likely still holds
   it, unless that rank's queued work, less the prompt tokens the prefix saves there, exceeds the
   least-loaded rank's by more than ``DEEPINFER_DP_AFFINITY_SLACK`` times the request's own cost
   (``assign``; the request weighs only what it still has to compute on that rank). ``least_load``
   turns affinity off; ``round_robin`` (a benchmark baseline) hands requests out in turn.
2. **Lock-step.** Every step starts with one small all-reduce: who still has work, who failed,
   how many requests finished. While anyone has work, every rank steps: a rank with work runs
   its engine's step; a rank whose step ran no forward pass (nothing to do, or nothing that
   could run) runs the MoE layers' exchanges empty (``ExpertParallel.idle``), so the ranks
   that compute are never left waiting. Under expert parallelism an engine step runs at most one
   forward pass of the decoder stack (drafters keep every expert and run alone; no graphs), which
   keeps the count the same everywhere.
3. **Context parallelism** (``context_parallel_size`` C > 1: CP groups of C consecutive ranks).
   Before the loop, every prompt whose whole-block prefix (before its last token) reaches
   ``DEEPINFER_CP_MIN_TOKENS`` is prefilled by its owner's CP group: zig-zag chunks, the rows a
   layer's attention needs gathered per layer (``ContextParallel``; the model's
   ``prefill_context_parallel``). The owner puts the prefix's cache rows into its prefix cache,
   and the request's admission finds them there: it computes only its last few tokens (on V4
   also the bounded replay its rings need) and decodes on the owner. (Those tokens count as
   cached tokens in its output.)
   A CP prefill that raises on one rank is dropped by its whole group at once (the other ranks
   learn it at their next gather; ``ContextParallel.fail``), its MoE exchanges finished empty,
   and the owner prefills that prompt on its own.
4. **EPLB.** Every ``DEEPINFER_EPLB_INTERVAL`` steps (counted the same on every rank) the
   experts are re-placed for the load counted since the last time, between two steps: requests
   in flight go on with the moved weights. The imbalance before and after goes into the next
   ``StepStats.extra["eplb"]``.
5. **Outputs.** Every rank's finished requests are gathered on every rank and returned in
   prompt order (under torchrun every rank's ``generate`` returns all of them).

An engine error on one rank is reported at the next step's all-reduce: every rank aborts what
it has, the finished outputs are gathered, and every rank raises ``GenerationError`` with them.
An error inside the forward pass first finishes that pass's MoE exchanges (empty from the
layer it reached, ``ExpertParallel.finish_pass``; an exchange whose expert computation raised
still sends its rows back), so no rank is left waiting. A rank that dies is reported by
``launch.Group.failure``.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from deepinfer_core.engine.output import GenerationError, to_output
from deepinfer_core.engine.progress import Progress, step_progress
from deepinfer_core.config import ParallelConfig, settings
from deepinfer_core.parallel import launch
from deepinfer_core.parallel.communicator import communicator_for
from deepinfer_core.parallel.context_parallel import ContextParallel, PeerFailed
from deepinfer_core.parallel.expert_parallel import ExpertParallel
from deepinfer_core.parallel.launch import Group
from deepinfer_core.sampling.params import SamplingParams

log = logging.getLogger("deepinfer")

DISK_FLUSH_S = 300.0  # how long closing waits for the other ranks to write their disk tiers and exit
GENERATE, STOP, STEP = "generate", "stop", "step"  # what rank 0 tells spawned ranks (STEP: one serving step)


class Refused(RuntimeError):
    """On a rank other than 0: rank 0 refused the requests of this ``generate`` (it raises why)."""

    def __init__(self, error: BaseException):
        super().__init__(f"rank 0 refused the requests: {type(error).__name__}: {error}")
        self.error = error


@dataclass
class Work:
    """One checked request as rank 0 hands it to the rank that runs it (in the caller's order)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    first_seq_id: int
    rank: int = 0

    @property
    def cost(self) -> int:
        return (len(self.prompt_token_ids) + (self.params.max_tokens or 0)) * self.params.n


def assign(costs: list[int], loads: list[int], free_blocks: list[int] | None = None,
           hashes: list[list[bytes]] | None = None, holders: Mapping[bytes, int] | None = None,
           slack: float = 1.0, block_size: int = 0) -> list[int]:
    """The rank for each of ``costs``: heaviest first, each to the rank whose load (``loads``, the
    work it already has) is then the least; ties go to the rank with the most free KV blocks,
    then to the lowest rank.

    Prefix affinity, with ``hashes`` (each request's prompt block chain hashes, in order) and
    ``holders`` (block hash -> the rank last given it): a request's preferred rank is the one
    given its longest prefix, the last of its hashes found among the requests placed before it in
    this call or else in ``holders``. A prefix of k blocks there saves k * ``block_size`` of the
    request's work (at most all of its prompt): it goes there, its cost less what the prefix saves
    counted in that rank's load, unless that rank's load less the saving exceeds the least load by
    more than ``slack`` times the request's cost. Pure: nothing passed in is changed."""
    loads = list(loads)
    free = free_blocks or [0] * len(loads)
    ranks = [0] * len(costs)
    placed: dict[bytes, int] = {}  # the hashes of this call's requests placed so far
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(len(loads)), key=lambda r: (loads[r], -free[r], r))
        cost = costs[i]
        if hashes is not None:
            for k in range(len(hashes[i]), 0, -1):  # a chain hash stands for its whole prefix: the longest known wins
                h = hashes[i][k - 1]
                held = placed.get(h)
                if held is None and holders is not None:
                    held = holders.get(h)
                if held is not None:
                    saved = min(k * block_size, costs[i])
                    if loads[held] - saved <= loads[rank] + slack * costs[i]:
                        rank, cost = held, costs[i] - saved
                    break
            for h in hashes[i]:
                placed[h] = rank
        ranks[i] = rank
        loads[rank] += cost
    return ranks


class Router:
    """Rank 0's choice of rank for each new request, by ``policy`` (``DEEPINFER_DP_POLICY``):
    "affinity" (least load with prefix affinity, ``assign``), "least_load" (``assign`` without
    affinity) or "round_robin" (in turn, across calls; a baseline). Under "affinity" it keeps
    ``holders``: block hash -> the rank last given a prompt with that block, an LRU map of at most
    ``entries`` hashes (``DEEPINFER_DP_AFFINITY_ENTRIES``); ``prompt_hashes`` is the cache's own
    key function (``KVCacheManager.prompt_hashes``: empty with prefix caching off, so affinity
    then changes nothing)."""

    def __init__(self, size: int, prompt_hashes: Callable[[list[int]], list[bytes]], block_size: int,
                 policy: str | None = None, slack: float | None = None, entries: int | None = None):
        config = settings()
        self.size, self.prompt_hashes, self.block_size = size, prompt_hashes, block_size
        self.policy = policy or config.dp_policy
        self.slack = config.dp_affinity_slack if slack is None else slack
        self.entries = entries or config.dp_affinity_entries
        self.holders: OrderedDict[bytes, int] = OrderedDict()
        self.next_rank = 0  # round robin's next rank

    def route(self, work: list[Work], loads: list[int], free_blocks: list[int]) -> None:
        """Set ``rank`` on each of ``work`` (the ranks' queued tokens and free KV blocks now)."""
        if self.policy == "round_robin":
            for w in work:
                w.rank, self.next_rank = self.next_rank, (self.next_rank + 1) % self.size
            return
        hashes = None
        if self.policy == "affinity":  # prompt_logprobs requests never reuse a cached prefix
            hashes = [self.prompt_hashes(w.prompt_token_ids) if w.params.prompt_logprobs is None else [] for w in work]
        ranks = assign([w.cost for w in work], loads, free_blocks, hashes, self.holders, self.slack, self.block_size)
        for i, (w, rank) in enumerate(zip(work, ranks)):
            w.rank = rank
            if hashes is not None:
                self.remember(hashes[i], rank)

    def remember(self, hashes: list[bytes], rank: int) -> None:
        """``rank`` was given a prompt with these block hashes: it will hold them (most recent first)."""
        holders = self.holders
        for h in hashes:
            holders[h] = rank
            holders.move_to_end(h)
        while len(holders) > self.entries:
            holders.popitem(last=False)


class DataParallel:
    """This rank's engine in a data-parallel group (``launch.Group``), with the MoE layers'
    experts sharded over the group when ``parallel.expert_parallel``, and CP groups of
    ``parallel.context_parallel_size`` consecutive ranks."""

    def __init__(self, engine, group: Group, parallel: ParallelConfig):
        self.engine, self.group = engine, group
        self.ep = None
        self.cp_size = parallel.context_parallel_size
        self.cp_comm = None
        if self.cp_size > 1:  # every rank creates every CP group, in the same order
            for first in range(0, group.size, self.cp_size):
                members = list(range(first, first + self.cp_size))
                handle = dist.new_group(members, timeout=datetime.timedelta(seconds=settings().dist_timeout))
                if group.rank in members:
                    self.cp_comm = communicator_for(engine.plugins, engine.backend.name, engine.platform, handle)
        self.cp_min_tokens = settings().cp_min_tokens
        self.num_cp_prefills = 0  # prefixes this rank's requests got from a CP prefill
        if parallel.expert_parallel:
            config = engine.model_config
            comm = communicator_for(engine.plugins, engine.backend.name, engine.platform)
            self.ep = ExpertParallel(engine.model, comm, config.n_routed_experts, num_groups=getattr(config, "n_group", None) or 1)
            log.info("expert parallelism over %d ranks: %d expert slots per MoE layer (%d per rank)", group.size,
                     self.ep.num_slots, self.ep.num_slots // group.size)
        self.eplb_interval = settings().eplb_interval
        self.steps = 0  # lock-step steps since start-up (the same on every rank)
        self.rank_preemptions: list[int] = []  # every rank's engine.num_preemptions after the last generate
        self.rank_gauges: list[dict[str, float]] = []  # every rank's engine.gauges() after the last generate
        self.served_counts: dict[str, list[int]] = {}  # serving: output tokens per sample already reported, by request
        self.router = Router(group.size, engine.kv.prompt_hashes, engine.kv.block_size)  # rank 0's: where new requests go

    @property
    def rank(self) -> int:
        return self.group.rank

    def queued_tokens(self) -> int:
        """This rank's unfinished work: prompt tokens still to compute plus tokens still to generate."""
        total = 0
        for req in self.engine.requests.values():
            for seq in req.seqs:
                if not seq.is_finished:
                    total += max(0, len(seq.prompt_token_ids) - seq.num_computed_tokens)
                    total += max(0, (req.params.max_tokens or 0) - len(seq.output_token_ids))
        return total

    # ---- the collective generate ---------------------------------------------------------------
    def generate(self, prepare=None, use_tqdm: bool = False) -> list:
        """Run a batch of requests across the group; every rank calls it. On rank 0 ``prepare()``
        returns the checked requests (``Work``, ranks unset) and the engine's next (seq, request)
        ids after them, or raises (then every rank raises: rank 0 the error itself, the others
        ``Refused`` around it); other ranks pass None. Returns the RequestOutputs in the caller's
        order on every rank."""
        control = self.group.control
        loads = [None] * self.group.size
        dist.all_gather_object(loads, (self.queued_tokens(), self.engine.kv.num_free), group=control)
        box = [None]
        if self.rank == 0:
            try:
                work, next_ids = prepare()
                self.router.route(work, [q for q, _ in loads], [f for _, f in loads])
                box = [(work, next_ids)]
            except Exception as e:  # noqa: BLE001 - sent to every rank, raised there
                box = [e]
        dist.broadcast_object_list(box, src=0, group=control)
        if isinstance(box[0], BaseException):
            raise Refused(box[0]) if self.rank else box[0]
        work, next_ids = box[0]
        engine = self.engine
        self._queue(work)
        engine.next_seq_id, engine.next_request_id = next_ids
        self._context_parallel_prefills(work)
        done, failure = self._run(len(work), use_tqdm)
        gathered = [None] * self.group.size
        dist.all_gather_object(gathered, (done, failure, engine.num_preemptions, engine.gauges()), group=control)
        self.rank_preemptions = [n for _, _, n, _ in gathered]
        self.rank_gauges = [g for _, _, _, g in gathered]
        outputs = {rid: out for part, _, _, _ in gathered for rid, out in part.items()}
        ordered = [dataclasses.replace(outputs[w.request_id], prompt=w.prompt) for w in work]
        failures = [f for _, f, _, _ in gathered if f]
        if failures:
            raise GenerationError(f"generation failed: {'; '.join(failures)}; finished results are in .outputs", ordered)
        return ordered

    def summary(self) -> str:
        """``Engine.summary`` for the whole group: every rank's prefix-cache lookups, drafts and
        preemptions summed, as they stood after the last ``generate`` (rank 0's alone before one)."""
        if not self.rank_gauges:
            return self.engine.summary()
        totals = {k: sum(g[k] for g in self.rank_gauges) for k in self.rank_gauges[0]}
        return self.engine.summary(totals, sum(self.rank_preemptions))

    def _cp_prefix(self, w: Work) -> int:
        """How many tokens of ``w``'s prompt its CP group prefills: the whole blocks before its
        last token when they reach DEEPINFER_CP_MIN_TOKENS (and CP is on), else 0."""
        block = self.engine.kv.block_size
        length = (len(w.prompt_token_ids) - 1) // block * block
        if self.cp_size == 1 or w.params.prompt_logprobs is not None or length < max(self.cp_min_tokens, 2 * self.cp_size):
            return 0
        return length

    def _context_parallel_prefills(self, work: list[Work]) -> None:
        """Prefill the long prompts' prefixes across their CP groups, before the lock-step loop:
        in rounds, each CP group takes its next long prompt (in the caller's order); a rank whose
        group has none left runs the MoE exchanges empty. The owner puts the prefix's cache rows
        into its prefix cache, where the request's admission finds them."""
        if self.cp_size == 1:
            return
        queues: dict[int, list[tuple[Work, int]]] = {}
        for w in work:
            length = self._cp_prefix(w)
            if length:
                queues.setdefault(w.rank // self.cp_size, []).append((w, length))
        mine = queues.get(self.rank // self.cp_size, [])
        engine = self.engine
        for i in range(max((len(q) for q in queues.values()), default=0)):
            if i >= len(mine):
                if self.ep is not None:
                    self.ep.idle()
                continue
            w, length = mine[i]
            cp = ContextParallel(self.cp_comm, length, engine.device)
            positions = cp.positions(engine.device)
            ids = torch.tensor(w.prompt_token_ids[:length], dtype=torch.int64, device=engine.device)[positions]
            exchanges = self.ep.exchanges if self.ep is not None else 0
            try:
                rows = engine.model.prefill_context_parallel(ids, positions, cp)
                cp.finish()
            except Exception as e:  # noqa: BLE001 - the group drops this prefix; its owner prefills it alone
                if not isinstance(e, PeerFailed):
                    log.exception("rank %d: the CP prefill of request %s failed", self.rank, w.request_id)
                    cp.fail()
                if self.ep is not None:  # the pass's MoE exchanges the other ranks still run, run empty
                    self.ep.finish_pass(self.ep.exchanges - exchanges)
                if w.rank == self.rank:
                    log.warning("request %s: the CP prefill of its %d-token prefix failed (%s: %s); it is prefilled on "
                                "its own rank", w.request_id, length, type(e).__name__, e)
                continue
            if w.rank == self.rank:
                block = engine.kv.block_size
                stored = engine.kv.cache_prefix(
                    w.prompt_token_ids[:length], lambda blocks: engine.model.write_context(engine.kv_cache.tensors, rows, blocks, block))
                self.num_cp_prefills += stored
                if not stored:
                    log.warning("request %s: no room in the KV cache for its %d-token prefix from the CP group; it is "
                                "prefilled again on its own rank", w.request_id, length)

    def _run(self, total: int, use_tqdm: bool) -> tuple[dict, str | None]:
        """Step in lock-step until no rank has work or one failed. Returns this rank's outputs by
        request id and its failure (None if it had none)."""
        engine, control = self.engine, self.group.control
        done: dict = {}
        failure = None
        with tqdm(total=total, desc=f"Generating ({self.group.size} ranks)", unit="req",
                  disable=not (use_tqdm and self.rank == 0)) as bar:
            while True:
                working = failure is None and engine.has_unfinished()
                flags = torch.tensor([int(working), int(failure is not None), len(done)], dtype=torch.int64)
                dist.all_reduce(flags, group=control)
                bar.update(int(flags[2]) - bar.n)
                if flags[1] or not flags[0]:
                    break
                finished, failure = self._turn(working)  # failure: reported to every rank at the next all-reduce
                for req in finished:
                    done[req.request_id] = to_output(req, engine.proposer is not None)
        if failure is not None or flags[1]:
            for req in engine.abort_all():
                done.setdefault(req.request_id, to_output(req, engine.proposer is not None))
        return done, failure

    def _queue(self, work: list[Work]) -> None:
        """Add this rank's share of ``work`` to its engine, each request with the sequence ids
        (and so the seeds) one engine would have given; the engine's own counter is left as it was."""
        engine = self.engine
        next_seq_id = engine.next_seq_id
        for w in work:
            if w.rank == self.rank:
                engine.next_seq_id = w.first_seq_id
                engine.add_request({"prompt_token_ids": w.prompt_token_ids}, w.params, request_id=w.request_id)
        engine.next_seq_id = next_seq_id

    def _turn(self, working: bool) -> tuple[list, str | None]:
        """One lock-step turn of this rank: its engine's step when ``working``, then the MoE
        exchanges it missed, run empty (no forward pass, or one cut short by an error), and
        EPLB when its interval is up. Returns (the requests that finished, this rank's failure)."""
        engine, finished, failure = self.engine, [], None
        exchanges = self.ep.exchanges if self.ep is not None else 0
        if working:
            try:
                finished = engine.step()
            except Exception as e:  # noqa: BLE001 - the caller reports it to every rank
                log.exception("rank %d: engine step failed", self.rank)
                failure = f"rank {self.rank}: {type(e).__name__}: {e}"
        if self.ep is not None:
            self.ep.finish_pass(self.ep.exchanges - exchanges)
        self.steps += 1
        if self.ep is not None and self.eplb_interval and self.steps % self.eplb_interval == 0:
            engine.stats_extra["eplb"] = self.ep.rebalance()
        return finished, failure

    # ---- serving -----------------------------------------------------------------------------------
    def serve_step(self, work: list[Work], aborts: list[str], run: bool = True):
        """One step of a served data-parallel LLM (``serving.drivers.ParallelDriver`` on rank 0);
        every rank calls it. Each rank queues its share of ``work`` (ranks set by rank 0), its CP
        group prefills the long prompts' prefixes as ``generate`` does, each rank aborts those of
        ``aborts`` it owns, and, when ``run``, steps like one turn of ``generate``'s lock-step
        loop. Then every rank's news (``Progress``), load (queued tokens, free KV blocks) and
        gauges are gathered. A failed step on any rank makes every rank abort what it has
        (all of it in the news, ``failure`` set). Returns (the news of every rank, their loads,
        the summed gauges)."""
        engine, spec = self.engine, self.engine.proposer is not None
        sent = self.served_counts
        self._queue(work)  # rank 0's counter stays where its driver numbers the next request's samples from
        self._context_parallel_prefills(work)  # the new long prompts' prefixes, across their CP groups
        ended = [to_output(engine.abort(rid), spec) for rid in aborts if rid in engine.requests]
        for out in ended:
            sent.pop(out.request_id, None)
        failure, finished = None, []
        if run:  # a failure is reported to every rank by the gather below
            finished, failure = self._turn(engine.has_unfinished())
        progress = step_progress(engine, finished, sent) if failure is None else Progress()
        progress.ended[:0] = ended
        control = self.group.control
        gathered = [None] * self.group.size
        load = (self.queued_tokens(), engine.kv.num_free)
        dist.all_gather_object(gathered, (progress, failure, load, engine.gauges()), group=control)
        failures = [f for _, f, _, _ in gathered if f]
        if failures:  # every rank ends what it has, as one engine does after a failed step
            aborted = [to_output(req, spec) for req in engine.abort_all()]
            sent.clear()
            more = [None] * self.group.size
            dist.all_gather_object(more, aborted, group=control)
            for part, outs in zip(gathered, more):
                part[0].ended += outs
        merged = Progress([o for part in gathered for o in part[0].ended], [o for part in gathered for o in part[0].partial],
                          "; ".join(failures) or None)
        gauges = {k: sum(part[3][k] for part in gathered) for k in gathered[0][3]}
        return merged, [part[2] for part in gathered], gauges

    # ---- spawned ranks -------------------------------------------------------------------------
    def serve(self) -> None:
        """A spawned rank's life after start-up: take rank 0's commands until it says stop."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.group.commands)
            if box[0] == STOP:
                return
            if isinstance(box[0], tuple) and box[0][0] == STEP:
                self.serve_step(*box[0][1:])
                continue
            try:
                self.generate()
            except (Refused, GenerationError) as e:  # rank 0 raises it for the caller; the group goes on
                log.debug("rank %d: generate ended with %s", self.rank, e)

    def command(self, what: str) -> None:
        """Rank 0 of a spawned group: tell the other ranks what comes next."""
        dist.broadcast_object_list([what], src=0, group=self.group.commands)

    def close(self) -> None:
        """Leave the group: rank 0 of a spawned group stops the other ranks first; under torchrun
        every rank closes (a barrier, so none leaves while another still talks to it). Safe to
        call twice."""
        group = self.group
        if group.broken is None and dist.is_initialized():
            try:
                if group.spawned:
                    self.command(STOP)
                elif group.control is not None:
                    dist.barrier(group=group.control)
            except Exception:  # noqa: BLE001 - a rank may already be gone
                pass
        group.stop(wait=DISK_FLUSH_S if self.engine.config.kv_disk_dir is not None else 10.0)  # ranks write their disk tiers
        group.broken = group.broken or "closed"
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_engine_args(engine_args: tuple, rank: int, size: int) -> tuple:
    """``Engine``'s arguments for one rank: a disk KV tier (``kv_disk_dir``) gets a directory of
    its own inside the one given, ``rank<R>-of-<N>``, and an even share of ``kv_disk_gb`` (each rank
    caches its own requests' prefixes; a restart with the same size finds them again)."""
    model_dir, config, *rest = engine_args
    if config.kv_disk_dir is None:
        return engine_args
    config = config.model_copy(update={"kv_disk_dir": os.path.join(config.kv_disk_dir, f"rank{rank}-of-{size}"),
                                       "kv_disk_gb": config.kv_disk_gb / size})
    return (model_dir, config, *rest)


def worker_main(rank: int, size: int, port: int, engine_args: tuple, parallel: ParallelConfig, log_level: str) -> None:
    """A spawned rank (``launch.spawn``'s worker): build the engine, join the group, serve rank 0's
    commands, then finish its disk tier's writes. An error after start-up is written to the
    rendezvous store for rank 0 to report."""
    from deepinfer_core.config import configure_logging
    from deepinfer_core.engine.engine import Engine

    configure_logging(log_level)
    shard = (rank, size) if parallel.expert_parallel else None
    engine_args = rank_engine_args(engine_args, rank, size)
    group, engine = launch.worker_join(rank, size, port, lambda: Engine(*engine_args, progress=False, expert_parallel=shard))
    try:
        DataParallel(engine, group, parallel).serve()
    except BaseException as e:
        launch.report(group.store, rank, e)
        raise SystemExit(1) from None
    dist.destroy_process_group()
    engine.kv.close_tiers()  # the blocks its pool still caches go to its disk tier too
