"""DeepSeek-V4's sparse-attention ops in Triton: attention with sinks over the keys each query
names, the compressors' pooling, the lightning indexer's top-k and a plain cache-row write
(contracts: ``deepinfer_core.ops.sparse``).

``sparse_attention`` has the shape of absorbed-MLA decode (``mla_decode.py``): every head of a
query reads the same 512-wide rows, each row both key and value. So, as there:

* a program holds BLOCK_H heads of one query (the M of both tensor-core dots; padded heads are
  masked, so any head count works) and walks its query's index row BLOCK_N columns at a time,
  gathering the named pool rows (-1: masked, never read); one gathered tile feeds ``q @ kv^T``
  and ``p @ kv``; the online softmax runs in base 2, in float32;
* the grid is 1-D, (query, split, head block) with head blocks fastest: the programs that read a
  query's rows run together and share them in L2 (and T is not bound by the 65535 of grid axes
  1 and 2);
* at small T the index row is cut into splits (from shapes only: T, heads, K, SM count, so the
  grid is CUDA-graph safe); each split writes a normalised float32 partial and its log-sum-exp
  and a combine kernel merges them, adding the sink to the denominator there. With one split the
  first kernel adds the sink and writes the output itself.

The key pool may come in up to 3 parts (the model's new rows and views of its caches, read in
place): each part's base pointer, row stride and first row in the concatenation are arguments,
POOLS (their number, empty parts dropped on the host) a constexpr; each gathered index picks its
row's pointer from its pool (a select per row, still one load per tile). One pool compiles to
exactly the single-pool gather. Parts must share the column stride (a column-strided part is
made contiguous; a row-strided view, the usual case, is read as it is).

A block of columns all -1 (or a whole query) leaves the running max at -inf: the exponents are
then taken against 0 instead, so nothing is NaN and a query with no valid key gets zeros.
P is rounded to the kv dtype for P V in 16-bit (the spec allows it), kept float32 in float32.

DeepSeek-V4's FP8 KV (``kv_cache_dtype="fp8"``): the pools may all be record caches (uint8
[N_i, 584] in FlashMLA's paged layout, ``deepinfer_core.ops.kv_record``). The kernel then
(RECORDS) addresses pools by page instead of row (each pool starts on a page: its start and row
stride are in pages), reads a gathered row's 448 e4m3 bytes, its 7 UE8M0 scale bytes and its 64
bf16 RoPE values from its page's planes and dequantises them in registers, exactly, to q's
dtype: the dots stay the 16-bit tensor-core ones (float32 for a float32 q) and see the very
rows the reference dequantises. ``write_cache`` quantises into such caches (``_write_records``).

Every op is free of host synchronisation; the grids follow from shapes only.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from deepinfer_core.ops import kv_record
from deepinfer_core.ops.sparse import key_pool_parts, record_pools
from deepinfer_nvidia_sm100.kernels.device import await_inputs, launch_options, num_sms

LOG2E = 1.4426950408889634

# ---- tunables (sweep on the GPU) -------------------------------------------------------------
# sparse_attention: key columns per inner iteration (16-bit pools; float32 pools use the FP32_
# tiles: no tensor cores for them and twice the bytes per tile).
ATTN_BLOCK_N = 32
ATTN_FP32_BLOCK_N = 16
ATTN_FP32_BLOCK_H = 16
ATTN_NUM_STAGES = 2
# A split covers at least this many key columns: fewer the fewer the queries (one decode query
# of 64 heads over 640 keys is otherwise 1 program on a 132-SM GPU).
ONE_QUERY_MIN_SPLIT = 32
FEW_QUERIES = 8
FEW_QUERIES_MIN_SPLIT = 64
MIN_SPLIT = 128
# Splits are added while (queries x head blocks x splits) fits in this many waves of SMs.
SPLIT_WAVES = 1.0
SPLIT_WAVES_SMALL_HEAD_BLOCKS = 4.0  # programs of fewer than 64 heads are light
MAX_SPLITS = 64
COMBINE_BLOCK_S = 8  # splits loaded together by the combine
COMBINE_NUM_WARPS = 4
INTERPRETER_SMS = 4  # under the interpreter: small, so the tests exercise the splits

# write_cache: columns per program
WRITE_BLOCK_C = 256
WRITE_NUM_WARPS = 2
RECORD_WRITE_NUM_WARPS = 2  # V4 FP8 records: one program per token

# compress_pool: a program pools one window; slots per tile = POOL_TILE // channels (pow2)
POOL_TILE = 4096
POOL_NUM_WARPS = 4

# indexer_topk: candidates scored per program
INDEX_BLOCK_C = 64
INDEX_NUM_WARPS = 4


# V4 FP8 KV records (deepinfer_core.ops.kv_record), for the kernels
_NOPE_DIM = tl.constexpr(kv_record.NOPE_DIM)  # 448 e4m3 bytes, then the RoPE part's 64 bf16 values
_TILE = tl.constexpr(kv_record.TILE)  # values per scale
_TILES = tl.constexpr(kv_record.TILES)
_PAGE_ROWS = tl.constexpr(kv_record.PAGE_ROWS)
_PAGE_BYTES = tl.constexpr(kv_record.PAGE_BYTES)
_DATA_BYTES = tl.constexpr(kv_record.DATA_BYTES)  # a row's data in its page's data plane
_SCALE_PLANE = tl.constexpr(kv_record.SCALE_PLANE)  # where a page's scale plane starts
_SCALE_BYTES = tl.constexpr(kv_record.SCALE_BYTES)
_UE8M0_BIAS = tl.constexpr(kv_record.UE8M0_BIAS)
_E4M3_MAX = tl.constexpr(kv_record.E4M3_MAX)
_AMAX_FLOOR = tl.constexpr(kv_record.AMAX_FLOOR)


# =============================================================================================
# sparse_attention
# =============================================================================================

def _attn_tiles(num_heads: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps): the [BLOCK_H, 512] float32 accumulator lives in registers
    (64 heads need 8 warps, as in mla_decode); tl.dot needs M >= 16."""
    if dtype == torch.float32:
        return ATTN_FP32_BLOCK_H, ATTN_FP32_BLOCK_N, 4
    if num_heads >= 64:
        return 64, ATTN_BLOCK_N, 8
    if num_heads >= 32:
        return 32, ATTN_BLOCK_N, 4
    return 16, ATTN_BLOCK_N, 4


