"""Where a DeepSeek-V4 forward finds the rows it reads, computed once per forward from BatchMeta.

V4 attention reads, per query, its sliding window (the last ``sliding_window`` positions, from
this batch's new tokens or from the sequence's ring) and compressed entries (from paged
groups); each compressor, when a token closes its window, pools the window's projected rows
(from this batch or from the sequence's state ring). Every layer of a kind addresses the same
rows, so the index tensors are built here once and each layer gathers its own tensors with
them. Row pools put this batch's new rows first (index t for token t) and the cache's rows
after them (index T + flat cache row), so one index tensor can name both.

Sequences are numbered in token order: the prefill sequences, then the decode rows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from deepinfer_core.models.batch import BatchMeta, CacheGroup


@dataclass
class Emitters:
    """The tokens of this batch that close a compression window (and write its entry)."""

    tokens: torch.Tensor  # [N] token indices
    slots: torch.Tensor  # [N] paged cache slots of their entries
    entry_positions: torch.Tensor  # [N] first position of each window (its RoPE position)
    rows: torch.Tensor  # [N, S] pool index of the window's rows, oldest first (-1: none)


class V4Batch:
    """Index tensors of one forward. ``groups``: the model's cache groups by name."""

    def __init__(self, positions: torch.Tensor, batch: BatchMeta, groups: dict[str, CacheGroup], block_size: int):
        self.batch = batch
        self.groups = groups
        self.block_size = block_size
        self.positions = positions
        device = positions.device
        self.num_tokens = t = positions.shape[0]
        cu_q, cu_k = batch.prefill_cu_seqlens_q.long(), batch.prefill_cu_seqlens_k.long()
        qsl = batch.decode_query_start_loc.long()
        n = torch.cat([cu_q[1:] - cu_q[:-1], qsl[1:] - qsl[:-1]])
        self.base = torch.cat([cu_q[:-1], batch.num_prefill_tokens + qsl[:-1]])  # first token of each sequence
        self.end = torch.cat([cu_k[1:] - cu_k[:-1], batch.decode_seq_lens.long()])  # context length after this step
        self.start = self.end - n  # first new position
        self.num_decodes = batch.num_decodes
        self.seq = torch.repeat_interleave(torch.arange(n.shape[0], device=device), n, output_size=t)
        self.rows: torch.Tensor | None = None  # a tail's rows of the whole batch (see ``tail``)
        self.skipped_from = self.start  # positions [skipped_from, start) were not computed (a tail)
        self._ring_tables: dict[str, torch.Tensor] = {}
        self._entries: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._built: dict[tuple, object] = {}  # window / emitters / visible results: the same for every layer

    def tail(self, keep: torch.Tensor) -> V4Batch:
        """The same batch restricted to each sequence's newest ``keep[seq]`` new tokens (bounded
        replay, §4.4): positions, slot mappings and window indices of those rows only; the
        skipped rows' positions read as no key (-1). Entries (paged groups) are shared."""
        sub = copy.copy(self)  # shares the ring tables and the entries (paged groups) already built
        n = self.end - self.start
        kept = torch.minimum(n, keep)
        pos_in_seq = torch.arange(self.num_tokens, device=self.positions.device) - self.base[self.seq]
        mask = pos_in_seq >= (n - kept)[self.seq]
        rows = torch.nonzero(mask).flatten()
        sub.rows = rows if self.rows is None else self.rows[rows]
        sub.positions, sub.seq, sub.num_tokens = self.positions[rows], self.seq[rows], rows.shape[0]
        sub.base = torch.cumsum(kept, 0) - kept
        sub.start = self.end - kept  # skipped_from stays the batch's first new position
        sub._built = {}
        return sub

    def slots(self, group: str) -> torch.Tensor:
        """This batch's (or tail's) rows of group ``group``'s slot mapping."""
        mapping = self.batch.groups[group].slot_mapping
        return mapping if self.rows is None else mapping[self.rows]

    def _once(self, key: tuple, build):
        if key not in self._built:
            self._built[key] = build()
        return self._built[key]

    def _token_order(self, per_seq: torch.Tensor) -> torch.Tensor:
        """Rows given decodes first, then prefills (the runner's ring order) -> token order."""
        d = self.num_decodes
        return torch.cat([per_seq[d:], per_seq[:d]])

    def valid_from(self, ring: str) -> torch.Tensor:
        vf = self.batch.groups[ring].valid_from
        return torch.zeros_like(self.end) if vf is None else self._token_order(vf.long())

    def pool_rows(self, ring: str, seq: torch.Tensor, pos: torch.Tensor, in_ring: bool = False) -> torch.Tensor:
        """Pool index of position ``pos`` of sequence ``seq`` (same shapes): this batch's row when
        the position is new in this step, else T + its ring slot; -1 before the ring's first
        valid position or below 0. ``in_ring``: this step's rows were written to the ring first,
        so every position is its ring slot (no batch rows before the ring in the pool)."""
        g = self.groups[ring]
        if ring not in self._ring_tables:
            self._ring_tables[ring] = self._token_order(self.batch.groups[ring].block_tables.long())
        table = self._ring_tables[ring]
        rb = g.ring_block or self.block_size
        start, lo = self.start[seq], self.valid_from(ring)[seq]
        new = self.base[seq] + (pos - start)
        blocks = table[seq.reshape(-1), ((pos.clamp(min=0) // rb) % table.shape[1]).reshape(-1)].view(pos.shape)
        cached = (0 if in_ring else self.num_tokens) + blocks * rb + pos.clamp(min=0) % rb
        out = cached if in_ring else torch.where(pos >= start, new, cached)
        skipped = (pos >= self.skipped_from[seq]) & (pos < start)  # rows a tail did not compute
        return torch.where((pos >= lo) & (pos >= 0) & ~skipped, out, torch.full_like(out, -1))

    def window(self, ring: str, window: int, in_ring: bool = False) -> torch.Tensor:
        """[T, window] pool indices of each query's window keys p - window + 1 .. p (-1: none);
        ``in_ring``: as ``pool_rows`` takes it (the ring's rows alone, this step's written first)."""
        def build() -> torch.Tensor:
            pos = self.positions[:, None] - torch.arange(window, device=self.positions.device)[None, :]
            return self.pool_rows(ring, self.seq[:, None].expand_as(pos), pos, in_ring)

        return self._once(("window", ring, window, in_ring), build)

    @property
    def decode_only(self) -> bool:
        """No prefill token in this forward (shapes alone say so): what a decode graph replays.
        The index tensors then take widths from shapes only, and nothing synchronises."""
        return self.batch.num_prefill_tokens == 0 and self.rows is None

    def emitters(self, paged: str, ring: str, span: int) -> Emitters:
        """Tokens that write an entry of paged group ``paged`` (tokens_per_entry m) and the pool
        indices of the ``span`` rows ending at them (m, or 2m for overlapping windows) in ``ring``.
        Decode-only forwards name every token (those that close no window have slot -1, so their
        entry is pooled and not stored): fixed shapes, no host synchronisation."""
        def build() -> Emitters:
            slots = self.slots(paged)
            if self.decode_only:
                tokens = torch.arange(slots.shape[0], device=slots.device)
            else:
                tokens = torch.nonzero(slots >= 0).flatten()
            pos = self.positions[tokens]
            rows_pos = pos[:, None] - span + 1 + torch.arange(span, device=pos.device)[None, :]
            seq = self.seq[tokens][:, None].expand_as(rows_pos)
            m = self.groups[paged].tokens_per_entry
            return Emitters(tokens, slots[tokens], (pos // m) * m, self.pool_rows(ring, seq, rows_pos))

        return self._once(("emitters", paged, ring, span), build)

    def entries(self, paged: str) -> torch.Tensor:
        """Slots [N] of every sequence's entries of paged group ``paged`` after this step, in
        sequence and entry order (the entry pool ``visible`` indexes)."""
        if paged not in self._entries:
            g, meta = self.groups[paged], self.batch.groups[paged]
            m = g.tokens_per_entry
            count = self.end // m
            per = self.block_size // m
            tables = meta.block_tables.long()
            width = int(count.max()) if count.numel() else 0
            w = torch.arange(width, device=count.device)
            dec = count[self.batch.num_prefills:]
            if dec.numel() and width:
                blocks = (w // per).clamp(max=max(tables.shape[1] - 1, 0))[None, :].expand(dec.shape[0], -1)
                dec_slots = (tables.gather(1, blocks) * per + w % per)[w[None, :] < dec[:, None]]
            else:
                dec_slots = meta.context_slots.new_zeros(0)
            first = torch.cumsum(count, 0) - count
            self._entries[paged] = (torch.cat([meta.context_slots.long(), dec_slots]), first, width)
        return self._entries[paged][0]

    def entry_table(self, paged: str) -> torch.Tensor:
        """[sequences, C] flat cache slots of each sequence's entries of paged group ``paged``
        after this step, in entry order, -1 past its count (``end // m``). Decode sequences read
        their block tables, so C is the tables' width in entries in a decode-only forward (a
        shape: fixed under a graph, whose tables are captured at full width); prefill sequences
        read their context slots (C then also covers the longest of them)."""
        def build() -> torch.Tensor:
            g, meta = self.groups[paged], self.batch.groups[paged]
            m = g.tokens_per_entry
            per = self.block_size // m
            count = self.end // m
            tables = meta.block_tables.long()
            width = tables.shape[1] * per
            dec = count[self.batch.num_prefills:]
            w = torch.arange(width, device=count.device)
            blocks = (w // per)[None, :].expand(dec.shape[0], -1)
            dec_slots = tables.gather(1, blocks) * per + w % per if width else tables.new_zeros((dec.shape[0], 0))
            dec_slots = torch.where(w[None, :] < dec[:, None], dec_slots, torch.full_like(dec_slots, -1))
            if not self.batch.num_prefills:
                return dec_slots
            pre = count[: self.batch.num_prefills]
            pre_width = int(pre.max())  # prefill: eager, never captured
            first = torch.cumsum(pre, 0) - pre
            wp = torch.arange(pre_width, device=count.device)
            context = meta.context_slots.long()
            pick = (first[:, None] + wp[None, :]).clamp(max=max(context.shape[0] - 1, 0))
            pre_slots = context[pick] if context.numel() else torch.zeros_like(pick)
            pre_slots = torch.where(wp[None, :] < pre[:, None], pre_slots, torch.full_like(pre_slots, -1))
            c = max(width, pre_width)
            pad = lambda t: torch.nn.functional.pad(t, (0, c - t.shape[1]), value=-1)  # noqa: E731
            return torch.cat([pad(pre_slots), pad(dec_slots)])

        return self._once(("entry_table", paged), build)

    def entry_width(self, paged: str) -> int:
        """C of ``entry_slots`` (a shape: no synchronisation)."""
        return self.entry_table(paged).shape[1]

    def entry_slots(self, paged: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """[hi - lo, C] flat cache slots of the entries of paged group ``paged`` that queries
        lo..hi-1 see (w < (p + 1) // m), -1 elsewhere: indices straight into the group's cache
        tensors viewed as rows, so nothing is gathered (``entry_table`` says what C is)."""
        table = self.entry_table(paged)
        pos, seq = self.positions[lo:hi], self.seq[lo:hi]
        w = torch.arange(table.shape[1], device=pos.device)[None, :]
        seen = (pos + 1) // self.groups[paged].tokens_per_entry
        rows = table[seq]
        return torch.where(w < seen[:, None], rows, torch.full_like(rows, -1))

    def visible(self, paged: str, lo: int = 0, hi: int | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[hi - lo, C] index into ``entries(paged)`` of the entries queries lo..hi-1 (or the
        queries ``rows``) see: w < (p + 1) // m, -1 padded (C: the most entries any sequence of
        the batch has)."""
        def build() -> torch.Tensor:
            self.entries(paged)
            _, first, width = self._entries[paged]
            pick = slice(lo, hi) if rows is None else rows
            pos, seq = self.positions[pick], self.seq[pick]
            w = torch.arange(width, device=pos.device)[None, :].expand(pos.shape[0], -1)
            seen = (pos + 1) // self.groups[paged].tokens_per_entry
            return torch.where(w < seen[:, None], first[seq][:, None] + w, torch.full_like(w, -1))

        if (lo, hi) != (0, None) or rows is not None:  # a chunk of queries (the indexers'): built when asked, not kept
            return build()
        return self._once(("visible", paged), build)


def plan_for(groups: dict[str, CacheGroup], positions: torch.Tensor, batch: BatchMeta, kv_caches: dict[str, torch.Tensor]) -> V4Batch:
    """The V4Batch of one forward; the engine's block size is read off a paged tensor
    [blocks, block_size // m, dim] (rings have their own block size)."""
    block_size = next((kv_caches[g.layers[0]].shape[1] * g.tokens_per_entry for g in groups.values()
                       if g.kind == "paged" and g.layers[0] in kv_caches), 0)
    return V4Batch(positions, batch, groups, block_size)
