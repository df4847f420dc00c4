"""Varlen causal flash attention for MLA prefill (expanded per-head form), in Triton.

Sequence b has lq new queries that are the last lq of its lk keys, so query i sees keys
0 .. lk - lq + i (the causal diagonal is aligned to the lower right). One program handles
BLOCK_M queries of one sequence and one head; it first walks the key tiles every one of its
queries sees (no mask), then the few tiles that cross the diagonal (masked).

The grid needs no host synchronisation: its first axis has cdiv(Tq, BLOCK_M) + B entries, an
upper bound of the total number of query tiles, mapped to (sequence, tile) by a searchsorted over
the cumulative tile counts computed on the device; the few spare programs exit at once. Within a
sequence the tiles run last-first, so the longest (most keys) start earliest.

The head dims need not be powers of two: d_qk is cut into a power-of-two part and a padded
remainder (192 = 128 + 64), so no tensor-core work is wasted on padding at DeepSeek's shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.kernels.device import await_inputs, launch_options

LOG2E = 1.4426950408889634

# Tunables (sweep on the GPU): 16-bit inputs, then float32 inputs (no tensor cores, twice the
# bytes per tile: smaller tiles keep them out of local memory).
BLOCK_M = 128
BLOCK_N = 64
NUM_WARPS = 8
NUM_STAGES = 2
FP32_BLOCK_M = 32
FP32_BLOCK_N = 16
FP32_NUM_WARPS = 8


def _tile_config(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for inputs of ``dtype``."""
    if dtype == torch.float32:
        return FP32_BLOCK_M, FP32_BLOCK_N, FP32_NUM_WARPS
    return BLOCK_M, BLOCK_N, NUM_WARPS


def _split_dim(d: int) -> tuple[int, int]:
    """d = a power of two part + a remainder padded to a power of two (0 when none); parts >= 16."""
    first = max(16, 1 << (d.bit_length() - 1)) if d >= 16 else 16
    rest = d - first
    return first, (max(16, triton.next_power_of_2(rest)) if rest > 0 else 0)


@triton.jit
def _attend_tile(
    q1, q2, k_base, v_base, n0, lk, diag, acc, l_i, m_i, scale_log2, s_kt, s_kd, s_vt, s_vd,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One key tile of online softmax; MASKED applies the causal and key-length masks."""
    keys = n0 + tl.arange(0, BLOCK_N)
    k_mask = keys < lk
    k_rows = k_base + keys.to(tl.int64) * s_kt
    d1 = tl.arange(0, BLOCK_D1)
    dv = tl.arange(0, BLOCK_DV)
    k1 = tl.load(k_rows[:, None] + d1[None, :] * s_kd, mask=k_mask[:, None] & (d1 < D_QK)[None, :], other=0.0)
    s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
    if BLOCK_D2 > 0:
        d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
        k2 = tl.load(k_rows[:, None] + d2[None, :] * s_kd, mask=k_mask[:, None] & (d2 < D_QK)[None, :], other=0.0)
        s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION)
    s = s * scale_log2
    if MASKED:
        visible = keys[None, :] <= (diag + tl.arange(0, BLOCK_M))[:, None]
        s = tl.where(visible & k_mask[None, :], s, float("-inf"))
    # Key 0 is visible to every row, so each row's running max is finite after the first tile.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + keys.to(tl.int64)[:, None] * s_vt + dv[None, :] * s_vd,
                mask=k_mask[:, None] & (dv < D_V)[None, :], other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _mla_prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, tile_seq_ptr, tile_start_ptr,
    scale_log2,
    num_seqs,
    s_qt, s_qh, s_qd,
    s_kt, s_kh, s_kd,
    s_vt, s_vh, s_vd,
    s_ot, s_oh, s_od,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    await_inputs(PDL)
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(tile_seq_ptr + tile)
    if b < num_seqs:
        q_start = tl.load(cu_q_ptr + b)
        lq = tl.load(cu_q_ptr + b + 1) - q_start
        k_start = tl.load(cu_k_ptr + b)
        lk = tl.load(cu_k_ptr + b + 1) - k_start
        # Tiles of a sequence run last-first: the local index counts down.
        n_tiles = tl.cdiv(lq, BLOCK_M)
        m_tile = n_tiles - 1 - (tile - tl.load(tile_start_ptr + b))
        m0 = m_tile * BLOCK_M
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < lq
        d1 = tl.arange(0, BLOCK_D1)
        dv = tl.arange(0, BLOCK_DV)
        d1_mask = d1 < D_QK
        dv_mask = dv < D_V

        q_rows = q_ptr + (q_start + offs_m).to(tl.int64) * s_qt + h * s_qh
        q1 = tl.load(q_rows[:, None] + d1[None, :] * s_qd, mask=m_mask[:, None] & d1_mask[None, :], other=0.0)
        if BLOCK_D2 > 0:
            d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
            q2 = tl.load(q_rows[:, None] + d2[None, :] * s_qd, mask=m_mask[:, None] & (d2 < D_QK)[None, :], other=0.0)
        else:
            q2 = q1  # unused

        k_base = k_ptr + k_start.to(tl.int64) * s_kt + h * s_kh
        v_base = v_ptr + k_start.to(tl.int64) * s_vt + h * s_vh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

        # Query m sees keys 0 .. lk - lq + m. Keys < lk - lq + m0 + 1 are seen by every row of the
        # tile (and are < lk): whole tiles of them need no mask.
        diag = lk - lq + m0
        full_end = ((diag + 1) // BLOCK_N) * BLOCK_N
        end = tl.minimum(lk, diag + BLOCK_M)
        for n0 in range(0, full_end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                q1, q2, k_base, v_base, n0, lk, diag, acc, l_i, m_i, scale_log2, s_kt, s_kd, s_vt, s_vd,
                D_QK, D_V, BLOCK_M, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV, False, DOT_PRECISION,
            )
        for n0 in range(full_end, end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                q1, q2, k_base, v_base, n0, lk, diag, acc, l_i, m_i, scale_log2, s_kt, s_kd, s_vt, s_vd,
                D_QK, D_V, BLOCK_M, BLOCK_N, BLOCK_D1, BLOCK_D2, BLOCK_DV, True, DOT_PRECISION,
            )

        o = acc / l_i[:, None]
        o_rows = o_ptr + (q_start + offs_m).to(tl.int64) * s_ot + h * s_oh
        tl.store(o_rows[:, None] + dv[None, :] * s_od, o.to(o_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & dv_mask[None, :])


def mla_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Varlen causal MLA prefill attention (contract: deepinfer_core.ops.attention.mla_prefill_attention)."""
    total_q, num_heads, d_qk = q.shape
    d_v = v.shape[-1]
    out = torch.empty((total_q, num_heads, d_v), dtype=q.dtype, device=q.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or num_heads == 0 or num_seqs == 0:
        return out

    # Query tiles per sequence and their cumulative start, on the device (no sync). Tile t belongs
    # to the sequence b with tile_start[b] <= t < tile_start[b + 1]; spare tiles map to b = B.
    block_m, block_n, num_warps = _tile_config(q.dtype)
    tiles = torch.div(cu_seqlens_q[1:] - cu_seqlens_q[:-1] + (block_m - 1), block_m, rounding_mode="floor")
    tile_end = torch.cumsum(tiles, 0)
    max_tiles = triton.cdiv(total_q, block_m) + num_seqs
    tile_ids = torch.arange(max_tiles, device=q.device, dtype=tile_end.dtype)
    tile_seq = torch.searchsorted(tile_end, tile_ids, right=True).to(torch.int32)
    tile_start = (tile_end - tiles).to(torch.int32)

    block_d1, block_d2 = _split_dim(d_qk)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _mla_prefill_kernel[(max_tiles, num_heads)](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, tile_seq, tile_start,
        scale * LOG2E,
        num_seqs,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        D_QK=d_qk, D_V=d_v, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D1=block_d1, BLOCK_D2=block_d2, BLOCK_DV=max(16, triton.next_power_of_2(d_v)),
        DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=NUM_STAGES, **launch_options(q.device),
    )
    return out


mla_prefill_attention.impl = "triton: varlen causal flash attention, device-side tile map, split power-of-two head dim"


def mla_prefill_attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same op through torch's scaled_dot_product_attention, one call per sequence, with the
    causal mask aligned to the lower right (cached prefix). Reads the sequence boundaries on the
    host once: prefill steps are never captured in graphs. Where SDPA has no kernel for the
    inputs, the Triton kernel computes them."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    try:
        return _sdpa_per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, out)
    except RuntimeError as e:  # no SDPA kernel for these head dims / layouts ("no kernel found to launch")
        if isinstance(e, torch.OutOfMemoryError) or "kernel" not in str(e).lower():
            raise
        return mla_prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)


