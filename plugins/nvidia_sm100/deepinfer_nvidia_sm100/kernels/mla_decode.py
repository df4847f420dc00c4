"""Absorbed-form MLA decode over the paged latent cache (flash-decoding), in Triton.

Each query row attends to a prefix of its sequence's cached entries ``[c_j | k_pe_j]``: this is
multi-query attention with a (d_c + d_r)-wide key and a d_c-wide value, both read from the same
cache row. A sequence has one query row in plain decode and 1 + k when speculative decoding
verifies k drafted tokens; its rows are its newest tokens, causal: row i of a sequence with
q_len rows and seq_len entries attends to the first seq_len - q_len + 1 + i of them (contract:
``deepinfer_core.ops.attention.mla_decode_attention``). The cache read dominates (576 values
per token, shared by all H heads), so:

* every query row is its own "batch" entry: grid = (head blocks, splits, query rows T), head
  blocks on the fastest-varying axis, so the programs that read the same (sequence, split) slice
  of the cache are scheduled together and share it in L2, and HBM sees each cache row about
  once; a sequence's rows are adjacent on the slow axis and cut their sequence at the same split
  boundaries (see below), so they share those slices in L2 too;
* a program finds its row's sequence itself, on the device: b = the number of
  query_start_loc[1:] entries <= row (one vector compare over query_start_loc, BLOCK_B entries
  at a time), then its length n = seq_lens[b] - query_start_loc[b + 1] + 1 + row (clamped at 0),
  and reads block_tables[b] in place: no host synchronisation, no [T, W] table copy, no extra
  launch;
* a program holds BLOCK_H heads (the M of both tensor-core dots) and walks BLOCK_N tokens at a
  time through the block table: one cache tile feeds both ``q @ [c | k_pe]^T`` and ``p @ c``;
* the number of splits comes from shapes only (query rows T, heads, block-table width, SM
  count), so the grid is CUDA-graph safe; the kernel cuts each sequence's actual ``seq_len``
  into that many equal slices (rounded to BLOCK_N, at least MIN_SPLIT_TOKENS) and each row
  covers the slices up to its own length, so short sequences and a sequence's earlier rows use
  only their first splits. Each split writes a normalised float32 partial output and its
  log-sum-exp (base 2); a split past the row's end writes lse = -inf and no output; a second
  kernel combines the splits (the valid ones are a prefix: those with a finite lse). With one
  split the first kernel writes the output directly and the combine is skipped.
* batch-invariant mode (``invariant_mla_decode_attention``) cuts each row at boundaries that
  follow from the row's own length and the heads alone (INV_*), always goes through the
  partials, and the combine adds the splits one by one in order: a row's bits do not follow the
  batch, the block-table width, or whether the row is a decode row or a prompt row.

With one query row per sequence (T == B, query_start_loc = 0, 1, .., B) this computes exactly
what the kernel of one new token per sequence did: same splits, same tiles, same bits (checked
on an H200 in bf16 and float32); the row -> sequence lookup, one more dependent load before
the first cache tile, cost 1-2% there (H200, bf16, graph replays, 2026-12-01: V2-Lite heads
B=32..256 +1.1..2.0%, V3 heads -1.9..+0.9%).

Not done yet: with several rows per sequence, each row's programs reload the cache tiles that
its sequence's other rows load (from L2, mostly): 4 rows per sequence took 3.2x the time of one
at V2-Lite heads (B=128, L=4096; 1.8x at B=32, L=1024) and 3.8x at V3 heads (B=32, L=4096,
where 4x the work is compute-bound anyway). A program could instead hold heads x rows of one
sequence as the M of its dots (BLOCK_H heads for each of its q_len rows; 16 V2-Lite heads x 4
rows = M 64, a fuller tensor-core tile than 16 heads alone), load each cache tile once for all
of them and mask per row only the last q_len - 1 positions (the causal diagonal). The grid
would then be (head blocks, splits, sequences x row groups), sized from shapes only with a
fixed row-group size (or the bound T - B + 1 on q_len), a row group's programs finding their
sequence as programs find it now.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.kernels.device import await_inputs, launch_options, num_sms

LOG2E = 1.4426950408889634

# Tunables (sweep on the GPU). Tokens per inner iteration (16-bit caches; float32 caches use
# FP32_BLOCK_N and FP32_BLOCK_H: no tensor cores for them, and their tiles are twice the bytes).
BLOCK_N = 32
FP32_BLOCK_N = 16
FP32_BLOCK_H = 16
NUM_STAGES = 2
# A split covers at least this many tokens (the partial write + combine cost ~8 bytes per head
# and latent channel per split, so tiny splits do not pay for themselves).
MIN_SPLIT_TOKENS = 256
# ... except in batches of at most SMALL_BATCH sequences, where short splits pay (H200,
# benchmarks/tune.py, 2026-11-30: B=1 L=1024 H=16 took 10.7 us with 64-token splits, 20.2 with 256).
SMALL_BATCH = 8
SMALL_BATCH_MIN_SPLIT_TOKENS = 64
# ... and for a single query row, shorter still (H200, benchmarks/tune.py --only mla_decode_small,
# 2026-12-03, 64-token KV blocks: B=1 L=1024 12.2 us with 32-token splits against 14.4 with 64 at
# 16 heads, 16.4 against 19.7 at 128 heads; no difference at L=4096 (the 64-split cap gives
# 64-token splits either way); at B=8 L=1024 32 lost, 16.8
# against 16.0 us, so only one row).
ONE_ROW_MIN_SPLIT_TOKENS = 32
# Splits are added while (head blocks x splits x batch) stays within this many waves of SMs
# (rounded down: a nearly full wave without splits beats a full one that pays for partials).
SPLIT_WAVES = 1.0
# Programs of fewer than 64 heads are light: four waves of them hide latency better (H200, H=16:
# 1.3-1.7x faster at B=64..128, L=1024..4096); 64-head programs lose from the extra partials.
SPLIT_WAVES_SMALL_HEAD_BLOCKS = 4.0
MAX_SPLITS = 64
# The batch-invariant kernel cuts each query row at places that follow from the row's own length
# (never from the batch): splits of INV_SPLIT_TOKENS_PER_HEAD x heads tokens, clamped to
# [INV_MIN_SPLIT_TOKENS, INV_MAX_SPLIT_TOKENS] (a partial costs ~8 bytes per head and latent
# channel: the more heads, the longer a split must be to pay for it), at most INV_MAX_SPLITS per
# row (longer rows get longer splits). H200, benchmarks/tune.py --only invariant_mla_decode,
# 2026-12-02, bf16, as a share of the normal kernel's time: 16 heads (128-token splits) B=1
# 1.1-1.4x, B=8 0.7-1.4x, B=32 0.7-1.2x, B=64 0.8-1.3x at L=256..4096 (longer splits win at
# large B, lose at small B: one size must serve every batch); 128 heads (256-token splits) 2.0x at
# B=1, 1.14x at B=32, L=1024. Rows go to the kernel in groups whose partials fit in
# INV_PARTIAL_BYTES (prompt chunks computed as rows would otherwise need gigabytes).
INV_MIN_SPLIT_TOKENS = 64
INV_MAX_SPLIT_TOKENS = 256
INV_SPLIT_TOKENS_PER_HEAD = 8
INV_MAX_SPLITS = 16
INV_PARTIAL_BYTES = 256 << 20
# Number of SMs assumed under the interpreter (no GPU there); small so tests exercise splitting.
INTERPRETER_SMS = 4
COMBINE_NUM_WARPS = 4
# Splits per unrolled step of the combine's loop (their loads in flight together).
COMBINE_BLOCK_S = 8
# query_start_loc entries a program compares at a time to find its row's sequence
MAX_BLOCK_B = 256


def _tile_config(num_heads: int, cache_dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps). The [BLOCK_H, d_c] float32 accumulator lives in registers:
    64 heads x 512 need 8 warps (128 registers a thread); tl.dot needs M >= 16."""
    if cache_dtype == torch.float32:
        return FP32_BLOCK_H, FP32_BLOCK_N, 4
    if num_heads >= 64:
        return 64, BLOCK_N, 8
    if num_heads >= 32:
        return 32, BLOCK_N, 4
    return 16, BLOCK_N, 4



