"""DeepInfer ops on stock torch_npu fused operators (CANN), with the argument marshalling their
documented layouts need. ``OPS`` maps op names to callables with the reference's signatures.

``torch_npu`` is imported inside the calls only (``_npu()``): importing this module needs torch
alone, so the plan and the CPU tests can read it on any machine. Each callable hands the cases its
operator does not take (a dtype, a shape outside the operator's documented limits, a weight format)
to the reference implementation, which runs on the NPU like on any torch device; the op's line in
``op_plan.PROVIDES`` (its ``impl``) names them. Each mapping names the documentation it follows;
``OP/<op>`` and ``GOLDEN/<op>`` are paths in ``Ascend/op-plugin`` (``op_plan``'s docstring), ``VA``
is ``vllm-project/vllm-ascend``.

Not one line here has run on an Ascend chip. ``tests/ascend/test_npu_ops_glue.py`` checks the
marshalling on the CPU against a test-only model of each operator's documented semantics (our
glue, not the chip); ``tests/ascend/test_hardware.py`` (marked ``npu``) checks the real thing.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from deepinfer_core.ops import activation, attention, hyper, moe, norm, rope

from deepinfer_ascend_950.op_plan import PROVIDES

HALF = (torch.bfloat16, torch.float16)
MHC_STREAMS = (4, 6, 8)  # OP/npu_mhc_pre, OP/npu_mhc_sinkhorn: n in {4, 6, 8}
MHC_MAX_HIDDEN = 16384  # OP/npu_mhc_pre: D in [1, 16384], a multiple of 16
GATING_MAX_EXPERTS = 2048  # OP/npu_moe_gating_top_k
GMM_MAX_GROUPS = 1024  # OP/npu_grouped_matmul: group_list of at most 1024 groups (single x / weight / y)
FIA_MASK_SIZE = 2048  # OP/npu_fused_infer_attention_score: sparse_mode 2/3/4 take a 2048x2048 mask
FIA_MAX_BATCH = 4096  # OP/npu_fused_infer_attention_score "TND布局约束": at most 4096 sequences
FIA_MAX_HEADS = 256  # ... "Q_S > 1 (Prefill) 专属约束": N <= 256
FIA_TND_DIMS = ((192, 128), (192, 192), (128, 128))  # ... TND without rope: (Q_D = K_D, V_D)
ROPE_DIM = 64  # OP/npu_interleave_rope: D must be 64


def _npu():
    """torch_npu, imported only when an op runs (never at import: without CANN it breaks torch)."""
    import torch_npu

    return torch_npu


def _cached(store: dict, key, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    tensor = store.get(key)
    if tensor is None:
        tensor = store[key] = make()
    return tensor


_MASKS: dict = {}
_ONES: dict = {}


# ---- norms ---------------------------------------------------------------------------------
def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as npu_rms_norm takes it: 2 to 8 dims (OP/（beta）torch_npu-npu_rms_norm.md)."""
    return x if 2 <= x.dim() <= 8 else x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # OP/（beta）torch_npu-npu_rms_norm.md: (y, rstd) = npu_rms_norm(self, gamma, epsilon), y = x / Rms(x) * gamma,
    # gamma float32 allowed with fp16 / bf16 x; GOLDEN/npu_rms_norm: float32 throughout, one rounding.
    if x.numel() == 0:
        return norm.rms_norm(x, weight, eps)
    gamma = weight if weight.dtype in (x.dtype, torch.float32) else weight.to(x.dtype)
    return _npu().npu_rms_norm(_rows(x), gamma, eps)[0].view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # OP/npu_add_rms_norm: (y, rstd, x_out) = npu_add_rms_norm(x1, x2, gamma, epsilon), x_out = x1 + x2 in x1's
    # dtype, gamma of x1's dtype, 1-8 dims, no empty tensors (GOLDEN/npu_add_rms_norm normalises the rounded sum).
    if x.numel() == 0:
        return norm.add_rms_norm(x, residual, weight, eps)
    y, _rstd, summed = _npu().npu_add_rms_norm(x, residual, weight.to(x.dtype), eps)
    return y, summed


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As rms_norm with the weight as float32 gamma: the weight multiplies in float32 and the result is
    # rounded once, which is this op's contract (GOLDEN/npu_rms_norm, test_rms_norm_mix_dtype).
    if x.numel() == 0:
        return norm.rms_norm_f32(x, weight, eps)
    return _npu().npu_rms_norm(_rows(x), weight.float(), eps)[0].view(x.shape)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    # npu_rms_norm's second output is rstd = 1 / Rms(x) in float32, shaped as x's leading dims
    # (OP/（beta）torch_npu-npu_rms_norm.md); the contract rounds that factor to x's dtype and
    # multiplies in x's dtype, which one multiply here does.
    if x.numel() == 0:
        return norm.rms_normalize(x, eps)
    ones = _cached(_ONES, (x.shape[-1], x.device), lambda: torch.ones(x.shape[-1], dtype=torch.float32, device=x.device))
    rstd = _npu().npu_rms_norm(_rows(x), ones, eps)[1]
    return x * rstd.reshape(*x.shape[:-1], 1).to(x.dtype)


