"""Mixture-of-experts kernels: fused routing and grouped-GEMM experts (Triton, sm_90 / sm_100).

``moe_route``: two launches. The float32 gate logits: up to ROUTE_GEMV_MAX_TOKENS tokens a Triton
GEMV that reads x in its own dtype (widened in registers) and writes partial sums over blocks of
channels, one load step per program, so that the whole weight is in flight at once (decode: one
launch where torch took a cast of x and cuBLAS's float32 GEMV, two or three). Beyond that,
torch's float32 GEMM, as the reference computes them (bit-identical). Both accumulate in float32;
the GEMV sums in another order, so its logits can differ from the reference's in the last bits (a
routing decision can then differ only at a near-tie, which the contract leaves free). Then ONE
Triton program per token does everything else: it adds the partials in order, and holds the row
as a [groups, experts per group] tile: scoring (sigmoid / softmax), correction bias, group scores
(sum of the top-2 biased scores for noaux_tc, max score for group_limited_greedy), the
topk_group best groups, top-k by iterative argmax (ties: lowest expert id), the gather of the
unbiased weights, renormalisation and scaling.

``moe_route_sqrtsoftplus`` (DeepSeek-V4): s = sqrt(softplus(logits)). Top-k layers: the same gate
logits (``gate_partials``), then one program per token (s, + bias, top-k by iterative argmax,
ties to the lowest id, renormalisation and scaling). Hash layers (``fixed_ids``): one launch, a
program per token that gathers only its k gate rows and dots them with x in float32 (k x D
reads instead of E x D, and no top-k). softplus is max(z, 0) + log1p(exp(-|z|)), so s keeps its
relative accuracy at very negative logits.

``moe_experts_clamped`` (DeepSeek-V4): ``moe_experts``' pass below with the clamp of V4's SwiGLU
(silu(min(gate, limit)) * clamp(up, -limit, limit)) in GEMM 1's epilogue, behind the CLAMP
constexpr (``moe_experts`` compiles without it) with ``limit`` a runtime float (one compile for
every limit). Triton only: DeepGEMM's provider (``deepgemm.py``) wraps ``moe_experts`` alone.

``moe_experts``: no per-expert loop and no host synchronisation (CUDA-graph safe):

1. align: the T*k (token, slot) pairs are grouped by expert, each expert's segment padded to a
   multiple of BLOCK_M, giving ``sorted_pairs`` (padding = the sentinel T*k), the expert of every
   M-block and the number of padded rows. Buffers have the shape-derived upper bound
   ``T*k + min(T*k, E) * (BLOCK_M - 1)`` rows. Up to ALIGN_SINGLE_PROGRAM_MAX_PAIRS pairs one
   program does it all (one launch at decode); beyond, three parallel launches (per-chunk expert
   counts, a one-program prefix over chunks, a per-chunk scatter). Deterministic: pairs keep
   their (token, slot) order inside each expert.
2. grouped GEMM 1: one program per (M-block, column tile) gathers its pairs' x rows and
   multiplies them by the gate rows AND the up rows of w13[e] in the same K loop, writing
   silu(gate) * up [T*k, I] (fused SwiGLU). M-blocks past the padded count exit at once.
3. grouped GEMM 2: h @ w2[e]^T times the pair's routing weight -> [T*k, D] in x's dtype.
4. a fixed-order float32 sum over the k slots -> [T, D] in x's dtype (no atomics; ``sum_slots``,
   which DeepGEMM's path uses too, its rows gathered and weighted).

Block-FP8 experts (float8_e4m3fn weights, float32 scales per [bn, bk] block): the K loop steps
BLOCK_K | bk channels, so each partial product has one weight scale per output column and is
rescaled in float32 before it joins the accumulator. Two numeric modes:

* W8A16 (default): the FP8 weight tile is widened to the activation dtype in registers (exact:
  every e4m3 value is a bf16 value) and multiplied by the unquantised activations. The weight
  stream, which is what decode is bound by, stays 1 byte per element.
* W8A8 (``FP8_W8A8_MIN_BLOCK_M``): each activation tile [BLOCK_M, bk] is quantised per row
  (scale = amax / 448), multiplied on the FP8 tensor cores (e4m3 x e4m3 -> fp32) and rescaled by
  a_scale[row] * w_scale[col]; h is quantised the same way in GEMM 2. Twice the MMA rate, but
  against the dequantising reference its error through the two GEMMs is max |err| / (1 + |ref|)
  ~ 0.04 at the spec's tiny FP8 case and 0.10-0.18 at V3 dims in bf16. moe_experts' FP8
  tolerance (``tolerance_fp8``, atol 0.2, rtol 5e-2) was set for DeepGEMM's W8A8 (0.05-0.10
  emulated at the kit's shapes); this mode stays off by default: it was slower than W8A16 where
  measured, and prefill-sized FP8 calls go to DeepGEMM where it is installed (``deepgemm.py``).

Triton's interpreter rounds float32 -> float8 wrongly (mantissa carries are lost), so under
TRITON_INTERPRET the e4m3 quantisation is done in float32 arithmetic (``fp8_linear.round_to_e4m3``)
and the dot runs on the float32 values of the e4m3 grid (same numerics). It also cannot loop to a
runtime bound, hence while loops (align) and constexpr loop bounds (GEMM K loops, top-k).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from deepinfer_core.ops.moe import SCORING_FUNCS, TOPK_METHODS
from deepinfer_nvidia_sm100.kernels.device import await_inputs, launch_options, num_sms
from deepinfer_nvidia_sm100.kernels.fp8_linear import E4M3_MAX, invariant_linear, round_to_e4m3

# ---- tunables (sweep on the GPU) -------------------------------------------------------------
ROUTE_ELEMS_PER_WARP = 256  # a routing row of BLOCK_G * BLOCK_S experts gets this many per warp
# Gate logits: the Triton GEMV (_gate_partials_kernel) up to this many tokens and products T x E x D,
# torch's float32 GEMM beyond. H200, graph replays with L2-cold inputs (benchmarks/kernels.py, the
# moe_route cases beside their torch-gate peer), gate + routing kernel: V2-Lite's gate (D 2048,
# E 64) 4.4 / 4.7 / 5.1 / 8.2 us at T = 1 / 8 / 16 / 64 against 9.9 / 14.1 / 14.6 / 15.4 us;
# V3's (D 7168, E 256) 9.4 / 14.2 / 20.8 us at T = 1 / 8 / 16 against 13.1 / 29.6 / 29.6 us, but
# 60.9 against 27.6 us at T = 64 (117M products; the GEMV's programs re-read the weight per 4 tokens).
ROUTE_GEMV_MAX_TOKENS = 64
ROUTE_GEMV_MAX_PRODUCTS = 32 << 20
# A GEMV program: GATE_BLOCK_T tokens (fewer when there are fewer) x up to GATE_MAX_BLOCK_E experts
# x GATE_BLOCK_D channels, products held as one float32 tile (4 x 4 x 512 = 64 registers a thread).
GATE_BLOCK_T = 4
GATE_MAX_BLOCK_E = 4
GATE_BLOCK_D = 512
GATE_NUM_WARPS = 4
INTERPRETER_SMS = 4  # "SM count" under TRITON_INTERPRET: small, so that tests see several experts per program
# V4 hash layers (moe_route_sqrtsoftplus with fixed ids): a program per token gathers its k gate
# rows, BLOCK_D channels per step.
HASH_ROUTE_BLOCK_D = 512
HASH_ROUTE_NUM_WARPS = 4


class ExpertTiles(NamedTuple):
    block_m: int  # pairs per M-block (the align padding unit)
    block_n_up: int  # GEMM 1: columns of gate (and as many of up) per program
    block_n_down: int  # GEMM 2: output columns per program
    block_k: int  # K step (with FP8 weights: lowered to a divisor of bk)
    num_warps: int
    num_stages: int


# Chosen by the average number of pairs per active expert, T*k / min(T*k, E): decode has one or
# two (stream the weights with narrow M), prefill of 4096 tokens about 128 at V3 (compute-bound).
EXPERT_TILES: tuple[tuple[float, ExpertTiles], ...] = (
    (16, ExpertTiles(16, 64, 64, 128, 4, 4)),
    (32, ExpertTiles(32, 64, 64, 128, 4, 4)),
    (96, ExpertTiles(64, 64, 128, 64, 4, 3)),
    (float("inf"), ExpertTiles(128, 64, 128, 64, 8, 3)),
)
EXPERT_GROUP_M = 8  # grouped program order: GROUP_M M-blocks sweep the column tiles together
# FP8 experts use W8A8 from this BLOCK_M on (None: never; W8A16 everywhere, see module doc).
FP8_W8A8_MIN_BLOCK_M: int | None = None
EXPERT_SMEM_BUDGET = 160 * 1024  # bytes of pipelined tiles per program; num_stages is lowered to fit
ALIGN_SINGLE_PROGRAM_MAX_PAIRS = 128  # up to this many pairs the align is one program (its loops are serial)
ALIGN_SINGLE_BLOCK_N = 64  # pairs per step of that program (one-hot [BLOCK_N, BLOCK_E] in registers)
ALIGN_BLOCK_N = 128  # pairs per program of the chunked align
ALIGN_BLOCK_C = 32  # chunks per step of the prefix program
ALIGN_BLOCK_B = 64  # M-blocks per step when writing the expert of each M-block
ALIGN_NUM_WARPS = 8
# Up to this many tokens, by expert weight dtype, the model runs the shared experts as extra
# experts of this op's grouped pass (deepinfer_core.ops.moe.moe_experts' shared_expert_max_tokens):
# the shared weights stream at the grouped GEMM's rate instead of through cuBLAS's bf16 GEMVs, with
# no SwiGLU and add of their own. Measured through LLM.generate on an H200
# (benchmarks/shared_fusion.py, two runs): V2-Lite (bf16) decode steps 0.90-0.99x at B=1..16,
# 0.98-1.12x at B=32..64; the V3 slice (FP8 experts, whose shared expert runs the Triton FP8 GEMV
# apart) 1.05-1.06x at B=1, 0.99-1.04x at B=4 and no gain above, hence not for FP8. Only the
# H200 (sm_90) was measured, and neither fp16 nor a bf16 model of V3's 256 experts.
SHARED_EXPERT_MAX_TOKENS = {torch.bfloat16: 16, torch.float16: 16}
SUM_BLOCK_D = 1024  # slot sum: hidden columns per program
SUM_NUM_WARPS = 4


# ============================================================================================
# Routing
# ============================================================================================


@triton.jit
def _moe_route_kernel(
    parts_ptr, bias_ptr, weights_ptr, ids_ptr,
    num_experts, group_size, n_group, scaling, part_stride,
    NUM_PARTS: tl.constexpr,  # the gate logits are the sum of this many partials (gate_partials), in order
    TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr,
    N_SHARED: tl.constexpr, BLOCK_SH: tl.constexpr,  # slots appended to each row: ids num_experts.., weight 1 (the shared experts)
    SOFTMAX: tl.constexpr,  # scoring: softmax (True) or sigmoid (False)
    METHOD: tl.constexpr,  # 0 noaux_tc, 1 greedy, 2 group_limited_greedy
    HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    await_inputs(PDL)
    NEG: tl.constexpr = float("-inf")
    row = tl.program_id(0).to(tl.int64)
    gidx = tl.arange(0, BLOCK_G)
    jidx = tl.arange(0, BLOCK_S)
    valid = (gidx[:, None] < n_group) & (jidx[None, :] < group_size)
    expert = gidx[:, None] * group_size + jidx[None, :]  # [BLOCK_G, BLOCK_S]
    logits = tl.load(parts_ptr + row * num_experts + expert, mask=valid, other=NEG)
    for part in tl.static_range(1, NUM_PARTS):
        logits += tl.load(parts_ptr + part * part_stride + row * num_experts + expert, mask=valid, other=0.0)
    if SOFTMAX:
        top = tl.max(tl.max(logits, axis=1), axis=0)
        p = tl.where(valid, tl.exp(logits - top), 0.0)
        scores = p / tl.sum(tl.sum(p, axis=1), axis=0)
    else:
        scores = tl.where(valid, 1.0 / (1.0 + tl.exp(-logits)), 0.0)

    if METHOD == 1:  # greedy: plain top-k of the scores
        select = tl.where(valid, scores, NEG)
        source = scores
    else:
        if METHOD == 0:  # noaux_tc: groups ranked by the sum of their top-2 biased scores
            choice = scores
            if HAS_BIAS:
                choice += tl.load(bias_ptr + expert, mask=valid, other=0.0)
            choice = tl.where(valid, choice, NEG)
            top1 = tl.max(choice, axis=1)
            first = tl.min(tl.where(choice == top1[:, None], jidx[None, :], BLOCK_S), axis=1)
            top2 = tl.max(tl.where(jidx[None, :] == first[:, None], NEG, choice), axis=1)
            group_score = tl.where(group_size > 1, top1 + top2, top1)
        else:  # group_limited_greedy: groups ranked by their max score
            group_score = tl.max(tl.where(valid, scores, NEG), axis=1)
        gvalid = gidx < n_group
        keep = gidx < 0
        for _ in tl.static_range(TOPK_GROUP):
            cand = tl.where(keep | ~gvalid, NEG, group_score)
            best = tl.max(cand, axis=0)
            pick = tl.min(tl.where((cand == best) & ~keep & gvalid, gidx, BLOCK_G), axis=0)
            keep = keep | (gidx == pick)
        if METHOD == 0:
            select = tl.where(keep[:, None], choice, NEG)
            source = scores
        else:  # the reference zeroes the other groups' scores and takes top-k of that
            source = tl.where(keep[:, None], scores, 0.0)
            select = tl.where(valid, source, NEG)

    # top-k by iterative argmax; `taken` (not -inf) marks chosen experts, so that -inf entries
    # (experts of dropped groups) can still be chosen when k exceeds the kept experts.
    taken = ~valid
    slots = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for i in tl.static_range(TOP_K):
        cand = tl.where(taken, NEG, select)
        best = tl.max(tl.max(cand, axis=1), axis=0)
        hit = (cand == best) & ~taken
        pick = tl.min(tl.min(tl.where(hit, expert, BLOCK_G * BLOCK_S), axis=1), axis=0)
        chosen = expert == pick
        taken = taken | chosen
        wi = tl.sum(tl.sum(tl.where(chosen, source, 0.0), axis=1), axis=0)
        w = tl.where(slots == i, wi, w)
        ids = tl.where(slots == i, pick, ids)
    if RENORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    base = row * (TOP_K + N_SHARED)
    tl.store(weights_ptr + base + slots, w * scaling, mask=slots < TOP_K)
    tl.store(ids_ptr + base + slots, ids.to(tl.int64), mask=slots < TOP_K)
    if N_SHARED > 0:
        j = tl.arange(0, BLOCK_SH)
        tl.store(weights_ptr + base + TOP_K + j, tl.full([BLOCK_SH], 1.0, tl.float32), mask=j < N_SHARED)
        tl.store(ids_ptr + base + TOP_K + j, num_experts + j.to(tl.int64), mask=j < N_SHARED)


@triton.jit(do_not_specialize=["s_op"])  # T x E: one compile, not one per value class
def _gate_partials_kernel(x_ptr, w_ptr, out_ptr, num_tokens, num_experts, hidden, s_xt, s_xd, s_we, s_wd, s_op,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Program (expert block, channel block, token block): the float32 partial gate logits of its
    BLOCK_D channels, out[channel block, t, e] = sum_d x[t, d] w[e, d] (x widened in registers):
    one load of each operand and one reduction, no loop, so every load of the GEMV is in flight at
    once instead of one channel step after another."""
    await_inputs(PDL)
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    e_ok, d_ok, t_ok = e < num_experts, d < hidden, t < num_tokens
    xs = tl.load(x_ptr + t.to(tl.int64)[:, None] * s_xt + d[None, :] * s_xd, mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    ws = tl.load(w_ptr + e.to(tl.int64)[:, None] * s_we + d[None, :] * s_wd, mask=e_ok[:, None] & d_ok[None, :], other=0.0)
    part = tl.sum(xs.to(tl.float32)[:, None, :] * ws.to(tl.float32)[None, :, :], axis=2)
    out = out_ptr + tl.program_id(1) * s_op
    tl.store(out + t[:, None] * num_experts + e[None, :], part, mask=t_ok[:, None] & e_ok[None, :])


def gate_partials(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """The float32 gate logits x @ gate_weight^T as partial sums [P, T, E] over P channel blocks, to
    be added in order: the Triton GEMV up to ROUTE_GEMV_MAX_TOKENS tokens and
    ROUTE_GEMV_MAX_PRODUCTS products (x read in its own dtype), torch's float32 GEMM beyond (P = 1,
    the reference's logits)."""
    num_tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    if gate_weight.shape[1] != hidden:
        raise ValueError(f"moe_route: the gate weight is {tuple(gate_weight.shape)} but the tokens have {hidden} "
                         f"channels; it must be [num_experts, {hidden}]")
    if num_tokens > ROUTE_GEMV_MAX_TOKENS or num_tokens * num_experts * hidden > ROUTE_GEMV_MAX_PRODUCTS:
        return F.linear(x.float(), gate_weight.float())[None]  # as the reference: bit-identical logits
    block_t = min(GATE_BLOCK_T, triton.next_power_of_2(num_tokens))
    block_d = min(GATE_BLOCK_D, triton.next_power_of_2(hidden))
    tiles = triton.cdiv(hidden, block_d) * triton.cdiv(num_tokens, block_t)
    # the most experts per program (up to GATE_MAX_BLOCK_E) that still give every SM a program
    block_e = GATE_MAX_BLOCK_E
    while block_e > 1 and triton.cdiv(num_experts, block_e) * tiles < num_sms(x.device, INTERPRETER_SMS):
        block_e //= 2
    grid = (triton.cdiv(num_experts, block_e), triton.cdiv(hidden, block_d), triton.cdiv(num_tokens, block_t))
    parts = torch.empty((grid[1], num_tokens, num_experts), dtype=torch.float32, device=x.device)
    _gate_partials_kernel[grid](
        x, gate_weight, parts, num_tokens, num_experts, hidden, *x.stride(), *gate_weight.stride(), parts.stride(0),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_D=block_d, num_warps=GATE_NUM_WARPS, **launch_options(x.device),
    )
    return parts


def moe_route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    shared_experts: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose top_k experts per token. Returns (weights [T, k] float32, ids [T, k] int64).

    Contract: deepinfer_core.ops.moe.moe_route. Ties between equal selection scores go to the
    lowest expert id; the k slots come in selection order. ``shared_experts`` = n > 0 (this
    callable's ``appends_shared_experts``): each row gets n more slots, ids E .. E + n - 1 and
    weight 1 (E = the gate's experts), as ``MoE.fuse_shared`` appends them: [T, k + n], in the
    same launch instead of two concatenations.
    """
    return _route(x, gate_weight, correction_bias, gate_partials, top_k=top_k, scoring_func=scoring_func, topk_method=topk_method,
                  n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                  routed_scaling_factor=routed_scaling_factor, shared_experts=shared_experts)


def invariant_moe_route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_route``, batch-invariant: the float32 gate logits from the batch-invariant GEMM."""
    return _route(x, gate_weight, correction_bias, lambda a, w: invariant_linear(a.float(), w.float())[None], top_k=top_k,
                  scoring_func=scoring_func, topk_method=topk_method, n_group=n_group, topk_group=topk_group,
                  norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)


def _route(x, gate_weight, correction_bias, parts_of, *, top_k: int, scoring_func: str, topk_method: str, n_group: int,
           topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
           shared_experts: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing kernel after ``parts_of(x, gate_weight)`` made the float32 gate logits as
    partial sums [P, T, E] (``gate_partials``; P = 1: the logits), with ``shared_experts`` slots
    appended to each row."""
    if shared_experts < 0:
        raise ValueError(f"shared_experts must be >= 0, not {shared_experts}")
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func {scoring_func!r} is not supported; expected one of {SCORING_FUNCS}")
    if topk_method not in TOPK_METHODS:
        raise ValueError(f"topk_method {topk_method!r} is not supported; expected one of {TOPK_METHODS}")
    num_tokens, num_experts = x.shape[0], gate_weight.shape[0]
    grouped = topk_method != "greedy"
    if grouped and (n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group):
        raise ValueError(
            f"{topk_method} needs experts ({num_experts}) divisible by n_group ({n_group}) "
            f"and 1 <= topk_group ({topk_group}) <= n_group"
        )
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k ({top_k}) must be between 1 and the number of experts ({num_experts})")
    weights = torch.empty((num_tokens, top_k + shared_experts), dtype=torch.float32, device=x.device)
    ids = torch.empty((num_tokens, top_k + shared_experts), dtype=torch.int64, device=x.device)
    if num_tokens == 0:
        return weights, ids
    parts = parts_of(x, gate_weight)
    groups = n_group if grouped else 1
    group_size = num_experts // groups
    has_bias = topk_method == "noaux_tc" and correction_bias is not None
    bias = correction_bias.float().contiguous() if has_bias else parts
    block_g, block_s = triton.next_power_of_2(groups), triton.next_power_of_2(group_size)
    _moe_route_kernel[(num_tokens,)](
        parts, bias, weights, ids,
        num_experts, group_size, groups, float(routed_scaling_factor), num_tokens * num_experts,
        NUM_PARTS=parts.shape[0],
        TOP_K=top_k, TOPK_GROUP=topk_group if grouped else 1,
        N_SHARED=shared_experts, BLOCK_SH=triton.next_power_of_2(max(1, shared_experts)),
        SOFTMAX=scoring_func == "softmax",
        METHOD=TOPK_METHODS.index(topk_method),
        HAS_BIAS=has_bias, RENORM=topk_method == "noaux_tc" and norm_topk_prob,
        BLOCK_G=block_g, BLOCK_S=block_s, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=max(1, min(8, block_g * block_s // ROUTE_ELEMS_PER_WARP)), **launch_options(parts.device),
    )
    return weights, ids


_ROUTE_PROGRAM = "one fused program per token (scores, bias, group top-k, top-k argmax, renorm)"
moe_route.appends_shared_experts = True  # accepts shared_experts=n (MoE.fuse_shared's slots, no concatenation)
moe_route.impl = (f"triton: gate GEMV from x's own dtype up to {ROUTE_GEMV_MAX_TOKENS} tokens and "
                  f"{ROUTE_GEMV_MAX_PRODUCTS >> 20}M products (cuBLAS float32 beyond), "
                  f"then {_ROUTE_PROGRAM}")
assert TOPK_METHODS == ("noaux_tc", "greedy", "group_limited_greedy")  # METHOD codes of the kernel


# ---- DeepSeek-V4 routing: sqrt(softplus) scores, top-k of s + bias, or the hash layers' fixed ids ----


@triton.jit
def _sqrt_softplus(z, LIBDEVICE: tl.constexpr):
    """sqrt(softplus(z)) in float32, softplus as max(z, 0) + log1p(exp(-|z|)) (torch's threshold 20
    lands on z itself too: log1p(exp(-20)) is below half an ulp of 20), so s keeps its relative
    accuracy down to large negative logits, where log(1 + exp(z)) would round to 0. log1p is
    CUDA's (LIBDEVICE) or, in the interpreter (no libdevice), log(1 + u) * u / ((1 + u) - 1),
    exact to float32 where 1 + u rounds."""
    u = tl.exp(-tl.abs(z))
    if LIBDEVICE:
        log1p = libdevice.log1p(u)
    else:
        v = 1.0 + u
        log1p = tl.where(v == 1.0, u, tl.log(v) * (u / tl.where(v == 1.0, 1.0, v - 1.0)))
    return tl.sqrt_rn(tl.maximum(z, 0.0) + log1p)


@triton.jit
def _store_route(weights_ptr, ids_ptr, row, w, ids, slots, scaling, TOP_K: tl.constexpr, RENORM: tl.constexpr):
    """One token's k slots: w renormalised (+1e-20) when RENORM, times scaling; ids as int64."""
    w = tl.where(slots < TOP_K, w, 0.0)
    if RENORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    tl.store(weights_ptr + row * TOP_K + slots, w * scaling, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, ids.to(tl.int64), mask=slots < TOP_K)


@triton.jit(do_not_specialize=["part_stride"])  # T x E: one compile, not one per value class
def _sqrtsoftplus_topk_kernel(
    parts_ptr, bias_ptr, weights_ptr, ids_ptr,
    num_experts, scaling, part_stride,
    NUM_PARTS: tl.constexpr, TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
    LIBDEVICE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """One token: its logits (the gate partials added in order), s = sqrt(softplus), top-k of
    s + bias by iterative argmax (ties: lowest expert id), the weights s at the chosen ids."""
    await_inputs(PDL)
    NEG: tl.constexpr = float("-inf")
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    logits = tl.load(parts_ptr + row * num_experts + e, mask=valid, other=0.0)
    for part in tl.static_range(1, NUM_PARTS):
        logits += tl.load(parts_ptr + part * part_stride + row * num_experts + e, mask=valid, other=0.0)
    scores = _sqrt_softplus(logits, LIBDEVICE)
    select = scores
    if HAS_BIAS:
        select += tl.load(bias_ptr + e, mask=valid, other=0.0)
    taken = ~valid
    slots = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for i in tl.static_range(TOP_K):
        cand = tl.where(taken, NEG, select)
        best = tl.max(cand, axis=0)
        pick = tl.min(tl.where((cand == best) & ~taken, e, BLOCK_E), axis=0)
        chosen = e == pick
        taken = taken | chosen
        w = tl.where(slots == i, tl.sum(tl.where(chosen, scores, 0.0), axis=0), w)
        ids = tl.where(slots == i, pick, ids)
    _store_route(weights_ptr, ids_ptr, row, w, ids, slots, scaling, TOP_K, RENORM)


@triton.jit
def _sqrtsoftplus_fixed_kernel(
    x_ptr, gate_ptr, fixed_ptr, weights_ptr, ids_ptr,
    scaling, s_xt, s_xd, s_ge, s_gd, s_ft, s_fk,
    HIDDEN: tl.constexpr, TOP_K: tl.constexpr, RENORM: tl.constexpr, LIBDEVICE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """One token of a hash layer: the float32 logits of its k given experts only (their gate rows
    gathered, x and the rows widened in registers), s = sqrt(softplus) at them, the weights."""
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_K)
    slot_ok = slots < TOP_K
    ids = tl.load(fixed_ptr + row * s_ft + slots * s_fk, mask=slot_ok, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    for d0 in range(0, HIDDEN, BLOCK_D):
        d_ok = (d0 + d) < HIDDEN
        xs = tl.load(x_ptr + row * s_xt + (d0 + d) * s_xd, mask=d_ok, other=0.0)
        ws = tl.load(gate_ptr + ids[:, None] * s_ge + (d0 + d)[None, :] * s_gd, mask=slot_ok[:, None] & d_ok[None, :], other=0.0)
        acc += xs.to(tl.float32)[None, :] * ws.to(tl.float32)
    scores = _sqrt_softplus(tl.sum(acc, axis=1), LIBDEVICE)
    _store_route(weights_ptr, ids_ptr, row, scores, ids, slots, scaling, TOP_K, RENORM)


def moe_route_sqrtsoftplus(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    fixed_ids: torch.Tensor | None,
    *,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 routing. Returns (weights [T, k] float32, ids [T, k] int64).

    Contract: deepinfer_core.ops.moe.moe_route_sqrtsoftplus. Without ``fixed_ids``: the gate
    logits as ``moe_route``'s (``gate_partials``), then one program per token (scores, bias,
    top-k by iterative argmax, ties to the lowest expert id; the slots in selection order). With
    ``fixed_ids`` (hash layers): one launch, one program per token computing only its k logits
    from the gathered gate rows (k x D reads instead of E x D); ids are ``fixed_ids`` in their
    order, which must lie in [0, E) (not checked: that would synchronise).
    """
    num_tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    if gate_weight.shape[1] != hidden:
        raise ValueError(f"moe_route_sqrtsoftplus: the gate weight is {tuple(gate_weight.shape)} but the tokens have "
                         f"{hidden} channels; it must be [num_experts, {hidden}]")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k ({top_k}) must be between 1 and the number of experts ({num_experts})")
    if fixed_ids is not None and tuple(fixed_ids.shape) != (num_tokens, top_k):
        raise ValueError(f"fixed_ids is {tuple(fixed_ids.shape)}; it must be [tokens, top_k] = [{num_tokens}, {top_k}]")
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=x.device)
    if num_tokens == 0:
        return weights, ids
    block_k = triton.next_power_of_2(top_k)
    if fixed_ids is not None:
        _sqrtsoftplus_fixed_kernel[(num_tokens,)](
            x, gate_weight, fixed_ids, weights, ids, float(routed_scaling_factor),
            *x.stride(), *gate_weight.stride(), *fixed_ids.stride(),
            HIDDEN=hidden, TOP_K=top_k, RENORM=bool(norm_topk_prob), LIBDEVICE=x.is_cuda,
            BLOCK_K=block_k, BLOCK_D=min(HASH_ROUTE_BLOCK_D, triton.next_power_of_2(hidden)),
            num_warps=HASH_ROUTE_NUM_WARPS, **launch_options(x.device),
        )
        return weights, ids
    parts = gate_partials(x, gate_weight)
    has_bias = correction_bias is not None
    block_e = triton.next_power_of_2(num_experts)
    _sqrtsoftplus_topk_kernel[(num_tokens,)](
        parts, correction_bias.float().contiguous() if has_bias else parts, weights, ids,
        num_experts, float(routed_scaling_factor), num_tokens * num_experts,
        NUM_PARTS=parts.shape[0], TOP_K=top_k, HAS_BIAS=has_bias, RENORM=bool(norm_topk_prob), LIBDEVICE=x.is_cuda,
        BLOCK_E=block_e, BLOCK_K=block_k,
        num_warps=max(1, min(8, block_e // ROUTE_ELEMS_PER_WARP)), **launch_options(parts.device),
    )
    return weights, ids


moe_route_sqrtsoftplus.impl = (f"triton: gate logits as moe_route's, then one program per token (sqrt-softplus, "
                               f"bias, top-k argmax, renorm); hash layers: one launch, only the k given experts' "
                               f"gate rows per token")


# ============================================================================================
# Align: pairs grouped by expert, padded to BLOCK_M
# ============================================================================================


@triton.jit
def _expert_histogram(ids, valid, BLOCK_E: tl.constexpr):
    """Counts [BLOCK_E] of each expert id among the valid entries of ids [BLOCK_N]."""
    hit = (ids[:, None] == tl.arange(0, BLOCK_E)[None, :]) & valid[:, None]
    return tl.sum(hit.to(tl.int32), axis=0)


@triton.jit
def _rank_in_chunk(ids, BLOCK_N: tl.constexpr):
    """For each entry, how many earlier entries of the chunk have the same expert id."""
    i = tl.arange(0, BLOCK_N)
    same = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])
    return tl.sum(same.to(tl.int32), axis=1)


@triton.jit
def _write_layout(counts, sorted_ptr, block_expert_ptr, num_padded_ptr, num_experts, max_blocks, sentinel,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """From the per-expert pair counts: the padded row count, the sentinels of the padding rows
    and the expert of every M-block. Returns each expert's first row."""
    e = tl.arange(0, BLOCK_E)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    # Padding rows: [start + count, start + padded) of each expert (fewer than BLOCK_M).
    for j0 in tl.static_range(0, BLOCK_M, 16):
        j = j0 + tl.arange(0, 16)
        pad = counts[:, None] + j[None, :]
        tl.store(sorted_ptr + starts[:, None] + pad, tl.zeros_like(pad) + sentinel, mask=pad < padded[:, None])
    # Expert of M-block b: the number of experts whose segment ends at or before row b*BLOCK_M.
    # Blocks past the padded count get num_experts; the GEMMs never read them.
    b0 = 0
    while b0 < max_blocks:
        b = b0 + tl.arange(0, BLOCK_B)
        before = (ends[None, :] <= b[:, None] * BLOCK_M) & (e[None, :] < num_experts)
        tl.store(block_expert_ptr + b, tl.sum(before.to(tl.int32), axis=1), mask=b < max_blocks)
        b0 += BLOCK_B
    return starts


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])  # per-step sizes: one compile, not one per value class
def _align_single_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, num_experts, max_blocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr,
):
    await_inputs(PDL)
    counts = tl.zeros([BLOCK_E], tl.int32)
    n0 = 0
    while n0 < num_pairs:
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
        counts += _expert_histogram(ids, valid, BLOCK_E)
        n0 += BLOCK_N
    cursor = _write_layout(counts, sorted_ptr, block_expert_ptr, num_padded_ptr, num_experts, max_blocks,
                           num_pairs, BLOCK_M, BLOCK_E, BLOCK_B)
    e = tl.arange(0, BLOCK_E)
    n0 = 0
    while n0 < num_pairs:
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
        hit = (ids[:, None] == e[None, :]) & valid[:, None]
        base = tl.sum(tl.where(hit, cursor[None, :], 0), axis=1)
        tl.store(sorted_ptr + base + _rank_in_chunk(ids, BLOCK_N), offs, mask=valid)
        cursor += tl.sum(hit.to(tl.int32), axis=0)
        n0 += BLOCK_N


@triton.jit(do_not_specialize=["num_pairs"])  # per-step sizes: one compile, not one per value class
def _align_count_kernel(ids_ptr, chunk_counts_ptr, num_pairs, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    chunk = tl.program_id(0)
    offs = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
    tl.store(chunk_counts_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), _expert_histogram(ids, valid, BLOCK_E))


@triton.jit(do_not_specialize=["num_chunks", "num_pairs", "max_blocks"])  # per-step sizes: one compile, not one per value class
def _align_prefix_kernel(
    chunk_counts_ptr, chunk_base_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_chunks, num_pairs, num_experts, max_blocks,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr,
):
    await_inputs(PDL)
    e = tl.arange(0, BLOCK_E)
    totals = tl.zeros([BLOCK_E], tl.int32)
    c0 = 0
    while c0 < num_chunks:
        c = c0 + tl.arange(0, BLOCK_C)
        tile = tl.load(chunk_counts_ptr + c[:, None] * BLOCK_E + e[None, :], mask=(c < num_chunks)[:, None], other=0)
        totals += tl.sum(tile, axis=0)
        c0 += BLOCK_C
    carry = _write_layout(totals, sorted_ptr, block_expert_ptr, num_padded_ptr, num_experts, max_blocks,
                          num_pairs, BLOCK_M, BLOCK_E, BLOCK_B)
    # chunk_base[c, e] = first row of expert e + pairs of e in chunks before c.
    c0 = 0
    while c0 < num_chunks:
        c = c0 + tl.arange(0, BLOCK_C)
        inside = (c < num_chunks)[:, None]
        tile = tl.load(chunk_counts_ptr + c[:, None] * BLOCK_E + e[None, :], mask=inside, other=0)
        base = carry[None, :] + tl.cumsum(tile, axis=0) - tile
        tl.store(chunk_base_ptr + c[:, None] * BLOCK_E + e[None, :], base, mask=inside)
        carry += tl.sum(tile, axis=0)
        c0 += BLOCK_C


@triton.jit(do_not_specialize=["num_pairs"])  # per-step sizes: one compile, not one per value class
def _align_scatter_kernel(ids_ptr, chunk_base_ptr, sorted_ptr, num_pairs,
                          BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    chunk = tl.program_id(0)
    offs = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
    base = tl.load(chunk_base_ptr + chunk * BLOCK_E + ids, mask=valid, other=0)
    tl.store(sorted_ptr + base + _rank_in_chunk(ids, BLOCK_N), offs, mask=valid)


class ExpertLayout(NamedTuple):
    sorted_pairs: torch.Tensor  # [max_blocks * block_m] int32: pair index (token * k + slot) or the sentinel T*k
    block_expert: torch.Tensor  # [max_blocks] int32: expert of each M-block (valid below num_padded)
    num_padded: torch.Tensor  # [1] int32: rows in use (a multiple of block_m)
    max_blocks: int  # host-known bound on the M-blocks


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertLayout:
    """Group the (token, slot) pairs of topk_ids [T, k] by expert, each segment padded to block_m."""
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    max_blocks = (num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m
    dev = topk_ids.device
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    block_e = triton.next_power_of_2(num_experts)
    if num_pairs <= ALIGN_SINGLE_PROGRAM_MAX_PAIRS:
        _align_single_kernel[(1,)](
            ids, sorted_pairs, block_expert, num_padded, num_pairs, num_experts, max_blocks,
            BLOCK_M=block_m, BLOCK_N=max(16, min(ALIGN_SINGLE_BLOCK_N, triton.next_power_of_2(num_pairs))),
            BLOCK_E=block_e, BLOCK_B=ALIGN_BLOCK_B, num_warps=ALIGN_NUM_WARPS, **launch_options(ids.device),
        )
    else:
        chunks = triton.cdiv(num_pairs, ALIGN_BLOCK_N)
        chunk_counts = torch.empty((chunks, block_e), dtype=torch.int32, device=dev)
        chunk_base = torch.empty((chunks, block_e), dtype=torch.int32, device=dev)
        _align_count_kernel[(chunks,)](ids, chunk_counts, num_pairs, BLOCK_N=ALIGN_BLOCK_N, BLOCK_E=block_e,
                                       num_warps=ALIGN_NUM_WARPS, **launch_options(ids.device))
        _align_prefix_kernel[(1,)](
            chunk_counts, chunk_base, sorted_pairs, block_expert, num_padded,
            chunks, num_pairs, num_experts, max_blocks,
            BLOCK_M=block_m, BLOCK_C=ALIGN_BLOCK_C, BLOCK_E=block_e, BLOCK_B=ALIGN_BLOCK_B, num_warps=ALIGN_NUM_WARPS,
            **launch_options(ids.device),
        )
        _align_scatter_kernel[(chunks,)](ids, chunk_base, sorted_pairs, num_pairs, BLOCK_N=ALIGN_BLOCK_N,
                                         BLOCK_E=block_e, num_warps=ALIGN_NUM_WARPS, **launch_options(ids.device))
    return ExpertLayout(sorted_pairs, block_expert, num_padded, max_blocks)


# ============================================================================================
# Grouped expert GEMMs
# ============================================================================================


@triton.jit
def _quantize_rows(a, INTERPRET: tl.constexpr):
    """Per-row e4m3 quantisation of a [BLOCK_M, BLOCK_K] tile: (q, scale [BLOCK_M]) with a ~= q * scale."""
    a = a.to(tl.float32)
    amax = tl.max(tl.abs(a), axis=1)
    # IEEE divisions (Triton's `/` is approximate on the GPU): the same scale and the same e4m3
    # rounding as the torch emulation in the tests.
    scale = tl.where(amax > 0, tl.div_rn(amax, E4M3_MAX), 1.0)
    v = tl.clamp(tl.div_rn(a, scale[:, None]), -E4M3_MAX, E4M3_MAX)
    if INTERPRET:
        q = round_to_e4m3(v)
    else:
        q = v.to(tl.float8e4nv)
    return q, scale


@triton.jit
def _accumulate(acc, a, a_scale, w, w_scale,
                W_FP8: tl.constexpr, ACT_QUANT: tl.constexpr, INTERPRET: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ w with the FP8 scales applied (w_scale per column of this K step)."""
    if ACT_QUANT:  # a: e4m3 values (float8, or float32 on the e4m3 grid in the interpreter)
        if INTERPRET:
            part = tl.dot(a, w.to(tl.float32))
        else:
            part = tl.dot(a, w)
        return acc + part * a_scale[:, None] * w_scale[None, :]
    if IEEE:
        part = tl.dot(a, w.to(a.dtype), input_precision="ieee")
    else:
        part = tl.dot(a, w.to(a.dtype))
    if W_FP8:
        return acc + part * w_scale[None, :]
    return acc + part


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])  # per-step sizes: one compile, not one per value class
def _expert_gemm_kernel(
    a_ptr, w_ptr, ws_ptr, out_ptr, route_w_ptr,
    sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, a_row_div, num_m_blocks, limit,
    stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_se, stride_sn, stride_sk,
    stride_om, stride_on,
    N: tl.constexpr, K: tl.constexpr,  # output columns (I with GATED: gate and up are 2I rows of w)
    BN_SCALE: tl.constexpr, BK_SCALE: tl.constexpr,  # FP8 weight block (bn, bk)
    GATED: tl.constexpr,  # GEMM 1: gate and up tiles, store silu(gate) * up
    CLAMP: tl.constexpr,  # with GATED: V4's clamped SwiGLU, silu(min(gate, limit)) * clamp(up, -limit, limit)
    WEIGHTED: tl.constexpr,  # GEMM 2: multiply each row by its pair's routing weight
    W_FP8: tl.constexpr, ACT_QUANT: tl.constexpr, INTERPRET: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
):
    await_inputs(PDL)
    pid_m, pid_n = expert_tile_ids(num_m_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert, pair, row_ok, a_row, cols, col_ok = expert_tile_rows(pid_m, pid_n, block_expert_ptr, sorted_ptr, num_pairs, a_row_div,
                                                                 N, BLOCK_M, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_row[:, None] * stride_am + ks[None, :] * stride_ak
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if GATED:
        up_ptrs = w_ptrs + N * stride_wn
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if W_FP8:
        s_ptrs = ws_ptr + expert * stride_se + (cols // BN_SCALE) * stride_sn
        if GATED:
            s_up_ptrs = ws_ptr + expert * stride_se + ((cols + N) // BN_SCALE) * stride_sn
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        # Scales are per iteration only (1.0 where a mode has none), never loop-carried.
        a_scale = 1.0
        w_scale = 1.0
        if W_FP8:
            w_scale = tl.load(s_ptrs + (k0 // BK_SCALE) * stride_sk, mask=col_ok, other=0.0)
        if ACT_QUANT:
            a, a_scale = _quantize_rows(a, INTERPRET)
        acc = _accumulate(acc, a, a_scale, w, w_scale, W_FP8, ACT_QUANT, INTERPRET, IEEE)
        if GATED:
            w_up = tl.load(up_ptrs, mask=w_mask, other=0.0)
            w_scale_up = 1.0
            if W_FP8:
                w_scale_up = tl.load(s_up_ptrs + (k0 // BK_SCALE) * stride_sk, mask=col_ok, other=0.0)
            acc_up = _accumulate(acc_up, a, a_scale, w_up, w_scale_up, W_FP8, ACT_QUANT, INTERPRET, IEEE)
            up_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    if GATED:
        acc = swiglu(acc, acc_up, limit, CLAMP)
    store_expert_tile(acc, out_ptr, route_w_ptr, pair, row_ok, cols, col_ok, stride_om, stride_on, WEIGHTED)


@triton.jit
def expert_tile_ids(num_m_blocks, N: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(M block, N block) of this program of a grouped expert GEMM: GROUP_M M blocks share their
    N blocks in turn (L2 reuse of the weight tiles)."""
    pid = tl.program_id(0)
    tiles_n: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    return first_m + (pid % width) % group_rows, (pid % width) // group_rows


@triton.jit
def expert_tile_rows(pid_m, pid_n, block_expert_ptr, sorted_ptr, num_pairs, a_row_div,
                     N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's expert, its (token, slot) pairs and their validity, the activation row of each
    (GEMM 1: the pair's token, a_row_div = top_k; GEMM 2: the pair), its output columns."""
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, pair, pair < num_pairs, (pair // a_row_div).to(tl.int64), cols, cols < N


@triton.jit
def swiglu(gate, up, limit, CLAMP: tl.constexpr):
    """silu(gate) * up in float32; CLAMP: V4's silu(min(gate, limit)) * clamp(up, -limit, limit)
    (exact and continuous: the clamp adds no rounding of its own)."""
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.clamp(up, -limit, limit)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def store_expert_tile(acc, out_ptr, route_w_ptr, pair, row_ok, cols, col_ok, stride_om, stride_on, WEIGHTED: tl.constexpr):
    """Row r of the tile to row pair[r] of out (times its routing weight when WEIGHTED: GEMM 2)."""
    if WEIGHTED:
        acc = acc * tl.load(route_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, rows_ptr, w_ptr, hidden, stride_ym, stride_om,
                      TOP_K: tl.constexpr, BLOCK_D: tl.constexpr, GATHER: tl.constexpr, WEIGHTED: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < hidden
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in tl.static_range(TOP_K):  # fixed slot order: deterministic
        row = token * TOP_K + j
        if GATHER:
            row = tl.load(rows_ptr + row).to(tl.int64)
        y = tl.load(y_ptr + row * stride_ym + cols, mask=mask, other=0.0)
        if WEIGHTED:  # the expert output times its routing weight, rounded to y's dtype (as the reference)
            y = (y.to(tl.float32) * tl.load(w_ptr + token * TOP_K + j)).to(y_ptr.dtype.element_ty)
        acc += y.to(tl.float32)
    tl.store(out_ptr + token * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_slots(y: torch.Tensor, out: torch.Tensor, top_k: int, *, rows: torch.Tensor | None = None,
              weights: torch.Tensor | None = None) -> None:
    """out[t] = the float32 sum over slots j (in order) of y's row for pair t * top_k + j: that
    row itself, or rows[t * top_k + j] given ``rows`` [T * top_k] int32; each times the pair's
    routing weight (``weights`` [T * top_k] float32) and rounded to y's dtype first, if given."""
    num_tokens, hidden = out.shape
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden, SUM_BLOCK_D))](
        y, out, rows if rows is not None else y, weights if weights is not None else y,
        hidden, y.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_D=SUM_BLOCK_D, GATHER=rows is not None, WEIGHTED=weights is not None,
        num_warps=SUM_NUM_WARPS, **launch_options(y.device),
    )


def expert_tiles(num_pairs: int, num_experts: int) -> ExpertTiles:
    """Tiles for T*k pairs over E experts, from the average pairs per active expert."""
    per_expert = num_pairs / max(1, min(num_pairs, num_experts))
    return next(tiles for bound, tiles in EXPERT_TILES if per_expert <= bound)


def _fp8_block_k(block_k: int, bk: int, act_quant: bool) -> int:
    """The K step for FP8 weights: bk with W8A8 (activation scale groups), else a divisor of it."""
    step = bk if act_quant else min(block_k, bk)
    while step >= 16 and bk % step:
        step //= 2
    if step < 16 or step & (step - 1):
        raise ValueError(f"FP8 expert block bk={bk} needs a power-of-two K step >= 16 dividing it")
    return step


def _num_stages(tiles: ExpertTiles, block_n: int, block_k: int, a_bytes: int, w_bytes: int, gated: bool) -> int:
    """tiles.num_stages, lowered until the pipelined tiles fit EXPERT_SMEM_BUDGET (Triton keeps
    num_stages - 1 of them in shared memory; float32 inputs would otherwise overflow it)."""
    per_stage = tiles.block_m * block_k * a_bytes + (2 if gated else 1) * block_k * block_n * w_bytes
    stages = tiles.num_stages
    while stages > 2 and (stages - 1) * per_stage > EXPERT_SMEM_BUDGET:
        stages -= 1
    return stages


def _run_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, tiles: ExpertTiles,
                 act_quant: bool, limit: float | None = None) -> torch.Tensor:
    """The grouped expert pass; ``limit``: V4's clamped SwiGLU in GEMM 1's epilogue (None: plain SwiGLU)."""
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    num_pairs = num_tokens * top_k
    fp8 = w13_scale is not None
    if fp8:
        bn, bk = (int(v) for v in block)
        block_k = _fp8_block_k(tiles.block_k, bk, act_quant)
    else:
        bn, bk, block_k = 1, 1, tiles.block_k
        act_quant = False
        w13_scale = w2_scale = w13  # placeholders, never read
    layout = align_pairs(topk_ids, num_experts, tiles.block_m)
    route_w = topk_weights.reshape(-1).float()
    common = dict(
        BN_SCALE=bn, BK_SCALE=bk, W_FP8=fp8, ACT_QUANT=act_quant,
        INTERPRET=not x.is_cuda, IEEE=x.dtype == torch.float32,
        BLOCK_M=tiles.block_m, BLOCK_K=block_k, GROUP_M=EXPERT_GROUP_M, num_warps=tiles.num_warps,
        **launch_options(x.device),
    )
    a_bytes, w_bytes = x.element_size(), w13.element_size()

    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    grid = (layout.max_blocks * triton.cdiv(inter, tiles.block_n_up),)
    _expert_gemm_kernel[grid](
        x, w13, w13_scale, h, route_w,
        layout.sorted_pairs, layout.block_expert, layout.num_padded,
        num_pairs, top_k, layout.max_blocks, 0.0 if limit is None else float(limit),
        x.stride(0), x.stride(1),
        w13.stride(0), w13.stride(1), w13.stride(2),
        w13_scale.stride(0), w13_scale.stride(1), w13_scale.stride(2),
        h.stride(0), h.stride(1),
        N=inter, K=hidden, GATED=True, CLAMP=limit is not None, WEIGHTED=False, BLOCK_N=tiles.block_n_up,
        num_stages=_num_stages(tiles, tiles.block_n_up, block_k, a_bytes, w_bytes, True), **common,
    )

    # With one slot the weighted rows are the output itself; otherwise sum the slots after.
    y = out if top_k == 1 else torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    grid = (layout.max_blocks * triton.cdiv(hidden, tiles.block_n_down),)
    _expert_gemm_kernel[grid](
        h, w2, w2_scale, y, route_w,
        layout.sorted_pairs, layout.block_expert, layout.num_padded,
        num_pairs, 1, layout.max_blocks, 0.0,
        h.stride(0), h.stride(1),
        w2.stride(0), w2.stride(1), w2.stride(2),
        w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2),
        y.stride(0), y.stride(1),
        N=hidden, K=inter, GATED=False, CLAMP=False, WEIGHTED=True, BLOCK_N=tiles.block_n_down,
        num_stages=_num_stages(tiles, tiles.block_n_down, block_k, a_bytes, w_bytes, False), **common,
    )
    if top_k > 1:
        sum_slots(y, out, top_k)
    return out


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Sum over each token's k experts of weight * SwiGLU expert output. Returns [T, D] in x's dtype.

    Contract: deepinfer_core.ops.moe.moe_experts. Each expert output is rounded to x's dtype
    (as the reference does) and the k slots are summed in float32 in slot order.
    """
    tiles = expert_tiles(topk_ids.numel(), w13.shape[0])
    act_quant = FP8_W8A8_MIN_BLOCK_M is not None and tiles.block_m >= FP8_W8A8_MIN_BLOCK_M
    return _run_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, tiles, act_quant)


def moe_experts_clamped(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    limit: float,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``moe_experts`` with DeepSeek-V4's clamped SwiGLU, down(silu(min(gate, limit)) * clamp(up,
    -limit, limit)): the same grouped GEMMs, the clamp in GEMM 1's epilogue (``limit`` a runtime
    argument: one compile for every limit). Contract: deepinfer_core.ops.moe.moe_experts_clamped."""
    tiles = expert_tiles(topk_ids.numel(), w13.shape[0])
    act_quant = FP8_W8A8_MIN_BLOCK_M is not None and tiles.block_m >= FP8_W8A8_MIN_BLOCK_M
    return _run_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, tiles, act_quant, limit=limit)


def invariant_moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``moe_experts``, batch-invariant: the decode tiles (EXPERT_TILES' first) and W8A16 whatever
    the number of tokens, so a pair's products, and its token's slot sum, never follow the batch."""
    return _run_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, EXPERT_TILES[0][1], False)


moe_experts.impl = "triton: expert-sorted padded M-blocks, grouped GEMMs (fused SwiGLU; FP8 W8A16), slot sum"
moe_experts.shared_expert_max_tokens = SHARED_EXPERT_MAX_TOKENS
invariant_moe_route.impl = f"triton, batch-invariant: gate logits by the invariant GEMM, then {_ROUTE_PROGRAM}"
invariant_moe_experts.impl = "triton, batch-invariant: " + moe_experts.impl.removeprefix("triton: ") + ", one tile for every batch"
moe_experts.impl += f"; bf16 shared experts as extra experts up to {SHARED_EXPERT_MAX_TOKENS[torch.bfloat16]} tokens"
moe_experts_clamped.impl = ("triton only (DeepGEMM's provider takes moe_experts alone): expert-sorted padded M-blocks, "
                            "grouped GEMMs (clamped SwiGLU fused, runtime limit; FP8 W8A16), slot sum")


OPS = {"moe_route": moe_route, "moe_experts": moe_experts, "moe_route_sqrtsoftplus": moe_route_sqrtsoftplus,
       "moe_experts_clamped": moe_experts_clamped}
INVARIANT_OPS = {"moe_route": invariant_moe_route, "moe_experts": invariant_moe_experts}
