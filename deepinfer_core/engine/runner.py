"""Turns a scheduled batch into flat tensors, runs the model, and returns the logits needed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.engine.graphs import DecodeGraphs
from deepinfer_core.engine.kv_cache import BlockManager, KVCache
from deepinfer_core.engine.scheduler import ScheduledBatch
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.models.batch import BatchMeta


@dataclass
class StepOutput:
    """Logits rows (float32) for the sequences that sample this step and for prompt logprobs."""

    sample_seqs: list[Sequence]
    sample_logits: torch.Tensor  # [len(sample_seqs), V]
    # (sequence, first position the logits predict, logits [n, V]) for prompt logprobs
    prompt_logits: list[tuple[Sequence, int, torch.Tensor]]


class ModelRunner:
    """``graphs``: when given, decode-only steps that fit its buckets replay CUDA graphs.

    ``run`` changes no sequence: the caches hold the new tokens' entries afterwards, but the
    computed-token counts advance only when the engine commits the step (``Scheduler.commit``),
    so a step that fails or is interrupted before that leaves every sequence as it was.
    """

    def __init__(self, model, kv_cache: KVCache, block_manager: BlockManager, device: torch.device, graphs: DecodeGraphs | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.blocks = block_manager
        self.device = device
        self.graphs = graphs

    def _tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def prepare(self, batch: ScheduledBatch):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_q, cu_k, context_slots = [0], [0], []
        logits_rows: list[int] = []  # flat token index whose logits we need
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []  # index into logits_rows of each sampling sequence
        prompt_rows: list[tuple[Sequence, int, int, int]] = []  # seq, first predicted position, row start, count

        for seq, num_new in batch.prefills:
            start = seq.num_computed_tokens
            end = start + num_new
            row0 = len(input_ids)
            for pos in range(start, end):
                input_ids.append(seq.token_at(pos))
                positions.append(pos)
                slots.append(self.blocks.slot(seq, pos))
            context_slots.extend(self.blocks.slot(seq, pos) for pos in range(end))
            cu_q.append(cu_q[-1] + num_new)
            cu_k.append(cu_k[-1] + end)
            if seq.wants_prompt_logprobs:
                # logits at position p predict token p + 1; only prompt tokens need them here
                count = min(end, seq.num_prompt_tokens - 1) - start
                if count > 0:
                    prompt_rows.append((seq, start + 1, len(logits_rows), count))
                    logits_rows.extend(range(row0, row0 + count))
            if end == seq.num_tokens:
                sample_seqs.append(seq)
                sample_rows.append(len(logits_rows))
                logits_rows.append(len(input_ids) - 1)
        num_prefill_tokens = len(input_ids)

        max_blocks = max((len(s.block_table) for s in batch.decodes), default=0)
        block_tables, seq_lens = [], []
        for seq in batch.decodes:
            pos = seq.num_computed_tokens
            input_ids.append(seq.token_at(pos))
            positions.append(pos)
            slots.append(self.blocks.slot(seq, pos))
            block_tables.append(seq.block_table + [0] * (max_blocks - len(seq.block_table)))
            seq_lens.append(pos + 1)
            sample_seqs.append(seq)
            sample_rows.append(len(logits_rows))
            logits_rows.append(len(input_ids) - 1)

        meta = BatchMeta(
            num_prefill_tokens=num_prefill_tokens,
            slot_mapping=self._tensor(slots, torch.int64),
            prefill_cu_seqlens_q=self._tensor(cu_q, torch.int32),
            prefill_cu_seqlens_k=self._tensor(cu_k, torch.int32),
            prefill_context_slots=self._tensor(context_slots, torch.int64),
            decode_block_tables=self._tensor(block_tables, torch.int32).view(len(batch.decodes), max_blocks),
            decode_seq_lens=self._tensor(seq_lens, torch.int32),
        )
        ids = self._tensor(input_ids, torch.int64)
        pos_t = self._tensor(positions, torch.int64)
        return ids, pos_t, meta, logits_rows, sample_seqs, sample_rows, prompt_rows

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        if (
            self.graphs is not None
            and not batch.prefills
            and self.graphs.can_run(len(batch.decodes), max((len(s.block_table) for s in batch.decodes), default=0))
        ):
            return self._run_graph(batch.decodes)
        ids, positions, meta, logits_rows, sample_seqs, sample_rows, prompt_rows = self.prepare(batch)
        hidden = self.model.forward(ids, positions, meta, self.kv_cache.tensors)
        rows = self._tensor(logits_rows, torch.int64)
        logits = self.model.compute_logits(hidden.index_select(0, rows)) if logits_rows else hidden.new_empty(0, 0)
        prompt_logits = [(seq, first, logits[r0 : r0 + n]) for seq, first, r0, n in prompt_rows]
        return StepOutput(sample_seqs, logits[sample_rows], prompt_logits)

    def _run_graph(self, decodes: list[Sequence]) -> StepOutput:
        ids, positions, slots = [], [], []
        for seq in decodes:
            pos = seq.num_computed_tokens
            ids.append(seq.token_at(pos))
            positions.append(pos)
            slots.append(self.blocks.slot(seq, pos))
        keys = [(s.seq_id, s.num_preemptions) for s in decodes]  # a preempted sequence gets new blocks
        logits = self.graphs.run(keys, ids, positions, slots, [s.block_table for s in decodes], [p + 1 for p in positions])
        return StepOutput(list(decodes), logits, [])
