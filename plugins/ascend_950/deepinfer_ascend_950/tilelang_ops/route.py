"""``moe_route_sqrtsoftplus`` (DeepSeek-V4's router) after its gate GEMM, as TileLang kernels.

CANN's ``npu_moe_gating_top_k`` scores with softmax or sigmoid only (no sqrt-softplus mode;
vllm-ascend uses a custom op of its own for V4), so the scoring, the top-k and the weights are
written here. The gate GEMM ``x @ W^T`` in float32 stays a torch matmul in the glue (as the
reference computes it); the kernels take its float32 logits [T, E].

For each token, with s_e = sqrt(softplus(logit_e)) (torch's softplus: the logit itself above 20,
else log1p(exp(logit))):

* ``deepinfer_route_topk``: ids = the top_k of s + correction_bias (a bias of zeros when the
  layer has none: adding +0.0 changes no score), chosen one at a time by the largest value, ties
  to the lower expert id; weights = s at the ids.
* ``deepinfer_route_fixed``: ids are given (V4's hash layers: ``tid2eid`` rows, int32); weights =
  s at them.

Then, when ``renormalize`` (norm_topk_prob), weights / (their sum + 1e-20); times
``routed_scaling_factor`` (a runtime scalar). Outputs: weights [T, k] float32, ids [T, k] int32
(the glue widens them to int64). The order of the k slots is the selection order (largest
first); the op leaves it unspecified.

Work split: tiles of ``TOKEN_TILE`` tokens (their logits, and for top-k their selection scores, in
UB), a persistent loop over the tiles on ``cores`` vector cores; the scores of a tile are one
SIMT pass over [tokens, experts], the selection one SIMT thread per token walking its experts
k times (selection sort: k is 6 to 8 against 256 / 384 experts).
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func's parameter annotations
# (shapes with dynamic dims) when it is defined, from the enclosing scope.

from deepinfer_ascend_950.tilelang_ops._dialect import Dialect

TOPK_NAME = "deepinfer_route_topk"
FIXED_NAME = "deepinfer_route_fixed"
TOKEN_TILE = 32
MAX_EXPERTS = 512  # two float32 [32, E] tiles: 128 KB of UB at 512 experts (V4 Flash 256, Pro 384)
SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus' default


def supports(experts: int, top_k: int) -> bool:
    """Whether the kernels take E experts and top_k: E a multiple of 8 (32-byte rows of float32) up
    to MAX_EXPERTS, 1 <= top_k <= E."""
    return 8 <= experts <= MAX_EXPERTS and experts % 8 == 0 and 1 <= top_k <= experts


def _check(experts, top_k):
    if not supports(experts, top_k):
        raise ValueError(f"moe_route_sqrtsoftplus kernel: unsupported experts={experts} top_k={top_k}")


def route_topk_kernel(experts: int, top_k: int, renormalize: bool, target: str = "ascend", cores: int = 64):
    """Parameters (by name): logits [T, E] float32, bias [E] float32, weights [T, k] float32
    (written), ids [T, k] int32 (written), routed_scaling_factor float32; T dynamic."""
    _check(experts, top_k)
    d = Dialect(target, threads=TOKEN_TILE)
    T = d.T
    tt = TOKEN_TILE
    M = T.dynamic("num_tokens")

    @T.prim_func
    def deepinfer_route_topk(
        logits: T.Tensor((M, experts), "float32"),
        bias: T.Tensor((experts,), "float32"),
        weights: T.Tensor((M, top_k), "float32"),
        ids: T.Tensor((M, top_k), "int32"),
        routed_scaling_factor: T.float32,
    ):
        with d.kernel(cores) as core:
            logit_ub = T.alloc_shared((tt, experts), "float32")
            select_ub = T.alloc_shared((tt, experts), "float32")
            bias_ub = T.alloc_shared((experts,), "float32")
            weight_ub = T.alloc_shared((tt, top_k), "float32")
            id_ub = T.alloc_shared((tt, top_k), "int32")
            T.copy(bias[0:experts], bias_ub)
            for tile in T.serial(core, T.ceildiv(M, tt), cores):
                t0 = tile * tt
                T.copy(logits[t0 : t0 + tt, 0:experts], logit_ub)  # rows past M: read clipped, never stored
                with d.vf(tt):
                    for t, e in T.Parallel(tt, experts):
                        z = logit_ub[t, e]
                        soft = T.if_then_else(z > SOFTPLUS_THRESHOLD, z, T.log1p(T.exp(z)))
                        logit_ub[t, e] = T.sqrt(soft)  # the score s, in place
                        select_ub[t, e] = logit_ub[t, e] + bias_ub[e]
                with d.vf(tt):
                    for t in T.Parallel(tt):
                        total = T.alloc_var("float32")
                        total = 0.0
                        for j in T.serial(top_k):
                            best = T.alloc_var("int32")
                            best = 0
                            for e in T.serial(1, experts):
                                if select_ub[t, e] > select_ub[t, best]:  # strict: ties keep the lower id
                                    best = e
                            id_ub[t, j] = best
                            weight_ub[t, j] = logit_ub[t, best]
                            total += logit_ub[t, best]
                            select_ub[t, best] = -T.infinity("float32")
                        for j in T.serial(top_k):
                            if renormalize:
                                weight_ub[t, j] = weight_ub[t, j] / (total + 1e-20) * routed_scaling_factor
                            else:
                                weight_ub[t, j] = weight_ub[t, j] * routed_scaling_factor
                T.copy(weight_ub, weights[t0 : t0 + tt, 0:top_k])
                T.copy(id_ub, ids[t0 : t0 + tt, 0:top_k])

    return deepinfer_route_topk


def route_fixed_kernel(experts: int, top_k: int, renormalize: bool, target: str = "ascend", cores: int = 64):
    """Parameters (by name): logits [T, E] float32, fixed_ids [T, k] int32, weights [T, k] float32
    (written), routed_scaling_factor float32; T dynamic."""
    _check(experts, top_k)
    d = Dialect(target, threads=TOKEN_TILE)
    T = d.T
    tt = TOKEN_TILE
    M = T.dynamic("num_tokens")

    @T.prim_func
    def deepinfer_route_fixed(
        logits: T.Tensor((M, experts), "float32"),
        fixed_ids: T.Tensor((M, top_k), "int32"),
        weights: T.Tensor((M, top_k), "float32"),
        routed_scaling_factor: T.float32,
    ):
        with d.kernel(cores) as core:
            logit_ub = T.alloc_shared((tt, experts), "float32")
            id_ub = T.alloc_shared((tt, top_k), "int32")
            weight_ub = T.alloc_shared((tt, top_k), "float32")
            for tile in T.serial(core, T.ceildiv(M, tt), cores):
                t0 = tile * tt
                T.copy(logits[t0 : t0 + tt, 0:experts], logit_ub)
                T.copy(fixed_ids[t0 : t0 + tt, 0:top_k], id_ub)
                with d.vf(tt):
                    for t in T.Parallel(tt):
                        total = T.alloc_var("float32")
                        total = 0.0
                        for j in T.serial(top_k):
                            z = logit_ub[t, id_ub[t, j]]
                            s = T.sqrt(T.if_then_else(z > SOFTPLUS_THRESHOLD, z, T.log1p(T.exp(z))))
                            weight_ub[t, j] = s
                            total += s
                        for j in T.serial(top_k):
                            if renormalize:
                                weight_ub[t, j] = weight_ub[t, j] / (total + 1e-20) * routed_scaling_factor
                            else:
                                weight_ub[t, j] = weight_ub[t, j] * routed_scaling_factor
                T.copy(weight_ub, weights[t0 : t0 + tt, 0:top_k])

    return deepinfer_route_fixed
