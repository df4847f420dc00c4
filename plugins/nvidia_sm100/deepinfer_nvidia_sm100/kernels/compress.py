"""DeepSeek-V4's compressor, from its window rows to rotated entries, in one launch:
``compress_entries`` (contract: ``deepinfer_core.ops.sparse.compress_entries``).

The model's chain it replaces was, per CSA / HCA layer and step, a gather of each window's rows
from this step's rows and the state ring, the two series' column picks (CSA), the masks, a cast,
``compress_pool`` and ``rotary_embedding`` (~10 launches, and a gathered [N, span, R] float32
copy). Here a program makes one entry n, all of its ``dim`` channels:

1. Window n's slot row numbers are loaded once per tile; each slot's row pointer is picked from
   the pool its number falls in (this step's rows below T, the ring's rows from T: the ring is
   read in place, as a row-strided view), -1 slots masked (never read). Overlapping windows
   (CSA, span 2m) read slot s < m's kv and gate columns [0, dim) of their halves, slots s >= m
   columns [dim, 2 dim): the previous window's first series, this window's second.
2. The per-channel softmax over the slots in float32: one slot tile (span <= BLOCK_S, every
   CSA shape) loads gates and kv once; more slots (HCA's 128) take two passes over the gates
   (an online max and sum, then the weights), kv read once in the second.
3. The reference's rounding points (``compress_pool``): kv cast to the compute dtype, the softmax
   rounded to it, each product kv * weight rounded to it, their sum in float32 rounded once; then
   ``rms_norm_f32`` (float32 weight multiply, one rounding) and RoPE of the trailing r channels as
   interleaved pairs at the window's position, computed in float32 from the rounded entry.

The slot tiles are [BLOCK_S, dim] (contiguous, vectorised loads); the normalised entry is then
viewed as [dim / 2, 2] (``tl.reshape`` + ``tl.split``), so RoPE rotates each pair in registers
without a trip through memory, and stored pair by pair (``tl.join``). Compiled for sm_90 every
variant keeps to 55-120 registers a thread without a stack (tests/nvidia/test_compress_kernels.py).

The cache write stays ``write_cache``'s: the op returns entries (the model writes the
compressor's and the indexer's to caches of any dtype, FP8 records included). A decode-only step
pools a window for every token, closing one or not (fixed shapes for the graphs; a closing
token's slot says where its entry goes, the others' are -1), and so does this kernel, as the
contract says: an HCA decode program reads its 128 rows whether or not the entry is kept.
Taking the slots (and writing the entry) would let it skip those; that is a change of the op.

Shapes the kernel does not take run the reference on the device (``compress_entries.impl`` says
which): rows / state not float32, a compute dtype other than bf16 / fp16 / float32, or dim above
MAX_DIM. Free of host synchronisation; the grid is N programs, from shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.ops import sparse as reference
from deepinfer_nvidia_sm100.kernels.device import await_inputs, launch_options

# ---- tunables (sweep on the GPU) -------------------------------------------------------------
# A slot tile holds at most TILE values of a gate or kv tile ([BLOCK_S, dim] float32, 4 warps:
# 32 values a thread each); fewer slots per tile the wider the entry (512 channels: 8 slots, a
# whole CSA window; HCA's 128 slots: 16 tiles).
TILE = 4096
NUM_WARPS = 4
MAX_DIM = 1024  # wider entries (none of V4's: 512 and the indexer's 128) go to the reference
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _slot_tile(rows_ptr, state_ptr, win_ptr, n, s0, T, span, m, dim, s_rt, s_st, s_wn, s_ws, c, c_ok,
               OVERLAP: tl.constexpr, BLOCK_S: tl.constexpr):
    """Pointers to the kv values of slots [s0, s0 + BLOCK_S) of window n, channels c [BLOCK_S,
    BLOCK_C] (the gate values are half_width columns on), and their mask (valid slot and channel)."""
    sl = s0 + tl.arange(0, BLOCK_S)
    idx = tl.load(win_ptr + n * s_wn + sl * s_ws, mask=sl < span, other=-1).to(tl.int64)
    row = tl.maximum(idx, 0)
    base = tl.where(row < T, rows_ptr + row * s_rt, state_ptr + (row - T) * s_st)
    if OVERLAP:  # the previous window's first series, this window's second
        base += tl.where(sl >= m, dim, 0)
    return base[:, None] + c[None, :], (idx >= 0)[:, None] & c_ok[None, :]


@triton.jit(do_not_specialize=["T", "span", "m", "dim"])
def _compress_entries_kernel(
    rows_ptr, state_ptr, win_ptr, pos_ptr, w_ptr, cs_ptr, out_ptr,
    T, span, m, dim, half_width, rope_dim, eps,
    s_rt, s_st, s_wn, s_ws, s_pn, s_w, s_cp, s_cr, s_on,
    OVERLAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr, ONE_TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program n: entry n. Rows and state are float32 with unit column stride; a slot's kv is at
    column col0(s) + c of its row and its gate at half_width + col0(s) + c, col0(s) = dim for the
    second series (OVERLAP and s >= m), else 0."""
    await_inputs(PDL)
    ty = out_ptr.dtype.element_ty
    n = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, 2 * BLOCK_J)
    c_ok = c < dim

    if ONE_TILE:
        ptrs, mask = _slot_tile(rows_ptr, state_ptr, win_ptr, n, 0, T, span, m, dim, s_rt, s_st, s_wn, s_ws, c, c_ok,
                                OVERLAP, BLOCK_S)
        z = tl.load(ptrs + half_width, mask=mask, other=float("-inf"))
        mx = tl.max(z, axis=0)
        m_use = tl.where(mx == float("-inf"), 0.0, mx)  # padded channels (and a window of no slot)
        e = tl.exp(z - m_use[None, :])
        total = tl.sum(e, axis=0)
        total = tl.where(total > 0.0, total, 1.0)
        wt = (e / total[None, :]).to(ty).to(tl.float32)
        x = tl.load(ptrs, mask=mask, other=0.0).to(ty).to(tl.float32)
        pooled = tl.sum((x * wt).to(ty).to(tl.float32), axis=0)
    else:
        mx = tl.full([2 * BLOCK_J], float("-inf"), tl.float32)
        total = tl.zeros([2 * BLOCK_J], tl.float32)
        for s0 in range(0, span, BLOCK_S):  # online max and sum of exp over the slots
            ptrs, mask = _slot_tile(rows_ptr, state_ptr, win_ptr, n, s0, T, span, m, dim, s_rt, s_st, s_wn, s_ws, c,
                                    c_ok, OVERLAP, BLOCK_S)
            z = tl.load(ptrs + half_width, mask=mask, other=float("-inf"))
            m_new = tl.maximum(mx, tl.max(z, axis=0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            total = total * tl.exp(mx - m_use) + tl.sum(tl.exp(z - m_use[None, :]), axis=0)
            mx = m_new
        m_use = tl.where(mx == float("-inf"), 0.0, mx)
        total = tl.where(total > 0.0, total, 1.0)
        pooled = tl.zeros([2 * BLOCK_J], tl.float32)
        for s0 in range(0, span, BLOCK_S):  # the weights, rounded as the reference rounds them
            ptrs, mask = _slot_tile(rows_ptr, state_ptr, win_ptr, n, s0, T, span, m, dim, s_rt, s_st, s_wn, s_ws, c,
                                    c_ok, OVERLAP, BLOCK_S)
            z = tl.load(ptrs + half_width, mask=mask, other=float("-inf"))
            wt = (tl.exp(z - m_use[None, :]) / total[None, :]).to(ty).to(tl.float32)
            x = tl.load(ptrs, mask=mask, other=0.0).to(ty).to(tl.float32)
            pooled += tl.sum((x * wt).to(ty).to(tl.float32), axis=0)

    # rms_norm_f32 of the entry as the reference holds it (rounded to the compute dtype)
    x32 = pooled.to(ty).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x32 * x32, axis=0) / dim + eps)
    w = tl.load(w_ptr + c * s_w, mask=c_ok, other=0.0).to(tl.float32)
    y = (w * (x32 * rstd)).to(ty).to(tl.float32)

    # RoPE of the last rope_dim channels, pairs (2j, 2j + 1): pair j is rope pair j - (dim - r) / 2
    a, b = tl.split(tl.reshape(y, [BLOCK_J, 2]))
    j = tl.arange(0, BLOCK_J)
    i = j - (dim - rope_dim) // 2
    rot = (i >= 0) & (2 * j < dim)
    pos = tl.load(pos_ptr + n * s_pn).to(tl.int64)
    cos = tl.load(cs_ptr + pos * s_cp + i * s_cr, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * s_cp + (rope_dim // 2 + i) * s_cr, mask=rot, other=0.0).to(tl.float32)
    ra = tl.where(rot, a * cos - b * sin, a)
    rb = tl.where(rot, b * cos + a * sin, b)
    ch = 2 * j[:, None] + tl.arange(0, 2)[None, :]
    tl.store(out_ptr + n * s_on + ch, tl.join(ra, rb).to(ty), mask=ch < dim)


def kernel_takes(rows: torch.Tensor, state: torch.Tensor, dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes a call (shapes already checked): float32 pools, a compute dtype
    of DTYPES, dim <= MAX_DIM."""
    return rows.dtype == torch.float32 and state.dtype == torch.float32 and dtype in DTYPES and dim <= MAX_DIM


def tiles(span: int, dim: int) -> tuple[int, int, bool]:
    """(BLOCK_S slots per tile, BLOCK_J channel pairs, whether one tile holds the window)."""
    block_j = max(1, triton.next_power_of_2(dim) // 2)
    block_s = max(1, min(triton.next_power_of_2(max(span, 1)), TILE // (2 * block_j)))
    return block_s, block_j, span <= block_s


def compress_entries(
    rows: torch.Tensor, state: torch.Tensor, windows: torch.Tensor, positions: torch.Tensor, norm_weight: torch.Tensor,
    eps: float, cos_sin: torch.Tensor, overlap: bool, dtype: torch.dtype,
) -> torch.Tensor:
    """V4's compressor from its window rows to rotated entries in one launch (contract:
    deepinfer_core.ops.sparse.compress_entries); the reference for shapes it does not take.
    Graph-capture safe."""
    dim, r = reference._check_compress_entries(rows, state, windows, positions, norm_weight, cos_sin, overlap)
    if not kernel_takes(rows, state, dim, dtype):
        return reference.compress_entries(rows, state, windows, positions, norm_weight, eps, cos_sin, overlap, dtype)
    n, span = windows.shape
    out = torch.empty((n, dim), dtype=dtype, device=windows.device)
    if n == 0:
        return out
    # the pools are read with unit column stride (the model's are row-strided views); an empty
    # pool's pointer is the other's (never chosen: no valid slot number falls in it)
    rows, state = (p if p.stride(1) == 1 or p.shape[0] == 0 else p.contiguous() for p in (rows, state))
    t = rows.shape[0]
    if t == 0:
        rows = state
    elif state.shape[0] == 0:
        state = rows
    block_s, block_j, one_tile = tiles(span, dim)
    _compress_entries_kernel[(n,)](
        rows, state, windows, positions, norm_weight, cos_sin, out,
        t, span, span // 2 if overlap else span, dim, rows.shape[1] // 2, r, eps,
        rows.stride(0), state.stride(0), *windows.stride(), positions.stride(0), norm_weight.stride(0), *cos_sin.stride(),
        out.stride(0),
        OVERLAP=overlap, BLOCK_S=block_s, BLOCK_J=block_j, ONE_TILE=one_tile,
        num_warps=NUM_WARPS, **launch_options(windows.device),
    )
    return out


compress_entries.impl = (f"triton: one program per entry: the window's rows gathered from this step's rows and the "
                         f"state ring in place, per-channel softmax pooling with the reference's roundings, "
                         f"rms_norm_f32 and interleaved RoPE in registers; the reference for non-float32 pools or "
                         f"dim > {MAX_DIM}")

OPS = {"compress_entries": compress_entries}
