"""Linear layers: cuBLAS for plain weights, a Triton GEMM for DeepSeek block-FP8 weights.

``fp8_block_linear`` multiplies x [M, K] by a float8_e4m3fn weight [N, K] with one float32
scale per [bn, bk] weight block. The K loop steps one weight block (BLOCK_K = bk) at a time, so
every partial product has exactly one weight scale per output column and is rescaled in float32
before it joins the accumulator. Two numeric modes, chosen per call from M:

* W8A16 (M < FP8_W8A8_MIN_M, decode and short prefill; float32 activations always): the FP8 weight tile is widened to the
  activation dtype in registers and multiplied by the unquantised activations. Memory-bound, so
  the wider MMA costs nothing, and it is nearly as accurate as the dequantising reference.
* W8A8 (large M, compute-bound): x is quantised per token and per bk channels (scale =
  amax / 448, as DeepSeek's checkpoints expect), multiplied on the FP8 tensor cores (e4m3 x e4m3
  -> fp32), and rescaled by a_scale[row] * w_scale[column]. FP8_W8A8_MODE picks where the
  quantisation happens: fused into the GEMM's K loop (each x tile quantised as it is loaded), or
  in a pre-pass kernel that writes x in e4m3 plus its scales, which the GEMM then streams like
  the weight (simpler to pipeline, one extra read and write of x).

Small N (kv_a 576, q_a 1536) at decode leaves most SMs idle, so K is split across programs that
write float32 partials; a second kernel sums them in a fixed order (deterministic) and adds the
bias. No host synchronisation anywhere: grids and buffers follow from shapes only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deepinfer_core.conformance.checkpoints import FP8_MAX
from deepinfer_nvidia_sm100.kernels.device import await_inputs, launch_options, num_sms

# ---- tunables (sweep on the GPU) -------------------------------------------------------------
# Tile shapes per regime: (BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_K is always the
# weight's bk. num_stages is lowered further if the stages would not fit FP8_SMEM_BUDGET.
FP8_DECODE_TILE = (16, 64, 4, 5)  # M <= FP8_DECODE_MAX_M: stream the weight
# H200, 2026-11-30 (graph-timed): with the medium tile, M=64 ran at 22% of copy bandwidth against
# 50% for M=16 with the decode tile. Raising this to 64 was tried end to end (V3 slice) and did not
# show a gain beyond the 10-20% spread between two machines' runs, so it stays at 16 until a
# same-machine A/B says otherwise (benchmarks/tune.py).
FP8_DECODE_MAX_M = 16
FP8_MEDIUM_TILE = (64, 128, 8, 4)  # FP8_DECODE_MAX_M < M <= 64
FP8_PREFILL_TILE = (128, 128, 8, 3)  # M > 64: compute-bound
FP8_GROUP_M = 8  # grouped tile order (L2 reuse of weight tiles across M tiles)
# From this many rows on, quantise activations and use FP8 tensor cores. H200, 2026-11-30
# (benchmarks/kernels.py): at M=256 W8A16 beat both W8A8 variants on 3 of 4 V3 shapes, at M=4096
# the pre-pass W8A8 ran 1.7-2x faster than the fused one and than W8A16.
FP8_W8A8_MIN_M = 1024
W8A16, W8A8_FUSED, W8A8_PREQUANT = 0, 1, 2  # numeric/launch modes of the GEMM kernel
FP8_W8A8_MODE = W8A8_PREQUANT  # or W8A8_FUSED: bench() times both
FP8_QUANT_BLOCK_M = 16  # pre-pass quantisation: rows per program (columns: one bk block)
FP8_SPLIT_K_CTAS_PER_SM = 2  # split K until about this many programs per SM are in flight
FP8_SPLIT_K_MIN_K_BLOCKS = 4  # ... but give each split at least this many bk-blocks
# Batch-invariant mode: one tile and one K split for every M (invariant_config), so tuned for
# what decode needs of it (benchmarks/tune.py --only invariant_linear).
INVARIANT_TILE = FP8_DECODE_TILE
INVARIANT_SPLIT_K_CTAS_PER_SM = FP8_SPLIT_K_CTAS_PER_SM  # FP8 weights (not tuned for this mode yet)
# Plain (bf16) weights: H200, 2026-12-02, every linear of V2-Lite's decode step timed at M=1 and 64
# with L2-cold weights (tune.py --only invariant_linear): one K split per SM's worth of row
# tiles and PLAIN_BLOCK_K = 64 summed 1310 / 2059 us a step against 1361 / 2431 us for the FP8
# defaults (cuBLAS: 1223 / 1278 us).
INVARIANT_PLAIN_SPLIT_K_CTAS_PER_SM = 1
FP8_SMEM_BUDGET = 160 * 1024  # bytes of pipelined tiles per program (H100/B200 have ~228 KB)
FP8_REDUCE_BLOCK_N = 1024  # split-K reduction: columns per program
INTERPRETER_SMS = 4  # "SM count" used under TRITON_INTERPRET (CPU tensors)

E4M3_MAX = tl.constexpr(FP8_MAX)  # largest finite float8_e4m3fn, for the kernels (moe.py too)
# Activation blocks whose amax is below this are quantised against it instead (all-zero rows
# would otherwise divide by zero); their values then quantise to 0 or to tiny subnormals.
_AMAX_FLOOR = tl.constexpr(1e-12)


class Fp8Config(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_k: int  # number of K splits (1: no split, the GEMM writes the output itself)
    mode: int  # W8A16 (widen the weight), W8A8_FUSED or W8A8_PREQUANT (activations in e4m3)


def fp8_config(m: int, n: int, k: int, bk: int, x_dtype: torch.dtype, device: torch.device) -> Fp8Config:
    """The launch configuration for an [m, k] x [n, k]^T block-FP8 GEMM (shapes only)."""
    if m <= FP8_DECODE_MAX_M:
        block_m, block_n, warps, stages = FP8_DECODE_TILE
    elif m <= 64:
        block_m, block_n, warps, stages = FP8_MEDIUM_TILE
    else:
        block_m, block_n, warps, stages = FP8_PREFILL_TILE
    # float32 activations stay W8A16 at any M: float32 is the exact mode of the op's contract
    # (specs/ops.toml: within 1e-5 of the dequantising reference; W8A8 rounding is ~0.1)
    mode = FP8_W8A8_MODE if m >= FP8_W8A8_MIN_M and x_dtype != torch.float32 else W8A16
    x_bytes = 1 if mode == W8A8_PREQUANT else torch.finfo(x_dtype).bits // 8
    if x_bytes == 4:  # float32 activations (tests): halve the x tile rather than starve the pipeline
        block_m = min(block_m, 64)
    per_stage = block_m * bk * x_bytes + block_n * bk  # an x tile and an FP8 weight tile
    # plus one converted operand: the x tile in e4m3 (fused W8A8) or the weight widened (W8A16)
    converted = {W8A16: block_n * bk * x_bytes, W8A8_FUSED: block_m * bk, W8A8_PREQUANT: 0}[mode]
    stages = max(2, min(stages, (FP8_SMEM_BUDGET - converted) // per_stage))

    split = _split_k(triton.cdiv(m, block_m) * triton.cdiv(n, block_n), triton.cdiv(k, bk), device)
    return Fp8Config(block_m, block_n, warps, stages, split, mode)


def _split_k(tiles: int, k_blocks: int, device: torch.device, ctas_per_sm: int | None = None) -> int:
    """K splits for ``tiles`` output tiles: enough to put ``ctas_per_sm`` (FP8_SPLIT_K_CTAS_PER_SM)
    programs per SM in flight, each split at least FP8_SPLIT_K_MIN_K_BLOCKS weight blocks long,
    none empty."""
    target = (ctas_per_sm or FP8_SPLIT_K_CTAS_PER_SM) * num_sms(device, INTERPRETER_SMS)
    if tiles >= target:
        return 1
    split = max(1, min(triton.cdiv(target, tiles), k_blocks // FP8_SPLIT_K_MIN_K_BLOCKS))
    return triton.cdiv(k_blocks, triton.cdiv(k_blocks, split))


def invariant_config(n: int, k: int, bk: int, x_dtype: torch.dtype, w_bytes: int, device: torch.device,
                     ctas_per_sm: int | None = None) -> Fp8Config:
    """The one launch configuration of every [m, k] x [n, k]^T product in batch-invariant mode,
    whatever m: INVARIANT_TILE, W8A16 (the weight widened; plain weights as they are), and the
    K splits one row tile gets (``ctas_per_sm``, default INVARIANT_SPLIT_K_CTAS_PER_SM), so that each output element sums
    the same products in the same order (split by split, then the splits in order) for any m."""
    block_m, block_n, warps, stages = INVARIANT_TILE
    x_bytes = torch.finfo(x_dtype).bits // 8
    per_stage = block_m * bk * x_bytes + block_n * bk * w_bytes
    converted = block_n * bk * x_bytes if w_bytes != x_bytes else 0  # the widened weight tile
    stages = max(2, min(stages, (FP8_SMEM_BUDGET - converted) // per_stage))
    split = _split_k(triton.cdiv(n, block_n), triton.cdiv(k, bk), device, ctas_per_sm or INVARIANT_SPLIT_K_CTAS_PER_SM)
    return Fp8Config(block_m, block_n, warps, stages, split, W8A16)


@triton.jit
def round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest float8_e4m3fn value (ties to even), as float32.

    For the interpreter only (its float32 -> float8 cast drops mantissa carries); moe.py uses it
    too. The grid spacing is 2^(e - 3) for a value of exponent e, 2^-9 in the subnormal range
    (e < -6); dividing by a power of two is exact and the 1.5 * 2^23 trick rounds to an integer,
    ties to even.
    """
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    spacing = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    steps = (v / spacing + 12582912.0) - 12582912.0
    return steps * spacing


