"""Mixture-of-experts ops: routing (DeepSeek V2/V3 gates) and expert computation."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from deepinfer_core.ops.activation import silu_and_mul, silu_and_mul_clamped
from deepinfer_core.ops.linear import MXFP4_GROUP, dequantize_fp8_block, dequantize_mxfp4

SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose top_k experts per token. Returns (weights [T, k] float32, ids [T, k] int64).

    x: [T, D]; gate_weight: [E, D]; correction_bias: [E] float32 or None. Logits are computed in
    float32. ``noaux_tc`` (V3): sigmoid scores, selection on scores + bias restricted to the
    ``topk_group`` groups with the largest sum of their top-2 biased scores; weights are the
    unbiased scores, optionally renormalised (+1e-20). ``greedy`` (V2-Lite): softmax, plain top-k.
    ``group_limited_greedy`` (V2): softmax, groups ranked by their max score, others zeroed.
    V2 gates never renormalise. Weights are finally multiplied by routed_scaling_factor. The
    order of the k slots is unspecified.

    A backend's callable may carry ``appends_shared_experts = True`` (not part of the contract):
    it then accepts the keyword ``shared_experts=n`` and returns [T, k + n] with n slots appended
    to every row, ids E .. E + n - 1 and weight 1, which the V2/V3 model asks for where the shared
    experts run in ``moe_experts``' call (see its ``shared_expert_max_tokens``) instead of
    concatenating them itself. The model refuses such a callable without that keyword at load.
    """
    return top_k_route(route_selection(x, gate_weight, correction_bias, scoring_func=scoring_func, topk_method=topk_method,
                                       n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                                       routed_scaling_factor=routed_scaling_factor), top_k)


def top_k_route(gate: tuple[torch.Tensor, Callable], top_k: int, fixed_ids: torch.Tensor | None = None):
    """(weights, ids) from a gate's (selection, weights_of): the top_k of the selection, or ``fixed_ids``."""
    selection, weights_of = gate
    ids = fixed_ids.long() if fixed_ids is not None else selection.topk(top_k, dim=-1, sorted=False)[1]
    return weights_of(ids), ids


def route_selection(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    matmul: Callable = F.linear,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``moe_route``'s gate: (selection [T, E] float32, weights_of). Its ids are the top_k of
    ``selection`` per token (-inf or 0 outside the kept groups); ``weights_of(ids)`` gives the
    weights of any ids [T, k]. The conformance checks judge routing with these two at ties.
    ``matmul`` computes the gate logits (F.linear's signature; the batch-invariant reference's own)."""
    logits = matmul(x.float(), gate_weight.float())
    num_tokens, num_experts = logits.shape
    if scoring_func == "sigmoid":
        scores = logits.sigmoid()
    elif scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"scoring_func {scoring_func!r} is not supported; expected one of {SCORING_FUNCS}")

    if topk_method == "noaux_tc":
        choice = scores if correction_bias is None else scores + correction_bias.float()
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        keep = _group_mask(group_scores, topk_group, num_experts)
        selection, source = choice.masked_fill(~keep, float("-inf")), scores
    elif topk_method == "greedy":
        selection = source = scores
    elif topk_method == "group_limited_greedy":
        group_scores = scores.view(num_tokens, n_group, num_experts // n_group).max(dim=-1).values
        keep = _group_mask(group_scores, topk_group, num_experts)
        selection = source = scores.masked_fill(~keep, 0.0)
    else:
        raise ValueError(f"topk_method {topk_method!r} is not supported; expected one of {TOPK_METHODS}")
    renormalise = topk_method == "noaux_tc" and norm_topk_prob  # V2 gates never renormalise
    return selection, lambda ids: _route_weights(source, ids, renormalise, routed_scaling_factor)


def _route_weights(source: torch.Tensor, ids: torch.Tensor, renormalise: bool, routed_scaling_factor: float) -> torch.Tensor:
    """``source`` at ``ids``, divided by their sum (+1e-20) when ``renormalise``, times routed_scaling_factor."""
    weights = source.gather(1, ids)
    if renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    num_tokens, n_group = group_scores.shape
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return mask[:, :, None].expand(num_tokens, n_group, num_experts // n_group).reshape(num_tokens, num_experts)


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

    x: [T, D]; w13: [E, 2I, D] (gate rows first, then up); w2: [E, D, I]; topk_weights: [T, k]
    float32; topk_ids: [T, k] int64. With block-FP8 experts, w13/w2 are float8_e4m3fn and
    w13_scale [E, ceil(2I/bn), ceil(D/bk)], w2_scale [E, ceil(D/bn), ceil(I/bk)], block=(bn, bk).

    MXFP4 experts (DeepSeek-V4's ``expert_dtype: fp4``) are said by the weights' dtype: w13 and
    w2 **uint8** (``is_mxfp4``), block None. They are packed two E2M1 codes a byte along the
    input dimension, byte j holding input 2j in its low nibble and 2j+1 in its high one: w13
    [E, 2I, D/2], w2 [E, D, I/2]; w13_scale [E, 2I, ceil(D/32)] and w2_scale [E, D, ceil(I/32)]
    are uint8 UE8M0 bytes s, each scaling its row's 32 inputs by 2^(s - 127) (byte 255 is NaN).
    W[n, j] = E2M1(code[n, j]) * 2^(s[n, j // 32] - 127), as ``ops.linear.dequantize_mxfp4``
    computes it; every such value is exact in bfloat16 and float16 (within their range), so a
    W4A16 backend that dequantises in registers differs from the reference only in summation
    order. Activations are never quantised.

    The reference follows transformers' eager path: experts in ascending id (each used expert's
    weights dequantised to x's dtype first), the weighted expert output accumulated into a
    buffer of x's dtype.

    A backend's callable may carry ``shared_expert_max_tokens`` ({expert weight dtype: int}, a
    hint, not part of the results' contract): up to that many tokens, the V2/V3 model appends
    its shared experts to the routed ones (``n_shared_experts`` more experts, ids E.., weight 1
    for every token) and computes them in this call instead of through the shared MLP
    (``MoE.fuse_shared``); a dtype it does not name is never fused, and neither is a
    batch-invariant table's model. The reference carries none: it keeps transformers' order
    (shared experts apart, added after). The model appends the shared slots to ``moe_route``'s
    results by concatenation, unless that callable appends them (its ``appends_shared_experts``).
    """
    return routed_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, silu_and_mul, F.linear)


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
    """``moe_experts`` with DeepSeek-V4's clamped SwiGLU: each expert computes
    down(silu(min(gate, limit)) * clamp(up, -limit, limit)). Same arguments and layout otherwise,
    MXFP4 experts (uint8 w13 / w2 with their UE8M0 scales, block None) included."""
    return routed_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block,
                          lambda h: silu_and_mul_clamped(h, limit), F.linear)


