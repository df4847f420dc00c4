"""Row-wise and elementwise ops: RMSNorm (plain, fused with the residual add, and DeepSeek-V4's
float32-weight and unweighted variants), SiLU-and-mul (plain and V4's clamped), RoPE.

Each kernel reproduces the reference's rounding points (deepinfer_core.ops.norm / activation /
rope): where the reference casts an intermediate to the input dtype, so do these, so that
bf16 results agree bit for bit except where float32 evaluation order differs by an ulp.
Inputs may be strided views (a column slice of a wider tensor); outputs are new contiguous tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.kernels.device import await_inputs, launch_options

# ---- tunables (sweep on the GPU) -------------------------------------------------------------
NORM_ELEMS_PER_WARP = 256  # a norm row of BLOCK_D elements gets BLOCK_D / this warps (1..16)
SILU_BLOCK = 1024  # output columns per SiLU program
SILU_NUM_WARPS = 4
ROPE_BLOCK_H = 16  # heads per RoPE program
ROPE_NUM_WARPS = 4


def norm_warps(block_d: int) -> int:
    return max(1, min(16, block_d // NORM_ELEMS_PER_WARP))


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    D, eps,
    stride_xm, stride_xd, stride_rm, stride_rd,
    stride_om, stride_rom,
    ADD_RESIDUAL: tl.constexpr,
    MODE: tl.constexpr,  # NORM_V3, NORM_F32 or NORM_UNWEIGHTED: where the reference rounds
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_xm + cols * stride_xd, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(res_ptr + row * stride_rm + cols * stride_rd, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)  # x + residual in x's dtype
        tl.store(res_out_ptr + row * stride_rom + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    if MODE == 0:
        y = rms_norm_row(x32, w_ptr, cols, mask, D, eps, out_ptr)
    elif MODE == 1:  # rms_norm_f32: the float32 weight multiplies before the one rounding
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (w * (x32 * tl.math.rsqrt(tl.sum(x32 * x32, axis=0) / D + eps))).to(out_ptr.dtype.element_ty)
    else:  # rms_normalize: the factor rounded to x's dtype, the product rounded once
        rstd = tl.math.rsqrt(tl.sum(x32 * x32, axis=0) / D + eps).to(out_ptr.dtype.element_ty).to(tl.float32)
        y = (x32 * rstd).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_om + cols, y, mask=mask)


@triton.jit
def rms_norm_row(x32, w_ptr, cols, mask, D, eps, out_ptr):
    """One row's RMSNorm, x32 [BLOCK_D] float32 (zeros past D) -> w * x / rms(x), rounded as the
    reference rounds it: to out_ptr's element type before the scale and after."""
    rstd = tl.math.rsqrt(tl.sum(x32 * x32, axis=0) / D + eps)
    normed = (x32 * rstd).to(out_ptr.dtype.element_ty)  # the reference casts before scaling
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (w * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as a 2-D [rows, D] tensor (a view where the strides allow it)."""
    return x.reshape(-1, x.shape[-1])


NORM_V3, NORM_F32, NORM_UNWEIGHTED = 0, 1, 2


def _launch_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float, mode: int = NORM_V3):
    d = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if x2.shape[0] == 0:
        return out, res_out
    r2 = _rows(residual) if residual is not None else x2
    block_d = triton.next_power_of_2(d)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, x2 if weight is None else weight, out, res_out if res_out is not None else out,
        d, eps,
        x2.stride(0), x2.stride(1), r2.stride(0), r2.stride(1),
        d, d,
        ADD_RESIDUAL=residual is not None,
        MODE=mode,
        BLOCK_D=block_d,
        num_warps=norm_warps(block_d), **launch_options(x2.device),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * cast_in(x_f32 * rsqrt(mean(x_f32^2, -1) + eps)); x [..., D], weight [D]; a new tensor."""
    if weight.stride(0) != 1:
        weight = weight.contiguous()
    return _launch_norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual (in x's dtype); returns (rms_norm(residual', weight, eps), residual'). Inputs untouched."""
    if weight.stride(0) != 1:
        weight = weight.contiguous()
    return _launch_norm(x, residual, weight, eps)


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = cast_in(weight_f32 * x_f32 * rsqrt(mean(x_f32^2, -1) + eps)); x [..., D], weight [D] (any float dtype)."""
    if weight.stride(0) != 1:
        weight = weight.contiguous()
    return _launch_norm(x, None, weight, eps, NORM_F32)[0]


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x * cast_in(rsqrt(mean(x_f32^2, -1) + eps)), multiplied in x's dtype; x [..., D]."""
    return _launch_norm(x, None, None, eps, NORM_UNWEIGHTED)[0]


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr,
    I, limit,
    stride_xm, stride_xd, stride_om,
    CLAMP: tl.constexpr,  # V4: silu(min(gate, limit)) * clamp(up, -limit, limit)
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_xm + cols * stride_xd, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xm + (cols + I) * stride_xd, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:  # exact in any dtype: the limit is compared, never rounded into a value
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    # F.silu rounds to the input dtype before the multiply by up; so does this.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] = [gate | up]; returns silu(gate) * up, [..., I], in x's dtype."""
    return _silu_and_mul(x, None)


def silu_and_mul_clamped(x: torch.Tensor, limit: float) -> torch.Tensor:
    """x: [..., 2I] = [gate | up]; returns silu(min(gate, limit)) * clamp(up, -limit, limit), [..., I]."""
    return _silu_and_mul(x, float(limit))


def _silu_and_mul(x: torch.Tensor, limit: float | None) -> torch.Tensor:
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    x2 = _rows(x)
    if x2.shape[0] == 0 or inter == 0:
        return out
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, SILU_BLOCK))](
        x2, out,
        inter, 0.0 if limit is None else limit,
        x2.stride(0), x2.stride(1), inter,
        CLAMP=limit is not None,
        BLOCK=SILU_BLOCK,
        num_warps=SILU_NUM_WARPS, **launch_options(x2.device),
    )
    return out


