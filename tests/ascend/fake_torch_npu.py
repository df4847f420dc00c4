"""A test-only model of the torch_npu operators ``deepinfer_ascend_950.npu_ops`` calls.

This tests OUR GLUE, NOT THE CHIP. Nothing here is torch_npu or CANN: each function is a plain
PyTorch model of one operator's documented semantics, written from the documentation its
docstring names (``OP/<op>``: ``Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-<op>.md``,
master 517f2e7; ``GOLDEN/<op>``: that repository's ``test/test_custom_ops/test_<op>.py``, whose CPU
golden functions are what Huawei's own tests compare the chip against). Each checks the
constraints its documentation states (argument layouts, dtypes, shapes, contiguity, limits) and
raises where the real operator would refuse, then computes in float32 on the CPU and rounds once.
So a test passing through it shows that the arguments DeepInfer builds are the ones the
documentation asks for and that, if the operator does what its documentation says, the op meets
its contract. It shows nothing about the chip's rounding, tie order or speed, nor about
documentation that is wrong.

Tests inject it as ``sys.modules["torch_npu"]`` for one test at a time (the ``fake_npu`` fixture);
``CALLS`` counts the operators called, so a test can tell the fused path from a fallback.
"""

from __future__ import annotations

import collections

import torch
import torch.nn.functional as F

__version__ = "0.0.0+fake-model-for-tests"
CALLS: collections.Counter = collections.Counter()
HALF = (torch.bfloat16, torch.float16)
FLOATS = (torch.float32, *HALF)


class DocumentedConstraint(RuntimeError):
    """The real operator's documentation refuses these arguments."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise DocumentedConstraint(what)


def _transposed_view(w: torch.Tensor) -> bool:
    """w [.., K, N] is the transpose of a contiguous [.., N, K] (what npu_grouped_matmul calls a transposed weight)."""
    return w.transpose(-1, -2).is_contiguous()


# ---- norms ---------------------------------------------------------------------------------
def npu_rms_norm(self, gamma, epsilon=1e-6):
    """OP/（beta）torch_npu-npu_rms_norm.md; GOLDEN/npu_rms_norm (float32 throughout, one rounding).
    self 2-8 dims; gamma = self's trailing dims; (self, gamma) dtypes: (fp16|bf16, fp32), (t, t)."""
    CALLS["npu_rms_norm"] += 1
    _require(2 <= self.dim() <= 8, f"npu_rms_norm: self has {self.dim()} dims, 2-8 supported")
    _require(tuple(gamma.shape) == tuple(self.shape[self.dim() - gamma.dim():]), "npu_rms_norm: gamma is not self's trailing shape")
    _require(gamma.dtype == self.dtype or (self.dtype in HALF and gamma.dtype == torch.float32),
             f"npu_rms_norm: gamma {gamma.dtype} with self {self.dtype}")
    return _rms(self, gamma, epsilon)


