"""Benchmark of ``deepinfer_nvidia_sm100.kernels.moe`` (the lead runs it on the GPU): the grouped-GEMM
experts (V3 bf16 / FP8, V2-Lite bf16; FP8 beside DeepGEMM through ``deepinfer_nvidia_sm100.deepgemm``
where it runs) and the routing kernel (V3, V2-Lite gates); DeepSeek-V4-Flash's clamped experts (bf16 / FP8) and
sqrt-softplus routing (top-k and hash layers), the latter beside the torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from deepinfer_core.conformance.checkpoints import FP8_MAX
from deepinfer_core.ops import REFERENCE_OPS

# _run_experts and _route are private helpers of the kernel module, imported by name: the bench times
# the experts at given tiles and W8A8 switch (_run_experts) and the routing behind either gate GEMM
# (_route), which the public ops do not expose.
from deepinfer_nvidia_sm100.kernels.moe import _route, _run_experts, expert_tiles, gate_partials, moe_route_sqrtsoftplus


BENCH_TOKENS = (1, 8, 32, 64, 256, 512, 1024, 4096, 16384)
BENCH_ROUTE_TOKENS = (1, 8, 16, 64, 128, 4096)
# name -> (hidden, intermediate, experts, top_k)
BENCH_EXPERT_MODELS = {"V3": (7168, 2048, 256, 8), "V2-Lite": (2048, 1408, 64, 6)}
# name -> gate (hidden, experts, top_k, n_group, topk_group, scoring_func, topk_method)
BENCH_ROUTE_MODELS = {"V3": (7168, 256, 8, 8, 4, "sigmoid", "noaux_tc"), "V2-Lite": (2048, 64, 6, 1, 1, "softmax", "greedy")}
BENCH_DTYPE = torch.bfloat16
# DeepSeek-V4-Flash: experts (hidden, intermediate, experts, top_k, swiglu_limit) and its gate
# (hidden, experts, top_k, routed_scaling_factor), at these token counts.
BENCH_V4_TOKENS = (1, 8, 64, 2048)
BENCH_V4_EXPERTS = {"V4-Flash": (4096, 2048, 256, 6, 10.0)}
BENCH_V4_ROUTE = {"V4-Flash": (4096, 256, 6, 1.5)}


def _bench_weights(experts: int, rows: int, cols: int, fp8: bool, device: str):
    """Random expert weights [experts, rows, cols] (bf16, or e4m3 with 128x128 float32 scales)."""
    if not fp8:
        return torch.randn(experts, rows, cols, device=device, dtype=BENCH_DTYPE) / cols**0.5, None
    w = torch.empty(experts, rows, cols, device=device, dtype=torch.float8_e4m3fn)
    for e in range(experts):  # one expert at a time bounds the float32 temporary
        w[e] = (torch.randn(rows, cols, device=device) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale = torch.full((experts, triton.cdiv(rows, 128), triton.cdiv(cols, 128)), 0.01 / cols**0.5, device=device)
    return w, scale


def bench(device: str = "cuda") -> list[dict]:
    """Median times (ms) of moe_experts (V3 bf16 / FP8, V2-Lite bf16) and moe_route (V3, V2-Lite
    gates), the latter beside ``moe_route/<model>/torch-gate``: the same routing kernel after
    torch's float32 gate GEMM (a cast of x, then cuBLAS), what ``gate_partials`` replaces up to
    ROUTE_GEMV_MAX_TOKENS tokens.

    bytes = weights (and scales) of the experts actually hit + x + the output (+ ids and weights);
    flops = 2 * T * k * 3 * D * I for the experts, 2 * T * D * E for the gate GEMM.
    """
    from triton.testing import do_bench

    from deepinfer_nvidia_sm100 import deepgemm

    results = []
    for model, (hidden, inter, experts, top_k) in BENCH_EXPERT_MODELS.items():
        for fp8 in (False, True) if model == "V3" else (False,):
            w13, s13 = _bench_weights(experts, 2 * inter, hidden, fp8, device)
            w2, s2 = _bench_weights(experts, hidden, inter, fp8, device)
            block = (128, 128) if fp8 else None
            per_expert = w13[0].numel() * w13.element_size() + w2[0].numel() * w2.element_size()
            if fp8:
                per_expert += (s13[0].numel() + s2[0].numel()) * 4
            # FP8 also in W8A8 (FP8_W8A8_MIN_BLOCK_M), to weigh its speed against its error.
            for mode in ("fp8", "fp8-w8a8") if fp8 else ("bf16",):
                for tokens in BENCH_TOKENS:
                    x = torch.randn(tokens, hidden, device=device, dtype=BENCH_DTYPE)
                    ids = torch.rand(tokens, experts, device=device).topk(top_k, dim=-1).indices
                    weights = torch.rand(tokens, top_k, device=device)
                    hit = int(torch.unique(ids).numel())
                    tiles = expert_tiles(ids.numel(), experts)
                    act_quant = mode == "fp8-w8a8"

                    def run():
                        return _run_experts(x, w13, w2, weights, ids, s13, s2, block, tiles, act_quant)

                    record = {
                        "shape": {"T": tokens, "D": hidden, "I": inter, "E": experts, "k": top_k, "experts_hit": hit},
                        "bytes": hit * per_expert + 2 * tokens * hidden * x.element_size() + tokens * top_k * 12,
                        "flops": 2 * tokens * top_k * 3 * hidden * inter,
                    }
                    ms = do_bench(run, return_mode="median")
                    results.append({"name": f"moe_experts/{model}/{mode}", "ms": ms, **record, "config": tiles._asdict()})
                    if mode == "fp8" and deepgemm.supported(device):  # DeepGEMM beside it, wherever it runs
                        peer = lambda: deepgemm.grouped_experts(x, w13, w2, weights, ids, s13, s2)  # noqa: E731
                        peer_ms = do_bench(peer, return_mode="median")
                        results[-1]["vs_deepgemm"] = peer_ms / ms
                        results.append({"name": f"moe_experts/{model}/fp8 [deepgemm]", "ms": peer_ms, "peer": deepgemm.version(),
                                        "provider_takes_it": deepgemm.fits(x, w13, w2, ids, s13, s2, block), **record})
            del w13, w2, s13, s2
            torch.cuda.empty_cache()

    torch_gate = lambda a, w: F.linear(a.float(), w.float())[None]  # noqa: E731 - the path gate_partials replaces
    for model, (hidden, experts, top_k, n_group, topk_group, scoring, method) in BENCH_ROUTE_MODELS.items():
        gate = torch.randn(experts, hidden, device=device) / hidden**0.5
        bias = 0.1 * torch.randn(experts, device=device)
        route = dict(top_k=top_k, scoring_func=scoring, topk_method=method, n_group=n_group, topk_group=topk_group,
                     norm_topk_prob=True, routed_scaling_factor=2.5)
        for tokens in BENCH_ROUTE_TOKENS:
            x = torch.randn(tokens, hidden, device=device, dtype=BENCH_DTYPE)
            for name, parts_of in ((f"moe_route/{model}", gate_partials), (f"moe_route/{model}/torch-gate", torch_gate)):
                results.append({
                    "name": name,
                    "shape": {"T": tokens, "D": hidden, "E": experts, "k": top_k},
                    "ms": do_bench(lambda: _route(x, gate, bias, parts_of, **route), return_mode="median"),
                    "bytes": tokens * hidden * x.element_size() + experts * hidden * 4 + experts * 4 + tokens * top_k * 12,
                    "flops": 2 * tokens * hidden * experts,
                })
    results += _bench_v4(device, do_bench)
    return results


def _bench_v4(device: str, do_bench) -> list[dict]:
    """moe_experts_clamped at V4-Flash's experts (bf16, FP8 [128, 128] W8A16) and
    moe_route_sqrtsoftplus at its gate (bf16 weight; top-k with a bias, and hash layers with fixed
    ids), each routing case beside ``<name> [torch]``, the reference op (a cast, cuBLAS float32,
    torch's topk and gather)."""
    results = []
    for model, (hidden, inter, experts, top_k, limit) in BENCH_V4_EXPERTS.items():
        for fp8 in (False, True):
            w13, s13 = _bench_weights(experts, 2 * inter, hidden, fp8, device)
            w2, s2 = _bench_weights(experts, hidden, inter, fp8, device)
            block = (128, 128) if fp8 else None
            per_expert = w13[0].numel() * w13.element_size() + w2[0].numel() * w2.element_size()
            if fp8:
                per_expert += (s13[0].numel() + s2[0].numel()) * 4
            for tokens in BENCH_V4_TOKENS:
                x = torch.randn(tokens, hidden, device=device, dtype=BENCH_DTYPE)
                ids = torch.rand(tokens, experts, device=device).topk(top_k, dim=-1).indices
                weights = torch.rand(tokens, top_k, device=device)
                tiles = expert_tiles(ids.numel(), experts)
                hit = int(torch.unique(ids).numel())

                def run():
                    return _run_experts(x, w13, w2, weights, ids, s13, s2, block, tiles, False, limit=limit)

                results.append({
                    "name": f"moe_experts_clamped/{model}/{'fp8' if fp8 else 'bf16'}",
                    "shape": {"T": tokens, "D": hidden, "I": inter, "E": experts, "k": top_k, "experts_hit": hit},
                    "ms": do_bench(run, return_mode="median"),
                    "bytes": hit * per_expert + 2 * tokens * hidden * x.element_size() + tokens * top_k * 12,
                    "flops": 2 * tokens * top_k * 3 * hidden * inter,
                    "config": tiles._asdict(),
                })
            del w13, w2, s13, s2
            torch.cuda.empty_cache()

    reference = REFERENCE_OPS["moe_route_sqrtsoftplus"]
    for model, (hidden, experts, top_k, scaling) in BENCH_V4_ROUTE.items():
        gate = (torch.randn(experts, hidden, device=device) / hidden**0.5).to(BENCH_DTYPE)
        bias = 0.1 * torch.randn(experts, device=device)
        kw = dict(top_k=top_k, norm_topk_prob=True, routed_scaling_factor=scaling)
        for tokens in BENCH_V4_TOKENS:
            x = torch.randn(tokens, hidden, device=device, dtype=BENCH_DTYPE)
            fixed = torch.rand(tokens, experts, device=device).topk(top_k, dim=-1).indices
            for mode, b, ids in (("", bias, None), ("/hash", None, fixed)):
                gate_bytes = (tokens * top_k if ids is not None else experts) * hidden * gate.element_size()
                record = {
                    "shape": {"T": tokens, "D": hidden, "E": experts, "k": top_k},
                    "bytes": tokens * hidden * x.element_size() + min(gate_bytes, experts * hidden * gate.element_size())
                    + tokens * top_k * (20 if ids is not None else 12),  # (fixed ids read,) weights and ids written
                    "flops": 2 * tokens * hidden * (top_k if ids is not None else experts),
                }
                name = f"moe_route_sqrtsoftplus/{model}{mode}"
                ms = do_bench(lambda: moe_route_sqrtsoftplus(x, gate, b, ids, **kw), return_mode="median")
                peer_ms = do_bench(lambda: reference(x, gate, b, ids, **kw), return_mode="median")
                results.append({"name": name, "ms": ms, "vs_torch": peer_ms / ms, **record})
                results.append({"name": f"{name} [torch]", "ms": peer_ms, **record})
    return results
