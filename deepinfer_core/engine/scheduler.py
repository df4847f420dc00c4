"""Continuous batching with chunked prefill, prefix caching, draft verification and preemption.

``schedule()`` gives every running sequence the tokens it still has to compute (its newest
token plus any draft tokens to verify for a decoding sequence, a chunk of its prompt for a
prefilling one) within a token budget, then admits waiting sequences while budget, sequence
slots and KV blocks last, starting each after the longest prefix the cache already holds. It
advances the computed-token counts itself and returns a plain ``SchedulerOutput``. When a
running sequence needs a block and none is free, the most recently admitted running sequence
is preempted: its blocks are freed and it goes back to the front of the queue, to be prefilled
again later from its prompt plus the tokens it already produced. With lower KV tiers, a waiting
sequence's prefix blocks that host memory or disk holds are copied back into the pool before its
prefix is looked up (``KVCacheManager.load_from_tiers``); one whose blocks are still being read
from disk waits while others run (or, with nothing else to run, the step waits for the reads).

``update(output, sampled)`` takes the tokens each sampling sequence accepted this step: they are
appended, draft positions that were rejected are rolled back (computed count lowered, paged
blocks truncated), and the full blocks now computed are registered for prefix caching.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from deepinfer_core.engine.kv_cache import KVCacheManager
from deepinfer_core.engine.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    """Positions [start, start + num_tokens) of ``seq`` are computed this step; the last
    ``num_drafts`` of them hold its draft tokens (``seq.draft_token_ids[:num_drafts]``)."""

    seq: Sequence
    start: int
    num_tokens: int
    num_drafts: int = 0
    is_decode: bool = False
    samples: bool = False  # the step reaches the sequence's newest token: its logits are sampled

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    """One step: prefill chunks first, then decode rows (1 + k tokens each)."""

    prefills: list[ScheduledSeq] = field(default_factory=list)
    decodes: list[ScheduledSeq] = field(default_factory=list)
    # seq_id -> cache group -> blocks it gained this step (what a remote worker's tables need)
    new_blocks: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache spared computing for sequences admitted now

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_preempted(self) -> int:
        return len(self.preempted)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.prefills + self.decodes


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.transfer = None  # kv_transfer.KVTransfer of a prefill or decode instance
        self.receiving: list[Sequence] = []  # holding blocks that a READ from a prefill instance fills

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.receiving)

    def schedule(self) -> SchedulerOutput:
        out, reading = self._schedule()
        while out.empty and reading:  # nothing else to do: wait for the disk tier, then admit from it
            self.kv.tiers.wait_reads()
            out, reading = self._schedule()
        return out

    def _schedule(self) -> tuple[SchedulerOutput, bool]:
        """One step's work, and whether a waiting sequence was left waiting for a disk read."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        queue = list(self.running)
        while queue and budget > 0:
            seq = queue.pop(0)
            remaining = seq.num_tokens + seq.num_pending - seq.num_computed_tokens
            if remaining <= 0 or (seq.exports and seq.num_computed_tokens >= seq.num_prompt_tokens):
                continue  # (a prefill instance's sequence computes its prompt only: its blocks go to a decode instance)
            decode = remaining == 1 and seq.num_computed_tokens > 0
            drafts = min(len(seq.draft_token_ids), self.max_model_len - seq.num_tokens - 1) if decode else 0
            num_new = min(remaining + max(drafts, 0), budget)
            if num_new > remaining and not self.kv.can_allocate(seq, seq.num_computed_tokens + num_new):
                num_new = min(remaining, budget)  # drafts never cost another sequence its blocks
            while not self.kv.can_allocate(seq, seq.num_computed_tokens + num_new):
                victim = queue.pop() if queue else seq  # the latest admitted yields first
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._take(out, seq, seq.num_computed_tokens, num_new, max(0, num_new - remaining), decode)
                budget -= num_new

        admitted, reading = [], False
        if not out.preempted:
            for seq in self.waiting:
                if budget <= 0 or len(self.running) + len(self.receiving) >= self.max_num_seqs:
                    break
                if seq.num_pending or self._held_back(seq):
                    continue  # its newest token is still on the device / its sibling is caching their prompt
                if seq.remote is not None:  # its first tokens' blocks come from a prefill instance
                    # (the paged blocks this pool already caches are kept; the READ brings the rest
                    # and the ring and state groups whole: nothing is replayed)
                    hit, cached = self.kv.find_cached(seq)
                    if not self.kv.can_allocate(seq, seq.remote.remote_num_tokens, cached):
                        break
                    self.kv.allocate(seq, seq.remote.remote_num_tokens, cached)
                    self.kv.count_lookup(seq.num_tokens, hit)
                    seq.num_cached_tokens, seq.num_cached_tokens_by_tier = hit, {**dict.fromkeys(self.kv.num_hit_tokens_by_tier, 0),
                                                                                  "gpu": hit}
                    seq.status, seq.paged_write_from = Status.RUNNING, hit
                    admitted.append(seq)
                    self.receiving.append(seq)
                    self.transfer.receive(seq, hit // self.kv.block_size)
                    continue
                if seq.num_computed_tokens == 0 and not self.kv.load_from_tiers(seq):
                    reading = True
                    continue  # its prefix is being read from the disk tier
                hit, cached = self.kv.find_cached(seq) if seq.num_computed_tokens == 0 else (0, {})
                if hit and not self.kv.replay_start(hit):  # the bounded replay would recompute it all: no gain
                    hit, cached = 0, {}
                start = self.kv.replay_start(hit) if hit else seq.num_computed_tokens
                saved = start if hit else 0  # tokens the prefix cache spares computing (hit minus the replay)
                num_new = min(seq.num_tokens - start, budget)
                if not self.kv.can_allocate(seq, start + num_new, cached):
                    break
                admitted.append(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
                by_tier = self.kv.tokens_by_tier(seq, hit, saved)
                seq.loaded_from = {}
                self.kv.count_lookup(seq.num_tokens, saved, by_tier)
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens, seq.num_cached_tokens_by_tier = saved, by_tier
                out.num_cached_tokens += saved
                seq.paged_write_from = hit
                self._take(out, seq, start, num_new, 0, False, cached)
                budget -= num_new
        for seq in admitted:  # after the walk: the queue is not copied every step
            self.waiting.remove(seq)
        self.kv.end_round()
        return out, reading

    def received(self, seq: Sequence) -> None:
        """``seq``'s blocks arrived from the prefill instance: it runs from the tokens they hold (its
        next step computes the prompt's last token and samples)."""
        self.receiving.remove(seq)
        seq.num_computed_tokens = seq.remote.remote_num_tokens
        seq.num_transferred_tokens = seq.num_computed_tokens - seq.num_cached_tokens
        seq.remote = None
        self.running.append(seq)

    def _take(self, out: SchedulerOutput, seq: Sequence, start: int, num_new: int, num_drafts: int, decode: bool,
              cached: dict[str, list[int]] | None = None) -> None:
        added = self.kv.allocate(seq, start + num_new, cached)
        if added:
            out.new_blocks[seq.seq_id] = added
        samples = start + num_new - num_drafts >= seq.num_tokens + seq.num_pending
        scheduled = ScheduledSeq(seq, start, num_new, num_drafts, decode, samples)
        (out.decodes if decode else out.prefills).append(scheduled)
        seq.num_computed_tokens = start + num_new
        if scheduled.samples:
            seq.num_pending += 1

    def _held_back(self, seq: Sequence) -> bool:
        """With prefix caching, the other samples of a request wait until its first sample has
        computed and registered the prompt's full blocks, then start from them: no re-prefill per
        sample (only the prompt's last block is computed again, partial or not: its last token's
        logits are needed)."""
        leader = seq.prefix_leader
        if leader is None or not self.kv.prefix_caching or not self.kv.paged or leader.is_finished or seq.wants_prompt_logprobs:
            return False
        blocks = (leader.num_prompt_tokens - 1) // self.kv.block_size
        if not self.kv.replay_start(blocks * self.kv.block_size):
            return False  # a hit that short would be replayed entirely (and not taken): nothing to wait for
        return leader.num_registered_blocks < blocks

    def update(self, output: SchedulerOutput, sampled: dict[int, list[int]], process: Callable[[Sequence, list[int]], bool]) -> None:
        """``sampled``: seq_id -> the tokens it accepted this step (verified drafts, then the token
        sampled after them), for every sequence of ``output`` that sampled. ``process(seq, tokens)``
        appends them (output processing: stops, logprobs) and says whether the sequence finished.
        Rejected draft positions are rolled back, the full blocks now computed are registered for
        prefix caching, finished sequences release their blocks. Sequences finished or aborted
        since the step was scheduled are skipped."""
        for s in output.scheduled:
            seq = s.seq
            tokens = sampled.get(seq.seq_id)
            if seq.is_finished:
                continue
            running = seq.status is Status.RUNNING  # not preempted while the step ran (overlapped mode)
            rejected = max(0, s.num_drafts - (len(tokens) - 1)) if tokens is not None else 0
            if tokens is not None:
                finished = process(seq, tokens)
                seq.num_pending = 0 if finished else seq.num_pending - 1
                if finished:
                    if running:  # what it computed stays findable after its blocks are released
                        self.kv.cache(seq, min(s.end - rejected, seq.num_tokens))
                    self.finish(seq)
                    continue
            if not running:
                continue  # preempted: it recomputes from scratch
            if rejected:
                seq.num_computed_tokens -= rejected
                self.kv.truncate(seq, seq.num_computed_tokens)
            # what this step wrote (a later step may still be running in overlapped mode)
            self.kv.cache(seq, min(s.end - rejected, seq.num_tokens))

    def forget_pending(self) -> None:
        """No step is in flight, yet sequences wait for sampled tokens: a step was cut short
        (an interrupt, an error) after it was scheduled. Its samples are lost; each such sequence
        recomputes its newest token instead (same position, same seed: the same token). A step
        that failed before its forward wrote the cache leaves counts this cannot repair: after an
        error ``LLM.generate`` aborts everything and resets the pools (``Engine.abort_all``)."""
        for seq in list(self.running) + list(self.waiting):
            if seq.num_pending:
                seq.num_pending = 0
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence's blocks (cached ones stay findable). On a
        prefill instance, a sequence that finished for a decode instance keeps them, parked
        (``KVTransfer.park``); one whose blocks a READ still fills keeps them until it is over."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.receiving:
            self.receiving.remove(seq)
            self.transfer.abandon(seq)
        seq.status = Status.FINISHED
        if seq.exports and seq.finish_reason != "abort" and seq.block_tables:
            seq.kv_transfer_params = self.transfer.park(seq, seq.prompt_token_ids)
        if self.transfer is None or not self.transfer.holds(seq):
            self.kv.free(seq)

    def reset(self) -> None:
        """Forget every sequence and free every block (nothing may be queued or running): what an
        interrupt that landed inside the bookkeeping may have left half-done is undone."""
        self.waiting.clear()
        self.running.clear()
        self.receiving.clear()
        if self.transfer is not None:
            self.transfer.reset()
        self.kv.reset()