def _rms(x, gamma, epsilon):
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    rstd = torch.rsqrt(x.float().pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (x.float() * rstd * gamma.float()).to(x.dtype), rstd


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    """OP/npu_add_rms_norm; GOLDEN/npu_add_rms_norm: x = x1 + x2 in x1's dtype, RMSNorm(x) * gamma in
    float32; returns (y, rstd, x). 1-8 dims, no empty tensors, gamma of x1's dtype."""
    CALLS["npu_add_rms_norm"] += 1
    _require(1 <= x1.dim() <= 8 and x1.numel() > 0, "npu_add_rms_norm: 1-8 dims, not empty")
    _require(x1.dtype == x2.dtype == gamma.dtype and x1.dtype in FLOATS, "npu_add_rms_norm: x1, x2, gamma dtypes differ")
    _require(x1.shape == x2.shape, "npu_add_rms_norm: x1 and x2 shapes differ")
    x = x1 + x2
    y, rstd = _rms(x, gamma, epsilon)
    return y, rstd, x


# ---- rotary ---------------------------------------------------------------------------------
def npu_interleave_rope(x, cos, sin):
    """OP/npu_interleave_rope: q = reshape(x, [B, N, S, D/2, 2]).transpose(-1, -2).reshape([B, N, S, D]);
    out = q * cos + RotateHalf(q) * sin, RotateHalf(q) = [-q[D/2:], q[:D/2]]. x 4-D [B, N, S, 64] bf16 / fp16,
    contiguous; cos, sin [B, 1, S or 1, 64] of x's dtype, contiguous."""
    CALLS["npu_interleave_rope"] += 1
    _require(x.dim() == 4 and x.shape[-1] == 64, f"npu_interleave_rope: x {tuple(x.shape)}, want [B, N, S, 64]")
    _require(x.dtype in HALF and cos.dtype == x.dtype == sin.dtype, "npu_interleave_rope: bf16 / fp16, cos / sin of x's dtype")
    _require(all(t.is_contiguous() for t in (x, cos, sin)), "npu_interleave_rope: non-contiguous tensor")
    b, n, s, d = x.shape
    _require(cos.shape == sin.shape and cos.dim() == 4 and cos.shape[0] == b and cos.shape[1] == 1
             and cos.shape[2] in (1, s) and cos.shape[3] == d, f"npu_interleave_rope: cos {tuple(cos.shape)} for x {tuple(x.shape)}")
    q = x.float().reshape(b, n, s, d // 2, 2).transpose(-1, -2).reshape(b, n, s, d)
    rotated = torch.cat([-q[..., d // 2:], q[..., : d // 2]], dim=-1)
    return (q * cos.float() + rotated * sin.float()).to(x.dtype)


# ---- activations ---------------------------------------------------------------------------
def npu_swiglu(input, dim=-1):
    """OP/（beta）torch_npu-npu_swiglu.md: A, B = the halves of input along dim; out = A * sigmoid(A) * B.
    1-8 dims, even along dim, contiguous, not empty, fp32 / fp16 / bf16."""
    CALLS["npu_swiglu"] += 1
    _require(input.is_contiguous() and input.numel() > 0 and input.dtype in FLOATS, "npu_swiglu: contiguous, non-empty float")
    _require(input.shape[dim] % 2 == 0, "npu_swiglu: odd size along dim")
    a, b = input.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(input.dtype)


# ---- MoE -----------------------------------------------------------------------------------
def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                         group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                         eps=1e-20):
    """OP/npu_moe_gating_top_k, its "等价计算逻辑" reference code: softmax (norm_type 0) or sigmoid (1) of x;
    bias added for selection only; groups ranked by their max (group_select_mode 0) or top-2 sum (1),
    the best k_group kept (stable order: ties to the lower group); top-k of the kept experts (stable:
    ties to the lower id); y = unbiased scores at the ids, divided by their sum + eps for sigmoid only,
    times routed_scaling_factor, in x's dtype; ids int32. Limits as documented."""
    CALLS["npu_moe_gating_top_k"] += 1
    tokens, experts = x.shape
    _require(x.dim() == 2 and x.dtype in FLOATS and experts <= 2048, "npu_moe_gating_top_k: x [T, E <= 2048]")
    _require(renorm == 0 and input_ids is None and tid2eid is None, "npu_moe_gating_top_k: renorm 0 only (no hash mode modelled)")
    _require(group_count > 0 and experts % group_count == 0 and experts // group_count > 2
             and -(-(experts // group_count) // 32) * 32 * group_count <= 2048, "npu_moe_gating_top_k: group_count limits")
    _require(1 <= k_group <= group_count and 1 <= k <= experts // group_count * k_group, "npu_moe_gating_top_k: k / k_group limits")
    _require(bias is None or (bias.shape == (experts,) and bias.dtype == x.dtype), "npu_moe_gating_top_k: bias [E] of x's dtype")
    scores = x.float().softmax(-1) if norm_type == 0 else x.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if group_count > 1:
        grouped = choice.view(tokens, group_count, -1)
        group_score = grouped.amax(-1) if group_select_mode == 0 else grouped.topk(2, dim=-1).values.sum(-1)
        kept = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :k_group]
        mask = torch.ones(tokens, group_count, dtype=torch.bool).scatter_(1, kept, False)
        choice = grouped.masked_fill(mask[..., None], float("-inf")).view(tokens, experts)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]
    y = scores.gather(1, ids)
    if norm_type == 1:
        y = y / (y.sum(-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    return y.to(x.dtype), ids.to(torch.int32), scores if out_flag else torch.zeros(0)


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1, expert_num=-1,
                            drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False, quant_mode=-1,
                            active_expert_range=(), row_idx_type=0, x_dtype=None):
    """OP/npu_moe_init_routing_v2; GOLDEN/npu_moe_init_routing_v2 cpu_op_exec, dropless (drop_pad_mode 0),
    unquantised (quant_mode -1): the flattened (token, slot) expert ids, those outside
    active_expert_range moved last, stably sorted; expanded_x = x[sorted // k][:active_num];
    row_idx_type 0: expanded_row_idx[sorted[i]] = i (gather), 1: = sorted (scatter);
    expert_tokens_num_type 0: cumulative counts, 1: counts (int64) over the range."""
    CALLS["npu_moe_init_routing_v2"] += 1
    _require(drop_pad_mode == 0 and quant_mode == -1 and scale is None, "model covers dropless, unquantised routing only")
    _require(x.dim() == 2 and expert_idx.dim() == 2 and expert_idx.dtype == torch.int32, "npu_moe_init_routing_v2: x [T, H], expert_idx [T, k] int32")
    _require(expert_idx.shape[0] == x.shape[0], "npu_moe_init_routing_v2: x and expert_idx rows differ")
    start, end = active_expert_range if active_expert_range else (0, expert_num)
    k = expert_idx.shape[1]
    flat = expert_idx.reshape(-1).long()
    active = (flat >= start) & (flat < end)
    keyed = torch.where(active, flat, torch.full_like(flat, torch.iinfo(torch.int32).max))
    order = torch.sort(keyed, stable=True).indices
    total = int(active.sum())
    rows = total if active_num in (-1, 0) else min(active_num, total)
    if row_idx_type == 1:
        row_idx = order.to(torch.int32)
    else:
        row_idx = torch.full_like(flat, -1, dtype=torch.int32)
        row_idx[order[:total]] = torch.arange(total, dtype=torch.int32)
    counts = None
    if expert_tokens_num_flag:
        counts = torch.bincount(flat[active] - start, minlength=end - start).to(torch.int64)
        if expert_tokens_num_type == 0:
            counts = counts.cumsum(0)
        else:
            _require(expert_tokens_num_type == 1, "model covers expert_tokens_num_type 0 / 1")
    return x[order[:rows] // k], row_idx, counts, None


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       output_dtype=None, tuning_config=None, x_dtype=None, weight_dtype=None, scale_dtype=None,
                       per_token_scale_dtype=None):
    """OP/npu_grouped_matmul, non-quantised, group_type 0 (m-axis groups), x / weight / y single tensors
    ("单单单"): split_item 2 or 3; weight 3-D [E, K, N] (a transposed view allowed), x 2-D, not
    transposed; group_list of at most 1024 groups, group_list_type 0 = cumulative, 1 = counts (length
    not 1), summing to x's rows; x, weight, y of one dtype. y[rows of group e] = x[rows] @ weight[e]."""
    CALLS["npu_grouped_matmul"] += 1
    _require(len(x) == 1 and len(weight) == 1 and split_item in (2, 3) and group_type == 0,
             "model covers the single-tensor m-axis form (split_item 2/3, group_type 0) only")
    _require(all(a is None for a in (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale)),
             "model covers the non-quantised form only")
    a, w = x[0], weight[0]
    _require(a.dim() == 2 and w.dim() == 3 and a.shape[1] == w.shape[1], f"npu_grouped_matmul: x {tuple(a.shape)}, weight {tuple(w.shape)}")
    _require(a.is_contiguous(), "npu_grouped_matmul: x may not be transposed")
    _require(w.is_contiguous() or _transposed_view(w), "npu_grouped_matmul: weight neither contiguous nor a transposed view")
    _require(a.dtype == w.dtype and a.dtype in FLOATS, "npu_grouped_matmul: x and weight dtypes differ")
    _require(group_list is not None and group_list.dim() == 1 and group_list.shape[0] == w.shape[0] <= 1024,
             "npu_grouped_matmul: group_list [E], E <= 1024")
    if group_list_type == 1:
        _require(group_list.shape[0] != 1, "npu_grouped_matmul: a counts group_list may not have length 1")
        counts = group_list.long()
    else:
        _require(group_list_type == 0, "model covers group_list_type 0 / 1")
        counts = torch.diff(group_list.long(), prepend=group_list.new_zeros(1).long())
    _require(bool((counts >= 0).all()) and int(counts.sum()) == a.shape[0], "npu_grouped_matmul: group_list does not cover x's rows")
    out = a.new_empty(a.shape[0], w.shape[2])
    start = 0
    for e, n in enumerate(counts.tolist()):
        out[start:start + n] = (a[start:start + n].float() @ w[e].float()).to(a.dtype)
        start += n
    return [out]


# ---- attention -----------------------------------------------------------------------------
def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, block_table=None, query_rope=None, key_rope=None,
                                    num_heads=1, scale=1.0, pre_tokens=2147483647, next_tokens=2147483647,
                                    input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0,
                                    block_size=0, softmax_lse_flag=False, **quant):
    """OP/npu_fused_infer_attention_score, the TND prefill form only ("TND布局约束"): query [T, N, D],
    key / value [T_kv, KV_N, D]; actual_seq_lengths(_kv) required host lists of cumulative lengths
    (non-decreasing, at most 4096, the last equal to T); without rope Q_D = K_D = 192 with V_D 128 or
    192, or all 128; bf16 (vllm-ascend: "FIA with TND layout only supports bfloat16"); contiguous;
    sparse_mode 3 = rightDownCausal (query i of a sequence sees keys 0 .. lk - lq + i) with the
    optimised 2048x2048 mask (int8 / bool / uint8; VA builds triu(ones, 1)). softmax(scale q k^T) v in float32."""
    CALLS["npu_fused_infer_attention_score"] += 1
    _require(input_layout == "TND", "model covers input_layout TND only")
    _require(block_table is None and query_rope is None and key_rope is None and pse_shift is None and not any(
        v is not None for v in quant.values()), "model covers TND without rope, paging, pse or quantisation")
    _require(query.dtype == torch.bfloat16 and key.dtype == value.dtype == query.dtype, "FIA TND: bfloat16 only")
    _require(all(t.is_contiguous() for t in (query, key, value)), "FIA: inputs must be contiguous")
    _require((query.shape[-1], value.shape[-1]) in ((192, 128), (192, 192), (128, 128)) and key.shape[-1] == query.shape[-1],
             f"FIA TND without rope: Q_D {query.shape[-1]}, K_D {key.shape[-1]}, V_D {value.shape[-1]}")
    _require(num_heads == query.shape[1] and num_key_value_heads in (0, key.shape[1]) and num_heads % key.shape[1] == 0,
             "FIA: num_heads / num_key_value_heads do not match the tensors")
    for name, ends, rows in (("actual_seq_lengths", actual_seq_lengths, query.shape[0]),
                             ("actual_seq_lengths_kv", actual_seq_lengths_kv, key.shape[0])):
        _require(isinstance(ends, (list, tuple)) and all(isinstance(e, int) for e in ends), f"FIA TND: {name} must be a host int list")
        _require(0 < len(ends) <= 4096 and list(ends) == sorted(ends) and ends[0] >= 0 and ends[-1] == rows,
                 f"FIA TND: {name} {ends} is not cumulative lengths ending at {rows}")
    _require(len(actual_seq_lengths) == len(actual_seq_lengths_kv), "FIA TND: q and kv batch counts differ")
    _require(sparse_mode == 3, "model covers sparse_mode 3 only")
    _require(atten_mask is not None and tuple(atten_mask.shape[-2:]) == (2048, 2048) and atten_mask.dtype in (torch.int8, torch.bool, torch.uint8),
             "FIA sparse_mode 3: the optimised 2048x2048 mask is required")
    _require(torch.equal(atten_mask.reshape(2048, 2048).bool(), torch.ones(2048, 2048, dtype=torch.bool).triu(1)),
             "FIA sparse_mode 3: the mask must be triu(ones(2048, 2048), 1)")
    out = query.new_empty(query.shape[0], query.shape[1], value.shape[-1])
    group = num_heads // key.shape[1]
    q0 = k0 = 0
    for q1, k1 in zip(actual_seq_lengths, actual_seq_lengths_kv):
        q, k, v = query[q0:q1].float(), key[k0:k1].float(), value[k0:k1].float()
        lq, lk = q1 - q0, k1 - k0
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        q0, k0 = q1, k1
    return out, torch.zeros(1)


# ---- hyper-connections ---------------------------------------------------------------------
def _mhc_streams(x) -> tuple[int, int, int]:
    _require(x.dim() == 3, "model covers x [T, n, D] only")
    t, n, d = x.shape
    _require(n in (4, 6, 8) and d % 16 == 0 and 1 <= d <= 16384 and t > 0, f"mHC: n {n} not in 4/6/8, or D {d} not 16-aligned <= 16384, or empty")
    return t, n, d


def npu_mhc_pre(x, phi, alpha, bias, *, gamma=None, norm_eps=1e-6, hc_eps=1e-6, out_flag=0, inner_precise=0):
    """OP/npu_mhc_pre; GOLDEN/npu_mhc_pre cpu_op_exec / cpu_op_exec_hy: inv_rms = rsqrt(mean(flatten(x)^2) +
    norm_eps); h_mix = flatten(x) phi^T; H = h_mix * inv_rms * alpha + bias split [pre n | post n | res n*n];
    h_pre = sigmoid(H_pre) + hc_eps, h_post = 2 sigmoid(H_post), h_res = H_res [T, n, n] (alpha [3], phi
    [n^2 + 2n, nD]) or none (alpha [2], phi [2n, nD]); h_in = sum_j h_pre_j x_j in x's dtype. Returns
    (h_in, h_post, h_res, inv_rms, h_mix, h_pre), the last three only with out_flag 1 (empty here otherwise)."""
    CALLS["npu_mhc_pre"] += 1
    t, n, d = _mhc_streams(x)
    _require(x.dtype in HALF, "npu_mhc_pre: x bf16 / fp16")
    _require(gamma is None and inner_precise == 0, "model covers gamma None, inner_precise 0")
    with_res = alpha.shape == (3,)
    rows = n * n + 2 * n if with_res else 2 * n
    _require(alpha.shape in ((3,), (2,)) and phi.shape == (rows, n * d) and bias.shape == (rows,),
             f"npu_mhc_pre: alpha {tuple(alpha.shape)}, phi {tuple(phi.shape)}, bias {tuple(bias.shape)} for n {n}, D {d}")
    _require(phi.dtype == alpha.dtype == bias.dtype == torch.float32, "npu_mhc_pre: phi, alpha, bias float32")
    flat = x.reshape(t, n * d).float()
    inv_rms = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    h_mix = F.linear(flat, phi)
    weight = h_mix * inv_rms
    h_pre = torch.sigmoid(weight[:, :n] * alpha[0] + bias[:n]) + hc_eps
    h_post = 2 * torch.sigmoid(weight[:, n:2 * n] * alpha[1] + bias[n:2 * n])
    h_res = (weight[:, 2 * n:] * alpha[2] + bias[2 * n:]).view(t, n, n) if with_res else torch.zeros(0)
    h_in = (h_pre[:, :, None] * flat.view(t, n, d)).sum(1).to(x.dtype)
    extra = (inv_rms[:, 0], h_mix, h_pre) if out_flag == 1 else (torch.zeros(0),) * 3
    return (h_in, h_post, h_res, *extra)


def npu_mhc_sinkhorn(x, eps=1e-6, num_iters=20, out_flag=0):
    """OP/npu_mhc_sinkhorn; GOLDEN/npu_mhc_sinkhorn: softmax(x, -1) + eps, divided by its column sums + eps,
    then (num_iters - 1) times by its row sums + eps and its column sums + eps. x float32 [T, n, n],
    n in 4/6/8, num_iters in [1, 100]; returns (y, norm_out, sum_out), the last two only with out_flag 1."""
    CALLS["npu_mhc_sinkhorn"] += 1
    _require(x.dtype == torch.float32 and x.dim() == 3 and x.shape[1] == x.shape[2] in (4, 6, 8), "npu_mhc_sinkhorn: x float32 [T, n, n]")
    _require(1 <= num_iters <= 100 and out_flag == 0, "npu_mhc_sinkhorn: num_iters in [1, 100] (model: out_flag 0)")
    y = x.softmax(-1) + eps
    y = y / (y.sum(-2, keepdim=True) + eps)
    for _ in range(num_iters - 1):
        y = y / (y.sum(-1, keepdim=True) + eps)
        y = y / (y.sum(-2, keepdim=True) + eps)
    return y, torch.zeros(0), torch.zeros(0)


def npu_mhc_post(x, h_res, h_out, h_post):
    """OP/npu_mhc_post; GOLDEN/npu_mhc_post cpu_op_exec: y = h_post[.., None] * h_out[:, None] +
    sum_j h_res[t, j, k] x[t, j] (over dim -3 of h_res[.., None] * x[.., None, :]), in x's dtype; x [T, n, D]
    bf16 / fp16, h_res float32 [T, n, n] (None: plain residual), h_out [T, D] of x's dtype, h_post float32 [T, n]."""
    CALLS["npu_mhc_post"] += 1
    t, n, d = _mhc_streams(x)
    _require(x.dtype in HALF and h_out.dtype == x.dtype and h_out.shape == (t, d), "npu_mhc_post: x bf16 / fp16, h_out [T, D] of x's dtype")
    _require(h_post.dtype == torch.float32 and h_post.shape == (t, n), "npu_mhc_post: h_post float32 [T, n]")
    _require(h_res is None or (h_res.dtype == torch.float32 and h_res.shape == (t, n, n)), "npu_mhc_post: h_res float32 [T, n, n]")
    xf = x.float()
    mixed = xf if h_res is None else (h_res[..., None] * xf[:, :, None, :]).sum(1)
    return (h_post[..., None] * h_out.float()[:, None, :] + mixed).to(x.dtype)



# ---- MoE dispatch / combine across the EP group (MC2) -----------------------------------------
# These two communicate: each process is one rank, and ``GROUPS`` (filled by the test) maps the
# group_ep name to the torch.distributed group (gloo) that stands in for the HCCL communicator.
# Modelled: the EP domain only (tp_world_size 0 / 1), no quantisation (quant_mode 0), no shared-
# expert ranks (shared_expert_rank_num 0), no special experts, no mask, comm_alg "". Limits are the
# documents' Atlas A3 ones (the 950 is in neither document's table). Read at op-plugin 04f7867.
GROUPS: dict = {}
MC2_GROUP_ARGS = ("group_ep", "ep_world_size", "moe_expert_num", "group_tp", "tp_world_size", "expert_shard_type",
                  "shared_expert_num", "shared_expert_rank_num", "global_bs")
_MC2_SETTINGS: dict = {}  # group_ep -> this rank's settings at its last dispatch (the combine must repeat them)


def _mc2_settings(*values) -> dict:
    """The arguments every rank must pass alike (MC2_GROUP_ARGS), by name."""
    return dict(zip(MC2_GROUP_ARGS, values, strict=True))


def _mc2_group(settings: dict, ep_rank_id: int, rows: int, where: str):
    """The stand-in group, after checking that every rank passes the same group arguments (the
    documents' 约束说明) and ``ep_rank_id`` is this rank's; returns (group, every rank's row count)."""
    import torch.distributed as dist

    name = settings["group_ep"]
    _require(isinstance(name, str) and 1 <= len(name) < 128, f"{where}: group_ep a name of 1-127 characters")
    group = GROUPS.get(name)
    _require(group is not None, f"{where}: group_ep {name!r} is no HCCL communicator's name")
    size = dist.get_world_size(group)
    _require(settings["ep_world_size"] == size and 2 <= size <= 768, f"{where}: ep_world_size {settings['ep_world_size']}, group of {size}")
    _require(ep_rank_id == dist.get_rank(group), f"{where}: ep_rank_id {ep_rank_id} is not this rank's {dist.get_rank(group)}")
    _require(settings["tp_world_size"] in (0, 1) and settings["group_tp"] in ("", name), f"{where}: no TP domain modelled")
    _require(settings["expert_shard_type"] == 0 and settings["shared_expert_rank_num"] == 0
             and 0 <= settings["shared_expert_num"] <= 4, f"{where}: shared-expert ranks are not modelled")
    experts = settings["moe_expert_num"]
    _require(1 <= experts <= 1024 and experts % size == 0, f"{where}: moe_expert_num {experts} (<= 1024, % ep_world_size == 0)")
    everyone = [None] * size
    dist.all_gather_object(everyone, (settings, rows), group=group)
    _require(all(s == settings for s, _ in everyone), f"{where}: the ranks' group arguments differ: {[s for s, _ in everyone]}")
    return group, [r for _, r in everyone]


def _mc2_exchange(group, send: torch.Tensor, dest: torch.Tensor, size: int) -> tuple[torch.Tensor, list[int]]:
    """Rows of ``send`` to rank ``dest[i]`` each (any dtype gloo takes); returns (received, grouped by source rank, and the counts)."""
    import torch.distributed as dist

    order = torch.argsort(dest, stable=True)
    counts = torch.bincount(dest, minlength=size)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    recv = send.new_empty((int(received.sum()), *send.shape[1:]))
    dist.all_to_all_single(recv, send[order].contiguous(), received.tolist(), counts.tolist(), group=group)
    return recv, received.tolist()


def npu_moe_distribute_dispatch_v2(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales=None,
                                   x_active_mask=None, expert_scales=None, elastic_info=None, performance_info=None,
                                   group_tp="", tp_world_size=0, tp_rank_id=0, expert_shard_type=0, shared_expert_num=1,
                                   shared_expert_rank_num=0, quant_mode=0, global_bs=0, expert_token_nums_type=1,
                                   comm_alg="", zero_expert_num=0, copy_expert_num=0, const_expert_num=0, y_dtype=None,
                                   x_dtype=None, scales_dtype=None):
    """OP/npu_moe_distribute_dispatch_v2 (the A3 limits): each token's K (token, expert) pairs go to the
    rank owning the expert, expert e on rank e // L with L = moe_expert_num / ep_world_size (no
    shared-expert ranks), with x's row unchanged (quant_mode 0) and its expert_scales value.
    x [BS, H] bf16 / fp16, 0 < BS <= 512, H in [1024, 8192]; expert_ids [BS, K] int32, 0 < K <= 16,
    values in [0, moe_expert_num), distinct in a row; expert_scales None or [BS, K] float32;
    global_bs 0 (every rank's BS alike) or at least max_bs x ep_world_size (ranks' BS differ; an upper
    bound, as vllm-ascend passes its MC2 capacity). A = (global_bs or BS x ep_world_size) x min(L, K).
    Returns (expand_x [A, H] of x's dtype, dynamic_scales (none: quant_mode 0), assist_info_for_combine
    [A * 128] int32, expert_token_nums [L] int64 (type 1 counts, type 0 prefix sums), ep_recv_counts
    [ep_world_size * L] int32 (A3's shape, prefix sums), tp_recv_counts [1] int32, expand_scales
    [A] float32 where expert_scales is given (A2's; A3's "" gives None)). expand_x holds the received
    rows grouped by local expert in ascending order (expert_token_nums counts them; vllm-ascend's
    grouped matmul reads them so), within an expert in an order the documents leave open (here:
    source rank descending, then token and k order), and NaN in the rows past them. The element
    values of assist_info / ep_recv_counts / tp_recv_counts / expand_scales are the model's own
    (the documents: pass them to the combine unchanged, rely on nothing in them)."""
    CALLS["npu_moe_distribute_dispatch_v2"] += 1
    where = "npu_moe_distribute_dispatch_v2"
    _require(x.dim() == 2 and x.dtype in HALF, f"{where}: x [BS, H] bfloat16 / float16, got {x.dtype} {tuple(x.shape)}")
    bs, hidden = x.shape
    _require(0 < bs <= 512 and 1024 <= hidden <= 8192, f"{where}: BS {bs} in (0, 512], H {hidden} in [1024, 8192]")
    _require(expert_ids.dtype == torch.int32 and expert_ids.dim() == 2 and expert_ids.shape[0] == bs,
             f"{where}: expert_ids [BS, K] int32, got {expert_ids.dtype} {tuple(expert_ids.shape)}")
    k = expert_ids.shape[1]
    _require(0 < k <= 16 and k <= moe_expert_num, f"{where}: K {k} in (0, 16], <= moe_expert_num")
    ids = expert_ids.long()
    _require(bool(((ids >= 0) & (ids < moe_expert_num)).all()), f"{where}: expert_ids outside [0, moe_expert_num)")
    _require(bool((ids.sort(dim=1).values.diff(dim=1) != 0).all()), f"{where}: an expert twice in a row of expert_ids")
    _require(expert_scales is None or (expert_scales.dtype == torch.float32 and expert_scales.shape == (bs, k)),
             f"{where}: expert_scales [BS, K] float32")
    _require(scales is None and quant_mode == 0 and x_active_mask is None and elastic_info is None and performance_info is None
             and zero_expert_num == copy_expert_num == const_expert_num == 0 and comm_alg == "" and tp_rank_id == 0
             and y_dtype is None and x_dtype is None and scales_dtype is None, f"{where}: only the unquantised EP path is modelled")
    _require(expert_token_nums_type in (0, 1), f"{where}: expert_token_nums_type in [0, 1]")
    settings = _mc2_settings(group_ep, ep_world_size, moe_expert_num, group_tp, tp_world_size, expert_shard_type,
                             shared_expert_num, shared_expert_rank_num, global_bs)
    group, every_bs = _mc2_group(settings, ep_rank_id, bs, where)
    if global_bs == 0:
        _require(len(set(every_bs)) == 1, f"{where}: global_bs 0 with different BS on the ranks {every_bs}")
    else:
        _require(max(every_bs) * ep_world_size <= global_bs, f"{where}: global_bs {global_bs} below max BS {max(every_bs)} x ranks")
    _MC2_SETTINGS[group_ep] = settings
    local_experts = moe_expert_num // ep_world_size
    rows_cap = (global_bs or bs * ep_world_size) * min(local_experts, k)

    token = torch.arange(bs).repeat_interleave(k)
    flat = ids.reshape(-1)
    dest = flat // local_experts
    rows, _ = _mc2_exchange(group, x.float()[token], dest, ep_world_size)  # float32 holds bf16 / fp16 exactly
    meta = torch.stack([torch.full_like(flat, ep_rank_id), token, torch.arange(k).repeat(bs), flat], dim=1)
    meta, _ = _mc2_exchange(group, meta, dest, ep_world_size)  # (source rank, token, k slot, expert)
    weight = None
    if expert_scales is not None:
        weight, _ = _mc2_exchange(group, expert_scales.reshape(-1, 1), dest, ep_world_size)
    local = meta[:, 3] - ep_rank_id * local_experts
    order = torch.argsort(meta[:, 1] * k + meta[:, 2], stable=True)  # token, k
    order = order[torch.argsort(-meta[order, 0], stable=True)]  # source rank, descending
    order = order[torch.argsort(local[order], stable=True)]  # local expert, ascending
    n = rows.shape[0]
    _require(n <= rows_cap, f"{where}: {n} rows received, above A = {rows_cap}")
    expand_x = torch.full((rows_cap, hidden), float("nan"), dtype=x.dtype)
    expand_x[:n] = rows[order].to(x.dtype)
    assist = torch.full((rows_cap, 128), -1, dtype=torch.int32)
    assist[:n, :4] = meta[order].to(torch.int32)
    counts = torch.bincount(local, minlength=local_experts)
    expert_token_nums = counts if expert_token_nums_type == 1 else counts.cumsum(0)
    per_source = torch.zeros(local_experts, ep_world_size, dtype=torch.int64)
    per_source.index_put_((local, meta[:, 0]), torch.ones_like(local), accumulate=True)
    ep_recv_counts = per_source.reshape(-1).cumsum(0).to(torch.int32)
    expand_scales = None
    if weight is not None:
        expand_scales = torch.full((rows_cap,), float("nan"))
        expand_scales[:n] = weight[order, 0]
    return (expand_x, torch.empty(0), assist.reshape(-1), expert_token_nums.to(torch.int64), ep_recv_counts,
            torch.tensor([n], dtype=torch.int32), expand_scales)


def npu_moe_distribute_combine_v2(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, group_ep,
                                  ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None, x_active_mask=None,
                                  expand_scales=None, shared_expert_x=None, elastic_info=None, ori_x=None,
                                  const_expert_alpha_1=None, const_expert_alpha_2=None, const_expert_v=None,
                                  performance_info=None, group_tp="", tp_world_size=0, tp_rank_id=0, expert_shard_type=0,
                                  shared_expert_num=1, shared_expert_rank_num=0, global_bs=0, comm_quant_mode=0,
                                  comm_alg="", zero_expert_num=0, copy_expert_num=0, const_expert_num=0):
    """OP/npu_moe_distribute_combine_v2: the dispatch's path back, x = Sum(expert_scales * ata_out)
    over each token's K experts (no shared_expert_x: no shared-expert ranks), in float32, rounded
    once to expand_x's dtype. expand_x [A, H] bf16 / fp16 (the dispatch's A: its rows in the
    dispatch's order, rows past them ignored); expert_ids [BS, K] int32, the dispatch's;
    expert_scales [BS, K] float32; assist_info_for_combine, ep_send_counts (the dispatch's
    ep_recv_counts), tp_send_counts and expand_scales the dispatch's, unchanged; the group
    arguments the dispatch's, on every rank. Returns [BS, H] of expand_x's dtype."""
    CALLS["npu_moe_distribute_combine_v2"] += 1
    where = "npu_moe_distribute_combine_v2"
    settings = _mc2_settings(group_ep, ep_world_size, moe_expert_num, group_tp, tp_world_size, expert_shard_type,
                             shared_expert_num, shared_expert_rank_num, global_bs)
    _require(_MC2_SETTINGS.get(group_ep) == settings, f"{where}: group arguments unlike the dispatch's {_MC2_SETTINGS.get(group_ep)}")
    _require(expand_x.dim() == 2 and expand_x.dtype in HALF, f"{where}: expand_x [A, H] bfloat16 / float16")
    _require(expert_ids.dtype == torch.int32 and expert_ids.dim() == 2, f"{where}: expert_ids [BS, K] int32")
    bs, k = expert_ids.shape
    _require(expert_scales is not None and expert_scales.dtype == torch.float32 and expert_scales.shape == (bs, k),
             f"{where}: expert_scales [BS, K] float32")
    rows_cap, hidden = expand_x.shape
    local_experts = moe_expert_num // ep_world_size
    _require(assist_info_for_combine.dtype == torch.int32 and assist_info_for_combine.shape == (rows_cap * 128,),
             f"{where}: assist_info_for_combine [A * 128] int32 for expand_x's A = {rows_cap}")
    _require(ep_send_counts.dtype == torch.int32 and ep_send_counts.shape == (ep_world_size * local_experts,),
             f"{where}: ep_send_counts [ep_world_size * local experts] int32")
    _require(tp_send_counts is None or tp_send_counts.dtype == torch.int32, f"{where}: tp_send_counts int32")
    _require(expand_scales is None or (expand_scales.dtype == torch.float32 and expand_scales.shape == (rows_cap,)),
             f"{where}: expand_scales [A] float32")
    _require(x_active_mask is None and shared_expert_x is None and elastic_info is None and ori_x is None
             and const_expert_alpha_1 is None and const_expert_alpha_2 is None and const_expert_v is None
             and performance_info is None and comm_quant_mode == 0 and comm_alg == "" and tp_rank_id == 0
             and zero_expert_num == copy_expert_num == const_expert_num == 0, f"{where}: only the unquantised EP path is modelled")
    group, _ = _mc2_group(settings, ep_rank_id, bs, where)
    n = int(ep_send_counts[-1])
    info = assist_info_for_combine.view(rows_cap, 128)[:n, :4].long()
    rows, _ = _mc2_exchange(group, expand_x[:n].float(), info[:, 0], ep_world_size)
    meta, _ = _mc2_exchange(group, info, info[:, 0], ep_world_size)
    _require(bool((meta[:, 0] == ep_rank_id).all()), f"{where}: rows returned to the wrong rank")
    token, slot, expert = meta[:, 1], meta[:, 2], meta[:, 3]
    _require(bool((expert_ids.long()[token, slot] == expert).all()), f"{where}: expert_ids are not the dispatch's")
    seen = torch.zeros(bs, k, dtype=torch.int64).index_put_((token, slot), torch.ones_like(token), accumulate=True)
    _require(bool((seen == 1).all()), f"{where}: not every (token, expert) pair came back exactly once")
    pairs = torch.zeros(bs, k, hidden)
    pairs[token, slot] = rows
    return (expert_scales[..., None] * pairs).sum(1).to(expand_x.dtype)
