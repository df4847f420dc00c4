"""Turns a SchedulerOutput into flat tensors, runs the model (or replays a decode graph), and
returns the logits rows that are sampled.

Host-side work is built in plain lists and numpy arrays and moved to the device in a few
copies; nothing here waits for the device, so in overlapped mode this runs while the previous
step is still executing. A decode row's newest token may still be on the device (sampled by the
previous, unresolved step): ``PrevTokens`` says where, and the row's input id is filled in there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer_core.engine.graphs import DecodeGraphs
from deepinfer_core.engine.kv_cache import KVCache, KVCacheManager
from deepinfer_core.engine.scheduler import ScheduledSeq, SchedulerOutput
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.models.batch import BatchMeta, CacheGroup, GroupMeta
from deepinfer_core.platform import to_device


@dataclass
class PrevTokens:
    """The previous step's sampled ids, still on the device: ``tokens`` [N] and, per sequence,
    its row in them."""

    tokens: torch.Tensor
    rows: dict[int, int]


@dataclass
class HostBatch:
    """One step's inputs on the host (decode rows possibly padded to a uniform length)."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: dict[str, list[int]] = field(default_factory=dict)
    cu_q: list[int] = field(default_factory=lambda: [0])
    cu_k: list[int] = field(default_factory=lambda: [0])
    context: dict[str, list[np.ndarray]] = field(default_factory=dict)
    num_prefill_tokens: int = 0
    seq_lens: list[int] = field(default_factory=list)
    query_start: list[int] = field(default_factory=lambda: [0])
    tables: dict[str, list[list[int]]] = field(default_factory=dict)
    valid_from: dict[str, list[int]] = field(default_factory=dict)
    from_device: list[tuple[int, int]] = field(default_factory=list)  # (token index, row in PrevTokens)
    logits_rows: list[int] = field(default_factory=list)
    # (scheduled sequence, first index into logits_rows, number of rows) of every sampling sequence
    samples: list[tuple[ScheduledSeq, int, int]] = field(default_factory=list)
    prompt_rows: list[tuple[Sequence, int, int, int]] = field(default_factory=list)  # seq, first predicted position, row, count
    lookback: list[list[int]] = field(default_factory=list)  # per sequence, the tokens before its new ones (-1: none)
    exact_prefills: list[int] = field(default_factory=list)  # prefill sequences whose every row's logits are used
    first_rows: dict[int, int] = field(default_factory=dict)  # seq_id -> its first token's row (position start)


@dataclass
class StepOutput:
    """Logits rows (float32) for every sampling sequence (1 + k rows for a verification row) and
    for prompt logprobs."""

    samples: list[tuple[ScheduledSeq, int, int]]  # (scheduled sequence, first row of sample_logits, rows)
    sample_logits: torch.Tensor
    prompt_logits: list[tuple[Sequence, int, torch.Tensor]]  # (sequence, first predicted position, logits)
    # with ``keep_hidden``: the draft state of every row (forward()'s hidden states [T, D]; V4: the
    # residual streams [T, hc, D] before the head) and, per seq_id, the row of its first
    # scheduled position (its rows follow in position order)
    hidden: torch.Tensor | None = None
    first_rows: dict[int, int] = field(default_factory=dict)


