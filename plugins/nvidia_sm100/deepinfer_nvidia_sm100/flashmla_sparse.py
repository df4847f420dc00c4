"""FlashMLA's sparse FP8 decode as the provider of ``sparse_attention`` over V4's FP8 records.

Chosen when ``flash_mla`` imports with its legacy kernels (``flashmla.version()``; on sm_90 only
those run: ``use_legacy=True``, ``kv_format="V4"``) and a call fits them: bf16 queries [T, H, 512]
with H = 64 or 128 (V4-Flash, V4-Pro) over one or two non-empty pools that are V4 FP8 record
caches (``deepinfer_core.ops.kv_record``: FlashMLA's own paged layout, pages of 64 rows, read in
place as ``k_cache`` [pages, 64, 1, 584]). That is what a V4 decode-only step passes with
``kv_cache_dtype="fp8"``: the window ring, and on CSA / HCA layers the compressed entries (the
step's rows are written to the ring first). Every other call goes to the fallback (the Triton
kernel). The test reads shapes and dtypes only, so a captured graph takes the eager call's path.

The op names rows of the pools' concatenation; FlashMLA takes ``indices`` into ``k_cache`` and
``extra_indices_in_kvcache`` into ``extra_k_cache``. So each index row is split in two full-width
rows (a key of the other pool: -1), padded to a multiple of TOPK_BLOCK with -1: FlashMLA walks
both. Each query is its own FlashMLA sequence of one query (b = T, s_q = 1). The sinks are
FlashMLA's ``attn_sink`` (its output is scaled by exp(lse) / (exp(lse) + exp(sink)), the op's
softmax with the sink's probability dropped). Queries with no valid key are set to zeros (the
contract) after the call.

FlashMLA's tile-scheduler metadata depends on the shapes only (no topk_length is passed): one
``FlashMLASchedMeta`` per (T, H, widths) is kept and reused by every layer of that shape; the
first call fills it (inside a capture, the graph recomputes it at every replay).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.ops.kv_record import PAGE_ROWS, RECORD_BYTES, ROW_DIM, flashmla_view, is_record_cache
from deepinfer_core.ops.sparse import key_pool_parts

HEADS = (64, 128)  # the head counts FlashMLA's sparse decode kernels are built for
TOPK_BLOCK = 64  # FlashMLA walks the indices 64 at a time: widths are padded to a multiple of this
KV_FORMAT = "V4"  # the legacy kernels' name for V4's 584-byte records
DEVICE_TYPES = ("cuda",)


def _records(parts: tuple[torch.Tensor, ...]) -> bool:
    return all(is_record_cache(p) and p.is_contiguous() and p.shape[0] % PAGE_ROWS == 0 for p in parts)


def fits(q: torch.Tensor, kv, indices: torch.Tensor) -> bool:
    """Whether FlashMLA's sparse FP8 decode takes this ``sparse_attention`` call (shapes, dtypes
    and devices only)."""
    try:
        parts = key_pool_parts(kv)
    except ValueError:
        return False
    filled = [p for p in parts if p.shape[0]]
    return (
        q.device.type in DEVICE_TYPES
        and q.dtype == torch.bfloat16
        and q.dim() == 3
        and q.shape[0] > 0
        and q.shape[1] in HEADS
        and q.shape[2] == ROW_DIM
        and indices.dim() == 2
        and indices.shape[1] > 0
        and 1 <= len(filled) <= 2
        and _records(parts)
        and all(p.device == q.device for p in parts)
    )


def _split(indices: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """The index row's keys in [start, start + rows) as that pool's rows, -1 elsewhere: int32
    [T, 1, K'] with K' the width padded to a multiple of TOPK_BLOCK."""
    inside = (indices >= start) & (indices < start + rows)
    local = torch.where(inside, indices - start, -1).to(torch.int32)
    pad = -local.shape[1] % TOPK_BLOCK
    if pad:
        local = F.pad(local, (0, pad), value=-1)
    return local.unsqueeze(1)


class FlashMLASparse:
    """``sparse_attention`` through FlashMLA's sparse FP8 decode where ``fits``, else ``fallback``."""

    def __init__(self, fallback, version: str):
        self.fallback = fallback
        self.impl = (f"flashmla ({version}, sparse FP8 decode, legacy sm_90 kernels) for bf16 queries of "
                     f"{' or '.join(map(str, HEADS))} heads x {ROW_DIM} over 1-2 V4 FP8 record caches of "
                     f"{RECORD_BYTES}-byte rows; else {getattr(fallback, 'impl', 'the Triton kernel')}")
        self._metas: dict[tuple, object] = {}

    def __call__(self, q, kv, indices, sinks, scale):
        if not fits(q, kv, indices):
            return self.fallback(q, kv, indices, sinks, scale)
        import flash_mla

        parts = key_pool_parts(kv)
        pools, start = [], 0
        for p in parts:  # (first row in the concatenation, pool) of the non-empty pools
            if p.shape[0]:
                pools.append((start, p))
            start += p.shape[0]
        (s0, main), extra = pools[0], (pools[1] if len(pools) > 1 else None)
        idx = _split(indices, s0, main.shape[0])
        extra_idx = _split(indices, extra[0], extra[1].shape[0]) if extra is not None else None
        t, heads, _ = q.shape
        key = (t, heads, idx.shape[-1], None if extra_idx is None else extra_idx.shape[-1],
               q.is_cuda and torch.cuda.is_current_stream_capturing())
        meta = self._metas.get(key)
        if meta is None:
            meta, _ = flash_mla.get_mla_metadata()
            self._metas[key] = meta
        out, _ = flash_mla.flash_mla_with_kvcache(
            q.unsqueeze(1).contiguous(), flashmla_view(main), None, None, ROW_DIM, meta,
            softmax_scale=scale, causal=False, is_fp8_kvcache=True, indices=idx, attn_sink=sinks.float(),
            extra_k_cache=None if extra is None else flashmla_view(extra[1]), extra_indices_in_kvcache=extra_idx,
            use_legacy=True, kv_format=KV_FORMAT,
        )
        empty = (indices < 0).all(dim=1)
        return out.squeeze(1).masked_fill_(empty[:, None, None], 0)


def provide(ops: dict, version: str | None) -> dict:
    """``ops`` with FlashMLA providing ``sparse_attention`` for V4's FP8 records (the op there
    becomes its fallback) when FlashMLA is installed; unchanged otherwise."""
    if version is None or "sparse_attention" not in ops:
        return ops
    return {**ops, "sparse_attention": FlashMLASparse(ops["sparse_attention"], version)}