def _min_split_tokens(batch: int) -> int:
    if batch <= 1:
        return ONE_ROW_MIN_SPLIT_TOKENS
    return SMALL_BATCH_MIN_SPLIT_TOKENS if batch <= SMALL_BATCH else MIN_SPLIT_TOKENS


def _num_splits(batch: int, head_blocks: int, max_len: int, device: torch.device, block_h: int = 64) -> int:
    """Splits per sequence, from shapes only: as many as fit in SPLIT_WAVES (programs of 64 heads)
    or SPLIT_WAVES_SMALL_HEAD_BLOCKS waves of programs, no split shorter than the minimum split of
    the longest possible sequence."""
    waves = SPLIT_WAVES if block_h >= 64 else SPLIT_WAVES_SMALL_HEAD_BLOCKS
    target = math.floor(waves * num_sms(device, INTERPRETER_SMS) / (batch * head_blocks))
    longest = max(1, math.ceil(max_len / _min_split_tokens(batch)))
    return max(1, min(target, longest, MAX_SPLITS))


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """Tokens per split of a sequence of seq_len tokens (a positive multiple of BLOCK_N)."""
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(per_split, MIN_SPLIT)


@triton.jit
def _sequence_of_row(qsl_ptr, num_seqs, row, BLOCK_B: tl.constexpr):
    """The sequence b whose query rows query_start_loc[b] .. query_start_loc[b + 1] - 1 include
    ``row``: the number of query_start_loc[1:] entries <= row (query_start_loc is
    non-decreasing and query_start_loc[num_seqs] == T > row, so at most num_seqs - 1)."""
    count = tl.zeros([BLOCK_B], tl.int32)
    for b0 in range(0, num_seqs, BLOCK_B):
        idx = b0 + 1 + tl.arange(0, BLOCK_B)
        ends = tl.load(qsl_ptr + idx, mask=idx <= num_seqs, other=row + 1)
        count += (ends <= row).to(tl.int32)
    return tl.sum(count, axis=0)