# ---- rotary embedding ------------------------------------------------------------------------
def _reinterleave(y: torch.Tensor) -> torch.Tensor:
    """[..., 64] as npu_interleave_rope leaves it ([rotated even elements | rotated odd elements]) ->
    the interleaved order the contract returns (pairs (2i, 2i+1))."""
    return y.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                     interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # OP/npu_interleave_rope: x [B, N, S, 64] (bf16 / fp16, contiguous) is de-interleaved
    # (reshape [.., 32, 2] -> transpose -> [.., 64]) and rotated rotate-half style with cos / sin
    # [B, 1, S or 1, 64] of x's dtype: q_embed = q * cos + RotateHalf(q) * sin. With cos = [c | c] and
    # sin = [s | s] that is DeepSeek's interleaved rotation of pairs (2i, 2i+1), stored de-interleaved
    # (VA mla_v1.py rope_single keeps that order in its caches); the contract keeps the pairs
    # interleaved, hence the permutation back. Rows are tokens (B = T, S = 1), so each gets its own cos / sin.
    r = cos_sin.shape[-1]
    if not interleaved or r != ROPE_DIM or q.dtype not in HALF or k.dtype != q.dtype or q.shape[0] == 0:
        return rope.rotary_embedding(q, k, positions, cos_sin, interleaved)
    t, heads = q.shape[0], q.shape[1]
    table = cos_sin[positions]  # [T, 64] float32: cos in the first half, sin in the second
    cos = table[:, : r // 2].repeat(1, 2).to(q.dtype).view(t, 1, 1, r)
    sin = table[:, r // 2 :].repeat(1, 2).to(q.dtype).view(t, 1, 1, r)
    npu = _npu()
    q_rot = npu.npu_interleave_rope(q.contiguous().view(t, heads, 1, r), cos, sin)
    k_rot = npu.npu_interleave_rope(k.contiguous().view(t, 1, 1, r), cos, sin)
    return _reinterleave(q_rot.view(t, heads, r)), _reinterleave(k_rot.view(t, r))


# ---- activations ---------------------------------------------------------------------------
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # OP/（beta）torch_npu-npu_swiglu.md: out = swish(A) * B with A, B the front and back halves along dim;
    # contiguous, non-empty input (VA moe_mlp.py unquant_apply_mlp calls it on every chip, the 950 included).
    if x.numel() == 0:
        return activation.silu_and_mul(x)
    return _npu().npu_swiglu(x.contiguous(), -1)


# ---- MoE -----------------------------------------------------------------------------------
def _gating(num_experts: int, top_k: int, scoring_func: str, topk_method: str, n_group: int, topk_group: int,
            norm_topk_prob: bool) -> dict | None:
    """npu_moe_gating_top_k's arguments for a DeepInfer gate, or None where it cannot express it.

    OP/npu_moe_gating_top_k (its "等价计算逻辑" reference code): norm_type 1 = sigmoid, whose weights are
    always divided by their sum + eps; norm_type 0 = softmax, never renormalised; the bias enters the
    selection only; group_select_mode 1 ranks groups by their top-2 sum, 0 by their max; then the
    top k of the kept groups, weights = unbiased scores * routed_scaling_factor. Limits: E <= 2048,
    E divisible by group_count with > 2 experts a group, ceil32(E / group_count) * group_count <= 2048,
    1 <= k_group <= group_count, 1 <= k <= E / group_count * k_group; renorm 0 only. VA
    device_op.py A5DeviceAdaptor.moe_gating_top_k calls it the same way on the 950.
    """
    if topk_method == "noaux_tc":
        if scoring_func == "sigmoid" and norm_topk_prob:
            mode = {"norm_type": 1, "group_select_mode": 1, "group_count": n_group, "k_group": topk_group}
        elif scoring_func == "softmax" and not norm_topk_prob:
            mode = {"norm_type": 0, "group_select_mode": 1, "group_count": n_group, "k_group": topk_group}
        else:
            return None  # sigmoid without renormalisation, softmax with it: not expressible
    elif scoring_func != "softmax":
        return None  # V2 gates never renormalise; sigmoid always would
    elif topk_method == "greedy":
        mode = {"norm_type": 0, "group_select_mode": 0, "group_count": 1, "k_group": 1}
    elif topk_method == "group_limited_greedy":
        mode = {"norm_type": 0, "group_select_mode": 0, "group_count": n_group, "k_group": topk_group}
    else:
        return None
    groups, kept = mode["group_count"], mode["k_group"]
    if groups < 1 or num_experts % groups or num_experts > GATING_MAX_EXPERTS:
        return None
    per_group = num_experts // groups
    if per_group <= 2 or -(-per_group // 32) * 32 * groups > GATING_MAX_EXPERTS:
        return None
    if not (1 <= kept <= groups and 1 <= top_k <= per_group * kept):
        return None
    return mode


def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor | None, *, top_k: int,
              scoring_func: str, topk_method: str, n_group: int, topk_group: int, norm_topk_prob: bool,
              routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    mode = _gating(gate_weight.shape[0], top_k, scoring_func, topk_method, n_group, topk_group, norm_topk_prob)
    if mode is None or x.shape[0] == 0:
        return moe.moe_route(x, gate_weight, correction_bias, top_k=top_k, scoring_func=scoring_func,
                             topk_method=topk_method, n_group=n_group, topk_group=topk_group,
                             norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)
    logits = F.linear(x.float(), gate_weight.float())  # float32, as the contract computes them
    bias = correction_bias.float() if topk_method == "noaux_tc" and correction_bias is not None else None
    weights, ids, _ = _npu().npu_moe_gating_top_k(logits, top_k, bias=bias, renorm=0, out_flag=False,
                                                  routed_scaling_factor=routed_scaling_factor, eps=1e-20, **mode)
    return weights.float(), ids.long()


def _grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """VA's all-gather MoE path without EP (ops/fused_moe/token_dispatcher.py TokenDispatcherWithAllGather,
    moe_mlp.py unquant_apply_mlp), with DeepInfer's combine.

    OP/npu_moe_init_routing_v2 (GOLDEN/npu_moe_init_routing_v2, dropless drop_pad_mode 0): the (token,
    slot) pairs flattened and stably sorted by expert id (int32 ids); expanded_x = x[sorted // k];
    row_idx_type 0: expanded_row_idx[token * k + slot] = that pair's row of expanded_x;
    expert_tokens_num_type 1: per-expert counts (int64) over active_expert_range.
    OP/npu_grouped_matmul (x, weight, y single tensors, group_type 0 = m-axis groups, split_item 2 = one
    output tensor): y[rows of group e] = x[rows] @ weight[e] with weight [E, K, N]; group_list_type 1 =
    counts; weight may be a transposed view (VA passes w.transpose(1, 2)); at most 1024 groups, and a
    counts list of length 1 is refused.
    The combine gathers each (token, slot) row back and sums it with its float32 weight, in float32.
    npu_moe_token_unpermute would fuse that, but torch_npu 2.13.0's docstring gives it bf16 probs only
    and its index direction by example alone: not used.
    """
    tokens, k = topk_ids.shape
    experts = w13.shape[0]
    npu = _npu()
    expanded_x, expanded_row_idx, counts, _ = npu.npu_moe_init_routing_v2(
        x.contiguous(), topk_ids.to(torch.int32), active_num=tokens * k, expert_num=experts, drop_pad_mode=0,
        expert_tokens_num_type=1, expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[0, experts],
        row_idx_type=0)
    gate_up = npu.npu_grouped_matmul([expanded_x], [w13.transpose(1, 2)], group_list=counts, group_list_type=1,
                                     group_type=0, split_item=2)[0]
    down = npu.npu_grouped_matmul([act(gate_up)], [w2.transpose(1, 2)], group_list=counts, group_list_type=1,
                                  group_type=0, split_item=2)[0]
    rows = down[expanded_row_idx.long()].view(tokens, k, -1)
    return (rows.float() * topk_weights.float()[..., None]).sum(dim=1).to(x.dtype)


def _grouped_fits(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale) -> bool:
    """Plain (bf16 / fp16 / fp32) experts of x's dtype that npu_grouped_matmul takes unquantised."""
    return (w13_scale is None and not moe.is_mxfp4(w13, w2) and x.shape[0] > 0 and x.dtype in (*HALF, torch.float32)
            and w13.dtype == x.dtype and w2.dtype == x.dtype and 2 <= w13.shape[0] <= GMM_MAX_GROUPS)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                block: tuple[int, int] | None = None) -> torch.Tensor:
    if not _grouped_fits(x, w13, w2, w13_scale):
        return moe.moe_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block)
    # OP/（beta）torch_npu-npu_swiglu.md between the grouped matmuls, as VA unquant_apply_mlp
    return _grouped_experts(x, w13, w2, topk_weights, topk_ids, lambda h: _npu().npu_swiglu(h, -1))


def moe_experts_clamped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, limit: float, w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    if not _grouped_fits(x, w13, w2, w13_scale):
        return moe.moe_experts_clamped(x, w13, w2, topk_weights, topk_ids, limit, w13_scale, w2_scale, block)
    # The clamp in torch: VA's 950 branch does the same (moe_mlp.py _apply_clipped_swiglu); see
    # op_plan.LEFT_OUT["silu_and_mul_clamped"].
    return _grouped_experts(x, w13, w2, topk_weights, topk_ids, lambda h: activation.silu_and_mul_clamped(h, limit))


# ---- MLA prefill attention ------------------------------------------------------------------
def mla_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, scale: float) -> torch.Tensor:
    # OP/npu_fused_infer_attention_score: input_layout "TND" (query [T, N, D], key / value [T, KV_N, D],
    # output [T, N, D_v]); actual_seq_lengths / actual_seq_lengths_kv are required, host int lists of
    # cumulative lengths (the ends of the packed sequences), at most 4096; without rope inputs Q_D = K_D =
    # 192 with V_D = 128 or 192, or all 128; sparse_mode 3 = rightDownCausal, which is the contract's
    # "query i sees keys 0 .. lk - lq + i" (a cached prefix needs nothing more), with the 2048x2048
    # upper-triangular mask (VA attention_mask.py get_splitfuse_attn_mask: triu(ones, 1), int8); N <= 256
    # for prefill. VA mla_v1.py _forward_prefill (head-padding branch: q and k of 192, v of 128, the same
    # call on the 950 through A5DeviceAdaptor) casts fp16 to bf16 first ("FIA with TND layout only supports
    # bfloat16"); that cast misses the op's fp16 tolerance (specs/ops.toml: 3e-3; bf16 keeps 8 bits), so
    # fp16 stays on the reference here.
    dims = (q.shape[-1], v.shape[-1])
    fits = (q.dtype == torch.bfloat16 and k.dtype == q.dtype and v.dtype == q.dtype and dims in FIA_TND_DIMS
            and k.shape[-1] == q.shape[-1] and k.shape[1] == q.shape[1] and q.shape[1] <= FIA_MAX_HEADS)
    if not fits:
        return attention.mla_prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    ends_q, ends_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # host lists: the reference reads them too
    lens_q = [b - a for a, b in zip(ends_q, ends_q[1:])]
    lens_k = [b - a for a, b in zip(ends_k, ends_k[1:])]
    if not lens_q or len(lens_q) > FIA_MAX_BATCH or any(lq < 1 or lq > lk for lq, lk in zip(lens_q, lens_k)):
        # an empty sequence or more queries than keys: rows the operator does not define
        return attention.mla_prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    mask = _cached(_MASKS, q.device, lambda: torch.triu(
        torch.ones(FIA_MASK_SIZE, FIA_MASK_SIZE, dtype=torch.int8, device=q.device), diagonal=1))
    out, _ = _npu().npu_fused_infer_attention_score(
        q.contiguous(), k.contiguous(), v.contiguous(), atten_mask=mask, actual_seq_lengths=ends_q[1:],
        actual_seq_lengths_kv=ends_k[1:], num_heads=q.shape[1], num_key_value_heads=k.shape[1], scale=scale,
        input_layout="TND", sparse_mode=3)
    return out