def _sdpa_per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, out):
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    # SDPA's kernels want 16-byte aligned rows; the model's q/k/v are (views of) contiguous tensors
    # whose rows are, other callers' views may not be.
    q, k, v = (t if t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]) else t.contiguous() for t in (q, k, v))
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if lq == 0:
            continue
        qs = q[cq[b] : cq[b + 1]].transpose(0, 1)[None]
        ks = k[ck[b] : ck[b + 1]].transpose(0, 1)[None]
        vs = v[ck[b] : ck[b + 1]].transpose(0, 1)[None]
        if lq == lk:  # square: lower-right and upper-left causal coincide (the fast is_causal path)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=causal_lower_right(lq, lk), scale=scale)
        out[cq[b] : cq[b + 1]] = o[0].transpose(0, 1)
    return out


# Which implementation runs, from shapes only. Measured on an H200 (benchmarks/kernels.py,
# 2026-11-30, the per-sequence wrapper's host read and launches included): SDPA was faster at
# 128 heads (1 and 8 sequences: 0.7-0.9x the Triton kernel's time) and for one sequence of 16
# heads (0.5-0.9x); with 8 sequences of 16 heads its per-sequence calls cost 2.9x the Triton
# kernel's single launch.
SDPA_MIN_HEADS = 64
SDPA_MAX_SEQS = 2


def mla_prefill_attention_auto(q, k, v, cu_seqlens_q, cu_seqlens_k, scale):
    """SDPA for many heads or few sequences, else the Triton kernel (see SDPA_MIN_HEADS)."""
    if q.shape[1] >= SDPA_MIN_HEADS or cu_seqlens_q.shape[0] - 1 <= SDPA_MAX_SEQS:
        return mla_prefill_attention_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    return mla_prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)


mla_prefill_attention_sdpa.impl = "torch sdpa: one scaled_dot_product_attention per sequence (lower-right causal)"
mla_prefill_attention_auto.impl = (
    f"torch sdpa per sequence when heads >= {SDPA_MIN_HEADS} or sequences <= {SDPA_MAX_SEQS}, else triton "
    "varlen flash attention (chosen by measurement)"
)

OPS = {"mla_prefill_attention": mla_prefill_attention_auto}