@triton.jit(do_not_specialize=["num_splits", "split_cap", "num_seqs", "row0", "s_btb"])  # per-step sizes: one compile, not one per value class
def _mla_decode_split_kernel(
    q_ptr, qpe_ptr, cache_ptr, bt_ptr, lens_ptr, qsl_ptr, out_ptr, part_ptr, lse_ptr,
    scale_log2,
    num_heads, num_splits, split_cap, num_seqs, row0,
    s_qb, s_qh, s_qd,
    s_pb, s_ph, s_pd,
    s_cn, s_cs, s_cd,
    s_btb, s_btn,
    s_ob, s_oh, s_od,
    s_pab, s_pas, s_pah,
    s_lb, s_ls,
    D_C: tl.constexpr, D_R: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr,
    SPLIT: tl.constexpr, MIN_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_B: tl.constexpr,
    ROW_SPLITS: tl.constexpr, PDL: tl.constexpr,
):
    await_inputs(PDL)
    pid_h = tl.program_id(0)
    split = tl.program_id(1)
    r = tl.program_id(2)  # the row of this launch's partials
    b = row0 + r  # the query row (the "batch" entry of the q / out tensors)

    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    dc = tl.arange(0, BLOCK_DC)
    dr = tl.arange(0, BLOCK_DR)
    dc_mask = dc < D_C
    dr_mask = dr < D_R

    # the row's queries first: their loads need no lookup and overlap with it
    cache_ty = cache_ptr.dtype.element_ty
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + dc[None, :] * s_qd,
                mask=h_mask[:, None] & dc_mask[None, :], other=0.0).to(cache_ty)
    q_pe = tl.load(qpe_ptr + b * s_pb + heads[:, None] * s_ph + dr[None, :] * s_pd,
                   mask=h_mask[:, None] & dr_mask[None, :], other=0.0).to(cache_ty)

    seq = _sequence_of_row(qsl_ptr, num_seqs, b, BLOCK_B)
    seq_len = tl.load(lens_ptr + seq)
    # causal: row i of the sequence's q_len rows sees seq_len - q_len + 1 + i entries
    row_len = tl.maximum(seq_len - tl.load(qsl_ptr + seq + 1) + 1 + b, 0)
    # split boundaries from the sequence's length, so all its rows cut it at the same places;
    # batch-invariant: from the row's own length, so a row is cut the same way in any call
    split_len = _split_len(row_len if ROW_SPLITS else seq_len, split_cap, BLOCK_N, MIN_SPLIT)
    start = split * split_len
    end = tl.minimum(start + split_len, row_len)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * s_btb
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        t_mask = toks < end
        page = tl.load(bt_row + (toks // BLOCK_SIZE) * s_btn, mask=t_mask, other=0)
        rows = cache_ptr + page.to(tl.int64) * s_cn + (toks % BLOCK_SIZE) * s_cs
        c = tl.load(rows[:, None] + dc[None, :] * s_cd, mask=t_mask[:, None] & dc_mask[None, :], other=0.0)
        k_pe = tl.load(rows[:, None] + (D_C + dr)[None, :] * s_cd, mask=t_mask[:, None] & dr_mask[None, :], other=0.0)

        s = tl.dot(q, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION)
        s = tl.where(t_mask[None, :], s * scale_log2, float("-inf"))
        # Every iteration has at least one valid token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(cache_ty), c, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    has_tokens = l_i > 0.0
    o = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    if not SPLIT:
        # A row with no token (graph padding) gets zeros, as the reference does.
        tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + dc[None, :] * s_od,
                 o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & dc_mask[None, :])
    else:
        lse = tl.where(has_tokens, m_i + tl.math.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + r * s_lb + split * s_ls + heads, lse, mask=h_mask)
        tl.store(part_ptr + r * s_pab + split * s_pas + heads[:, None] * s_pah + dc[None, :], o,
                 mask=(h_mask & (start < end))[:, None] & dc_mask[None, :])


@triton.jit(do_not_specialize=["num_splits", "row0"])  # per-step sizes: one compile, not one per value class
def _mla_decode_combine_kernel(
    part_ptr, lse_ptr, out_ptr,
    num_heads, num_splits, row0,
    s_pab, s_pas, s_pah,
    s_lb, s_ls,
    s_ob, s_oh, s_od,
    D_C: tl.constexpr, BLOCK_DC: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    await_inputs(PDL)
    pid = tl.program_id(0)
    r = pid // num_heads  # the row of this launch's partials
    b = row0 + r  # the query row
    h = pid % num_heads

    # Every split wrote its lse; those with tokens (finite lse) are a prefix of the splits. The
    # maximum is exact whatever the padding; the sums run split by split in order (a split past
    # the valid ones adds exactly 0), so a row's result does not follow the number of splits of
    # the call (SPLITS_P2). The loop is unrolled BLOCK_S splits at a time so that their loads are
    # in flight together: one round trip to memory per BLOCK_S splits, not per split.
    splits = tl.arange(0, SPLITS_P2)
    lse = tl.load(lse_ptr + r * s_lb + splits * s_ls + h, mask=splits < num_splits, other=float("-inf"))
    n_valid = tl.sum((lse > float("-inf")).to(tl.int32), axis=0)
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)

    dc = tl.arange(0, BLOCK_DC)
    dc_mask = dc < D_C
    acc = tl.zeros([BLOCK_DC], tl.float32)
    total = tl.full([], 0.0, tl.float32)
    base = part_ptr + r * s_pab + h * s_pah
    for s0 in range(0, n_valid, BLOCK_S):
        for i in tl.static_range(BLOCK_S):  # unrolled: the loads do not wait for the sums
            ok = s0 + i < n_valid
            w = tl.math.exp2(tl.load(lse_ptr + r * s_lb + (s0 + i) * s_ls + h, mask=ok, other=float("-inf")) - m)
            total += w
            acc += w * tl.load(base + (s0 + i) * s_pas + dc, mask=dc_mask & ok, other=0.0)
    o = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * s_ob + h * s_oh + dc * s_od, o.to(out_ptr.dtype.element_ty), mask=dc_mask)


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed-form MLA decode (contract: deepinfer_core.ops.attention.mla_decode_attention).

    Graph-capture safe: the grid and the tuning depend on shapes only (T query rows, B
    sequences, the block-table width W), and each program maps its row to its sequence on the
    device."""
    return _decode(q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale)


def invariant_mla_decode_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``mla_decode_attention``, batch-invariant: each row's entries are split where its own length
    says (``_invariant_splits``), never where the batch's shape would, and the splits are merged
    one by one in order, so a row gets the same bits alone, in any batch, and as a row of a prompt
    chunk, whatever its sequence's query length."""
    return _decode(q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale, invariant=True)