# ---- hyper-connections (DeepSeek-V4) --------------------------------------------------------
def _mhc_fits(x: torch.Tensor) -> bool:
    """Streams npu_mhc_pre / _sinkhorn / _post take: bf16 / fp16, n in {4, 6, 8}, D a multiple of 16 up to
    16384 (OP/npu_mhc_pre "约束说明"), no empty tensor."""
    t, hc, d = x.shape
    return x.dtype in HALF and hc in MHC_STREAMS and d % 16 == 0 and 0 < d <= MHC_MAX_HIDDEN and t > 0


def _sinkhorn(h_res: torch.Tensor, hc_eps: float, iters: int) -> torch.Tensor:
    # OP/npu_mhc_sinkhorn: softmax over the last axis + eps, then column sums (+ eps), then (num_iters - 1)
    # times row then column sums: exactly mhc_pre's comb; x and y fp32 [T, n, n]; num_iters in [1, 100].
    return _npu().npu_mhc_sinkhorn(h_res, eps=hc_eps, num_iters=iters)[0]


def mhc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_eps: float,
            rms_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # OP/npu_mhc_pre and GOLDEN/npu_mhc_pre: x' = x / Rms(flatten x) (norm_eps); H = alpha * (x' phi^T) + bias,
    # split [pre n | post n | res n*n] (phi [n^2 + 2n, nD] float32 rows W_pre, W_post, W_res: fn's order);
    # h_pre = sigmoid(H_pre) + hc_eps, h_post = 2 sigmoid(H_post) [T, n] float32, h_res [T, n, n] before
    # Sinkhorn, h_in = sum_j h_pre_j x_j in x's dtype. alpha = scale [3], bias = base: mhc_pre's contract.
    if not _mhc_fits(x) or not 1 <= sinkhorn_iters <= 100:
        return hyper.mhc_pre(x, fn, base, scale, hc_eps=hc_eps, rms_eps=rms_eps, sinkhorn_iters=sinkhorn_iters)
    t, hc, _ = x.shape
    h_in, h_post, h_res = _npu().npu_mhc_pre(x, fn.float(), scale.float(), base.float(), norm_eps=rms_eps,
                                             hc_eps=hc_eps)[:3]
    return h_post.reshape(t, hc).float(), _sinkhorn(h_res.reshape(t, hc, hc).float(), hc_eps, sinkhorn_iters), h_in