@triton.jit
def rotate(a_ptrs, b_ptrs, out_a_ptrs, out_b_ptrs, mask, cos, sin):
    a = tl.load(a_ptrs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_a_ptrs, (a * cos - b * sin).to(out_a_ptrs.dtype.element_ty), mask=mask)
    tl.store(out_b_ptrs, (b * cos + a * sin).to(out_b_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def rope_pairs(pos_ptr, cs_ptr, t, stride_cp, stride_cd, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Token t's rotation: the columns (ia, ib) of each pair, their mask, and cos / sin [BLOCK_HALF]
    float32 from the table's row at the token's position."""
    i = tl.arange(0, BLOCK_HALF)
    mask_i = i < HALF
    if INTERLEAVED:  # pairs (2i, 2i + 1)
        ia = 2 * i
        ib = 2 * i + 1
    else:  # NeoX pairs (i, i + r/2)
        ia = i
        ib = i + HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * stride_cp + i * stride_cd, mask=mask_i, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cp + (i + HALF) * stride_cd, mask=mask_i, other=0.0).to(tl.float32)
    return ia, ib, mask_i, cos, sin


@triton.jit
def rotate_heads(q_ptr, q_out_ptr, t, heads, H, stride_qt, stride_qh, stride_qd, ia, ib, mask_i, cos, sin, HALF: tl.constexpr):
    """Rotates token t's ``heads`` of q (strided) into q_out [T, H, 2 HALF] (contiguous)."""
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    q_out_row = q_out_ptr + (t * H + heads[:, None]) * (2 * HALF)
    rotate(
        q_row + ia[None, :] * stride_qd, q_row + ib[None, :] * stride_qd,
        q_out_row + ia[None, :], q_out_row + ib[None, :],
        (heads < H)[:, None] & mask_i[None, :], cos[None, :], sin[None, :],
    )


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cs_ptr, q_out_ptr, k_out_ptr,
    H,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kd,
    stride_cp, stride_cd,
    HALF: tl.constexpr,  # rope_dim / 2
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr, PDL: tl.constexpr,
):
    await_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    ia, ib, mask_i, cos, sin = rope_pairs(pos_ptr, cs_ptr, t, stride_cp, stride_cd, HALF, BLOCK_HALF, INTERLEAVED)
    rotate_heads(q_ptr, q_out_ptr, t, tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H), H, stride_qt, stride_qh, stride_qd,
                 ia, ib, mask_i, cos, sin, HALF)
    if tl.program_id(1) == 0:  # the first head block also rotates k
        k_row = k_ptr + t * stride_kt
        k_out_row = k_out_ptr + t * (2 * HALF)
        rotate(k_row + ia * stride_kd, k_row + ib * stride_kd, k_out_row + ia, k_out_row + ib, mask_i, cos, sin)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, r] and k [T, r] by their positions; new tensors in the inputs' dtypes.

    positions [T] int; cos_sin [max_pos, r] float32 (cos | sin halves). interleaved=True rotates
    pairs (2i, 2i+1), False NeoX pairs (i, i + r/2). q and k may be strided views.
    """
    t, h, r = q.shape
    q_out = torch.empty((t, h, r), dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    half = r // 2
    block_h = min(ROPE_BLOCK_H, triton.next_power_of_2(max(h, 1)))
    _rope_kernel[(t, max(1, triton.cdiv(h, block_h)))](
        q, k, positions, cos_sin, q_out, k_out,
        h,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1),
        cos_sin.stride(0), cos_sin.stride(1),
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_H=block_h,
        INTERLEAVED=bool(interleaved),
        num_warps=ROPE_NUM_WARPS, **launch_options(q.device),
    )
    return q_out, k_out


rms_norm.impl = "triton: one program per row, float32 sum of squares, reference rounding order"
add_rms_norm.impl = "triton: fused residual add + RMSNorm, one program per row"
silu_and_mul.impl = "triton: fused SiLU(gate) * up, rounding like F.silu then mul"
rotary_embedding.impl = "triton: one kernel for q and k, strided inputs, interleaved or NeoX pairs"
rms_norm_f32.impl = "triton: one program per row, float32 weight multiply, one rounding"
rms_normalize.impl = "triton: one program per row, the factor rounded to the input dtype as the reference does"
silu_and_mul_clamped.impl = "triton: fused clamped SiLU(gate) * up (V4's swiglu_limit)"

OPS = {
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "silu_and_mul": silu_and_mul,
    "rotary_embedding": rotary_embedding,
    "rms_norm_f32": rms_norm_f32,
    "rms_normalize": rms_normalize,
    "silu_and_mul_clamped": silu_and_mul_clamped,
}