def routed_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, act, matmul) -> torch.Tensor:
    """The expert loop of ``moe_experts`` (activation ``act``; the products by ``matmul``, F.linear's
    signature: the batch-invariant reference passes its own)."""
    mxfp4 = is_mxfp4(w13, w2)
    if mxfp4:
        check_mxfp4_experts(x, w13, w2, w13_scale, w2_scale, block)
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    for expert in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == expert)
        gate_up, down = w13[expert], w2[expert]
        if mxfp4:
            gate_up = dequantize_mxfp4(gate_up, w13_scale[expert], x.dtype)
            down = dequantize_mxfp4(down, w2_scale[expert], x.dtype)
        elif w13_scale is not None:
            gate_up = dequantize_fp8_block(gate_up, w13_scale[expert], block, x.dtype)
            down = dequantize_fp8_block(down, w2_scale[expert], block, x.dtype)
        h = act(matmul(x[token_idx], gate_up))
        y = matmul(h, down) * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(x.dtype))
    return out


def is_mxfp4(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether expert weights are packed MXFP4 (``moe_experts``' convention: uint8 weights)."""
    return w13.dtype == torch.uint8 and w2.dtype == torch.uint8


def check_mxfp4_experts(x, w13, w2, w13_scale, w2_scale, block) -> None:
    """ValueError unless packed MXFP4 experts and their scales have ``moe_experts``' shapes for
    x's hidden size (shapes only: no device value is read)."""
    hidden = x.shape[-1]
    e, rows, half_d = w13.shape
    inter = rows // 2
    want = {
        "w13": ((e, 2 * inter, hidden // 2), w13),
        "w2": ((e, hidden, inter // 2), w2),
        "w13_scale": ((e, 2 * inter, -(-hidden // MXFP4_GROUP)), w13_scale),
        "w2_scale": ((e, hidden, -(-inter // MXFP4_GROUP)), w2_scale),
    }
    bad = [f"{name} {None if t is None else tuple(t.shape)} (needs {shape})" for name, (shape, t) in want.items()
           if t is None or tuple(t.shape) != shape or t.dtype != torch.uint8]
    if block is not None or hidden % 2 or inter % 2 or bad:
        raise ValueError(
            f"MXFP4 experts (uint8 weights) for hidden size {hidden}: need even hidden and intermediate sizes, "
            f"uint8 weights and UE8M0 scales of these shapes and block=None; got block={block}"
            + (f", {', '.join(bad)}" if bad else "")
        )


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

    x: [T, D]; gate_weight: [E, D]. Scores s = sqrt(softplus(x @ W^T)) in float32. ids are
    ``fixed_ids`` [T, k] when given (hash layers: the model looks them up from the token ids; no
    bias), else the top_k of s + correction_bias ([E] float32, or none). weights = s at ids,
    divided by their sum (+1e-20) when norm_topk_prob, times routed_scaling_factor. The order of
    the k slots is unspecified.
    """
    return top_k_route(sqrtsoftplus_selection(x, gate_weight, correction_bias, norm_topk_prob=norm_topk_prob,
                                              routed_scaling_factor=routed_scaling_factor), top_k, fixed_ids)


def sqrtsoftplus_selection(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``moe_route_sqrtsoftplus``'s gate without fixed ids, as ``route_selection``: (selection
    [T, E] float32, s + correction_bias, whose top_k are the ids; weights_of)."""
    scores = F.softplus(F.linear(x.float(), gate_weight.float())).sqrt()
    selection = scores if correction_bias is None else scores + correction_bias.float()
    return selection, lambda ids: _route_weights(scores, ids, norm_topk_prob, routed_scaling_factor)