def mhc_pre_delayed(x: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    *, hc_eps: float, rms_eps: float, sinkhorn_iters: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # As mhc_pre; out_flag 1 returns (h_in, h_post, h_res, inv_rms, h_mix, h_pre) all (OP/npu_mhc_pre:
    # "需同时输出"), h_pre being this sublayer's pre. h_in collapses with that pre, not with pre_in, so
    # the collapse with pre_in is the reference's weighted sum.
    if not _mhc_fits(x) or not 1 <= sinkhorn_iters <= 100:
        return hyper.mhc_pre_delayed(x, pre_in, fn, base, scale, hc_eps=hc_eps, rms_eps=rms_eps,
                                     sinkhorn_iters=sinkhorn_iters)
    t, hc, _ = x.shape
    outs = _npu().npu_mhc_pre(x, fn.float(), scale.float(), base.float(), norm_eps=rms_eps, hc_eps=hc_eps, out_flag=1)
    h_post, h_res, h_pre = outs[1], outs[2], outs[5]
    comb = _sinkhorn(h_res.reshape(t, hc, hc).float(), hc_eps, sinkhorn_iters)
    return h_pre.reshape(t, hc).float(), h_post.reshape(t, hc).float(), comb, hyper.mhc_collapse(x, pre_in)


def mhc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_eps: float,
             rms_eps: float) -> torch.Tensor:
    # OP/npu_mhc_pre "约束说明": with alpha of shape [2], phi [2n, nD] and bias [2n] it computes no H_res
    # (GOLDEN/npu_mhc_pre cpu_op_exec_hy: h_in = sum_j (sigmoid(alpha_0 * M_pre * inv_rms + b_pre) + hc_eps) x_j).
    # mhc_head is that h_in with M_pre from fn: the post rows are zeros (alpha_1 = 0) and ignored.
    if not _mhc_fits(x):
        return hyper.mhc_head(x, fn, base, scale, hc_eps=hc_eps, rms_eps=rms_eps)
    phi = torch.cat([fn.float(), torch.zeros_like(fn, dtype=torch.float32)])
    alpha = torch.cat([scale.float().reshape(1), scale.new_zeros(1, dtype=torch.float32)])
    bias = torch.cat([base.float(), torch.zeros_like(base, dtype=torch.float32)])
    return _npu().npu_mhc_pre(x, phi, alpha, bias, norm_eps=rms_eps, hc_eps=hc_eps)[0]


