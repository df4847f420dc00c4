"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4 and V4.1's delayed form): mhc_pre,
mhc_pre_delayed, mhc_head, mhc_collapse, mhc_post (contracts: deepinfer_core.ops.hyper).

``mhc_pre`` / ``mhc_pre_delayed`` / ``mhc_head``: two launches, where the reference takes dozens.

1. ``_mixes_kernel``, a split-K GEMM: flatten(x) [T, hc D] (read in its own dtype) times fn^T
   [hc D, N] (N = (2 + hc) hc, or hc for the head) on the tensor cores at float32 accuracy
   (plain TF32 or bf16 would round fn to 11 / 8 bits: ~1e-3 off in M): bf16 x against fn split
   into three bf16 terms (exact: 8 + 8 + 8 significant bits; each product exact in the float32
   accumulator), other dtypes in tf32x3; summing the squares of x in the same pass. Program (K split, token block) walks its
   share of the (stream, channel block) steps and writes float32 partials [T, P, N + 1] (column
   N: the sum of squares). No program reads more than its share of fn, and at decode the P
   splits keep every SM streaming fn at once.
2. ``_token_kernel``, program (token, channel chunk): adds the P partials, applies the rms
   factor to the sums (M = (sum x fn) * rstd: the reference normalises x first, the same math,
   another rounding), then pre / post / comb (sigmoid, softmax over hc, + hc_eps) and the
   Sinkhorn rounds on the [HC_PAD, HC_PAD] tile in registers (hc padded to a power of two, the
   padding masked to exact zeros so it never enters a sum), and the collapse sum_j w_j x_j of its
   channels in float32, rounded once. Every chunk recomputes the coefficients (a few hundred
   flops); chunk 0 stores them. ``mhc_collapse`` is this kernel alone, with given weights.

``mhc_post``: one elementwise kernel, float32 math, one rounding.

Divisions in the coefficients are IEEE (div_rn) as torch's are. Sums run in other orders than
the reference's (tensor-core K blocks, a tree over the splits and over hc): float32 results differ
in the last bits, well inside the spec's 1e-5.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.kernels.device import await_inputs, launch_options, num_sms

# ---- tunables (sweep on the GPU) -------------------------------------------------------------
# GEMM program tiles: 4 warps, BLOCK_K 64 compile for sm_90 without spills at BLOCK_T 16 / 32 / 64
# (bf16: 96 / 168 / 128 registers; float32 148 / 251 / 192); BLOCK_K 128 spills from BLOCK_T 32.
MIX_BLOCK_K = 64  # channels of one stream per GEMM step (fewer when the hidden size is smaller)
MIX_MAX_BLOCK_T = 64  # tokens per GEMM program (at least 16: tl.dot's smallest M)
MIX_NUM_WARPS = 4
MIX_PROGRAMS_PER_SM = 2  # split K until (splits x token blocks) reaches this many programs per SM ...
MIX_MAX_PARTS = 64  # ... but into at most this many partials, which every token program adds up
TOKEN_BLOCK_D = 256  # channels per collapse step of a token program
TOKEN_NUM_WARPS = 2  # small: the Sinkhorn tile's reductions then stay within few warps
POST_MIN_BLOCK_D = 128  # mhc_post's channels per program: enough programs for every SM, in these bounds
POST_MAX_BLOCK_D = 1024
POST_ELEMS_PER_WARP = 1024  # an [HC_PAD, BLOCK_D] tile gets HC_PAD * BLOCK_D / this warps (1..8)
INTERPRETER_SMS = 4  # under TRITON_INTERPRET: a count that still splits K and the channels

# MODE of _token_kernel
_PRE, _DELAYED, _HEAD, _COLLAPSE = 0, 1, 2, 3


