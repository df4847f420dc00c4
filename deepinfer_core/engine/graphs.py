"""Decode steps replayed as graphs, captured while the engine starts.

A decode-only step runs the same kernels every time; only the batch size and the rows' length
change. ``DecodeGraphs`` captures ``model.forward`` once per (batch bucket, row length) through
the platform's ``GraphBackend`` (CUDA graphs on NVIDIA; the core never touches a device API),
over static input buffers, and replays it: the step's inputs are copied into the buffers and
the logits of the real rows are computed from the graph's hidden states (outside the graph:
one [max batch, vocab] output per graph would pile up).

Row lengths are 1 and, with speculative decoding, 1 + k: a sequence with fewer drafts has its
row padded at the end (padding tokens write nothing, and causality keeps them out of the real
tokens' attention). Padding sequences repeat sequence 0 with nothing written, so they route to
its experts: a padded step reads no extra expert weights. Block tables are captured at their
full width (the longest sequence the model allows): the decode kernels read no further than
each sequence's length, and split their work by it, so one width serves every context.

Batch buckets come from the backend's ``SchedulerLimits.graph_batch_sizes``. Batches larger
than the largest bucket run eagerly. A model whose decode work follows the width of its block
tables (``graphs_by_context``: V4's indexer scores every entry a table could name) gets graphs
per context bucket too (``context_buckets``): a step replays the graph of the narrowest paged
tables that hold its longest sequence. Every op on the decode path must be free of host
synchronisation (the backend declares that with ``Platform.graph_capture``).
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from deepinfer_core.models.batch import BatchMeta, CacheGroup, GroupMeta
from deepinfer_core.platform import to_device

log = logging.getLogger("deepinfer")


class BlockTableBuffer:
    """Host copy of one group's decode block tables, updated incrementally.

    Building a padded [batch, width] table from Python lists every step costs milliseconds at
    long contexts; here a row is rewritten only from the first block it has not seen for the
    sequence it holds (``key`` changes when a sequence lost blocks: preemption, rollback).
    Entries past a row's length may be stale: kernels read no further than the context length.
    """

    def __init__(self, max_batch: int, max_blocks: int):
        self.table = np.zeros((max_batch, max_blocks), dtype=np.int32)
        self.keys: list[object] = [None] * max_batch
        self.lengths = [0] * max_batch

    def fill(self, keys: list[object], block_tables: list[list[int]]) -> np.ndarray:
        """The rows for this step's sequences, in order: a view [len(keys), max_blocks]."""
        for i, (key, row) in enumerate(zip(keys, block_tables)):
            have = self.lengths[i] if self.keys[i] == key else 0
            if len(row) > have:
                self.table[i, have : len(row)] = row[have:]
            self.keys[i], self.lengths[i] = key, len(row)
        return self.table[: len(keys)]