def mhc_post(out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    # OP/npu_mhc_post: x_{l+1} = H_res x x_l + h_out (x) H_post; x [T, n, D] bf16 / fp16, h_res [T, n, n] fp32,
    # h_out [T, D] of x's dtype, h_post [T, n] fp32. The prose leaves H_res's index order open;
    # GOLDEN/npu_mhc_post (hc_post) sums h_res[t, j, k] * x[t, j] over j for output stream k, which is
    # the contract's comb[t, j, k]: comb goes in as it is.
    if not _mhc_fits(x) or out.dtype != x.dtype:
        return hyper.mhc_post(out, x, post, comb)
    return _npu().npu_mhc_post(x, comb.float(), out, post.float())


# Every torch_npu operator the callables above call (the hardware tests check this torch_npu has each).
OPERATORS: tuple[str, ...] = (
    "npu_rms_norm", "npu_add_rms_norm", "npu_interleave_rope", "npu_swiglu", "npu_moe_gating_top_k",
    "npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_fused_infer_attention_score", "npu_mhc_pre",
    "npu_mhc_sinkhorn", "npu_mhc_post",
)

OPS: dict[str, Callable] = {
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "silu_and_mul": silu_and_mul,
    "moe_route": moe_route,
    "moe_experts": moe_experts,
    "mla_prefill_attention": mla_prefill_attention,
    "rms_norm_f32": rms_norm_f32,
    "rms_normalize": rms_normalize,
    "moe_experts_clamped": moe_experts_clamped,
    "mhc_pre": mhc_pre,
    "mhc_post": mhc_post,
    "mhc_head": mhc_head,
    "mhc_pre_delayed": mhc_pre_delayed,
}
for _name, _fn in OPS.items():
    _fn.impl = PROVIDES[_name]  # what `deepinfer backends` shows beside the op
del _name, _fn