def _attn_splits(queries: int, head_blocks: int, block_h: int, keys: int, block_n: int,
                 device: torch.device) -> tuple[int, int]:
    """(splits, key columns per split, a positive multiple of block_n), from shapes only; every
    split starts inside the row."""
    waves = SPLIT_WAVES if block_h >= 64 else SPLIT_WAVES_SMALL_HEAD_BLOCKS
    target = math.floor(waves * num_sms(device, INTERPRETER_SMS) / max(1, queries * head_blocks))
    shortest = ONE_QUERY_MIN_SPLIT if queries <= 1 else FEW_QUERIES_MIN_SPLIT if queries <= FEW_QUERIES else MIN_SPLIT
    splits = max(1, min(target, triton.cdiv(keys, shortest), MAX_SPLITS))
    per = max(block_n, triton.cdiv(triton.cdiv(max(keys, 1), splits), block_n) * block_n)
    return max(1, triton.cdiv(keys, per)), per


@triton.jit
def _record_rows(pages, slot, valid, ty, BLOCK_N: tl.constexpr):
    """[BLOCK_N, 512] key rows from V4 FP8 records, in ``ty``: row i is slot[i] of the page at
    pages[i] (not read where ~valid[i]: zeros). Viewed as 8 tiles of 64 columns: tile t < 7 is
    e4m3 bytes times 2^(b_t - 127), b_t the row's scale byte t (the power of two built from its
    bits: exact), tile 7 the RoPE part's bf16 values; exact in float32 and bfloat16, as
    read_records is. The scales load once per row, the RoPE part as its own 64 columns."""
    data = pages + slot * _DATA_BYTES
    tile = tl.arange(0, _SCALE_BYTES)
    c = tl.arange(0, _TILE)
    cols = tile[None, :, None] * _TILE + c[None, None, :]  # [1, 8, 64]
    nope = valid[:, None, None] & (tile < _TILES)[None, :, None]
    q8 = tl.load(data[:, None, None] + cols, mask=nope, other=0)
    b = tl.load((pages + _SCALE_PLANE + slot * _SCALE_BYTES)[:, None] + tile[None, :], mask=valid[:, None], other=0)
    scale = (b.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(b - 127); the pad byte's 0 gives 0
    rope = (data + _NOPE_DIM).to(tl.pointer_type(tl.bfloat16))
    r = tl.load(rope[:, None] + c[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    x = q8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, :, None]
    x = tl.where((tile == _TILES)[None, :, None], r[:, None, :], x)
    return tl.reshape(x, [BLOCK_N, _SCALE_BYTES * _TILE]).to(ty)


@triton.jit(do_not_specialize=["num_keys", "split_len", "num_splits", "s_it", "kv1_start", "kv2_start"])
def _sparse_attn_kernel(
    q_ptr, kv_ptr, kv1_ptr, kv2_ptr, idx_ptr, sink_ptr, out_ptr, part_ptr, lse_ptr,
    scale_log2,
    num_heads, num_keys, split_len, num_splits,
    kv1_start, kv2_start,
    s_qt, s_qh, s_qd,
    s_kn, s_k1n, s_k2n, s_kd,
    s_it, s_ik,
    s_ot, s_oh, s_od,
    s_pt, s_ps, s_ph,
    s_lt, s_ls,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, POOLS: tl.constexpr,
    RECORDS: tl.constexpr, PDL: tl.constexpr,
):
    """Key pools: row i of the concatenation is row i of kv (POOLS == 1, or i < kv1_start), row
    i - kv1_start of kv1 (POOLS >= 2, i < kv2_start) or row i - kv2_start of kv2 (POOLS == 3),
    each pool with its own row stride and the column stride s_kd; the row's pointer is chosen per
    gathered index (one load per tile, whichever pool each row is in). RECORDS: the pools are V4
    FP8 record caches and the same choice is made per page (starts and strides in pages), row i
    being slot i % 64 of page i // 64; the rows are dequantised to q's dtype."""
    await_inputs(PDL)
    pid = tl.program_id(0)
    hb = pid % HEAD_BLOCKS
    rest = pid // HEAD_BLOCKS
    split = rest % num_splits
    t = (rest // num_splits).to(tl.int64)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    kv_ty = q_ptr.dtype.element_ty if RECORDS else kv_ptr.dtype.element_ty  # the dots' dtype
    q = tl.load(q_ptr + t * s_qt + heads[:, None] * s_qh + d[None, :] * s_qd,
                mask=h_mask[:, None] & d_mask[None, :], other=0.0).to(kv_ty)

    start = split * split_len
    end = tl.minimum(start + split_len, num_keys)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    idx_row = idx_ptr + t * s_it
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_row + cols * s_ik, mask=cols < end, other=-1)
        valid = idx >= 0
        row = tl.maximum(idx, 0).to(tl.int64)
        unit = row // _PAGE_ROWS if RECORDS else row  # what the pools' starts and strides count
        rows = kv_ptr + unit * s_kn
        if POOLS >= 2:  # an empty pool's start is the next one's: its rows are never chosen
            rows = tl.where(unit >= kv1_start, kv1_ptr + (unit - kv1_start) * s_k1n, rows)
        if POOLS >= 3:
            rows = tl.where(unit >= kv2_start, kv2_ptr + (unit - kv2_start) * s_k2n, rows)
        if RECORDS:
            kv = _record_rows(rows, row % _PAGE_ROWS, valid, kv_ty, BLOCK_N)
        else:
            kv = tl.load(rows[:, None] + d[None, :] * s_kd, mask=valid[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: nothing is NaN
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(kv_ty), kv, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        has = l_i > 0.0
        o = acc / tl.where(has, l_i, 1.0)[:, None]  # zeros for a split without a valid key
        lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + t * s_lt + split * s_ls + heads, lse, mask=h_mask)
        tl.store(part_ptr + t * s_pt + split * s_ps + heads[:, None] * s_ph + d[None, :], o,
                 mask=h_mask[:, None] & d_mask[None, :])
    else:
        sink = tl.load(sink_ptr + heads, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)  # finite: the sink is
        w = tl.math.exp2(m_i - m_f)
        o = acc * w[:, None] / (l_i * w + tl.math.exp2(sink - m_f))[:, None]
        tl.store(out_ptr + t * s_ot + heads[:, None] * s_oh + d[None, :] * s_od, o.to(out_ptr.dtype.element_ty),
                 mask=h_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _sparse_attn_combine_kernel(
    part_ptr, lse_ptr, sink_ptr, out_ptr,
    num_heads, num_splits,
    s_pt, s_ps, s_ph,
    s_lt, s_ls,
    s_ot, s_oh, s_od,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    """Program (query, head): o = sum_s 2^lse_s o_s / (sum_s 2^lse_s + 2^sink), against the
    largest of them. A split without a valid key has lse -inf (weight 0) and a zero partial."""
    await_inputs(PDL)
    pid = tl.program_id(0)
    t = (pid // num_heads).to(tl.int64)
    h = pid % num_heads
    sink = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
    m = sink
    for s0 in range(0, num_splits, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(lse_ptr + t * s_lt + sp * s_ls + h, mask=sp < num_splits, other=float("-inf"))
        m = tl.maximum(m, tl.max(lse, axis=0))
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = tl.math.exp2(sink - m)
    for s0 in range(0, num_splits, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        ok = sp < num_splits
        w = tl.math.exp2(tl.load(lse_ptr + t * s_lt + sp * s_ls + h, mask=ok, other=float("-inf")) - m)
        part = tl.load(part_ptr + t * s_pt + sp[:, None] * s_ps + h * s_ph + d[None, :],
                       mask=ok[:, None] & d_mask[None, :], other=0.0)
        total += tl.sum(w, axis=0)
        acc += tl.sum(w[:, None] * part, axis=0)
    tl.store(out_ptr + t * s_ot + h * s_oh + d * s_od, (acc / total).to(out_ptr.dtype.element_ty), mask=d_mask)


def _key_pools(parts: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], list[int], int]:
    """(the non-empty pools, at least one; the row each starts at in the concatenation; the
    column stride they share). Pools without rows are dropped (the others' starts already skip
    them); a pool whose column stride is not the others' (only a column-strided view can
    differ) is copied contiguous. Shapes and strides only: no device work in the usual case."""
    starts = [sum(p.shape[0] for p in parts[:i]) for i in range(len(parts))]
    kept = [(p, s) for p, s in zip(parts, starts) if p.shape[0]] or [(parts[0], 0)]
    pools, starts = [p for p, _ in kept], [s for _, s in kept]
    if len({p.stride(1) for p in pools}) > 1:
        pools = [p.contiguous() for p in pools]
    return pools, starts, pools[0].stride(1)


def sparse_attention(q: torch.Tensor, kv, indices: torch.Tensor, sinks: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Shared-KV attention with per-head sinks over the named pool rows (contract:
    deepinfer_core.ops.sparse.sparse_attention). ``kv``: one pool [N, d], or a tuple of 1..3
    pools read in place (the kernel picks each gathered row's pool, no concatenation), or 1..3
    V4 FP8 record caches (d = 512: dequantised in registers to q's dtype). Graph-capture safe."""
    parts = key_pool_parts(kv)
    records = record_pools(parts, q)
    pools, starts, s_kd = _key_pools(parts)
    t_all, heads, d = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t_all == 0 or heads == 0:
        return out
    kv = pools[0]
    kv1, kv2 = (pools + [kv, kv])[1:3]  # unused pointers (POOLS < 3) repeat pool 0
    # records: pools are addressed by page (each starts on one), rows by their page's slot
    unit = kv_record.PAGE_ROWS if records else 1
    starts_12 = [s // unit for s in (starts + [0, 0])[1:3]]
    row_strides = [kv_record.PAGE_BYTES if records else p.stride(0) for p in (kv, kv1, kv2)]
    dot_dtype = q.dtype if records else kv.dtype
    keys = indices.shape[1]
    block_h, block_n, num_warps = _attn_tiles(heads, dot_dtype)
    head_blocks = triton.cdiv(heads, block_h)
    num_splits, split_len = _attn_splits(t_all, head_blocks, block_h, keys, block_n, q.device)
    split = num_splits > 1
    if split:
        partial = torch.empty((t_all, num_splits, heads, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((t_all, num_splits, heads), dtype=torch.float32, device=q.device)
    else:
        partial = lse = out  # unused without splits
    block_d = max(16, triton.next_power_of_2(d))
    precision = "ieee" if dot_dtype == torch.float32 else "tf32"
    _sparse_attn_kernel[(t_all * num_splits * head_blocks,)](
        q, kv, kv1, kv2, indices, sinks, out, partial, lse,
        scale * LOG2E,
        heads, keys, split_len, num_splits,
        *starts_12,
        *q.stride(), *row_strides, s_kd, *indices.stride(), *out.stride(),
        *(partial.stride()[:3] if split else (0, 0, 0)),
        *(lse.stride()[:2] if split else (0, 0)),
        D=d, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_N=block_n, HEAD_BLOCKS=head_blocks,
        SPLIT=split, DOT_PRECISION=precision, POOLS=len(pools), RECORDS=records,
        num_warps=num_warps, num_stages=ATTN_NUM_STAGES, **launch_options(q.device),
    )
    if split:
        _sparse_attn_combine_kernel[(t_all * heads,)](
            partial, lse, sinks, out,
            heads, num_splits,
            *partial.stride()[:3], *lse.stride()[:2], *out.stride(),
            D=d, BLOCK_D=block_d, BLOCK_S=min(COMBINE_BLOCK_S, triton.next_power_of_2(num_splits)),
            num_warps=COMBINE_NUM_WARPS, **launch_options(q.device),
        )
    return out


sparse_attention.impl = ("triton: gathered-key flash-decoding over 1-3 key pools in place, (query, key split, "
                         "head block) programs, log-sum-exp combine with the sink in the denominator; V4 FP8 record "
                         "pools (FlashMLA's paged layout) dequantised in registers to q's dtype before the dots")


# =============================================================================================
# write_cache
# =============================================================================================

@triton.jit
def _write_cache_kernel(cache_ptr, val_ptr, slot_ptr, C, s_cn, s_cc, s_vt, s_vc,
                        BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    keep = (cols < C) & (slot >= 0)
    v = tl.load(val_ptr + t * s_vt + cols * s_vc, mask=keep, other=0.0)
    tl.store(cache_ptr + tl.maximum(slot, 0) * s_cn + cols * s_cc, v.to(cache_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _e4m3_bits(y):
    """float32 y (|y| <= 448) -> its float8_e4m3fn byte, rounded to nearest, ties to even, as
    torch's cast (c10's fp8e4m3fn_from_fp32_value, whose steps these are). In integer steps
    rather than .to(tl.float8e4nv), which lowers to cvt.rn.satfinite (the same rounding) on the
    GPU but which Triton's interpreter (3.6) gets wrong: ties away from zero, a mantissa carry
    dropped (1.96875 -> 1.0), subnormals truncated. So the interpreter tests what the GPU runs."""
    u = y.to(tl.uint32, bitcast=True)
    a = u & 0x7FFFFFFF
    # below 2^-6, e4m3's subnormals (steps of 2^-9): adding 2^14, whose float32 step is 2^-9, rounds once
    sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)
    # normal: drop 20 mantissa bits to nearest even (a carry moves the exponent), rebias 127 -> 7
    norm = (a + 0x7FFFF + ((a >> 20) & 1) - (120 << 23)) >> 20
    return (tl.where(a < (121 << 23), sub, norm) | ((u >> 31) << 7)).to(tl.uint8)


@triton.jit
def _bf16_bits(x):
    """float32 x (finite) -> its bfloat16 bits, rounded to nearest, ties to even: .to(tl.bfloat16)
    on the GPU (cvt.rn), which the interpreter gets wrong as it does e4m3 (see _e4m3_bits)."""
    u = x.to(tl.uint32, bitcast=True)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16)


@triton.jit
def _write_records_kernel(cache_ptr, val_ptr, slot_ptr, s_vt, s_vc, PDL: tl.constexpr):
    """Program t: values[t] as row slot_mapping[t] of a V4 FP8 record cache (nothing for a
    negative slot), as kv_record.quantize_rows does it: per 64-value NoPE tile amax (float32,
    floored at AMAX_FLOOR), e the smallest integer with 2^e >= amax / 448 (the float32 quotient
    rounded as torch divides, then its exponent field, plus one unless the mantissa is zero),
    q = e4m3(clamp(x 2^-e, +-448)); scale bytes e + 127 and a zero pad; the RoPE part as bf16."""
    await_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    keep = slot >= 0
    slot = tl.maximum(slot, 0)
    page = cache_ptr + (slot // _PAGE_ROWS) * _PAGE_BYTES
    data = page + (slot % _PAGE_ROWS) * _DATA_BYTES
    tile = tl.arange(0, _SCALE_BYTES)  # the 7 NoPE tiles, then the scale row's pad byte
    c = tl.arange(0, _TILE)
    nope = keep & (tile < _TILES)[:, None]
    cols = tile[:, None] * _TILE + c[None, :]
    x = tl.load(val_ptr + t * s_vt + cols * s_vc, mask=nope, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), _AMAX_FLOOR)
    ratio = tl.math.div_rn(amax, _E4M3_MAX).to(tl.int32, bitcast=True)  # a normal float: amax >= 1e-4
    e = ((ratio >> 23) & 0xFF) - 127 + ((ratio & 0x7FFFFF) != 0).to(tl.int32)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact
    y = tl.minimum(tl.maximum(x * inv[:, None], -_E4M3_MAX), _E4M3_MAX)
    tl.store(data + cols, _e4m3_bits(y), mask=nope)
    scale = tl.where(tile < _TILES, e + _UE8M0_BIAS, 0).to(tl.uint8)
    tl.store(page + _SCALE_PLANE + (slot % _PAGE_ROWS) * _SCALE_BYTES + tile, scale, mask=keep)
    rope = tl.load(val_ptr + t * s_vt + (_NOPE_DIM + c) * s_vc, mask=keep, other=0.0).to(tl.float32)
    tl.store((data + _NOPE_DIM).to(tl.pointer_type(tl.uint16)) + c, _bf16_bits(rope), mask=keep)


def _write_records(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """write_cache into a V4 FP8 record cache: one program per token (``_write_records_kernel``)."""
    kv_record.planes(cache)  # a contiguous cache of whole pages, else ValueError
    kv_record.check_rows(values)
    if values.shape[0] == 0:
        return
    _write_records_kernel[(values.shape[0],)](
        cache, values, slot_mapping, *values.stride(),
        num_warps=RECORD_WRITE_NUM_WARPS, **launch_options(values.device),
    )


def write_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Row t of ``values`` [T, C] to flat row slot_mapping[t] of ``cache`` [..., C], cast to the
    cache's dtype (round to nearest even, as torch casts); negative slots skipped in the kernel.
    A V4 FP8 record cache (uint8 [..., 584]) gets values [T, 512] quantised (``_write_records``)."""
    if kv_record.is_record_cache(cache):
        return _write_records(cache, values, slot_mapping)
    flat = cache.view(-1, cache.shape[-1])
    t, c = values.shape
    if t == 0 or c == 0:
        return
    _write_cache_kernel[(t, triton.cdiv(c, WRITE_BLOCK_C))](
        flat, values, slot_mapping, c, *flat.stride(), *values.stride(),
        BLOCK_C=WRITE_BLOCK_C, num_warps=WRITE_NUM_WARPS, **launch_options(values.device),
    )


write_cache.impl = ("triton: one program per (token, column block), negative slots skipped on the device; V4 FP8 "
                    "record caches: one program per token quantises its 7 NoPE tiles (power-of-two scales, e4m3 "
                    "rounded to nearest even) and stores the RoPE part as bf16")


# =============================================================================================
# compress_pool
# =============================================================================================

@triton.jit
def _compress_pool_kernel(kv_ptr, score_ptr, w_ptr, out_ptr, S, C, eps,
                          s_kn, s_ks, s_kc, s_sn, s_ss, s_sc, s_on, s_oc,
                          BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """Program n: window n's entry. The reference's rounding points: the float32 softmax over the
    slots (max, then the sum of exp, then the quotient) rounded to kv's dtype, each product
    kv * weight rounded to it, their sum in float32 rounded once, then rms_norm_f32."""
    await_inputs(PDL)
    n = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    c_mask = c < C
    ty = kv_ptr.dtype.element_ty
    m = tl.full([BLOCK_C], float("-inf"), tl.float32)
    for s0 in range(0, S, BLOCK_S):
        sl = s0 + tl.arange(0, BLOCK_S)
        mask = (sl < S)[:, None] & c_mask[None, :]
        z = tl.load(score_ptr + n * s_sn + sl[:, None] * s_ss + c[None, :] * s_sc, mask=mask, other=float("-inf"))
        m = tl.maximum(m, tl.max(z, axis=0))
    m_use = tl.where(m == float("-inf"), 0.0, m)  # padded channels only: every real one has a finite slot
    total = tl.zeros([BLOCK_C], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        sl = s0 + tl.arange(0, BLOCK_S)
        mask = (sl < S)[:, None] & c_mask[None, :]
        z = tl.load(score_ptr + n * s_sn + sl[:, None] * s_ss + c[None, :] * s_sc, mask=mask, other=float("-inf"))
        total += tl.sum(tl.exp(z - m_use[None, :]), axis=0)
    total = tl.where(total > 0.0, total, 1.0)
    pooled = tl.zeros([BLOCK_C], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        sl = s0 + tl.arange(0, BLOCK_S)
        mask = (sl < S)[:, None] & c_mask[None, :]
        z = tl.load(score_ptr + n * s_sn + sl[:, None] * s_ss + c[None, :] * s_sc, mask=mask, other=float("-inf"))
        wt = (tl.exp(z - m_use[None, :]) / total[None, :]).to(ty)
        x = tl.load(kv_ptr + n * s_kn + sl[:, None] * s_ks + c[None, :] * s_kc, mask=mask, other=0.0)
        pooled += tl.sum((x.to(tl.float32) * wt.to(tl.float32)).to(ty).to(tl.float32), axis=0)
    x32 = pooled.to(ty).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x32 * x32, axis=0) / C + eps)
    w = tl.load(w_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * s_on + c * s_oc, (w * (x32 * rstd)).to(out_ptr.dtype.element_ty), mask=c_mask)


def compress_pool(kv: torch.Tensor, score: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One compressed entry per window (contract: deepinfer_core.ops.sparse.compress_pool): the
    per-channel softmax over the S slots, the weighted sum and rms_norm_f32 in one program per
    window."""
    n, s, c = kv.shape
    out = torch.empty((n, c), dtype=kv.dtype, device=kv.device)
    if n == 0 or c == 0:
        return out
    block_c = triton.next_power_of_2(c)
    block_s = min(triton.next_power_of_2(max(s, 1)), max(1, POOL_TILE // block_c))
    _compress_pool_kernel[(n,)](
        kv, score, norm_weight, out, s, c, eps,
        *kv.stride(), *score.stride(), *out.stride(),
        BLOCK_S=block_s, BLOCK_C=block_c, num_warps=POOL_NUM_WARPS, **launch_options(kv.device),
    )
    return out


compress_pool.impl = ("triton: one program per window, per-channel softmax over the slots, pooled with the "
                      "reference's roundings, rms_norm_f32 in the same program")


# =============================================================================================
# indexer_topk
# =============================================================================================

@triton.jit(do_not_specialize=["C", "s_ct", "s_st"])
def _indexer_scores_kernel(q_ptr, w_ptr, key_ptr, cand_ptr, score_ptr, scale, HI, DI, C,
                           s_qt, s_qh, s_qd, s_wt, s_wh, s_kn, s_kd, s_ct, s_cc, s_st,
                           BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_C: tl.constexpr,
                           DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (query, candidate block): score_j = sum_h w_h relu(q_h . key_j) scale in float32,
    -inf for -1 and past C, +0.0 for a zero (the sort below would rank -0.0 under +0.0). A
    column's score is computed the same way wherever it sits, so equal keys score equal bits."""
    await_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    h = tl.arange(0, BLOCK_HI)
    dd = tl.arange(0, BLOCK_DI)
    h_mask = h < HI
    d_mask = dd < DI
    key_ty = key_ptr.dtype.element_ty
    q = tl.load(q_ptr + t * s_qt + h[:, None] * s_qh + dd[None, :] * s_qd,
                mask=h_mask[:, None] & d_mask[None, :], other=0.0).to(key_ty)
    w = tl.load(w_ptr + t * s_wt + h * s_wh, mask=h_mask, other=0.0).to(tl.float32)
    cand = tl.load(cand_ptr + t * s_ct + cols * s_cc, mask=cols < C, other=-1)
    valid = cand >= 0
    keys = tl.load(key_ptr + tl.maximum(cand, 0).to(tl.int64)[:, None] * s_kn + dd[None, :] * s_kd,
                   mask=valid[:, None] & d_mask[None, :], other=0.0)
    dots = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION)  # [BLOCK_HI, BLOCK_C]
    score = tl.sum(tl.maximum(dots, 0.0) * scale * w[:, None], axis=0)
    score = tl.where(valid, score + 0.0, float("-inf"))
    tl.store(score_ptr + t * s_st + cols, score, mask=cols < C)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """[T, C] float32 scores of the candidates (-inf where -1), as indexer_topk ranks them."""
    t, c = candidates.shape
    hi, di = q.shape[1], q.shape[2]
    scores = torch.empty((t, c), dtype=torch.float32, device=candidates.device)
    if t == 0 or c == 0:
        return scores
    _indexer_scores_kernel[(t, triton.cdiv(c, INDEX_BLOCK_C))](
        q, weights, keys, candidates, scores, scale, hi, di, c,
        *q.stride(), *weights.stride(), *keys.stride(), *candidates.stride(), scores.stride(0),
        BLOCK_HI=max(16, triton.next_power_of_2(hi)), BLOCK_DI=max(16, triton.next_power_of_2(di)),
        BLOCK_C=INDEX_BLOCK_C, DOT_PRECISION="ieee" if keys.dtype == torch.float32 else "tf32",
        num_warps=INDEX_NUM_WARPS, **launch_options(candidates.device),
    )
    return scores


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor, top_k: int,
                 scale: float) -> torch.Tensor:
    """The lightning indexer (contract: deepinfer_core.ops.sparse.indexer_topk): the scores in
    Triton, the choice by torch's stable descending sort (of equal scores the earlier column
    first, the contract's tie rule), -1 where a query runs out of valid candidates."""
    t, c = candidates.shape
    k = min(top_k, c)
    if k == 0 or t == 0:
        return candidates.new_full((t, k), -1)
    scores = indexer_scores(q, weights, keys, candidates, scale)
    order = top_k_columns(scores, k)
    chosen = candidates.gather(1, order)
    return torch.where(scores.gather(1, order) > float("-inf"), chosen, torch.full_like(chosen, -1))


# How indexer_topk picks the k best columns of a [T, C] score matrix, both by the contract's tie rule:
# "sort": torch's stable descending sort of every row; "threshold": the k-th best score from
# torch.topk (a selection, no full sort), every column above it and, of the columns equal to it,
# the earliest ones. Which is faster at a context's C (16k entries at 64k tokens) is not measured yet.
INDEXER_SELECT = "sort"


def top_k_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] column indices of each row's k highest scores; of equal scores (-0.0 equal to +0.0)
    the earlier columns. Without a host synchronisation."""
    if INDEXER_SELECT == "sort":
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    t, c = scores.shape
    kth = torch.topk(scores, k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = scores > kth
    tied = scores == kth
    take = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))  # exactly k a row
    slot = torch.where(take, take.cumsum(-1) - 1, k)  # column order; the rest to a dropped column k
    cols = torch.arange(c, device=scores.device).expand(t, c)
    return torch.empty((t, k + 1), dtype=torch.long, device=scores.device).scatter_(1, slot, cols)[:, :k]


indexer_topk.impl = "triton scores (one program per query and candidate block) + torch stable sort for the top-k"


OPS = {"sparse_attention": sparse_attention, "write_cache": write_cache, "compress_pool": compress_pool,
       "indexer_topk": indexer_topk}