class ModelRunner:
    """``graphs``: when given, decode-only steps that fit its buckets replay captured graphs.
    ``keep_hidden``: every step's output carries the model's hidden states (MTP drafting).
    ``prefills_as_rows`` (batch-invariant inference): a prefill chunk is laid out as a row, as a
    decode row is (BatchMeta with no prefill tokens; the chunk causal within its row), so the
    model computes a prompt token exactly as it computes a decoded one. Paged cache groups only."""

    lookback = 0  # tokens before each sequence's new ones the model reads (set from the model)
    prefills_as_rows = False

    def __init__(self, model, kv_cache: KVCache, kv: KVCacheManager, device: torch.device, graphs: DecodeGraphs | None = None,
                 keep_hidden: bool = False, prefills_as_rows: bool = False):
        if prefills_as_rows and any(g.kind != "paged" for g in kv.groups):
            raise ValueError("prefill chunks can be laid out as rows only for models whose caches are all paged")
        self.model = model
        self.prefills_as_rows = prefills_as_rows
        self.keep_hidden = keep_hidden
        self.kv_cache = kv_cache
        self.kv = kv
        self.device = device
        self.graphs = graphs
        self.groups: list[CacheGroup] = kv.groups
        self.block_size = kv.block_size
        self.max_position = model.config.max_position_embeddings - 1
        self.lookback = model.lookback_tokens

    def _lookback(self, seq: Sequence, start: int) -> list[int]:
        """The ids at positions start - n .. start - 1 (-1 before 0); all on the host: a decode
        row's only token that may still be on the device is its newest, at ``start``."""
        n = self.lookback
        return [-1] * max(0, n - start) + list(seq.token_slice(max(0, start - n), start))

    def _tensor(self, values, dtype) -> torch.Tensor:
        return to_device(torch.as_tensor(values, dtype=dtype), self.device)

    # ---- addressing ---------------------------------------------------------------------------
    def _slots(self, g: CacheGroup, seq: Sequence, positions: range) -> list[int]:
        """Where each position's entry of group ``g`` is written (-1: not written)."""
        bs, table = self.block_size, seq.block_tables[g.name]
        if g.kind == "paged":
            m, wf = g.tokens_per_entry, seq.paged_write_from
            per = bs // m
            return [table[p // bs] * per + (p % bs) // m if p >= wf and p % m == m - 1 else -1 for p in positions]
        if g.kind == "ring":
            rb = KVCache.ring_block(g, bs)
            ring, first = len(table), positions.stop - len(table) * rb  # older ones this step overwrites
            return [table[(p // rb) % ring] * rb + p % rb if p >= first else -1 for p in positions]
        versions = 1 + self.kv.lookahead
        return [table[0] * versions + (p + 1) % versions for p in positions]

    def _context(self, g: CacheGroup, seq: Sequence, start: int, end: int) -> np.ndarray:
        """Slots a prefill chunk [start, end) reads for group ``g`` (see GroupMeta.context_slots)."""
        bs, table = self.block_size, np.asarray(seq.block_tables[g.name], dtype=np.int64)
        if g.kind == "paged":
            per = bs // g.tokens_per_entry
            return (table[:, None] * per + np.arange(per)).ravel()[: end // g.tokens_per_entry]
        if g.kind == "ring":
            rb = KVCache.ring_block(g, bs)
            lo = max(self.kv.replay_start(seq.paged_write_from), start - g.window)
            pos = np.arange(lo, start)
            return table[(pos // rb) % len(table)] * rb + pos % rb
        return table[:1] * (1 + self.kv.lookahead) + start % (1 + self.kv.lookahead)

    # ---- building a step ----------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput, prev: PrevTokens | None = None, pad_to: int = 0) -> HostBatch:
        """Host inputs of a step; ``pad_to``: decode rows padded to that many tokens (graphs)."""
        hb = HostBatch(slots={g.name: [] for g in self.groups}, context={g.name: [] for g in self.groups},
                       tables={g.name: [] for g in self.groups},
                       valid_from={g.name: [] for g in self.groups if g.kind == "ring"})
        for s in out.prefills:
            seq = s.seq
            row0 = hb.first_rows[seq.seq_id] = len(hb.ids)
            hb.ids.extend(seq.token_slice(s.start, s.end))
            hb.positions.extend(range(s.start, s.end))
            for g in self.groups:
                hb.slots[g.name].extend(self._slots(g, seq, range(s.start, s.end)))
                if self.prefills_as_rows:
                    hb.tables[g.name].append(seq.block_tables[g.name])
                else:
                    hb.context[g.name].append(self._context(g, seq, s.start, s.end))
            if self.prefills_as_rows:
                hb.seq_lens.append(s.end)
                hb.query_start.append(hb.query_start[-1] + s.num_tokens)
            else:
                hb.cu_q.append(hb.cu_q[-1] + s.num_tokens)
                hb.cu_k.append(hb.cu_k[-1] + s.end)
            if self.lookback:
                hb.lookback.append(self._lookback(seq, s.start))
            if seq.wants_prompt_logprobs:
                hb.exact_prefills.append(len(hb.cu_q) - 2)
                # logits at position p predict token p + 1; only prompt tokens need them here
                count = min(s.end, seq.num_prompt_tokens - 1) - s.start
                if count > 0:
                    hb.prompt_rows.append((seq, s.start + 1, len(hb.logits_rows), count))
                    hb.logits_rows.extend(range(row0, row0 + count))
            if s.samples:
                hb.samples.append((s, len(hb.logits_rows), 1))
                hb.logits_rows.append(len(hb.ids) - 1)
        hb.num_prefill_tokens = 0 if self.prefills_as_rows else len(hb.ids)

        for s in out.decodes:
            seq = s.seq
            row0 = hb.first_rows[seq.seq_id] = len(hb.ids)
            known = seq.num_tokens
            for p in range(s.start, s.end):
                if p < known:
                    hb.ids.append(seq.token_at(p))
                elif prev is not None and seq.seq_id in prev.rows:  # sampled by the step still running
                    hb.from_device.append((len(hb.ids), prev.rows[seq.seq_id]))
                    hb.ids.append(0)
                else:
                    hb.ids.append(seq.draft_token_ids[p - known])
            hb.positions.extend(range(s.start, s.end))
            if self.lookback:
                hb.lookback.append(self._lookback(seq, s.start))
            pad = max(0, pad_to - s.num_tokens)
            if pad:
                hb.ids.extend([hb.ids[-1]] * pad)
                hb.positions.extend(min(s.end + i, self.max_position) for i in range(pad))
            for g in self.groups:
                slots = hb.slots[g.name]
                slots.extend(self._slots(g, seq, range(s.start, s.end)))
                slots.extend([-1] * pad)
                hb.tables[g.name].append(seq.block_tables[g.name])
                if g.kind == "ring":
                    hb.valid_from[g.name].append(self.kv.replay_start(seq.paged_write_from))
            hb.seq_lens.append(s.end + pad)
            hb.query_start.append(hb.query_start[-1] + s.num_tokens + pad)
            hb.samples.append((s, len(hb.logits_rows), s.num_tokens))
            hb.logits_rows.extend(range(row0, row0 + s.num_tokens))
        for s in out.prefills:
            for g in self.groups:
                if g.kind == "ring":
                    hb.valid_from[g.name].append(self.kv.replay_start(s.seq.paged_write_from))
                    hb.tables[g.name].append(s.seq.block_tables[g.name])
        return hb

    def _meta(self, hb: HostBatch) -> tuple[torch.Tensor, torch.Tensor, BatchMeta]:
        groups = {}
        for g in self.groups:
            rows = hb.tables[g.name]
            width = max((len(r) for r in rows), default=0)
            table = np.zeros((len(rows), width), dtype=np.int32)  # ring groups: decodes, then prefills
            for i, r in enumerate(rows):
                table[i, : len(r)] = r
            context = np.concatenate(hb.context[g.name]) if hb.context[g.name] else np.zeros(0, dtype=np.int64)
            valid = hb.valid_from.get(g.name)
            groups[g.name] = GroupMeta(
                slot_mapping=self._tensor(hb.slots[g.name], torch.int64),
                block_tables=self._tensor(table, torch.int32),
                context_slots=self._tensor(context, torch.int64),
                valid_from=None if valid is None else self._tensor(valid, torch.int64),
            )
        meta = BatchMeta(
            num_prefill_tokens=hb.num_prefill_tokens,
            prefill_cu_seqlens_q=self._tensor(hb.cu_q, torch.int32),
            prefill_cu_seqlens_k=self._tensor(hb.cu_k, torch.int32),
            decode_seq_lens=self._tensor(hb.seq_lens, torch.int32),
            decode_query_start_loc=self._tensor(hb.query_start, torch.int32),
            groups=groups,
            lookback_ids=self._tensor(np.asarray(hb.lookback, dtype=np.int64).reshape(-1, self.lookback), torch.int64)
            if self.lookback else None,
            exact_prefills=tuple(hb.exact_prefills),
        )
        return self._tensor(hb.ids, torch.int64), self._tensor(hb.positions, torch.int64), meta

    def fill_from_device(self, ids: torch.Tensor, hb: HostBatch, prev: PrevTokens | None) -> None:
        """Write the input ids that are still on the device (previous step's samples) into ``ids``."""
        if hb.from_device:
            where, rows = zip(*hb.from_device)
            ids[self._tensor(list(where), torch.int64)] = prev.tokens[self._tensor(list(rows), torch.int64)]

    # ---- running ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, out: SchedulerOutput, prev: PrevTokens | None = None) -> StepOutput:
        q_len = self.graphs.query_len_for(out) if self.graphs is not None else None
        if q_len is not None:
            hb = self.prepare(out, prev, pad_to=q_len)
            result = self.graphs.replay(hb, q_len, lambda ids: self.fill_from_device(ids, hb, prev))
            hidden, state = result if isinstance(result, tuple) else (result, result)  # V4 + MTP: (hidden, streams)
        else:
            hb = self.prepare(out, prev)
            ids, positions, meta = self._meta(hb)
            self.fill_from_device(ids, hb, prev)
            if self.keep_hidden and self.model.mtp_reads_streams:  # V4: the MTP block reads the streams
                state = self.model.forward_streams(ids, positions, meta, self.kv_cache.tensors)
                hidden = self.model.head_hidden(state)
            else:
                hidden = state = self.model.forward(ids, positions, meta, self.kv_cache.tensors)
        if hb.logits_rows:
            logits = self.model.compute_logits(hidden.index_select(0, self._tensor(hb.logits_rows, torch.int64)))
        else:
            logits = hidden.new_empty(0, 0)
        prompt_logits = [(seq, first, logits[r0 : r0 + n]) for seq, first, r0, n in hb.prompt_rows]
        kept = (state, hb.first_rows) if self.keep_hidden else (None, {})
        if hb.prompt_rows:  # sampling rows without the prompt-logprob rows
            index = [r for _, r0, n in hb.samples for r in range(r0, r0 + n)]
            sample_logits = logits.index_select(0, self._tensor(index, torch.int64))
            samples, row = [], 0
            for s, _, n in hb.samples:
                samples.append((s, row, n))
                row += n
            return StepOutput(samples, sample_logits, prompt_logits, *kept)
        return StepOutput(hb.samples, logits, [], *kept)
