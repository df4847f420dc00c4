"""Paged MLA latent-cache ops: store [latent | k_pe] rows at slots (as given, or normalised and
rotated from the kv_a projection's rows in the same launch that rotates q_pe), and gather rows back.

A slot s addresses row s % block_size of block s // block_size of kv_cache [num_blocks,
block_size, d_c + d_r]; the cache's strides are honoured, so it need not be contiguous.
Padding tokens carry slot -1 and are skipped inside the kernel (no boolean-mask indexing,
hence no host synchronisation: safe under CUDA graph capture).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.kernels.device import await_inputs, launch_options
from deepinfer_nvidia_sm100.kernels.elementwise import ROPE_BLOCK_H, norm_warps, rms_norm_row, rope_pairs, rotate_heads

# ---- tunables (sweep on the GPU) -------------------------------------------------------------
CACHE_BLOCK_D = 256  # entry columns per program (an MLA entry is 576 wide: 3 programs per row)
CACHE_NUM_WARPS = 2


@triton.jit
def _write_latent_kernel(
    cache_ptr, latent_ptr, pe_ptr, slot_ptr,
    D_C, D_R, BLOCK_SIZE,
    stride_cb, stride_cs, stride_cd,
    stride_lt, stride_ld,
    stride_pt, stride_pd,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    await_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    keep = slot >= 0
    slot = tl.maximum(slot, 0)
    row = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    in_latent = cols < D_C
    in_pe = (cols >= D_C) & (cols < D_C + D_R)
    latent = tl.load(latent_ptr + t * stride_lt + cols * stride_ld, mask=in_latent & keep, other=0.0)
    pe = tl.load(pe_ptr + t * stride_pt + (cols - D_C) * stride_pd, mask=in_pe & keep, other=0.0)
    ty = cache_ptr.dtype.element_ty
    tl.store(row + cols * stride_cd, tl.where(in_latent, latent.to(ty), pe.to(ty)), mask=(in_latent | in_pe) & keep)


def write_latent_cache(kv_cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store [latent | k_pe] of token t at slot slot_mapping[t] (in place); negative slots are skipped.

    kv_cache: [num_blocks, block_size, d_c + d_r]; latent: [T, d_c]; k_pe: [T, d_r] (strided
    views allowed); slot_mapping: [T] int64.
    """
    t, d_c = latent.shape
    d_r = k_pe.shape[-1]
    if t == 0:
        return
    _write_latent_kernel[(t, triton.cdiv(d_c + d_r, CACHE_BLOCK_D))](
        kv_cache, latent, k_pe, slot_mapping,
        d_c, d_r, kv_cache.shape[1],
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        latent.stride(0), latent.stride(1),
        k_pe.stride(0), k_pe.stride(1),
        BLOCK_D=CACHE_BLOCK_D,
        num_warps=CACHE_NUM_WARPS, **launch_options(kv_cache.device),
    )


