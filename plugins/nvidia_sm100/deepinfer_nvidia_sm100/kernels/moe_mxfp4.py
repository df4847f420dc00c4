"""MXFP4 routed experts kept packed: a W4A16 grouped GEMM (Triton, sm_90 / sm_100).

DeepSeek-V4's routed experts (``expert_dtype: fp4``) arrive as ops.moe.moe_experts' MXFP4
convention: uint8 w13 [E, 2I, D/2] and w2 [E, D, I/2], two E2M1 codes a byte (input 2j in the
low nibble, 2j+1 in the high), and uint8 UE8M0 scales [E, 2I, ceil(D/32)], [E, D, ceil(I/32)]
(2^(s - 127) per 32 inputs). Kept so, an expert weighs 0.53 bytes a parameter instead of 2.

The structure is moe.py's grouped GEMM (its routing layout, ``align_pairs``, and its slot sum,
``sum_slots``, are used as they are): the T*k (token, slot) pairs sorted by expert into BLOCK_M
tiles; GEMM 1 multiplies each tile's x rows by the gate AND up rows of w13[e] in one K loop and
stores the clamped SwiGLU silu(min(gate, limit)) * clamp(up, -limit, limit) (plain SwiGLU with
no limit); GEMM 2 multiplies h by w2[e] and by the pair's routing weight; then the k slots are
summed per token in float32, in slot order.

The weights are dequantised in registers, as Marlin does on Hopper. Each K step loads the weight
tile packed ([BLOCK_N, BLOCK_K/2] bytes, contiguous along K: cp.async 128-bit loads when K is a
whole number of steps), takes the low nibbles (the even inputs) and the high ones (the odd inputs)
apart and feeds two tl.dots in x's dtype: the even columns of the activation tile by the
low-nibble weights, the odd columns by the high ones (the same products as the interleaved K, with
no shuffle of the weight tile). Every e2m1 * 2^k is exact in bf16 (and in float32), so the
products are the reference's (ops.moe dequantises to x's dtype first); only the summation order
differs. Activations are never quantised (W4A16).

Decode is bound by instruction issue more than by bandwidth: an H100 keeps up with its copy
bandwidth only below ~0.16 warp instructions a packed weight. benchmarks/sass_profile.py reads the
sm_90 code (compiled without a GPU) and counts them in the K loop; the defaults since 2026-12-08
come from it and from benchmarks/tune.py --only mxfp4 on an H100:
- the E2M1 values are decoded in PTX wherever the activations are bf16 on a GPU: by shifts and
  masks into a bf16 that is the value times 2^-126, then one bf16 multiply by 2^126
  (_E2M1_SHIFT_ASM, MXFP4_SHIFT_DECODE; ~2.25 instructions a value) or by byte-permute lookup
  tables (_E2M1_BF16_ASM; ~3, and ptxas rematerialises their constants); in the interpreter
  (float32) through one e4m3 conversion;
- each 32-input group's 2^(s - 127) multiplies the decoded weights in bf16 (exact: a power of two;
  MXFP4_SCALE_WEIGHTS), or, at one scale group a K step, the dot's float32 partial sums;
- the activation tile is loaded whole (vectors, pipelined) and split into its even and odd inputs
  in registers (MXFP4_SPLIT_LOAD), not as two stride-2 loads of single bf16 values staged through
  shared memory between barriers.
The decode tile (16, 64, 64, 128): 0.164 warp instructions a weight in GEMM 1 (0.41 with the byte
permutes at BLOCK_K 32 only, the scale on the sums and stride-2 loads); V4-Flash, one token: 61.6
us a layer (43% of the copy bandwidth), 8 tokens 326 us (58%), against 96.7 and 575 us before.
Prefill, 2048 tokens: 3.1 ms (197 TFLOP/s), against 14.5 ms.
Decode's few (expert, column) tiles would leave most SMs idle with one program per tile: K is
split into slices (MXFP4_PROGRAMS_PER_SM programs an SM), whose float32 partial sums an epilogue
kernel adds in slice order before the SwiGLU or the routing weight.
With MXFP4_SWAP_AB the tile is accumulated transposed, W @ A^T (Hopper's wgmma reads its first
operand from registers, where the weights are decoded): slower at every point swept, because the
decoded weights still pass through shared memory.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_core.ops.moe import check_mxfp4_experts
from deepinfer_nvidia_sm100.kernels.device import await_inputs, launch_options, num_sms
from deepinfer_nvidia_sm100.kernels.moe import (ExpertTiles, align_pairs, expert_tile_ids, expert_tile_rows, store_expert_tile, sum_slots,
                                                swiglu)

# ---- tunables (sweep on the GPU; not yet measured) -------------------------------------------
# As moe.py's EXPERT_TILES, chosen by the average pairs per active expert. BLOCK_K (inputs) is a
# multiple of the 32-input scale group and of 64 (each of its two dots has K = BLOCK_K / 2 >= 32).
MXFP4_TILES: tuple[tuple[float, ExpertTiles], ...] = (
    # decode: four scale groups a K step (the wide PTX decode, lean), K split to fill the SMs: the best
    # of benchmarks/tune.py --only mxfp4 at 1, 8 and 64 tokens at V4-Flash's and V4-Pro's shapes on
    # an H100 (2026-12-08: 61.6 / 325.6 / 1391 us at V4-Flash, against 96.7 / 575.1 / 2401 us for the
    # previous default (16, 128, 128, 32, 4, 4) without the lean flags)
    (16, ExpertTiles(16, 64, 64, 128, 4, 3)),
    (32, ExpertTiles(32, 64, 64, 32, 4, 4)),  # not measured (the sweep has no 32-row tile)
    (96, ExpertTiles(64, 64, 128, 64, 4, 3)),  # 2048 tokens of V4-Flash (48 pairs an expert): 3140 us, 197 TFLOP/s
    (float("inf"), ExpertTiles(128, 64, 128, 64, 8, 3)),
)
MXFP4_GROUP_M = 8  # grouped program order: GROUP_M M-blocks sweep the column tiles together
MXFP4_SMEM_BUDGET = 160 * 1024  # bytes of pipelined tiles per program; num_stages is lowered to fit
MXFP4_PROGRAMS_PER_SM = 8  # split K until a GEMM has this many programs an SM (decode: few (expert, column) tiles)
MXFP4_MAX_SPLITS = 16
MXFP4_FORCE_SPLITS = 0  # > 0: this many K slices whatever the shape (tests, sweeps), where the steps divide
MXFP4_ASM_DECODE = True  # BLOCK_K 32, bf16, compiled: E2M1 -> bf16 in PTX (_e2m1_bf16; else through e4m3 and a multiply)
MXFP4_ASM_WIDE = True  # the same for BLOCK_K >= 64 (decode and prefill tiles), the scale multiplied in bf16
MXFP4_SWAP_AB = False  # the dots as W @ A^T (decoded weights the first operand): slower in every sweep (2026-12-08)
# The lean flags (benchmarks/sass_profile.py: fewer instructions in the sm_90 code), each the
# fastest at every point of benchmarks/tune.py --only mxfp4 on an H100 (2026-12-08):
MXFP4_SHIFT_DECODE = True  # E2M1 -> bf16 by shifts and masks and a bf16 multiply (_E2M1_SHIFT_ASM), not byte permutes
MXFP4_SCALE_WEIGHTS = True  # BLOCK_K 32 tiles too: the scale multiplies the decoded weights (bf16), not the dot's sums
MXFP4_SPLIT_LOAD = True  # the activation tile loaded whole (vectors, pipelined) and split in registers, not two stride-2 loads
# Register caps (ptxas' maxnreg) for GEMM 1 and GEMM 2, None: ptxas' choice. At the decode tile GEMM 2
# takes 118 registers (4 programs of 4 warps an SM); 96 fits 5 with no spill (benchmarks/sass_profile.py),
# GEMM 1 spills below its 128. Not yet measured: benchmarks/tune.py sweeps (None, 96).
MXFP4_MAXNREG: tuple[int | None, int | None] = (None, None)
MXFP4_SCALE_GATHER = False  # True: each packed byte's scale loaded by address; False: a group's once, broadcast
SCALE_GROUP = 32  # inputs per UE8M0 scale (the format's, not a tunable)


@triton.jit
def _scales(scale_bytes):
    """UE8M0 bytes -> 2^(s - 127) as float32, exactly (byte 0: 2^-127, a subnormal; 255: NaN)."""
    s = scale_bytes.to(tl.int32)
    return (tl.maximum(s << 23, 0x00400000) | (((s + 1) >> 8) << 22)).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_as_e4m3(codes):
    """int32 E2M1 codes (0-15) -> float32 value * 2^-6, through the e4m3 byte whose bits are the
    code's magnitude shifted left by 2 (exponent field e, top mantissa bit m: (1 + m/2) 2^(e - 7),
    and for e = 0 the e4m3 subnormal m/2 * 2^-6) and its sign in bit 7: one hardware conversion
    (e4m3 -> f16 on sm_89+) instead of decoding exponent and mantissa in integer ops."""
    bits = ((codes & 7) << 2) | ((codes & 8) << 4)
    return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _dequantize(packed, scale):
    """[BLOCK_N, BLOCK_K/2] uint8 (two codes a byte) and each byte's float32 group scale (or one
    that broadcasts to it) -> (the float32 weights of the even inputs (low nibbles), of the odd ones
    (high nibbles)): E2M1(code) * 2^(s - 127), exactly (the e4m3 value * 64 is the E2M1 value)."""
    b = packed.to(tl.int32)
    return (_e2m1_as_e4m3(b) * 64.0) * scale, (_e2m1_as_e4m3(b >> 4) * 64.0) * scale


@triton.jit
def _load_weights(w_ptrs, s_ptrs, mask, s_mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_GATHER: tl.constexpr,
                  ASM: tl.constexpr, SHIFT: tl.constexpr):
    """The even- and odd-input halves of a weight tile: packed bytes w_ptrs [BLOCK_N, BLOCK_K/2].
    SCALE_GATHER: s_ptrs [BLOCK_N, BLOCK_K/2], the scale byte of each byte (one per 16 bytes:
    repeated addresses, served by the cache); else s_ptrs [BLOCK_N, BLOCK_K/32], one byte a group,
    decoded once and broadcast over its 16 bytes in registers."""
    packed = tl.load(w_ptrs, mask=mask, other=0)
    scales = _scales(tl.load(s_ptrs, mask=s_mask, other=127))  # masked inputs: code 0 (value 0) times 1
    if not SCALE_GATHER:
        scales = tl.reshape(tl.broadcast_to(scales[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))
    if ASM:  # E2M1 decoded to bf16 in PTX, times the scale in bf16 (a power of two: exact)
        even, odd = _e2m1_bf16(packed, SHIFT)
        scales = scales.to(tl.bfloat16)
        even, odd = even * scales, odd * scales
    else:
        even, odd = _dequantize(packed, scales)
    return even, odd


# Four packed bytes (one 32-bit register: 8 E2M1 codes) -> the bf16 values of their low nibbles
# ($0, $1: bytes 0-1, 2-3) and of their high nibbles ($2, $3), exactly, with byte permutes as
# lookup tables (Marlin's way): the magnitude (3 bits) of each nibble selects the bf16's high byte
# from {00, 3F, 3F, 3F, 40 x4} and its low byte from {00, 00, 80, C0, 00, 40, 80, C0} (0, 0.5, 1,
# 1.5, 2, 3, 4, 6); two more permutes interleave them into (even, odd) bf16 pairs, and the sign
# bit of each nibble (bit 3 / 7 of its byte) is replicated into place by a permute in sign mode.
# About 2.6 instructions a value, against ~17 for the integer decode and scale multiply.
def _e2m1_pair_ptx(even: str, odd: str) -> str:
    """PTX for the two bytes in w's low half: their low nibbles' bf16 pair into ``even``, their
    high nibbles' into ``odd``."""
    return f"""and.b32 m, w, 0x7777;
prmt.b32 h, hl, hh, m;
prmt.b32 l, ll, lh, m;
prmt.b32 {even}, l, h, 0x6240;
prmt.b32 {odd}, l, h, 0x7351;
shl.b32 k, w, 4;
prmt.b32 s, k, z, 0x9484;
and.b32 s, s, 0x80008000;
or.b32 {even}, {even}, s;
prmt.b32 s, w, z, 0x9484;
and.b32 s, s, 0x80008000;
or.b32 {odd}, {odd}, s;
"""