class DecodeGraphs:
    """``max_blocks``: per cache group, the widest block table a sequence can have.
    ``draft_dim`` (an int > 0, or a shape): capture the model's MTP module (``forward_mtp`` at
    depth 0) instead of ``forward``, with one more static input, the draft state [rows, *draft_dim]
    it is fed (the hidden state, or V4's hyper-connection streams [hc, D]). ``keep_streams``: the
    target's graphs return (hidden, streams) (``forward_streams`` then ``head_hidden``: what V4's
    MTP block is fed)."""

    def __init__(self, model, kv_caches: dict[str, torch.Tensor], groups: list[CacheGroup], max_blocks: dict[str, int],
                 batch_sizes: tuple[int, ...], query_lens: tuple[int, ...], device: torch.device, backend,
                 draft_dim: int | tuple[int, ...] = 0, keep_streams: bool = False, context_buckets: tuple[int, ...] = (),
                 block_size: int = 0):
        self.model = model
        self.kv_caches = kv_caches
        self.groups = groups
        self.sizes = sorted(set(batch_sizes))
        self.query_lens = sorted(set(query_lens))
        self.device = device
        self.backend = backend
        n, q = self.sizes[-1], self.query_lens[-1]
        self.input_ids = torch.zeros(n * q, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n * q, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.slots = {g.name: torch.full((n * q,), -1, dtype=torch.int64, device=device) for g in groups}
        self.tables = {g.name: torch.zeros(n, max_blocks[g.name], dtype=torch.int32, device=device) for g in groups}
        self.valid_from = {g.name: torch.zeros(n, dtype=torch.int64, device=device) for g in groups if g.kind == "ring"}
        self.query_start = {ql: torch.arange(0, (n + 1) * ql, ql, dtype=torch.int32, device=device) for ql in self.query_lens}
        self.host_tables = {g.name: BlockTableBuffer(n, max_blocks[g.name]) for g in groups}
        self._no_prefill_i32 = torch.zeros(1, dtype=torch.int32, device=device)
        self._no_context = torch.zeros(0, dtype=torch.int64, device=device)
        shape = (draft_dim,) if isinstance(draft_dim, int) else tuple(draft_dim)
        self.prev = torch.zeros(n * q, *shape, dtype=model.dtype, device=device) if draft_dim else None
        self.label = "draft" if draft_dim else "decode"
        self.keep_streams = keep_streams
        # (batch, row length) -> the graph over full-width tables; (batch, row length, tokens) -> the
        # graph whose paged tables hold ``tokens`` of context (context_buckets, narrowest first)
        self.graphs: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}
        self.bucket_graphs: dict[tuple[int, int, int], tuple[object, torch.Tensor]] = {}
        self.paged = {g.name for g in groups if g.kind == "paged"}
        self.block_size = block_size
        self.buckets = sorted(b for b in set(context_buckets) if block_size and -(-b // block_size) < min(
            (max_blocks[name] for name in self.paged), default=0))
        self.capture_seconds = 0.0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _width(self, name: str, tokens: int | None) -> int:
        """Columns of group ``name``'s tables in the graph of context bucket ``tokens`` (None: all)."""
        full = self.tables[name].shape[1]
        return full if tokens is None or name not in self.paged else min(full, -(-tokens // self.block_size))

    def _meta(self, size: int, q_len: int, tokens: int | None = None) -> BatchMeta:
        t = size * q_len
        groups = {
            g.name: GroupMeta(
                slot_mapping=self.slots[g.name][:t],
                block_tables=self.tables[g.name][:size, : self._width(g.name, tokens)],
                context_slots=self._no_context,
                valid_from=self.valid_from[g.name][:size] if g.name in self.valid_from else None,
            )
            for g in self.groups
        }
        return BatchMeta(
            num_prefill_tokens=0,
            prefill_cu_seqlens_q=self._no_prefill_i32,
            prefill_cu_seqlens_k=self._no_prefill_i32,
            decode_seq_lens=self.seq_lens[:size],
            decode_query_start_loc=self.query_start[q_len][: size + 1],
            groups=groups,
        )

    def _forward(self, size: int, q_len: int, tokens: int | None = None):
        t = size * q_len
        meta = self._meta(size, q_len, tokens)
        if self.prev is not None:
            return self.model.forward_mtp(0, self.input_ids[:t], self.positions[:t], self.prev[:t], meta, self.kv_caches)
        if self.keep_streams:
            streams = self.model.forward_streams(self.input_ids[:t], self.positions[:t], meta, self.kv_caches)
            return self.model.head_hidden(streams), streams
        return self.model.forward(self.input_ids[:t], self.positions[:t], meta, self.kv_caches)

    @torch.inference_mode()
    def capture_all(self, progress: bool = True) -> None:
        """Capture every (batch bucket, row length): nothing written to the cache, every row
        attending to its first entries."""
        t0 = time.perf_counter()
        todo = [(size, ql, tokens) for ql in self.query_lens for size in self.sizes for tokens in [*self.buckets, None]]
        for size, ql, tokens in tqdm(todo, desc=f"Capturing {self.label} graphs", unit="graph", disable=not progress):
            for slots in self.slots.values():
                slots.fill_(-1)
            self.seq_lens.fill_(ql)
            graph = self.backend.capture(lambda size=size, ql=ql, tokens=tokens: self._forward(size, ql, tokens))
            if tokens is None:
                self.graphs[(size, ql)] = graph
            else:
                self.bucket_graphs[(size, ql, tokens)] = graph
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured %d %s graphs (batch sizes %s, row lengths %s%s) in %.1f s", len(todo), self.label, self.sizes,
                 self.query_lens, f", context buckets {self.buckets} tokens and the full width" if self.buckets else "",
                 self.capture_seconds)

    def query_len_for(self, out) -> int | None:
        """The row length of the graph that can run this step, or None (run it eagerly)."""
        if out.prefills or not out.decodes or len(out.decodes) > self.max_batch:
            return None
        longest = max(s.num_tokens for s in out.decodes)
        i = bisect.bisect_left(self.query_lens, longest)
        if i == len(self.query_lens):
            return None
        for name, buffer in self.host_tables.items():
            if any(len(s.seq.block_tables[name]) > buffer.table.shape[1] for s in out.decodes):
                return None
        return self.query_lens[i]

    def replay(self, hb, q_len: int, fill_from_device: Callable[[torch.Tensor], None], prev: torch.Tensor | None = None):
        """Hidden states [len(seq_lens) * q_len, D] of the step ``hb`` (runner.HostBatch, decode
        rows padded to q_len); ``prev``: the draft state of each of those rows (draft graphs),
        whose forward may return (hidden, next draft state): both come back, sliced alike."""
        n = len(hb.seq_lens)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        t, total = n * q_len, size * q_len
        pad = total - t
        names = [g.name for g in self.groups]
        # one host-to-device copy for ids, positions and every group's slots (padding included)
        parts = [hb.ids + hb.ids[:q_len] * (size - n), hb.positions + hb.positions[:q_len] * (size - n)]
        parts += [hb.slots[name] + [-1] * pad for name in names]
        packed = torch.from_numpy(np.asarray(parts, dtype=np.int64))
        small = [hb.seq_lens + [hb.seq_lens[0]] * (size - n)]
        small += [hb.valid_from[name] + hb.valid_from[name][:1] * (size - n) for name in self.valid_from]
        dev = to_device(packed, self.device)
        dev_small = to_device(torch.from_numpy(np.asarray(small, dtype=np.int64)), self.device)
        self.input_ids[:total].copy_(dev[0])
        self.positions[:total].copy_(dev[1])
        for i, name in enumerate(names):
            self.slots[name][:total].copy_(dev[2 + i])
        self.seq_lens[:size].copy_(dev_small[0])
        for i, name in enumerate(self.valid_from):
            self.valid_from[name][:size].copy_(dev_small[1 + i])
        keys = [(s.seq.seq_id, s.seq.table_version) for s, _, _ in hb.samples]
        for name in names:
            rows = hb.tables[name]
            width = max(len(r) for r in rows)
            host = torch.from_numpy(self.host_tables[name].fill(keys, rows)[:, :width])
            table = self.tables[name]
            table[:n, :width].copy_(to_device(host, self.device))
            if size > n:
                table[n:size].copy_(table[:1].expand(size - n, -1))
        fill_from_device(self.input_ids)
        if self.prev is not None:
            self.prev[:t].copy_(prev)
            if size > n:  # padding sequences repeat sequence 0 (its experts, nothing written)
                self.prev[t:total].copy_(prev[:q_len].repeat(size - n, *[1] * (prev.dim() - 1)))
        longest = max(hb.seq_lens)
        tokens = next((b for b in self.buckets if longest <= b), None)
        graph, hidden = self.graphs[(size, q_len)] if tokens is None else self.bucket_graphs[(size, q_len, tokens)]
        self.backend.replay(graph)
        if isinstance(hidden, tuple):  # (hidden, the draft state for the next row): V4's MTP block
            return tuple(h[:t] for h in hidden)
        return hidden[:t]


def context_buckets(max_model_len: int, smallest: int = 4096, factor: int = 4) -> tuple[int, ...]:
    """Context lengths (tokens) below ``max_model_len`` at which a ``graphs_by_context`` model's
    decode graphs are captured narrower than full width: smallest, x factor, ..."""
    out, b = [], smallest
    while b < max_model_len:
        out.append(b)
        b *= factor
    return tuple(out)


def max_blocks_per_group(groups: list[CacheGroup], max_model_len: int, block_size: int, max_query_len: int, ring_blocks: dict[str, int]) -> dict[str, int]:
    """The widest block table of each group a decode row can need."""
    out = {}
    for g in groups:
        if g.kind == "paged":
            out[g.name] = math.ceil((max_model_len + max_query_len) / block_size)
        elif g.kind == "ring":
            out[g.name] = ring_blocks[g.name]
        else:
            out[g.name] = 1
    return out
