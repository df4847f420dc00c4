"""Decode steps replayed as CUDA graphs.

A decode-only step runs the same kernels every time; only the batch size and the widest block
table change. ``DecodeGraphs`` captures ``model.forward`` once per (batch bucket, block-table
width bucket), lazily on first use, over static input buffers, and replays it: the step's inputs
are copied into the buffers and the logits of the first ``n`` rows are computed from the graph's
hidden states (outside the graph: one [max batch, vocab] output per graph would pile up). Padding
rows repeat row 0 (token, position, context) with slot -1, so nothing is written to the cache and
they route to row 0's experts: a padded step reads no extra expert weights.

Batch buckets come from the backend's ``SchedulerLimits.graph_batch_sizes``; widths are powers
of two and 1.5x them (in blocks), so the decode kernels see an upper bound of the context at
most 1.5x the real one. Batches larger than the largest bucket, or with a block table wider than
the model's longest sequence allows, run eagerly. Every op on the decode path must be free of
host synchronisation (the backend declares that with ``Platform.graph_capture``).
"""

from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from deepinfer_core.models.batch import BatchMeta

log = logging.getLogger("deepinfer")


class BlockTableBuffer:
    """Host copy of the decode block tables, updated incrementally.

    Building a padded [batch, width] table from Python lists every step costs milliseconds at
    long contexts; here a row is rewritten only from the first block it has not seen for the
    sequence it holds (``key`` changes when a sequence was preempted and got new blocks).
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
    def __init__(self, model, kv_caches: list[torch.Tensor], batch_sizes: tuple[int, ...], max_blocks_per_seq: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(set(batch_sizes))
        self.max_blocks = max_blocks_per_seq
        self.device = device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables: dict[int, torch.Tensor] = {}  # width -> [n, width] int32
        self.host_tables = BlockTableBuffer(n, max_blocks_per_seq)
        self._no_prefill_i32 = torch.zeros(1, dtype=torch.int32, device=device)
        self._no_prefill_i64 = torch.zeros(0, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def can_run(self, num_seqs: int, max_table_len: int = 0) -> bool:
        return 0 < num_seqs <= self.max_batch and max_table_len <= self.max_blocks

    def _width(self, blocks: int) -> int:
        """The smallest bucket >= blocks among 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (at most 1.5x too wide)."""
        width = 1
        while width < blocks:
            width = width * 3 // 2 if width >= 2 and width & (width - 1) == 0 else (width * 4 // 3 if width >= 3 else width + 1)
        return min(width, self.max_blocks)

    def _meta(self, size: int, width: int) -> BatchMeta:
        return BatchMeta(
            num_prefill_tokens=0,
            slot_mapping=self.slot_mapping[:size],
            prefill_cu_seqlens_q=self._no_prefill_i32,
            prefill_cu_seqlens_k=self._no_prefill_i32,
            prefill_context_slots=self._no_prefill_i64,
            decode_block_tables=self.block_tables[width][:size],
            decode_seq_lens=self.seq_lens[:size],
        )

    def _forward(self, size: int, width: int) -> torch.Tensor:
        return self.model.forward(self.input_ids[:size], self.positions[:size], self._meta(size, width), self.kv_caches)

    def _capture(self, size: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        if width not in self.block_tables:
            self.block_tables[width] = torch.zeros(self.max_batch, width, dtype=torch.int32, device=self.device)
        # Warm-up and capture inputs: no cache write, one context token (block 0).
        self.slot_mapping[:size].fill_(-1)
        self.seq_lens[:size].fill_(1)
        return self._record(size, width)

    def _record(self, size: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up (kernels compile outside the capture), then capture; returns (graph, hidden)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(size, width)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self._forward(size, width)
        if self.pool is None:
            self.pool = graph.pool()
        log.debug("captured decode graph: batch %d, block-table width %d", size, width)
        return graph, hidden

    @torch.inference_mode()
    def run(self, keys: list[object], input_ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]], seq_lens: list[int]) -> torch.Tensor:
        """Logits [len(input_ids), V] (float32) of one decode step. ``keys`` identify each row's
        sequence and its block allocation (see BlockTableBuffer)."""
        n = len(input_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        width = self._width(max(len(t) for t in block_tables))
        key = (size, width)
        if key not in self.graphs:
            self.graphs[key] = self._capture(size, width)
        graph, hidden = self.graphs[key]
        table = torch.from_numpy(self.host_tables.fill(keys, block_tables)[:, :width])
        host = torch.tensor([input_ids, positions, slots, seq_lens], dtype=torch.int64)
        dev = host.to(self.device, non_blocking=True)
        self.input_ids[:n].copy_(dev[0])
        self.positions[:n].copy_(dev[1])
        self.slot_mapping[:n].copy_(dev[2])
        self.seq_lens[:n].copy_(dev[3])
        tables = self.block_tables[width]
        tables[:n].copy_(table.to(self.device, non_blocking=True))
        if size > n:  # padding rows recompute row 0 without writing the cache: no extra expert weights read
            self.input_ids[n:size].fill_(input_ids[0])
            self.positions[n:size].fill_(positions[0])
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(seq_lens[0])
            tables[n:size].copy_(tables[:1].expand(size - n, -1))
        graph.replay()
        return self.model.compute_logits(hidden[:n])