_E2M1_BF16_ASM = tl.constexpr("""
{
.reg .b32 w, m, hl, hh, ll, lh, h, l, s, z, k;
mov.b32 hl, 0x3F3F3F00;
mov.b32 hh, 0x40404040;
mov.b32 ll, 0xC0800000;
mov.b32 lh, 0xC0804000;
mov.b32 z, 0;
mov.b32 w, $4;
""" + _e2m1_pair_ptx("$0", "$2") + "shr.b32 w, w, 16;\n" + _e2m1_pair_ptx("$1", "$3") + "}\n")


# The same values by shifts and masks, no tables: each byte's two codes are spread into the 16-bit
# halves of t (PRMT), then each code's magnitude bits (e1 e0 m) land at bf16 bits 8-6 (the
# exponent's two low bits and the mantissa's top bit) and its sign at bit 15. That bf16 is the
# E2M1 value times 2^-126 (e = 0, m = 1: the subnormal 2^-127 for 0.5), so one bf16 multiply by
# 2^126 makes it exact. About 2.25 instructions a value plus the multiply (sm_90 bf16 arithmetic
# keeps subnormals), against the tables' ~3 and their constants rematerialised by ptxas.
def _e2m1_shift_ptx(even: str, odd: str, spread: str) -> str:
    """PTX for two bytes of w (chosen by the PRMT selector ``spread``): their low nibbles' bf16 pair
    (times 2^-126) into ``even``, their high nibbles' into ``odd``."""
    return f"""prmt.b32 t, w, z, {spread};
shl.b32 x, t, 6;
and.b32 x, x, 0x01C001C0;
shl.b32 y, t, 12;
and.b32 y, y, 0x80008000;
or.b32 {even}, x, y;
shl.b32 x, t, 2;
and.b32 x, x, 0x01C001C0;
shl.b32 y, t, 8;
and.b32 y, y, 0x80008000;
or.b32 {odd}, x, y;
"""