@triton.jit
def _norm_rope_write_kernel(
    cache_ptr, kv_ptr, w_ptr, q_ptr, pos_ptr, cs_ptr, slot_ptr, q_out_ptr,
    H, D_C, eps, BLOCK_SIZE,  # heads, latent width (a runtime value: the norm divides by it as rms_norm does)
    stride_cb, stride_cs, stride_cd,
    stride_kt, stride_kd,
    stride_qt, stride_qh, stride_qd,
    stride_cp, stride_cd_table,
    HALF: tl.constexpr,  # rope_dim / 2
    BLOCK_DC: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr, PDL: tl.constexpr,
):
    """Program (token, j): for j < the head blocks, rotates head block j of q_pe; the last program of
    the token normalises the latent, rotates the rope key and stores both in the token's cache row
    (not for a negative slot), beside the heads rather than after them. Each value is rounded as
    the three ops round it: to the activations' dtype, then to the cache's (elementwise.py's norm
    and RoPE kernels, and write_latent_cache); launched with the norm kernel's warps, the latent's
    sum of squares is added in its order too (the same bits)."""
    await_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    ia, ib, mask_i, cos, sin = rope_pairs(pos_ptr, cs_ptr, t, stride_cp, stride_cd_table, HALF, BLOCK_HALF, INTERLEAVED)
    if tl.program_id(1) < tl.num_programs(1) - 1:
        rotate_heads(q_ptr, q_out_ptr, t, tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H), H, stride_qt, stride_qh, stride_qd,
                     ia, ib, mask_i, cos, sin, HALF)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        keep = slot >= 0
        row = cache_ptr + (tl.maximum(slot, 0) // BLOCK_SIZE) * stride_cb + (tl.maximum(slot, 0) % BLOCK_SIZE) * stride_cs
        ty = cache_ptr.dtype.element_ty
        kv_ty = kv_ptr.dtype.element_ty
        cols = tl.arange(0, BLOCK_DC)
        in_latent = cols < D_C
        kv_row = kv_ptr + t * stride_kt
        x32 = tl.load(kv_row + cols * stride_kd, mask=in_latent, other=0.0).to(tl.float32)
        latent = rms_norm_row(x32, w_ptr, cols, in_latent, D_C, eps, kv_ptr)  # in kv's dtype, as rms_norm returns it
        tl.store(row + cols * stride_cd, latent.to(ty), mask=in_latent & keep)
        ka = tl.load(kv_row + (D_C + ia) * stride_kd, mask=mask_i, other=0.0).to(tl.float32)
        kb = tl.load(kv_row + (D_C + ib) * stride_kd, mask=mask_i, other=0.0).to(tl.float32)
        tl.store(row + (D_C + ia) * stride_cd, (ka * cos - kb * sin).to(kv_ty).to(ty), mask=mask_i & keep)
        tl.store(row + (D_C + ib) * stride_cd, (kb * cos + ka * sin).to(kv_ty).to(ty), mask=mask_i & keep)


def norm_rope_write_latent(
    kv_cache: torch.Tensor,
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    q_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    interleaved: bool,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """rms_norm of the latent, RoPE of q_pe and the rope key, and the cache write in one launch
    (contract: deepinfer_core.ops.attention.norm_rope_write_latent); returns the rotated q_pe."""
    t, h, r = q_pe.shape
    d_c = norm_weight.shape[0]
    q_out = torch.empty((t, h, r), dtype=q_pe.dtype, device=q_pe.device)
    if t == 0:
        return q_out
    if norm_weight.stride(0) != 1:
        norm_weight = norm_weight.contiguous()
    block_h = min(ROPE_BLOCK_H, triton.next_power_of_2(max(h, 1)))
    block_dc = triton.next_power_of_2(d_c)
    _norm_rope_write_kernel[(t, triton.cdiv(h, block_h) + 1)](  # the head blocks, then the cache row's program
        kv_cache, kv, norm_weight, q_pe, positions, cos_sin, slot_mapping, q_out,
        h, d_c, eps, kv_cache.shape[1],
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv.stride(0), kv.stride(1),
        q_pe.stride(0), q_pe.stride(1), q_pe.stride(2),
        cos_sin.stride(0), cos_sin.stride(1),
        HALF=r // 2,
        BLOCK_DC=block_dc, BLOCK_HALF=triton.next_power_of_2(r // 2), BLOCK_H=block_h,
        INTERLEAVED=bool(interleaved),
        num_warps=norm_warps(block_dc), **launch_options(kv_cache.device),  # as rms_norm's launch: its reduction order
    )
    return q_out


@triton.jit(do_not_specialize=["NUM_SLOTS"])  # per-step sizes: one compile, not one per value class
def _gather_latent_kernel(
    cache_ptr, slot_ptr, out_ptr,
    D, BLOCK_SIZE, NUM_SLOTS,
    stride_cb, stride_cs, stride_cd,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    await_inputs(PDL)
    s = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    slot = tl.load(slot_ptr + s).to(tl.int64)
    slot = tl.where(slot < 0, slot + NUM_SLOTS, slot)  # negative indices count from the end, as in torch
    row = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    tl.store(out_ptr + s * D + cols, tl.load(row + cols * stride_cd, mask=mask), mask=mask)


def gather_latent_cache(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of the cache at ``slots`` [S] int64 -> [S, d_c + d_r] (a new tensor)."""
    num_blocks, block_size, d = kv_cache.shape
    out = torch.empty((slots.shape[0], d), dtype=kv_cache.dtype, device=kv_cache.device)
    if slots.shape[0] == 0:
        return out
    _gather_latent_kernel[(slots.shape[0], triton.cdiv(d, CACHE_BLOCK_D))](
        kv_cache, slots, out,
        d, block_size, num_blocks * block_size,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        BLOCK_D=CACHE_BLOCK_D,
        num_warps=CACHE_NUM_WARPS, **launch_options(kv_cache.device),
    )
    return out


write_latent_cache.impl = "triton: one program per (token, column block), padding slots skipped in-kernel"
norm_rope_write_latent.impl = ("triton: one launch for the latent's RMSNorm, RoPE of q_pe and the rope key, and the cache "
                               "write; programs (token, head block) and one per token for the cache row")
gather_latent_cache.impl = "triton: one program per (slot, column block), strided cache"

OPS = {"write_latent_cache": write_latent_cache, "norm_rope_write_latent": norm_rope_write_latent,
       "gather_latent_cache": gather_latent_cache}
