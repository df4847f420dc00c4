"""DeepSeek-V4.1's Engram n-gram memory layer (deepseek_architectures.md §4.5).

Per token, the compressed ids of it and the ``max_ngram - 1`` tokens before it hash (per n-gram
size and head) into one table of FP8 rows; the rows, projected by ``kv_proj``, give one key per
stream and one value that every stream adds, gated by its own key's match. The hash tables
(primes, offsets, multipliers) come from ``engram_tables``; the tokens before a sequence's new
ones arrive as ``BatchMeta.lookback_ids``.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.config import ConfigError
from deepinfer_core.models.layers import FP8_DTYPE, Alloc, Linear, param
from deepinfer_core.models.v4.batch import V4Batch
from deepinfer_core.models.v41.engram_tables import engram_multipliers, engram_offsets, engram_primes, engram_table_rows
from deepinfer_core.ops import OpTable

SCALE_GROUP = 32  # table values per e8m0 scale


def ngram_ids(compressed: torch.Tensor, input_ids: torch.Tensor, plan: V4Batch, lookback: torch.Tensor | None, n: int) -> torch.Tensor:
    """[T, n] compressed ids of the tokens at positions p, p - 1, ..., p - n + 1 of each token's
    sequence (-1 before position 0). Tokens before a sequence's first new one come from
    ``lookback`` [S, n - 1] (column j: position start - (n - 1) + j; -1 where none)."""
    t = input_ids.shape[0]
    shifts = torch.arange(n, device=input_ids.device)
    pos = plan.positions[:, None] - shifts
    start = plan.start[plan.seq][:, None]
    in_batch = pos >= start
    here = compressed[input_ids][(torch.arange(t, device=input_ids.device)[:, None] - shifts).clamp(min=0)]
    if lookback is None or n == 1:
        before = torch.full_like(pos, -1)
    else:
        col = (pos - start + (n - 1)).clamp(0, n - 2)
        raw = lookback.long()[plan.seq[:, None].expand_as(pos), col]
        before = torch.where(raw >= 0, compressed[raw.clamp(min=0)], torch.full_like(raw, -1))
    out = torch.where(in_batch, here, before)
    return torch.where(pos >= 0, out, torch.full_like(out, -1))


class Engram(nn.Module):
    def __init__(self, config, ops: OpTable, alloc: Alloc, layer: int):
        super().__init__()
        self.ops, self.config = ops, config
        n, heads, hd = config.engram_max_ngram_size, config.engram_n_heads, config.engram_head_dim
        primes = engram_primes(config.engram_vocab_size, config.engram_layer_ids, n, heads)[layer]
        rows = engram_table_rows(primes)
        given = dict(zip(config.engram_layer_ids, config.engram_num_embeddings))
        if layer in given and given[layer] != rows:
            raise ConfigError(
                f"engram_num_embeddings gives layer {layer} {given[layer]} rows but its hash tables (engram_vocab_size "
                f"{config.engram_vocab_size}, {n}-grams, {heads} heads) address {rows}: config.json is inconsistent"
            )
        self.embed = nn.Module()
        quantised = config.fp8_block is not None  # kept as stored: the real table is ~200 GB in FP8
        self.embed.weight = param((rows, hd), FP8_DTYPE if quantised else alloc.dtype, alloc.device)
        self.embed.weight_scale_inv = param((rows, -(-hd // SCALE_GROUP)), torch.float32, alloc.device) if quantised else None
        cols = (n - 1) * heads
        self.kv_proj = Linear(cols * hd, (config.hc_mult + 1) * config.hidden_size, ops, alloc)
        self.q_weight = param((config.hc_mult, config.hidden_size), alloc.dtype, alloc.device)
        self.k_weight = param((config.hc_mult, config.hidden_size), alloc.dtype, alloc.device)
        mult = engram_multipliers(layer, config.engram_compressed_vocab_size, n)
        self.register_buffer("multipliers", torch.tensor(mult, dtype=torch.int64, device=alloc.device), persistent=False)
        self.register_buffer("primes", torch.tensor(primes, dtype=torch.int64, device=alloc.device), persistent=False)
        self.register_buffer("offsets", torch.tensor(engram_offsets(primes), dtype=torch.int64, device=alloc.device), persistent=False)
        self.pad_id: int | None = None  # the pad token's compressed id (the model's set_tokenizer)

    def forward(self, x: torch.Tensor, ngram: torch.Tensor) -> torch.Tensor:
        """x: [T, hc, D] streams; ngram: [T, n] from ``ngram_ids`` -> the streams with the memory added."""
        c = self.config
        ids = self.ops.engram_hash_ids(ngram, self.multipliers, self.primes, self.offsets, self.pad_id)
        rows = self.embed.weight[ids]  # [T, cols, hd]
        if self.embed.weight_scale_inv is not None:
            scale = self.embed.weight_scale_inv[ids].repeat_interleave(SCALE_GROUP, dim=-1)[..., : rows.shape[-1]]
            rows = rows.float() * scale
        kv = self.kv_proj(rows.to(x.dtype).flatten(1))
        return self.ops.engram_gate(x, kv, self.q_weight, self.k_weight, c.rms_norm_eps)