_E2M1_SHIFT_ASM = tl.constexpr("{\n.reg .b32 w, t, x, y, z;\nmov.b32 z, 0;\nmov.b32 w, $4;\n"
                               + _e2m1_shift_ptx("$0", "$2", "0x4140") + _e2m1_shift_ptx("$1", "$3", "0x4342") + "}\n")
E2M1_SHIFT_UNSCALE = tl.constexpr(2.0 ** 126)  # _E2M1_SHIFT_ASM's values times this are the E2M1 values


@triton.jit
def _e2m1_bf16(packed, SHIFT: tl.constexpr):
    """uint8 bytes (two E2M1 codes each) -> (bf16 values of the low nibbles, of the high nibbles),
    exactly: _E2M1_BF16_ASM's byte permutes, or with SHIFT _E2M1_SHIFT_ASM's shifts and a multiply
    by 2^126; four bytes a call (compiled code only; the interpreter cannot run PTX)."""
    if SHIFT:
        even, odd = tl.inline_asm_elementwise(_E2M1_SHIFT_ASM, "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16),
                                              is_pure=True, pack=4)
        even, odd = even * E2M1_SHIFT_UNSCALE, odd * E2M1_SHIFT_UNSCALE
    else:
        even, odd = tl.inline_asm_elementwise(_E2M1_BF16_ASM, "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16),
                                              is_pure=True, pack=4)
    return even, odd