@triton.jit(do_not_specialize=["M", "M_STORE", "stride_sk", "ROW_DIV"])  # per-step sizes: one compile, not one per value class
def _quantize_activations_kernel(
    x_ptr, q_ptr, s_ptr, rows_ptr,
    M, M_STORE, K, ROW_DIV,
    stride_xm, stride_xk, stride_qm, stride_sm, stride_sk,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    GATHER: tl.constexpr, GATED: tl.constexpr,
    INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """q = e4m3(a / s), s = amax / 448 per row and per BLOCK_K (= bk) columns, for rows
    [0, M_STORE) (M_STORE >= M: rows from M on are padding, written as zeros of the floor scale).
    a is x's row, or with GATHER x's row rows[r] // ROW_DIV where rows[r] < M (else padding); with
    GATED a = silu(gate) * up of x = [gate | up] (K columns each), rounded as silu_and_mul rounds."""
    await_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = (k < K)[None, :]
    stored = rows < M_STORE
    rows64 = rows.to(tl.int64)
    if GATHER:
        src = tl.load(rows_ptr + rows, mask=stored, other=M)
        valid = src < M
        src = (src // ROW_DIV).to(tl.int64)
    else:
        src = rows64
        valid = rows < M
    a_ptrs = x_ptr + src[:, None] * stride_xm + k[None, :] * stride_xk
    a = tl.load(a_ptrs, mask=valid[:, None] & mask_k, other=0.0)
    if GATED:
        gate = a.to(tl.float32)
        up = tl.load(a_ptrs + K * stride_xk, mask=valid[:, None] & mask_k, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
        a = (act * up).to(x_ptr.dtype.element_ty)
    a = a.to(tl.float32)
    a_scale = tl.maximum(tl.max(tl.abs(a), axis=1), _AMAX_FLOOR) / E4M3_MAX
    q = a * (1.0 / a_scale)[:, None]
    if INTERPRET:
        q = round_to_e4m3(q)
    tl.store(q_ptr + rows64[:, None] * stride_qm + k[None, :], q.to(tl.float8e4nv), mask=stored[:, None] & mask_k)
    tl.store(s_ptr + rows64 * stride_sm + kb * stride_sk, a_scale, mask=stored)


def empty_quantized(rows: int, cols: int, bk: int, device, row_align: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty e4m3 rows [padded, cols] and their float32 scales [padded, cols / bk] M-major
    (strides (1, padded)), rows padded to a multiple of ``row_align``: the layout cuBLAS's
    DeepSeek recipe and DeepGEMM's TMA loads read (``row_align`` 4: 16-byte scale rows)."""
    padded = -(-rows // row_align) * row_align
    scales = torch.empty((-(-cols // bk), padded), dtype=torch.float32, device=device).t()
    return torch.empty((padded, cols), dtype=torch.float8_e4m3fn, device=device), scales


def quantize_activations(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bk: int, *,
                         rows: torch.Tensor | None = None, num_valid: int | None = None, row_div: int = 1,
                         gated: bool = False) -> None:
    """Fill q [m_store, k] (float8_e4m3fn) and scales [m_store, k blocks] (float32, any strides)
    per row and per bk channels: s = amax / 448, q = e4m3(a / s) (DeepSeek's dynamic activation
    quantisation). a is x [m, k]'s row, rows from m on padding (zeros); or, given ``rows``
    [m_store] int32, x's row rows[r] // row_div where rows[r] < num_valid, padding elsewhere (the
    expert-sorted rows of ``moe.align_pairs``). ``gated``: x is [.., 2k] = [gate | up] and a is
    silu(gate) * up rounded to x's dtype (``silu_and_mul``), quantised in the same pass."""
    m_store, k = q.shape
    if x.shape[1] != (2 * k if gated else k):
        raise ValueError(f"quantize_activations: x has {x.shape[1]} columns for {k} quantised ones (gated={gated})")
    if (rows is None) != (num_valid is None):
        raise ValueError("quantize_activations: rows and num_valid go together (num_valid: the indices below it are rows)")
    m = num_valid if rows is not None else x.shape[0]
    _quantize_activations_kernel[(triton.cdiv(m_store, FP8_QUANT_BLOCK_M), triton.cdiv(k, bk))](
        x, q, scales, rows if rows is not None else q,
        m, m_store, k, row_div,
        x.stride(0), x.stride(1), q.stride(0), scales.stride(0), scales.stride(1),
        BLOCK_M=FP8_QUANT_BLOCK_M, BLOCK_K=bk,
        GATHER=rows is not None, GATED=gated,
        INTERPRET=not x.is_cuda, **launch_options(x.device),
    )


@triton.jit(do_not_specialize=["M", "stride_os"])  # per-step sizes: one compile, not one per value class
def _fp8_block_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_xsm,
    stride_wn, stride_wk,
    stride_sn, stride_sk,
    stride_os, stride_om, stride_on,
    stride_xh, stride_wh, stride_oh,  # grid axis 2 (head_linear's heads): one product per head; 0 otherwise
    # constexpr: under numpy 2.4, Triton 3.6's interpreter cannot loop to a runtime bound
    K_BLOCKS_PER_SPLIT: tl.constexpr,
    BN_SCALE: tl.constexpr,  # the weight block's bn (rows of W per scale row)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # BLOCK_K == bk
    GROUP_M: tl.constexpr,
    MODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 activations (W8A16), as the reference computes
    SPLIT: tl.constexpr,  # True: write float32 partials [split, M, N]; False: final output
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    await_inputs(PDL)
    head = tl.program_id(2).to(tl.int64)
    x_ptr += head * stride_xh
    w_ptr += head * stride_wh
    out_ptr += head * stride_oh
    # Grouped tile order: GROUP_M row tiles share each column (weight) tile while it is in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_size
    pid_n = (pid % (GROUP_M * tiles_n)) // group_size

    # This program's K range: K_BLOCKS_PER_SPLIT blocks from kb_begin; the last split may run
    # past K, where every load is masked (a fixed trip count keeps the loop easy to pipeline).
    split = tl.program_id(1)
    kb_begin = split * K_BLOCKS_PER_SPLIT
    k_blocks = tl.cdiv(K, BLOCK_K)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    scale_cols = ws_ptr + (offs_n // BN_SCALE) * stride_sn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, K_BLOCKS_PER_SPLIT):
        kb = kb_begin + i
        k = kb * BLOCK_K + offs_k
        mask_k = k < K
        a = tl.load(x_rows + k[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None] * stride_wk, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        w_scale = tl.load(scale_cols + kb * stride_sk, mask=mask_n & (kb < k_blocks), other=0.0)
        if MODE == 1:  # W8A8_FUSED: quantise this x tile per row
            a = a.to(tl.float32)
            a_scale = tl.maximum(tl.max(tl.abs(a), axis=1), _AMAX_FLOOR) / E4M3_MAX
            q = a * (1.0 / a_scale)[:, None]
            if INTERPRET:  # the interpreter's float8 cast is wrong; exact e4m3 values in float32
                part = tl.dot(round_to_e4m3(q), w.to(tl.float32))
            else:
                part = tl.dot(q.to(tl.float8e4nv), w)
            acc += part * a_scale[:, None] * w_scale[None, :]
        elif MODE == 2:  # W8A8_PREQUANT: x is already e4m3, with one scale per row and bk-block
            a_scale = tl.load(xs_ptr + offs_m.to(tl.int64) * stride_xsm + kb, mask=mask_m & (kb < k_blocks), other=0.0)
            if INTERPRET:
                part = tl.dot(a.to(tl.float32), w.to(tl.float32))
            else:
                part = tl.dot(a, w)
            acc += part * a_scale[:, None] * w_scale[None, :]
        else:  # W8A16
            part = tl.dot(a, w.to(a.dtype), input_precision=DOT_PRECISION)
            acc += part * w_scale[None, :]

    out_offs = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        tl.store(out_ptr + split * stride_os + out_offs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])  # per-step sizes: one compile, not one per value class
def _split_k_reduce_kernel(
    part_ptr, bias_ptr, out_ptr,
    M, N,
    stride_om,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """out[m, n] = sum over s in order of part[s, m, n] (+ bias[n]); part is [S, M, N] contiguous."""
    await_inputs(PDL)
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    ptrs = part_ptr + m.to(tl.int64) * N + offs_n
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(ptrs + s * M * N, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_block_linear_with_config(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    config: Fp8Config | None,
) -> torch.Tensor:
    """``fp8_block_linear`` with an explicit launch configuration (None: the shape heuristic)."""
    bn, bk = int(block[0]), int(block[1])
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"fp8_block_linear needs a power-of-two bk >= 16 (tl.dot's K), got block {block}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    cfg = config or fp8_config(m, n, k, bk, x.dtype, x.device)
    k_blocks = triton.cdiv(k, bk)
    per_split = triton.cdiv(k_blocks, cfg.split_k)
    splits = triton.cdiv(k_blocks, per_split) if k_blocks else 1
    target = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    a, a_scale = x2, out  # (a_scale unused unless pre-quantised)
    if cfg.mode == W8A8_PREQUANT:
        a = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
        a_scale = torch.empty((m, k_blocks), dtype=torch.float32, device=x.device)
        quantize_activations(x2, a, a_scale, bk)
    _launch_gemm(a, a_scale, weight, weight_scale_inv, bias, target, out, (m, n, k), (bn, bk), cfg, per_split, splits)
    return out.view(*lead, n)


def _launch_gemm(a, a_scale, weight, weight_scale_inv, bias, target, out, mnk, block, cfg: Fp8Config, per_split: int, splits: int,
                 heads: int = 1, head_strides: tuple[int, int, int] = (0, 0, 0)) -> None:
    """The GEMM kernel (and the split-K sum when splits > 1) of ``a`` [m, k] (a strided view)
    into ``target``; with ``heads`` > 1 one product per head (grid axis 2), a's, the weight's and
    the output's head strides in ``head_strides`` (one split then)."""
    m, n, k = mnk
    bn, bk = block
    has_bias = bias is not None
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), splits, heads)
    _fp8_block_gemm_kernel[grid](
        a, a_scale, weight, weight_scale_inv, bias if has_bias else out, target,
        m, n, k,
        a.stride(0), a.stride(-1), a_scale.stride(0),
        weight.stride(-2), weight.stride(-1),
        weight_scale_inv.stride(0), weight_scale_inv.stride(1),
        target.stride(0) if splits > 1 else 0, target.stride(-2) if heads == 1 else target.stride(0), target.stride(-1),
        *head_strides,
        K_BLOCKS_PER_SPLIT=per_split,
        BN_SCALE=bn,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk,
        GROUP_M=FP8_GROUP_M,
        MODE=cfg.mode,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        SPLIT=splits > 1,
        HAS_BIAS=has_bias,
        INTERPRET=not a.is_cuda,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **launch_options(a.device),
    )
    if splits > 1:
        _split_k_reduce_kernel[(m, triton.cdiv(n, FP8_REDUCE_BLOCK_N))](
            target, bias if has_bias else out, out,
            m, n,
            out.stride(0),
            SPLITS=splits,
            HAS_BIAS=has_bias,
            BLOCK_N=FP8_REDUCE_BLOCK_N, **launch_options(target.device),
        )


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) times a block-FP8 weight [N, K] with scales [ceil(N/bn), ceil(K/bk)].

    Returns [..., N] in x's dtype (see deepinfer_core.ops.linear.fp8_block_linear).
    """
    return fp8_block_linear_with_config(x, weight, weight_scale_inv, block, bias, None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias[N]) -> [..., N] in x's dtype (cuBLAS)."""
    return F.linear(x, weight, bias)


def head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out[t, h] = weight[h] @ x[t, h] (see deepinfer_core.ops.linear.head_linear; cuBLAS)."""
    return torch.einsum("thk,hnk->thn", x, weight)


# ---- batch-invariant forms (deepinfer_ops(batch_invariant=True)) ------------------------------
# Every product runs the same tile (FP8_DECODE_TILE), W8A16 and the K splits chosen from (N, K)
# alone (invariant_config): an output element sums the same products in the same order at any M.
# Plain weights go through the same kernel with unit scales (a stride-0 tensor of ones: the
# rescale multiplies by 1.0, exact), stepping K by PLAIN_BLOCK_K.
PLAIN_BLOCK_K = 64  # see INVARIANT_PLAIN_SPLIT_K_CTAS_PER_SM


_ONES: dict[torch.device, torch.Tensor] = {}  # one 1.0 per device, made outside graph capture


def _unit_scales(n: int, k: int, device: torch.device) -> torch.Tensor:
    """Scales [n, k blocks] of a plain weight for blocks (1, PLAIN_BLOCK_K): all 1.0, one value in
    memory (kept per device, so that graph replays launch no fill for it)."""
    one = _ONES.get(device)
    if one is None:
        one = torch.ones(1, 1, dtype=torch.float32, device=device)
        if not (one.is_cuda and torch.cuda.is_current_stream_capturing()):  # a capture's pool is the graph's
            _ONES[device] = one
    return one.expand(n, triton.cdiv(k, PLAIN_BLOCK_K))


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear``, batch-invariant (the Triton GEMM with unit scales)."""
    n, k = weight.shape
    cfg = invariant_config(n, k, PLAIN_BLOCK_K, x.dtype, weight.element_size(), x.device, INVARIANT_PLAIN_SPLIT_K_CTAS_PER_SM)
    return fp8_block_linear_with_config(x, weight, _unit_scales(n, k, x.device), (1, PLAIN_BLOCK_K), bias, cfg)


def invariant_fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fp8_block_linear``, batch-invariant (W8A16 at every M)."""
    n, k = weight.shape
    cfg = invariant_config(n, k, int(block[1]), x.dtype, 1, x.device)
    return fp8_block_linear_with_config(x, weight, weight_scale_inv, block, bias, cfg)


def invariant_head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``head_linear``, batch-invariant: the Triton GEMM with one product per head (grid axis 2)."""
    t, heads, k = x.shape
    n = weight.shape[1]
    out = torch.empty((t, heads, n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    cfg = invariant_config(n, k, PLAIN_BLOCK_K, x.dtype, weight.element_size(), x.device)._replace(split_k=1)
    per_split = triton.cdiv(k, PLAIN_BLOCK_K)
    rows = x[:, 0]  # head 0's [t, k] view: the kernel adds head * stride for the others
    _launch_gemm(rows, out, weight[0], _unit_scales(n, k, x.device), None, out, out, (t, n, k), (1, PLAIN_BLOCK_K), cfg, per_split, 1,
                 heads=heads, head_strides=(x.stride(1), weight.stride(0), out.stride(1)))
    return out


fp8_block_linear.impl = (
    "triton: block-FP8 GEMM, BLOCK_K = bk, per-block fp32 rescale; W8A16 below "
    f"{FP8_W8A8_MIN_M} rows, dynamic 1 x bk e4m3 activation quantisation (W8A8, "
    f"{'fused' if FP8_W8A8_MODE == W8A8_FUSED else 'pre-pass'}) above; deterministic split-K for few tiles"
)
linear.impl = "cublas: torch.nn.functional.linear"
head_linear.impl = "cublas: torch.einsum (one batched GEMM over the heads)"
invariant_linear.impl = invariant_fp8_block_linear.impl = invariant_head_linear.impl = (
    "triton, batch-invariant: the block GEMM at one tile, W8A16, K splits from (N, K) alone"
)

OPS = {"fp8_block_linear": fp8_block_linear, "linear": linear, "head_linear": head_linear}
INVARIANT_OPS = {"fp8_block_linear": invariant_fp8_block_linear, "linear": invariant_linear, "head_linear": invariant_head_linear}