def _invariant_splits(num_heads: int, block_n: int, max_len: int) -> tuple[int, int]:
    """(tokens per split at least, splits per row at most) of the batch-invariant kernel: from the
    heads and the longest possible row only."""
    tokens = min(INV_MAX_SPLIT_TOKENS, max(INV_MIN_SPLIT_TOKENS, INV_SPLIT_TOKENS_PER_HEAD * num_heads))
    split = triton.cdiv(tokens, block_n) * block_n
    return split, max(1, min(INV_MAX_SPLITS, triton.cdiv(max_len, split)))


def _decode(q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale: float, invariant: bool = False) -> torch.Tensor:
    rows, num_heads, d_c = q_latent.shape
    num_seqs = seq_lens.shape[0]
    d_r = q_pe.shape[-1]
    block_size = kv_cache.shape[1]
    out = torch.empty(q_latent.shape, dtype=q_latent.dtype, device=q_latent.device)
    if rows == 0 or num_heads == 0:
        return out
    assert kv_cache.shape[-1] == d_c + d_r, "cache rows must be [latent | k_pe]"
    assert query_start_loc.shape[0] == num_seqs + 1 and num_seqs > 0, "query_start_loc must be [B + 1]"

    block_h, block_n, num_warps = _tile_config(num_heads, kv_cache.dtype)
    head_blocks = triton.cdiv(num_heads, block_h)
    max_len = block_tables.shape[1] * block_size
    if invariant:  # every row split where its length says, always through the partials and the combine
        min_split, num_splits = _invariant_splits(num_heads, block_n, max_len)
        split_cap, group = INV_MAX_SPLITS, max(1, INV_PARTIAL_BYTES // (num_splits * num_heads * d_c * 4))
    else:  # every query row is a "batch" entry of the grid: the tuning counts rows
        num_splits = split_cap = _num_splits(rows, head_blocks, max_len, q_latent.device, block_h)
        min_split, group = triton.cdiv(_min_split_tokens(rows), block_n) * block_n, rows
    split = invariant or num_splits > 1
    block_dc = max(16, triton.next_power_of_2(d_c))
    block_dr = max(16, triton.next_power_of_2(d_r))
    block_b = min(MAX_BLOCK_B, triton.next_power_of_2(num_seqs))
    precision = "ieee" if kv_cache.dtype == torch.float32 else "tf32"

    group = min(group, rows)
    if split:
        partial = torch.empty((group, num_splits, num_heads, d_c), dtype=torch.float32, device=q_latent.device)
        lse = torch.empty((group, num_splits, num_heads), dtype=torch.float32, device=q_latent.device)
    else:
        partial = lse = out  # unused by the kernel when SPLIT is False
    for row0 in range(0, rows, group):  # one group but in the invariant kernel's long prompt chunks
        n = min(group, rows - row0)
        _mla_decode_split_kernel[(head_blocks, num_splits, n)](
            q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, out, partial, lse,
            scale * LOG2E,
            num_heads, num_splits, split_cap, num_seqs, row0,
            *q_latent.stride(), *q_pe.stride(), *kv_cache.stride(), *block_tables.stride(), *out.stride(),
            *(partial.stride()[:3] if split else (0, 0, 0)),
            *(lse.stride()[:2] if split else (0, 0)),
            D_C=d_c, D_R=d_r, BLOCK_SIZE=block_size, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_DC=block_dc, BLOCK_DR=block_dr,
            SPLIT=split, MIN_SPLIT=min_split, DOT_PRECISION=precision, BLOCK_B=block_b, ROW_SPLITS=invariant,
            num_warps=num_warps, num_stages=NUM_STAGES, **launch_options(q_latent.device),
        )
        if split:
            _mla_decode_combine_kernel[(n * num_heads,)](
                partial, lse, out,
                num_heads, num_splits, row0,
                *partial.stride()[:3], *lse.stride()[:2], *out.stride(),
                D_C=d_c, BLOCK_DC=block_dc, SPLITS_P2=triton.next_power_of_2(num_splits),
                BLOCK_S=min(COMBINE_BLOCK_S, triton.next_power_of_2(num_splits)),
                num_warps=COMBINE_NUM_WARPS, **launch_options(partial.device),
            )
    return out


mla_decode_attention.impl = ("triton: paged flash-decoding, head blocks x KV splits x query rows (1 + k per sequence, "
                             "causal), log-sum-exp combine")


@triton.jit(do_not_specialize=["num_seqs", "width", "s_btb", "s_tb"])
def _row_plan_kernel(bt_ptr, lens_ptr, qsl_ptr, tables_ptr, row_lens_ptr, empty_ptr, num_seqs, width,
                     s_btb, s_btw, s_tb, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    row = tl.program_id(0)
    b = _sequence_of_row(qsl_ptr, num_seqs, row, BLOCK_B)
    start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - start
    n = tl.load(lens_ptr + b) - q_len + 1 + (row - start)
    tl.store(row_lens_ptr + row, tl.maximum(n, 1))
    tl.store(empty_ptr + row, (n <= 0).to(tl.uint8))
    for w0 in range(0, width, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        keep = w < width
        tl.store(tables_ptr + row * s_tb + w, tl.load(bt_ptr + b * s_btb + w * s_btw, mask=keep), mask=keep)


def row_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, rows: int):
    """Every query row as a sequence of its own, in one launch (no host synchronisation): ([T, W]
    int32 block table rows, each its sequence's; [T] int32 entries each row attends to, at least
    1; [T] bool, True for rows with none). Row i of sequence b attends to
    seq_lens[b] - q_len_b + 1 + i entries, as ``mla_decode_attention``'s contract says."""
    width = block_tables.shape[1]
    device = seq_lens.device
    tables = torch.empty((rows, width), dtype=torch.int32, device=device)
    lens = torch.empty(rows, dtype=torch.int32, device=device)
    empty = torch.empty(rows, dtype=torch.uint8, device=device)
    if rows:
        num_seqs = seq_lens.shape[0]
        _row_plan_kernel[(rows,)](
            block_tables, seq_lens, query_start_loc, tables, lens, empty, num_seqs, width,
            block_tables.stride(0), block_tables.stride(1), tables.stride(0),
            BLOCK_B=MAX_BLOCK_B, BLOCK_W=128, **launch_options(block_tables.device),  # one compile for every batch size
        )
    return tables, lens, empty.view(torch.bool)


invariant_mla_decode_attention.impl = ("triton, batch-invariant: paged flash-decoding, KV splits where each row's length says, "
                                       "merged in order")

OPS = {"mla_decode_attention": mla_decode_attention}
INVARIANT_OPS = {"mla_decode_attention": invariant_mla_decode_attention}