@triton.jit
def _group_dot(a_even, a_odd, w_ptrs, s_ptrs, mask, col_ok, IEEE: tl.constexpr, ASM: tl.constexpr, SHIFT: tl.constexpr,
               SWAP: tl.constexpr):
    """One 32-input scale group: a [BLOCK_M, 16] (even, odd inputs) @ the group's E2M1 values (no
    scale multiplied into the weights), the partial sums then times the row's 2^(s - 127) (a power
    of two: exact) -> [BLOCK_M, BLOCK_N] float32. ASM (bf16 activations, compiled): the values come
    from _e2m1_bf16 (SHIFT: its shift decode); else through e4m3 (the values / 64, the sums times 64).
    SWAP: a is given as [16, BLOCK_M] (a^T) and the result is [BLOCK_N, BLOCK_M], the weights the
    dots' first operand."""
    packed = tl.load(w_ptrs, mask=mask, other=0)
    # one return: compiled Triton types every return of a function alike, even under a constexpr if
    if SWAP:
        zero = tl.zeros([packed.shape[0], a_even.shape[1]], tl.float32)
        if ASM:
            w_even, w_odd = _e2m1_bf16(packed, SHIFT)
            part = tl.dot(w_odd, a_odd, tl.dot(w_even, a_even, zero))
        else:
            b = packed.to(tl.int32)
            part = _dot_t(_dot_t(zero, _e2m1_as_e4m3(b), a_even, IEEE), _e2m1_as_e4m3(b >> 4), a_odd, IEEE) * 64.0
        part = part * _scales(tl.load(s_ptrs, mask=col_ok, other=127))[:, None]
    else:
        zero = tl.zeros([a_even.shape[0], packed.shape[0]], tl.float32)
        if ASM:
            w_even, w_odd = _e2m1_bf16(packed, SHIFT)
            part = tl.dot(a_odd, tl.trans(w_odd), tl.dot(a_even, tl.trans(w_even), zero))
        else:
            b = packed.to(tl.int32)
            part = _dot(_dot(zero, a_even, _e2m1_as_e4m3(b), IEEE), a_odd, _e2m1_as_e4m3(b >> 4), IEEE) * 64.0
        part = part * _scales(tl.load(s_ptrs, mask=col_ok, other=127))[None, :]
    return part


@triton.jit
def _dot(acc, a, w, IEEE: tl.constexpr):
    """acc + a [BLOCK_M, BLOCK_K/2] @ w^T (w [BLOCK_N, BLOCK_K/2] float32, rounded to a's dtype: exact)."""
    wt = tl.trans(w.to(a.dtype))
    if IEEE:
        return acc + tl.dot(a, wt, input_precision="ieee")
    return acc + tl.dot(a, wt)


