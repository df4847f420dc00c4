"""Continuous batching with chunked prefill and preemption by recompute.

Each step the scheduler gives every running sequence the tokens it still has to compute (one
for a decoding sequence, a chunk of its prompt for a prefilling one) within a token budget,
then admits waiting sequences while budget, sequence slots and KV blocks last. When a running
sequence needs a block and none is free, the most recently admitted running sequence is
preempted: its blocks are freed and it goes back to the front of the queue, to be prefilled
again later from its prompt plus the tokens it already produced.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from deepinfer_core.engine.kv_cache import BlockManager
from deepinfer_core.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """Sequences to run this step and how many new tokens each computes, prefills first."""

    prefills: list[tuple[Sequence, int]]
    decodes: list[Sequence]
    num_preempted: int = 0

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        num_preempted = 0
        queue = list(self.running)
        while queue and budget > 0:
            seq = queue.pop(0)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.can_allocate(seq, seq.num_computed_tokens + num_new):
                victim = queue.pop() if queue else seq  # the latest admitted yields first
                self._preempt(victim)
                num_preempted += 1
                if victim is seq:
                    break
            else:
                self.blocks.allocate(seq, seq.num_computed_tokens + num_new)
                scheduled.append((seq, num_new))
                budget -= num_new

        if num_preempted == 0:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if not self.blocks.can_allocate(seq, seq.num_computed_tokens + num_new):
                    break
                self.waiting.popleft()
                self.blocks.allocate(seq, seq.num_computed_tokens + num_new)
                seq.status = Status.RUNNING
                self.running.append(seq)
                scheduled.append((seq, num_new))
                budget -= num_new

        prefills = [(s, n) for s, n in scheduled if not self._is_decode(s, n)]
        decodes = [s for s, n in scheduled if self._is_decode(s, n)]
        return ScheduledBatch(prefills, decodes, num_preempted)

    @staticmethod
    def _is_decode(seq: Sequence, num_new: int) -> bool:
        """One new token after a computed context, and it is the sequence's last known token (a
        one-token chunk in the middle of a prompt is a prefill: it must not sample)."""
        return num_new == 1 and seq.num_computed_tokens == seq.num_tokens - 1 > 0

    def commit(self, batch: ScheduledBatch) -> None:
        """The batch ran and was sampled: its sequences' new tokens are now in the cache."""
        for seq, num_new in batch.prefills:
            seq.num_computed_tokens += num_new
        for seq in batch.decodes:
            seq.num_computed_tokens += 1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence's blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED

    def reset(self) -> None:
        """Forget every sequence and free every block (nothing may be queued or running): what an
        interrupt that landed inside the bookkeeping may have left half-done is undone."""
        self.waiting.clear()
        self.running.clear()
        self.blocks.reset()
