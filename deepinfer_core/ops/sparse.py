"""DeepSeek-V4 attention ops: attention with sinks over gathered keys, the compressors' pooling
(alone, and fused from the window rows to rotated entries), the lightning indexer's top-k, and a
plain cache-row write.

These ops work on *pools* of rows and index tensors, which the model builds once per forward:
a key pool is every row a batch's queries may read (the new tokens' keys, the sliding-window
ring rows, the compressed entries of every sequence), and each query names its keys by row
index into the pool (-1: no key). A kernel can gather straight from the caches instead; the
contract is only the math on the named rows (deepseek_architectures.md §3.3-3.6).
"""

from __future__ import annotations

import torch

from deepinfer_core.ops.kv_record import PAGE_ROWS, RECORD_BYTES, ROW_DIM, is_record_cache, read_records, write_records
from deepinfer_core.ops.norm import rms_norm_f32
from deepinfer_core.ops.rope import rotary_embedding

# The reference attention and indexer take queries in chunks of at most this many, fewer when
# the keys per query are many: each chunk's float32 gather stays within CHUNK_BYTES.
ATTENTION_CHUNK = 256
CHUNK_BYTES = 256 * 2**20


# sparse_attention's kv: one [N, d] pool, or 1..MAX_KEY_POOLS parts [N_i, d] read as their concatenation
KeyPools = torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]
MAX_KEY_POOLS = 3


def key_pool_parts(kv: KeyPools) -> tuple[torch.Tensor, ...]:
    """The parts of a key pool (one tensor: itself alone), checked: 1..MAX_KEY_POOLS 2-D tensors
    of one dtype, width and device. ValueError otherwise."""
    parts = (kv,) if isinstance(kv, torch.Tensor) else tuple(kv) if isinstance(kv, (tuple, list)) else None
    if parts is None:
        raise ValueError(f"kv must be a tensor [N, d] or a tuple of 1 to {MAX_KEY_POOLS} of them, got {type(kv).__name__}")
    if not 1 <= len(parts) <= MAX_KEY_POOLS or not all(isinstance(p, torch.Tensor) and p.dim() == 2 for p in parts):
        got = [tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__ for p in parts]
        raise ValueError(f"kv must be 1 to {MAX_KEY_POOLS} 2-D tensors [N_i, d], got {got}")
    first = parts[0]
    if any(p.dtype != first.dtype or p.shape[1] != first.shape[1] or p.device != first.device for p in parts[1:]):
        got = [(tuple(p.shape), p.dtype, str(p.device)) for p in parts]
        raise ValueError(f"kv's pools must share dtype, width d and device, got {got}")
    return parts


def key_pool(kv: KeyPools) -> torch.Tensor:
    """The one [N, d] pool ``kv`` names: the tensor itself, or its parts concatenated (pool 0's
    rows first), a copy. For references and backends without a multi-pool path."""
    parts = key_pool_parts(kv)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def record_pools(parts: tuple[torch.Tensor, ...], q: torch.Tensor) -> bool:
    """Whether the key pools ``parts`` (from key_pool_parts) are V4 FP8 record caches: False for
    float pools; True for uint8 ones, which must then all be contiguous [N_i, 584] of whole pages
    read by queries q [T, H, 512] (ValueError otherwise: a mix of records and rows is refused too,
    by key_pool_parts)."""
    if parts[0].dtype != torch.uint8:
        return False
    if not all(is_record_cache(p) and p.is_contiguous() and p.shape[0] % PAGE_ROWS == 0 for p in parts) \
            or q.shape[-1] != ROW_DIM:
        raise ValueError(f"uint8 key pools must be V4 FP8 record caches [N_i, {RECORD_BYTES}] (contiguous, N_i a multiple "
                         f"of {PAGE_ROWS}) read by queries of width {ROW_DIM}, got pools "
                         f"{[tuple(p.shape) for p in parts]} and q {tuple(q.shape)}")
    return True