@triton.jit
def _dot_t(acc, w, a_t, IEEE: tl.constexpr):
    """acc + w [BLOCK_N, BLOCK_K/2] (rounded to a's dtype: exact) @ a_t [BLOCK_K/2, BLOCK_M]."""
    if IEEE:
        return acc + tl.dot(w.to(a_t.dtype), a_t, input_precision="ieee")
    return acc + tl.dot(w.to(a_t.dtype), a_t)


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks", "k_split"])  # one compile, not one per value class
def _mxfp4_expert_gemm_kernel(
    a_ptr, w_ptr, s_ptr, out_ptr, route_w_ptr, part_ptr,
    sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, a_row_div, num_m_blocks, limit, k_split,  # k_split: inputs per program (K, or a multiple of BLOCK_K)
    stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,  # packed codes [E, rows, K/2]
    stride_se, stride_sn, stride_sk,  # UE8M0 scales [E, rows, ceil(K/32)]
    stride_om, stride_on,
    N: tl.constexpr, K: tl.constexpr,  # output columns (I with GATED: gate and up are 2I rows of w); inputs
    GATED: tl.constexpr,  # GEMM 1: gate and up tiles, store the (clamped) SwiGLU
    CLAMP: tl.constexpr,  # GATED: silu(min(gate, limit)) * clamp(up, -limit, limit)
    WEIGHTED: tl.constexpr,  # GEMM 2: multiply each row by its pair's routing weight
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_GATHER: tl.constexpr,  # each byte's scale loaded by address (else one load a group, broadcast)
    SPLIT: tl.constexpr,  # K cut into slices (program_id 1): float32 partial sums to part_ptr, reduced after
    ASM: tl.constexpr,  # bf16 activations, compiled: E2M1 -> bf16 in PTX (_e2m1_bf16)
    SHIFT: tl.constexpr,  # ASM by shifts and masks (_E2M1_SHIFT_ASM), not byte permutes
    SCALE_WEIGHTS: tl.constexpr,  # BLOCK_K 32 too: the scale multiplies the decoded weights, not the dot's partial sums
    SPLIT_LOAD: tl.constexpr,  # the activation tile loaded whole and split into even / odd inputs in registers
    SWAP: tl.constexpr,  # accumulate the transposed tile: W [BLOCK_N, .] @ A^T, transposed back for the epilogue
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    pid_m, pid_n = expert_tile_ids(num_m_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert, pair, row_ok, a_row, cols, col_ok = expert_tile_rows(pid_m, pid_n, block_expert_ptr, sorted_ptr, num_pairs, a_row_div,
                                                                 N, BLOCK_M, BLOCK_N)
    # A K step of BLOCK_K inputs is BLOCK_K/2 packed bytes: byte j holds input 2j (low nibble) and
    # 2j+1 (high). The activations are read as their even and odd columns (two stride-2 loads, or
    # SPLIT_LOAD's one load split in registers), each multiplied by its nibble's weights: two dots
    # of K = BLOCK_K/2, no interleaving shuffle of the weights.
    kb = tl.arange(0, BLOCK_K // 2)
    HALF_K: tl.constexpr = K // 2
    split = tl.program_id(1)  # this program's k_split inputs
    k_lo = tl.multiple_of(split * k_split, BLOCK_K)  # k_split is K or a multiple of BLOCK_K: aligned vector loads

    a_rows = a_ptr + a_row[:, None] * stride_am
    a_ptrs = a_rows + (k_lo + 2 * kb)[None, :] * stride_ak  # even inputs; odd: + stride_ak
    rows = cols[:, None].to(tl.int64)
    w_ptrs = w_ptr + expert * stride_we + rows * stride_wn + (k_lo // 2 + kb)[None, :] * stride_wk
    if BLOCK_K == 32 and not SCALE_WEIGHTS:  # one scale group a step: the scale multiplies the dot's partial sums
        s_ptrs = s_ptr + expert * stride_se + cols.to(tl.int64) * stride_sn + (k_lo // 32) * stride_sk
    elif SCALE_GATHER:
        s_ptrs = s_ptr + expert * stride_se + rows * stride_sn + (k_lo // 32 + kb // 16)[None, :] * stride_sk  # 16 bytes a scale
    else:
        kg = tl.arange(0, BLOCK_K // 32)
        s_ptrs = s_ptr + expert * stride_se + rows * stride_sn + (k_lo // 32 + kg)[None, :] * stride_sk
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if GATED:
        acc_up = tl.zeros_like(acc)
    for k0 in range(k_lo, k_lo + k_split, BLOCK_K):
        if K % BLOCK_K == 0:  # no mask along K: the weight bytes load as vectors, not one by one
            a_mask = row_ok[:, None]
            mask = col_ok[:, None]
        else:
            byte_ok = (k0 // 2 + kb) < HALF_K  # K is even: an input pair is both in or both out
            a_mask = row_ok[:, None] & byte_ok[None, :]
            mask = col_ok[:, None] & byte_ok[None, :]
        if SPLIT_LOAD:  # one contiguous [BLOCK_M, BLOCK_K] load (vectors, pipelined), split in registers
            a_cols = k0 + tl.arange(0, BLOCK_K)
            a_ok = row_ok[:, None] if K % BLOCK_K == 0 else row_ok[:, None] & (a_cols < K)[None, :]
            a_all = tl.load(a_rows + a_cols[None, :] * stride_ak, mask=a_ok, other=0.0)
            a_even, a_odd = tl.split(tl.reshape(a_all, [BLOCK_M, BLOCK_K // 2, 2]))
        else:
            a_even = tl.load(a_ptrs, mask=a_mask, other=0.0)
            a_odd = tl.load(a_ptrs + stride_ak, mask=a_mask, other=0.0)
        if SWAP:  # the activations as [BLOCK_K/2, BLOCK_M]: the dots' second operand
            a_even, a_odd = tl.trans(a_even), tl.trans(a_odd)
        if BLOCK_K == 32 and not SCALE_WEIGHTS:
            acc += _group_dot(a_even, a_odd, w_ptrs, s_ptrs, mask, col_ok, IEEE, ASM, SHIFT, SWAP)
            if GATED:  # the up rows: N rows further down w13[e]
                acc_up += _group_dot(a_even, a_odd, w_ptrs + N * stride_wn, s_ptrs + N * stride_sn, mask, col_ok, IEEE, ASM, SHIFT, SWAP)
        else:
            if SCALE_GATHER:
                s_mask = mask
            else:
                s_mask = col_ok[:, None] & ((k0 // 32 + kg) < (K + 31) // 32)[None, :]
            w_even, w_odd = _load_weights(w_ptrs, s_ptrs, mask, s_mask, BLOCK_N, BLOCK_K, SCALE_GATHER, ASM, SHIFT)
            if SWAP:
                acc = _dot_t(_dot_t(acc, w_even, a_even, IEEE), w_odd, a_odd, IEEE)
            else:
                acc = _dot(_dot(acc, a_even, w_even, IEEE), a_odd, w_odd, IEEE)
            if GATED:  # the up rows: N rows further down w13[e]
                up_even, up_odd = _load_weights(w_ptrs + N * stride_wn, s_ptrs + N * stride_sn, mask, s_mask, BLOCK_N, BLOCK_K,
                                                SCALE_GATHER, ASM, SHIFT)
                if SWAP:
                    acc_up = _dot_t(_dot_t(acc_up, up_even, a_even, IEEE), up_odd, a_odd, IEEE)
                else:
                    acc_up = _dot(_dot(acc_up, a_even, up_even, IEEE), a_odd, up_odd, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += (BLOCK_K // 2) * stride_wk
        s_ptrs += (BLOCK_K // 32) * stride_sk

    if SWAP:  # back to [BLOCK_M, BLOCK_N] for the epilogue
        acc = tl.trans(acc)
        if GATED:
            acc_up = tl.trans(acc_up)
    if SPLIT:  # float32 partial sums part[split, pair, col] (GATED: the up sums at col + N); reduced after
        wide: tl.constexpr = 2 * N if GATED else N
        p_ptrs = part_ptr + (split * num_pairs + pair.to(tl.int64))[:, None] * wide + cols[None, :]
        p_mask = row_ok[:, None] & col_ok[None, :]
        tl.store(p_ptrs, acc, mask=p_mask)
        if GATED:
            tl.store(p_ptrs + N, acc_up, mask=p_mask)
    else:
        if GATED:
            acc = swiglu(acc, acc_up, limit, CLAMP)
        store_expert_tile(acc, out_ptr, route_w_ptr, pair, row_ok, cols, col_ok, stride_om, stride_on, WEIGHTED)


@triton.jit
def _split_k_epilogue_kernel(part_ptr, out_ptr, route_w_ptr, num_pairs, limit, stride_om, stride_on,
                             N: tl.constexpr, SPLITS: tl.constexpr, GATED: tl.constexpr, CLAMP: tl.constexpr,
                             WEIGHTED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[pair, cols] = the SPLITS partial sums of a split-K expert GEMM added in split order, then
    GEMM 1's (clamped) SwiGLU of the gate and up sums, or GEMM 2's routing weight; one program per
    (pair, column block)."""
    await_inputs(PDL)
    pair = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    wide: tl.constexpr = 2 * N if GATED else N
    acc = tl.zeros([BLOCK], tl.float32)
    acc_up = tl.zeros([BLOCK], tl.float32)
    for split in tl.static_range(SPLITS):
        row = part_ptr + (split * num_pairs + pair) * wide + cols
        acc += tl.load(row, mask=ok, other=0.0)
        if GATED:
            acc_up += tl.load(row + N, mask=ok, other=0.0)
    if GATED:
        acc = swiglu(acc, acc_up, limit, CLAMP)
    if WEIGHTED:
        acc = acc * tl.load(route_w_ptr + pair)
    tl.store(out_ptr + pair * stride_om + cols * stride_on, acc.to(out_ptr.dtype.element_ty), mask=ok)


def mxfp4_tiles(num_pairs: int, num_experts: int) -> ExpertTiles:
    """Tiles for T*k pairs over E experts, from the average pairs per active expert."""
    per_expert = num_pairs / max(1, min(num_pairs, num_experts))
    return next(tiles for bound, tiles in MXFP4_TILES if per_expert <= bound)


def _num_stages(tiles: ExpertTiles, block_n: int, a_bytes: int, gated: bool) -> int:
    """tiles.num_stages, lowered until the pipelined tiles (activations, packed codes and their
    scales) fit MXFP4_SMEM_BUDGET."""
    k = tiles.block_k
    per_stage = tiles.block_m * k * a_bytes + (2 if gated else 1) * block_n * (k // 2 + k // SCALE_GROUP)
    stages = tiles.num_stages
    while stages > 2 and (stages - 1) * per_stage > MXFP4_SMEM_BUDGET:
        stages -= 1
    return stages


def k_splits(programs: int, k: int, block_k: int, device: torch.device) -> int:
    """How many slices a GEMM's K is cut into: enough programs to give every SM MXFP4_PROGRAMS_PER_SM
    of them (decode's few (expert, column) tiles otherwise leave most SMs idle and each program a long
    serial loop), a power of two whose slices are whole BLOCK_K steps, at most MXFP4_MAX_SPLITS."""
    steps, rest = divmod(k, block_k)
    if rest:
        return 1
    if MXFP4_FORCE_SPLITS:
        return MXFP4_FORCE_SPLITS if steps % MXFP4_FORCE_SPLITS == 0 else 1
    if device.type != "cuda":
        return 1
    want = MXFP4_PROGRAMS_PER_SM * num_sms(device, 1)
    splits = 1
    while splits * 2 <= MXFP4_MAX_SPLITS and programs * splits < want and steps % (splits * 2) == 0:
        splits *= 2
    return splits


def gemm_launch(a, w, scales, out, route_w, part, layout, tiles: ExpertTiles, *, n: int, k: int, block_n: int, num_pairs: int,
                row_div: int, gated: bool, limit: float | None, weighted: bool, splits: int,
                compiled: bool) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, keywords but launch_options') of one _mxfp4_expert_gemm_kernel launch:
    what _gemm launches and benchmarks/sass_profile.py compiles for sm_90 without a GPU.
    ``compiled``: a GPU launch (the PTX decodes need it)."""
    asm = (MXFP4_ASM_DECODE if tiles.block_k == 32 else MXFP4_ASM_WIDE) and a.dtype == torch.bfloat16 and compiled
    grid = (layout.max_blocks * triton.cdiv(n, block_n), splits)
    args = (a, w, scales, out, route_w, part, layout.sorted_pairs, layout.block_expert, layout.num_padded,
            num_pairs, row_div, layout.max_blocks, 0.0 if limit is None else float(limit), k // splits,
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), scales.stride(0), scales.stride(1), scales.stride(2),
            out.stride(0), out.stride(1))
    kwargs = dict(N=n, K=k, GATED=gated, CLAMP=limit is not None, WEIGHTED=weighted, IEEE=a.dtype == torch.float32,
                  BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=tiles.block_k, GROUP_M=MXFP4_GROUP_M,
                  SCALE_GATHER=MXFP4_SCALE_GATHER, SPLIT=splits > 1, ASM=asm, SHIFT=MXFP4_SHIFT_DECODE,
                  SCALE_WEIGHTS=MXFP4_SCALE_WEIGHTS, SPLIT_LOAD=MXFP4_SPLIT_LOAD, SWAP=MXFP4_SWAP_AB,
                  num_warps=tiles.num_warps, num_stages=_num_stages(tiles, block_n, a.element_size(), gated))
    maxnreg = MXFP4_MAXNREG[0 if gated else 1]
    if maxnreg:
        kwargs["maxnreg"] = maxnreg
    return grid, args, kwargs


def _gemm(a, w, scales, out, route_w, layout, tiles: ExpertTiles, *, n: int, k: int, block_n: int, num_pairs: int,
          row_div: int, gated: bool, limit: float | None, weighted: bool, active_blocks: int) -> None:
    splits = k_splits(active_blocks * triton.cdiv(n, block_n), k, tiles.block_k, a.device)
    part = out
    if splits > 1:
        part = torch.empty((splits, num_pairs, 2 * n if gated else n), dtype=torch.float32, device=a.device)
    grid, args, kwargs = gemm_launch(a, w, scales, out, route_w, part, layout, tiles, n=n, k=k, block_n=block_n,
                                     num_pairs=num_pairs, row_div=row_div, gated=gated, limit=limit, weighted=weighted,
                                     splits=splits, compiled=a.device.type == "cuda")
    _mxfp4_expert_gemm_kernel[grid](*args, **kwargs, **launch_options(a.device))
    if splits > 1:
        block = min(1024, triton.next_power_of_2(n))
        _split_k_epilogue_kernel[(num_pairs, triton.cdiv(n, block))](
            part, out, route_w, num_pairs, 0.0 if limit is None else float(limit), out.stride(0), out.stride(1),
            N=n, SPLITS=splits, GATED=gated, CLAMP=limit is not None, WEIGHTED=weighted, BLOCK=block, num_warps=4,
            **launch_options(a.device),
        )


def run_mxfp4_experts(x, w13, w2, topk_weights, topk_ids, limit, w13_scale, w2_scale, tiles: ExpertTiles) -> torch.Tensor:
    """The routed experts over packed MXFP4 weights with the given tiles; [T, D] in x's dtype."""
    check_mxfp4_experts(x, w13, w2, w13_scale, w2_scale, None)
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    num_pairs = num_tokens * top_k
    layout = align_pairs(topk_ids, num_experts, tiles.block_m)
    route_w = topk_weights.reshape(-1).float()
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    active = min(layout.max_blocks, num_pairs, num_experts)  # M blocks with pairs, as the host can tell without a sync
    _gemm(x, w13, w13_scale, h, route_w, layout, tiles, n=inter, k=hidden, block_n=tiles.block_n_up,
          num_pairs=num_pairs, row_div=top_k, gated=True, limit=limit, weighted=False, active_blocks=active)
    # With one slot the weighted rows are the output itself; otherwise sum the slots after.
    y = out if top_k == 1 else torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _gemm(h, w2, w2_scale, y, route_w, layout, tiles, n=hidden, k=inter, block_n=tiles.block_n_down,
          num_pairs=num_pairs, row_div=1, gated=False, limit=None, weighted=True, active_blocks=active)
    if top_k > 1:
        sum_slots(y, out, top_k)
    return out


def mxfp4_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    limit: float | None,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
) -> torch.Tensor:
    """Sum over each token's k experts of weight * expert output, MXFP4 experts packed
    (deepinfer_core.ops.moe.moe_experts' convention: uint8 w13 / w2 and UE8M0 scales). The
    clamped SwiGLU of moe_experts_clamped with ``limit``; moe_experts' plain SwiGLU with None.
    Returns [T, D] in x's dtype: each expert output rounded to it, the k slots summed in float32
    in slot order. No host synchronisation."""
    tiles = mxfp4_tiles(topk_ids.numel(), w13.shape[0])
    return run_mxfp4_experts(x, w13, w2, topk_weights, topk_ids, limit, w13_scale, w2_scale, tiles)


mxfp4_experts.impl = ("triton: MXFP4 experts kept packed, W4A16 grouped GEMMs dequantising in registers (E2M1 by PTX "
                      "shifts and masks, the scale on the bf16 weights), K split across SMs at decode, fused clamped SwiGLU, "
                      "slot sum")


def with_mxfp4(clamped, plain=None) -> dict:
    """The op table entries that send MXFP4 experts (uint8 weights: ops.moe's convention) to
    ``mxfp4_experts`` and every other call to the given callables: ``clamped`` (a
    moe_experts_clamped) and, when given, ``plain`` (a moe_experts; its attributes, such as
    ``shared_expert_max_tokens``, are kept: uint8 is no dtype it names, so packed experts are never
    fused with the shared ones). For backend.deepinfer_ops: ``ops.update(with_mxfp4(...))``. The
    clamped entry is one wrapper per callable (cached: the normal and batch-invariant tables hold
    the same one); the plain entry is made afresh, its attributes copied from ``plain`` as they are
    when the table is built."""
    table = {"moe_experts_clamped": _clamped_entry(clamped)}
    if plain is not None:
        table["moe_experts"] = _plain_entry(plain)
    return table


@functools.cache
def _clamped_entry(clamped):
    def moe_experts_clamped(x, w13, w2, topk_weights, topk_ids, limit, w13_scale=None, w2_scale=None, block=None):
        if w13.dtype == torch.uint8:
            return mxfp4_experts(x, w13, w2, topk_weights, topk_ids, limit, w13_scale, w2_scale)
        return clamped(x, w13, w2, topk_weights, topk_ids, limit, w13_scale, w2_scale, block)

    moe_experts_clamped.impl = f"{getattr(clamped, 'impl', '') or 'reference'}; MXFP4 experts: {mxfp4_experts.impl}"
    return moe_experts_clamped


def _plain_entry(plain):
    def moe_experts(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, block=None, **kwargs):
        if w13.dtype == torch.uint8:
            return mxfp4_experts(x, w13, w2, topk_weights, topk_ids, None, w13_scale, w2_scale)
        return plain(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, **kwargs)

    moe_experts.__dict__.update(plain.__dict__)
    moe_experts.impl = f"{getattr(plain, 'impl', '') or 'reference'}; MXFP4 experts: {mxfp4_experts.impl}"
    return moe_experts