@triton.jit(do_not_specialize=["num_tokens", "steps_per_split", "num_parts"])
def _mixes_kernel(
    x_ptr, fn_ptr, parts_ptr,
    num_tokens, hidden, d_blocks, steps, steps_per_split, num_parts,
    s_xt, s_xh, s_xd, s_fn, s_fk,
    N_OUT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """Program (split, token block): parts[t, split, n] = sum over its steps of x[t, j, d] fn[n, j D + d]
    for n < N_OUT, and parts[t, split, N_OUT] = sum of x[t, j, d]^2; a step is (stream j, a block
    of BLOCK_K channels), so the channel loads stay contiguous whatever the hidden size."""
    await_inputs(PDL)
    split = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.arange(0, BLOCK_N)
    t_ok = t < num_tokens
    n_ok = n < N_OUT
    x_rows = x_ptr + t.to(tl.int64)[:, None] * s_xt
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    squares = tl.zeros([BLOCK_T], tl.float32)
    first = split * steps_per_split
    last = tl.minimum(first + steps_per_split, steps)
    for step in range(first, last):
        j = step // d_blocks
        d = (step - j * d_blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
        d_ok = d < hidden
        xs = tl.load(x_rows + j * s_xh + d[None, :] * s_xd, mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        ws = tl.load(fn_ptr + n[None, :] * s_fn + (j * hidden + d)[:, None] * s_fk, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _dot_exact(xs, ws.to(tl.float32), acc)
        x32 = xs.to(tl.float32)
        squares += tl.sum(x32 * x32, axis=1)
    acc = tl.where(n[None, :] == N_OUT, squares[:, None], acc)
    out = parts_ptr + (t.to(tl.int64)[:, None] * num_parts + split) * (N_OUT + 1) + n[None, :]
    tl.store(out, acc, mask=t_ok[:, None] & (n <= N_OUT)[None, :])


@triton.jit
def _dot_exact(xs, ws, acc):
    """acc + xs @ ws to float32 accuracy on the tensor cores, ws float32. bf16 xs: ws as the sum
    of three bf16 terms (24 significant bits), three bf16 products, each exact in the float32
    accumulator. Other dtypes: tf32x3 (the three-term TF32 split of both operands)."""
    if xs.dtype == tl.bfloat16:
        hi = ws.to(tl.bfloat16)
        rest = ws - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(xs, hi, acc)
        acc = tl.dot(xs, mid, acc)
        return tl.dot(xs, lo, acc)
    return tl.dot(xs.to(tl.float32), ws, acc, input_precision="tf32x3")


@triton.jit
def _pick(v, n, idx):
    """v[idx] for a vector idx of indices into v [BLOCK_N] (whose own indices are n)."""
    return tl.sum(tl.where(idx[:, None] == n[None, :], v[None, :], 0.0), axis=1)


@triton.jit
def _pick_tile(v, n, idx):
    """v[idx] for a 2-D tile idx of indices into v [BLOCK_N]."""
    return tl.sum(tl.where(idx[:, :, None] == n[None, None, :], v[None, None, :], 0.0), axis=2)


@triton.jit
def _sigmoid(z):
    return tl.div_rn(1.0, 1.0 + tl.exp(-z))


@triton.jit
def _sinkhorn(logits, valid, hc_eps, sinkhorn_iters):
    """comb = softmax over the last axis + hc_eps, divided by its column sums (+ hc_eps), then
    (sinkhorn_iters - 1) times by its row sums and its column sums; entries outside ``valid`` 0."""
    logits = tl.where(valid, logits, -1e30)  # finite: a padded row stays NaN-free
    e = tl.where(valid, tl.exp(logits - tl.max(logits, axis=1)[:, None]), 0.0)
    total = tl.sum(e, axis=1)
    comb = tl.where(valid, tl.div_rn(e, tl.where(total > 0.0, total, 1.0)[:, None]) + hc_eps, 0.0)
    comb = tl.div_rn(comb, tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = tl.div_rn(comb, tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = tl.div_rn(comb, tl.sum(comb, axis=0)[None, :] + hc_eps)
    return comb


@triton.jit(do_not_specialize=["num_parts", "d_per_chunk", "sinkhorn_iters"])
def _token_kernel(
    parts_ptr, x_ptr, base_ptr, scale_ptr, w_in_ptr, pre_ptr, post_ptr, comb_ptr, y_ptr,
    hidden, fan_in, num_parts, d_per_chunk, rms_eps, hc_eps, sinkhorn_iters,
    s_xt, s_xh, s_xd, s_wt, s_wh, s_base, s_scale,
    HC: tl.constexpr, MODE: tl.constexpr, HC_PAD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Program (token t, channel chunk): the coefficients of token t from the partial mixes
    (MODE _PRE / _DELAYED / _HEAD), then y[t, chunk] = sum_j w_j x[t, j, chunk] in float32,
    w = pre (_PRE), w_in[t] (_DELAYED, _COLLAPSE) or the head's weights (_HEAD)."""
    await_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    j = tl.arange(0, HC_PAD)
    j_ok = j < HC
    if MODE == 3:  # _COLLAPSE
        w = tl.load(w_in_ptr + t * s_wt + j * s_wh, mask=j_ok, other=0.0).to(tl.float32)
    else:
        N_OUT: tl.constexpr = HC if MODE == 2 else (2 + HC) * HC
        n = tl.arange(0, BLOCK_N)
        p = tl.arange(0, BLOCK_P)
        parts = tl.load(parts_ptr + (t * num_parts + p[:, None]) * (N_OUT + 1) + n[None, :],
                        mask=(p < num_parts)[:, None] & (n <= N_OUT)[None, :], other=0.0)
        sums = tl.sum(parts, axis=0)
        rstd = tl.math.rsqrt(tl.sum(tl.where(n == N_OUT, sums, 0.0), axis=0) / fan_in + rms_eps)
        m = sums * rstd
        pre = _sigmoid(_pick(m, n, j) * tl.load(scale_ptr) + tl.load(base_ptr + j * s_base, mask=j_ok, other=0.0)) + hc_eps
        pre = tl.where(j_ok, pre, 0.0)
        if MODE == 2:  # _HEAD
            w = pre
        else:
            post = 2.0 * _sigmoid(_pick(m, n, HC + j) * tl.load(scale_ptr + s_scale)
                                  + tl.load(base_ptr + (HC + j) * s_base, mask=j_ok, other=0.0))
            jk = 2 * HC + j[:, None] * HC + j[None, :]  # comb[j, k]: input stream j, output stream k
            valid = j_ok[:, None] & j_ok[None, :]
            logits = _pick_tile(m, n, jk) * tl.load(scale_ptr + 2 * s_scale) + tl.load(base_ptr + jk * s_base, mask=valid, other=0.0)
            comb = _sinkhorn(logits, valid, hc_eps, sinkhorn_iters)
            if chunk == 0:
                tl.store(post_ptr + t * HC + j, post, mask=j_ok)
                tl.store(comb_ptr + t * HC * HC + j[:, None] * HC + j[None, :], comb, mask=valid)
                if MODE == 1:
                    tl.store(pre_ptr + t * HC + j, pre, mask=j_ok)
            if MODE == 1:  # _DELAYED: the collapse takes the previous sublayer's pre
                w = tl.load(w_in_ptr + t * s_wt + j * s_wh, mask=j_ok, other=0.0).to(tl.float32)
            else:
                w = pre
    first = chunk * d_per_chunk
    last = tl.minimum(first + d_per_chunk, hidden)
    x_row = x_ptr + t * s_xt + j[:, None] * s_xh
    y_row = y_ptr + t * hidden
    for d0 in range(first, last, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < last
        xs = tl.load(x_row + d[None, :] * s_xd, mask=j_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        tl.store(y_row + d, tl.sum(w[:, None] * xs, axis=0).to(y_ptr.dtype.element_ty), mask=d_ok)


def _mixes(x: torch.Tensor, fn: torch.Tensor, n_out: int) -> torch.Tensor:
    """The float32 partial mixes [T, P, n_out + 1] of x [T, hc, D] by fn [n_out, hc D] (column
    n_out: partial sums of squares), P splits of the hc x ceil(D / BLOCK_K) GEMM steps."""
    tokens, hc, hidden = x.shape
    if tuple(fn.shape) != (n_out, hc * hidden):
        raise ValueError(f"mHC: fn is {tuple(fn.shape)}, expected [{n_out}, {hc * hidden}] for streams {tuple(x.shape)}")
    block_k = min(MIX_BLOCK_K, max(16, triton.next_power_of_2(hidden)))
    block_t = min(MIX_MAX_BLOCK_T, max(16, triton.next_power_of_2(tokens)))
    d_blocks = triton.cdiv(hidden, block_k)
    steps = hc * d_blocks
    token_blocks = triton.cdiv(tokens, block_t)
    want = triton.cdiv(MIX_PROGRAMS_PER_SM * num_sms(x.device, INTERPRETER_SMS), token_blocks)
    steps_per_split = triton.cdiv(steps, max(1, min(steps, MIX_MAX_PARTS, want)))
    splits = triton.cdiv(steps, steps_per_split)
    parts = torch.empty((tokens, splits, n_out + 1), dtype=torch.float32, device=x.device)
    _mixes_kernel[(splits, token_blocks)](
        x, fn, parts,
        tokens, hidden, d_blocks, steps, steps_per_split, splits,
        *x.stride(), *fn.stride(),
        N_OUT=n_out, BLOCK_T=block_t, BLOCK_N=max(16, triton.next_power_of_2(n_out + 1)), BLOCK_K=block_k,
        num_warps=MIX_NUM_WARPS, **launch_options(x.device),
    )
    return parts


def _token_pass(mode: int, x: torch.Tensor, parts, base, scale, w_in, outs, *, hc_eps=0.0, rms_eps=0.0, sinkhorn_iters=1):
    """Launch _token_kernel over T tokens x channel chunks (as many chunks as give every SM a
    program, at least TOKEN_BLOCK_D channels each). outs = (pre, post, comb, y); unused entries
    (and parts / base / scale / w_in) may be any tensor: the MODE never touches them."""
    tokens, hc, hidden = x.shape
    pre, post, comb, y = outs
    block_d = min(TOKEN_BLOCK_D, triton.next_power_of_2(hidden))
    d_blocks = triton.cdiv(hidden, block_d)
    chunks = max(1, min(d_blocks, triton.cdiv(num_sms(x.device, INTERPRETER_SMS), tokens)))
    d_per_chunk = triton.cdiv(d_blocks, chunks) * block_d
    n_out = hc if mode == _HEAD else (2 + hc) * hc
    num_parts = parts.shape[1] if mode != _COLLAPSE else 1
    w_strides = w_in.stride() if mode in (_DELAYED, _COLLAPSE) else (0, 0)
    _token_kernel[(tokens, triton.cdiv(hidden, d_per_chunk))](
        parts, x, base, scale, w_in, pre, post, comb, y,
        hidden, hc * hidden, num_parts, d_per_chunk, float(rms_eps), float(hc_eps), int(sinkhorn_iters),
        *x.stride(), *w_strides, base.stride(0), scale.stride(0),
        HC=hc, MODE=mode, HC_PAD=max(2, triton.next_power_of_2(hc)), BLOCK_P=triton.next_power_of_2(num_parts),
        BLOCK_N=max(16, triton.next_power_of_2(n_out + 1)), BLOCK_D=block_d,
        num_warps=TOKEN_NUM_WARPS, **launch_options(x.device),
    )


def _coefficient_outputs(x: torch.Tensor):
    tokens, hc, hidden = x.shape
    f32 = {"dtype": torch.float32, "device": x.device}
    return (torch.empty((tokens, hc), **f32), torch.empty((tokens, hc), **f32), torch.empty((tokens, hc, hc), **f32),
            torch.empty((tokens, hidden), dtype=x.dtype, device=x.device))


def _check_sinkhorn(sinkhorn_iters: int) -> None:
    if sinkhorn_iters < 1:
        raise ValueError(f"mHC: sinkhorn_iters must be >= 1 (the first column normalisation always runs), not {sinkhorn_iters}")


def mhc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_eps: float, rms_eps: float,
            sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(post [T, hc] f32, comb [T, hc, hc] f32, collapsed [T, D] in x's dtype); contract:
    deepinfer_core.ops.hyper.mhc_pre. Two launches (mixes GEMM, fused per-token kernel)."""
    _check_sinkhorn(sinkhorn_iters)
    outs = _coefficient_outputs(x)
    if x.shape[0] > 0:
        hc = x.shape[1]
        parts = _mixes(x, fn, (2 + hc) * hc)
        _token_pass(_PRE, x, parts, base, scale, parts, outs, hc_eps=hc_eps, rms_eps=rms_eps, sinkhorn_iters=sinkhorn_iters)
    return outs[1], outs[2], outs[3]


def mhc_pre_delayed(x: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                    hc_eps: float, rms_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre, post, comb float32, collapsed with pre_in [T, D] in x's dtype); contract:
    deepinfer_core.ops.hyper.mhc_pre_delayed. Two launches, as mhc_pre."""
    _check_sinkhorn(sinkhorn_iters)
    outs = _coefficient_outputs(x)
    if x.shape[0] > 0:
        hc = x.shape[1]
        parts = _mixes(x, fn, (2 + hc) * hc)
        _token_pass(_DELAYED, x, parts, base, scale, pre_in, outs, hc_eps=hc_eps, rms_eps=rms_eps, sinkhorn_iters=sinkhorn_iters)
    return outs


def mhc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_eps: float, rms_eps: float) -> torch.Tensor:
    """sum_j w_j x_j [T, D] in x's dtype, w = sigmoid(M scale + base) + hc_eps; contract:
    deepinfer_core.ops.hyper.mhc_head. Two launches (mixes GEMM, per-token collapse)."""
    y = torch.empty((x.shape[0], x.shape[2]), dtype=x.dtype, device=x.device)
    if x.shape[0] > 0:
        parts = _mixes(x, fn, x.shape[1])
        _token_pass(_HEAD, x, parts, base, scale, parts, (y, y, y, y), hc_eps=hc_eps, rms_eps=rms_eps)
    return y


def mhc_collapse(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] x[t, j] [T, D] in x's dtype, summed in float32; contract:
    deepinfer_core.ops.hyper.mhc_collapse. One launch."""
    y = torch.empty((x.shape[0], x.shape[2]), dtype=x.dtype, device=x.device)
    if x.shape[0] > 0:
        _token_pass(_COLLAPSE, x, weights, weights, weights, weights, (y, y, y, y))
    return y


@triton.jit
def _post_kernel(
    out_ptr, x_ptr, post_ptr, comb_ptr, new_ptr,
    hidden,
    s_ot, s_od, s_xt, s_xh, s_xd, s_pt, s_ph, s_ct, s_cj, s_ck,
    HC: tl.constexpr, HC_PAD: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Program (token t, channel block): new[t, k, d] = post[t, k] out[t, d] + sum_j comb[t, j, k] x[t, j, d]."""
    await_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    k = tl.arange(0, HC_PAD)
    d_ok = d < hidden
    k_ok = k < HC
    mixed = tl.zeros([HC_PAD, BLOCK_D], tl.float32)
    for j in tl.static_range(HC):
        xj = tl.load(x_ptr + t * s_xt + j * s_xh + d * s_xd, mask=d_ok, other=0.0).to(tl.float32)
        cj = tl.load(comb_ptr + t * s_ct + j * s_cj + k * s_ck, mask=k_ok, other=0.0).to(tl.float32)
        mixed += cj[:, None] * xj[None, :]
    out = tl.load(out_ptr + t * s_ot + d * s_od, mask=d_ok, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * s_pt + k * s_ph, mask=k_ok, other=0.0).to(tl.float32)
    new = post[:, None] * out[None, :] + mixed
    tl.store(new_ptr + (t * HC + k[:, None]) * hidden + d[None, :], new.to(new_ptr.dtype.element_ty), mask=k_ok[:, None] & d_ok[None, :])


def mhc_post(out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, hc, D] in x's dtype: post[t, k] out[t] + sum_j comb[t, j, k] x[t, j], float32
    math, one rounding; contract: deepinfer_core.ops.hyper.mhc_post. One launch."""
    tokens, hc, hidden = x.shape
    new = torch.empty((tokens, hc, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0 or hidden == 0:
        return new
    want = triton.next_power_of_2(triton.cdiv(tokens * hidden, num_sms(x.device, INTERPRETER_SMS)))
    block_d = min(triton.next_power_of_2(hidden), max(POST_MIN_BLOCK_D, min(POST_MAX_BLOCK_D, want)))
    hc_pad = max(2, triton.next_power_of_2(hc))
    _post_kernel[(tokens, triton.cdiv(hidden, block_d))](
        out, x, post, comb, new,
        hidden,
        *out.stride(), *x.stride(), *post.stride(), *comb.stride(),
        HC=hc, HC_PAD=hc_pad, BLOCK_D=block_d,
        num_warps=max(1, min(8, hc_pad * block_d // POST_ELEMS_PER_WARP)), **launch_options(x.device),
    )
    return new


_MIXES = f"split-K tensor-core GEMM (fn as 3 bf16 terms for bf16 x, tf32x3 otherwise) of x (own dtype) by fn + sum of squares, at most {MIX_MAX_PARTS} partials"
mhc_pre.impl = f"triton: 2 launches: {_MIXES}; one program per (token, channel chunk): rms, sigmoid / softmax, Sinkhorn in registers, collapse"
mhc_pre_delayed.impl = f"triton: 2 launches as mhc_pre ({_MIXES}; coefficients + collapse with pre_in per token)"
mhc_head.impl = f"triton: 2 launches: {_MIXES}; per-token sigmoid weights + collapse"
mhc_collapse.impl = "triton: one program per (token, channel chunk), float32 sum over hc, one rounding"
mhc_post.impl = "triton: one elementwise kernel, post * out + comb^T x in float32, one rounding"

OPS = {
    "mhc_pre": mhc_pre,
    "mhc_pre_delayed": mhc_pre_delayed,
    "mhc_head": mhc_head,
    "mhc_collapse": mhc_collapse,
    "mhc_post": mhc_post,
}