def _chunk(keys_per_query: int, floats_per_key: int) -> int:
    return max(1, min(ATTENTION_CHUNK, CHUNK_BYTES // max(1, 4 * keys_per_query * floats_per_key)))


def _gather_rows(pool: torch.Tensor, idx: torch.Tensor, record_dtype: torch.dtype | None = None) -> torch.Tensor:
    """pool[idx] in float32 with -1 read as row 0 (masked by the caller); an empty pool (every
    index -1) gives zeros. record_dtype: the pool holds V4 FP8 records, dequantised to it."""
    width = ROW_DIM if record_dtype is not None else pool.shape[-1]
    if pool.shape[0] == 0:
        return pool.new_zeros(*idx.shape, width, dtype=torch.float32)
    if record_dtype is not None:
        return read_records(pool, idx.clamp(min=0), record_dtype).float()
    return pool[idx.clamp(min=0)].float()


def write_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store row t of ``values`` [T, C] at flat row slot_mapping[t] of ``cache`` [..., C] (in
    place, cast to the cache's dtype); a negative slot means "do not store".

    A uint8 cache whose rows are 584 bytes is a V4 FP8 record cache (``ops/kv_record.py``:
    contiguous, whole pages of 64 rows): values [T, 512] are then quantised into its data and
    scale planes, row slot_mapping[t] getting ``quantize_rows(values[t])``'s bytes."""
    keep = slot_mapping >= 0
    if is_record_cache(cache):
        write_records(cache, values[keep], slot_mapping[keep])
        return
    flat = cache.view(-1, cache.shape[-1])
    flat[slot_mapping[keep]] = values[keep].to(cache.dtype)


def sparse_attention(
    q: torch.Tensor, kv: KeyPools, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Shared-KV multi-query attention with a per-head sink over the keys each query names.

    q: [T, H, d]; kv: the key pool (each key is also its value): a tensor [N, d], or a tuple (or
    list) of 1 to 3 tensors [N_i, d] of one dtype and d, each any row-strided 2-D view (a cache
    [blocks, rows, d] viewed as [-1, d], a slice of rows; any may have no rows), read as their
    concatenation: pool 0's rows are 0..N_0-1, pool 1's N_0..N_0+N_1-1, and so on, N = sum N_i
    (the model passes its new rows and views of its caches, not copied). The op reads only the
    named rows; it writes none. indices: [T, K] int64 rows of that pool per query, -1 = none (any
    order, no duplicates); sinks: [H] float32 logits with no value.
    o[t, h] = sum_j P_j kv[indices[t, j]] with P = softmax over [q[t, h] . kv[idx] * scale for
    the valid idx..., sinks[h]] (the sink's probability is dropped). A query with no valid key
    gets zeros. Scores and the weighted sum in float32; returns [T, H, d] in q's dtype.

    FP8 KV (``kv_cache_dtype="fp8"``, V4, d = 512): the pools may instead all be uint8 V4 FP8
    record caches [N_i, 584] (``ops/kv_record.py``: contiguous, N_i a multiple of 64, FlashMLA's
    paged layout); a named row then reads as ``read_records(pool, row, q.dtype)`` (exact), and
    the math above runs on those rows.
    """
    parts = key_pool_parts(kv)
    records = record_pools(parts, q)
    kv = key_pool(parts)  # the reference concatenates (whole pages: a record cache again); kernels read the parts in place
    t_all, heads, d = q.shape
    out = torch.empty_like(q)
    row_dtype = q.dtype if records else None
    sink = sinks.float()[None, :, None]
    step = _chunk(indices.shape[1], d + 3 * heads)  # the [t, K, d] gather, scores and probabilities
    for lo in range(0, t_all, step):
        hi = min(lo + step, t_all)
        idx = indices[lo:hi]
        valid = idx >= 0
        keys = _gather_rows(kv, idx, row_dtype)  # [t, K, d]
        scores = torch.einsum("thd,tkd->thk", q[lo:hi].float(), keys) * scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        logits = torch.cat([scores, sink.expand(hi - lo, heads, 1)], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        out[lo:hi] = torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)
    return out


def compress_pool(kv: torch.Tensor, score: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One compressed entry per window: RMSNorm(sum_s softmax_s(score[n, s, c]) * kv[n, s, c]).

    kv: [N, S, C] the window's projected rows (model dtype); score: [N, S, C] float32 gate logits
    with the position bias already added (-inf: an empty slot, weight 0; every (n, c) has at least
    one finite slot); the softmax runs over the S slots independently per channel. The pooled rows are normalised with ``rms_norm_f32``
    (weight [C], float32 multiply, one cast). Returns [N, C] in kv's dtype. (transformers weighs
    in kv's dtype after rounding the softmax to it; so does this.)
    """
    weights = torch.softmax(score.float(), dim=1).to(kv.dtype)
    pooled = (kv * weights).sum(dim=1)
    return rms_norm_f32(pooled, norm_weight, eps)


def _two_pool_rows(rows: torch.Tensor, state: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` [N, S] of the concatenation of ``rows`` and ``state`` without building it,
    [N, S, R] float32 (-1 and an empty pool read as zeros: masked by the caller). No host
    synchronisation: the model calls it inside decode graphs where a backend leaves
    ``compress_entries`` to the reference."""
    n = rows.shape[0]
    first = rows[idx.clamp(0, max(n - 1, 0))] if n else rows.new_zeros((*idx.shape, rows.shape[-1]))
    second = state[(idx - n).clamp(0, max(state.shape[0] - 1, 0))] if state.shape[0] else state.new_zeros((*idx.shape, state.shape[-1]))
    return torch.where((idx < n)[..., None], first.float(), second.float())


def _check_compress_entries(rows, state, windows, positions, norm_weight, cos_sin, overlap) -> tuple[int, int]:
    """(dim, rope dims) of a ``compress_entries`` call; ValueError on inconsistent shapes."""
    width2 = rows.shape[-1] if rows.dim() == 2 else -1
    parts = 4 if overlap else 2
    if rows.dim() != 2 or state.dim() != 2 or state.shape[1] != width2 or width2 % parts:
        raise ValueError(f"compress_entries: rows [T, R] and state [S, R] with R a multiple of {parts} "
                         f"({'overlap: kv and gate of two series' if overlap else 'kv and gate'}), got "
                         f"{tuple(rows.shape)} and {tuple(state.shape)}")
    dim = width2 // parts
    if windows.dim() != 2 or windows.shape[1] < 1 or (overlap and windows.shape[1] % 2) or positions.shape != windows.shape[:1]:
        raise ValueError(f"compress_entries: windows [N, span] (span >= 1, even when overlapping) and positions [N], got "
                         f"{tuple(windows.shape)} and {tuple(positions.shape)}")
    r = cos_sin.shape[-1]
    if norm_weight.shape != (dim,) or cos_sin.dim() != 2 or r % 2 or dim % 2 or not 0 < r <= dim:
        raise ValueError(f"compress_entries: norm_weight [{dim}] and a cos/sin table [P, r] with r even and "
                         f"0 < r <= dim ({dim}, even), got {tuple(norm_weight.shape)} and {tuple(cos_sin.shape)}")
    return dim, r


def compress_entries(
    rows: torch.Tensor, state: torch.Tensor, windows: torch.Tensor, positions: torch.Tensor, norm_weight: torch.Tensor,
    eps: float, cos_sin: torch.Tensor, overlap: bool, dtype: torch.dtype,
) -> torch.Tensor:
    """DeepSeek-V4's compressor from its window rows to rotated entries (§3.5): gather, pool,
    normalise and rotate in one op (the compressor and the CSA indexer's own compressor each
    call it once per step).

    rows: [T, R] float32, this step's compressor rows, each [kv | gate logits + position bias]
    (kv and gate ``R / 2`` wide); state: [S, R] float32, the state ring's rows. Either may be a
    row-strided view of wider rows (a CSA layer's compressor and indexer rows are column slices
    of one row) and either may have no rows. windows: [N, span] int64, row numbers into the
    concatenation (rows first: row i < T is rows[i], row T + j is state[j]), oldest slot first,
    -1 for an empty slot; positions: [N] int64, each entry's RoPE position; norm_weight: [dim];
    cos_sin: [P, r] as ``rotary_embedding`` takes it.

    ``overlap`` (CSA): span = 2 * ratio, kv and gate are each 2 * dim wide and slot s < ratio
    (the previous window) contributes their first dim columns, slot s >= ratio their last dim
    columns. Otherwise (HCA): span = ratio, kv and gate are dim wide.

    entry[n] = RoPE(rms_norm_f32(sum_s softmax_s(gate[s, c]) * kv[s, c])) over the valid slots,
    computed as the model always has: kv cast to ``dtype`` first, the float32 softmax over the
    slots rounded to ``dtype`` and the weighted sum in ``dtype`` (``compress_pool``), then
    ``rms_norm_f32``, then the trailing r channels rotated as interleaved pairs at
    ``positions[n]`` (``rotary_embedding``). Returns [N, dim] in ``dtype``. A window needs a
    valid slot (a model's closing token is its own); one without gives an unspecified entry.
    """
    return compress_entries_with(compress_pool, rows, state, windows, positions, norm_weight, eps, cos_sin, overlap, dtype)


def compress_entries_with(pool, rows, state, windows, positions, norm_weight, eps, cos_sin, overlap, dtype) -> torch.Tensor:
    """``compress_entries`` pooling with ``pool`` (a ``compress_pool``): for a backend that has a
    pooling kernel but no fused compressor (the reference's gather and RoPE around its kernel)."""
    dim, r = _check_compress_entries(rows, state, windows, positions, norm_weight, cos_sin, overlap)
    slots = _two_pool_rows(rows, state, windows)  # [N, span, R]
    width = slots.shape[-1] // 2
    kv, score = slots[..., :width], slots[..., width:]
    if overlap:  # the previous window's first series, this window's second
        m = windows.shape[1] // 2
        kv = torch.cat([kv[:, :m, :dim], kv[:, m:, dim:]], dim=1)
        score = torch.cat([score[:, :m, :dim], score[:, m:, dim:]], dim=1)
    valid = (windows >= 0)[:, :, None]
    kv = kv.masked_fill(~valid, 0.0).to(dtype)
    entries = pool(kv, score.masked_fill(~valid, float("-inf")), norm_weight, eps)
    rotated = rotary_embedding(entries[:, None, -r:], entries[:, -r:], positions, cos_sin, True)[0][:, 0]
    return torch.cat([entries[:, :-r], rotated], dim=-1)


def _scores(q, weights, keys, cands, scale) -> torch.Tensor:
    """The indexer's float32 scores [t, C] of candidates ``cands`` [t, C] (-inf where -1). A
    zero score is +0.0 (adding +0.0 turns -0.0 into it): a sort that orders by bits, as GPU
    radix sorts do, would otherwise rank -0.0 below +0.0 and break the tie rule."""
    keys_c = _gather_rows(keys, cands)  # [t, C, Di]
    dots = torch.einsum("thd,tcd->thc", q.float(), keys_c).relu() * scale
    return (dots * weights.float()[:, :, None]).sum(dim=1).masked_fill(cands < 0, float("-inf")) + 0.0


def indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor, top_k: int, scale: float
) -> torch.Tensor:
    """The lightning indexer: each query's ``top_k`` best candidate entries.

    q: [T, Hi, Di] indexer queries; weights: [T, Hi] float32 per-head weights; keys: [N, Di]
    indexer key pool; candidates: [T, C] int64 rows of keys each query may pick, -1 = none (any
    order, no duplicates).
    score(t, j) = sum_h weights[t, h] * relu(q[t, h] . keys[j]) * scale, in float32. Returns
    [T, min(top_k, C)] int64: the chosen rows of keys (highest scores first is not required), -1
    where a query has fewer valid candidates than that.

    Ties: of candidates with exactly equal scores (-0.0 equal to +0.0) the earlier columns are
    chosen, as a stable sort does (§4.3: "ties to the smaller position"; the models pass
    candidates in position order). Exact ties are common: a candidate whose dot products every
    head's ReLU zeroes scores 0.
    """
    t_all, c = candidates.shape
    k = min(top_k, c)
    if k == 0 or t_all == 0:
        return candidates.new_full((t_all, k), -1)
    out = candidates.new_empty((t_all, k))
    step = _chunk(c, q.shape[-1] + 2 * q.shape[1])  # the [t, C, Di] gather and the [t, Hi, C] dots
    for lo in range(0, t_all, step):
        hi = min(lo + step, t_all)
        cands = candidates[lo:hi]
        valid = cands >= 0
        scores = _scores(q[lo:hi], weights[lo:hi], keys, cands, scale)
        best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]  # ties: earlier column first
        chosen = cands.gather(1, best)
        out[lo:hi] = torch.where(valid.gather(1, best), chosen, torch.full_like(chosen, -1))
    return out


def indexer_block_candidates(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor, scale: float,
    block_size: int, top_blocks: int,
) -> torch.Tensor:
    """DeepSeek-V4.1's first indexer level (§4.3): the candidate blocks each query keeps.

    q, weights, keys, scale: as ``indexer_topk``; candidates: [T, C] int64, column c is the
    sequence's compressed entry c (its row of keys, -1 where the query does not see it). Columns
    form blocks of ``block_size`` (block b: columns [b * block_size, (b + 1) * block_size)); a
    block's score is the highest score of its valid columns. When there are more blocks than
    ``top_blocks``: the block holding the query's newest valid column is always kept and takes one
    of the places, the others go to the best scores, ties to the lower block, and blocks without a
    valid column are never kept. Returns [T, ceil(C / block_size)] bool, True for the kept blocks
    (all True when there are at most ``top_blocks`` blocks: nothing is filtered).
    """
    t_all, c = candidates.shape
    nb = -(-c // block_size)
    kept = torch.ones((t_all, nb), dtype=torch.bool, device=candidates.device)
    if t_all == 0 or nb <= top_blocks:
        return kept
    cols = torch.arange(c, device=candidates.device)
    step = _chunk(c, q.shape[-1] + 2 * q.shape[1])
    for lo in range(0, t_all, step):
        hi = min(lo + step, t_all)
        cands = candidates[lo:hi]
        padded = torch.full((hi - lo, nb * block_size), float("-inf"), device=candidates.device)
        padded[:, :c] = _scores(q[lo:hi], weights[lo:hi], keys, cands, scale)
        block = padded.view(hi - lo, nb, block_size).amax(dim=-1)
        newest = torch.where(cands >= 0, cols, torch.full_like(cands, -1)).amax(dim=-1)
        has = torch.nonzero(newest >= 0).flatten()
        block[has, newest[has] // block_size] = float("inf")
        order = torch.sort(block, dim=-1, descending=True, stable=True).indices[:, :top_blocks]  # ties: lower block first
        top = torch.zeros_like(block, dtype=torch.bool).scatter_(1, order, True)
        kept[lo:hi] = top & (block > float("-inf"))
    return kept
