"""Benchmark of ``deepinfer_nvidia_sm100.kernels.fp8_linear`` (the lead runs it on the GPU): the
Triton block-FP8 GEMM at DeepSeek-V3's and V2-Lite's linear shapes, beside cuBLAS (bf16, the
block-scaled FP8 provider ``deepinfer_nvidia_sm100.cublas_fp8``, and tensor-wise FP8 as the peer)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from deepinfer_core.conformance.checkpoints import quantize_fp8_block
from deepinfer_nvidia_sm100.kernels.fp8_linear import (
    W8A8_FUSED,
    W8A8_PREQUANT,
    W8A16,
    fp8_block_linear_with_config,
    fp8_config,
)


V3_FP8_LINEARS = {  # name: (N, K)
    "q_a_proj": (1536, 7168),
    "q_b_proj": (24576, 1536),
    "kv_a_proj": (576, 7168),
    "kv_b_proj": (32768, 512),
    "o_proj": (7168, 16384),
    "dense_gate_up": (18432, 7168),
    "dense_down": (7168, 18432),
}
V2_LITE_LINEARS = {  # V2-Lite is shipped in bf16; timed in FP8 for the kernel's sake
    "v2lite_q_proj": (3072, 2048),
    "v2lite_kv_a_proj": (576, 2048),
    "v2lite_kv_b_proj": (4096, 512),
    "v2lite_o_proj": (2048, 2048),
    "v2lite_dense_gate_up": (21888, 2048),
    "v2lite_dense_down": (2048, 10944),
}
BENCH_TOKENS = (1, 4, 16, 64, 256, 1024, 4096)


def bench(device: str = "cuda") -> list[dict]:
    """Median times (ms) of fp8_block_linear (the Triton GEMM), of cuBLAS's block-scaled FP8 GEMM
    as the provider runs it (``fp8_block_linear[cublas]``, quantisation pre-pass included), of
    cuBLAS FP8 with one scale per tensor on operands already in e4m3 (``fp8_tensorwise_cublas``:
    the FP8 rate cuBLAS reaches at that shape, the peer) and of the same GEMM in bf16 through cuBLAS."""
    from deepinfer_nvidia_sm100 import cublas_fp8

    block = (128, 128)
    peers = cublas_fp8.supported(device)
    results = []
    for name, (n, k) in {**V3_FP8_LINEARS, **V2_LITE_LINEARS}.items():
        weight, scale = quantize_fp8_block(torch.randn(n, k, device=device) / k**0.5, block)
        w_bf16 = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        scale_bytes = scale.numel() * 4
        for m in BENCH_TOKENS:
            first = len(results)  # this shape's records start here
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            cfg = fp8_config(m, n, k, block[1], x.dtype, x.device)
            flops = 2 * m * n * k
            variants = {"": cfg}
            if cfg.mode != W8A16:  # time both W8A8 variants (and W8A16) where the heuristic picks W8A8
                variants = {
                    f"[{label}]": cfg._replace(mode=mode)
                    for label, mode in (("fused", W8A8_FUSED), ("prequant", W8A8_PREQUANT), ("w8a16", W8A16))
                }
            for label, c in variants.items():
                ms = triton.testing.do_bench(
                    lambda: fp8_block_linear_with_config(x, weight, scale, block, None, c), return_mode="median"
                )
                results.append({
                    "name": f"fp8_block_linear{label}/{name}", "shape": {"M": m, "N": n, "K": k}, "ms": ms,
                    "bytes": m * k * 2 + n * k + scale_bytes + m * n * 2, "flops": flops,
                    "config": c._asdict(),
                })
            ms = triton.testing.do_bench(lambda: F.linear(x, w_bf16), return_mode="median")
            results.append({
                "name": f"bf16_cublas/{name}", "shape": {"M": m, "N": n, "K": k}, "ms": ms,
                "bytes": m * k * 2 + n * k * 2 + m * n * 2, "flops": flops,
            })
            if peers and k % block[1] == 0 and n % 8 == 0:
                results += _cublas_cases(name, x, weight, scale, results[first:])
    return results


def _cublas_cases(name: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, others: list[dict]) -> list[dict]:
    """bench()'s cuBLAS cases at one shape (the provider, the tensor-wise FP8 peer); a case that
    fails is printed and left out, not the module's other cases. The provider's record and the
    FP8 records of ``others`` (the Triton GEMM's at this shape) get ``vs_cublas_fp8`` = the peer's
    time / theirs (1.0: as fast as cuBLAS FP8 with one scale per tensor)."""
    from deepinfer_nvidia_sm100 import cublas_fp8

    (m, k), n = x.shape, weight.shape[0]
    shape = {"M": m, "N": n, "K": k}
    a = x.to(torch.float8_e4m3fn)
    one = torch.ones((), device=x.device)
    cases = {
        "fp8_block_linear[cublas]": (lambda: cublas_fp8.block_fp8_linear(x, weight, scale),
                                     m * k * 2 + n * k + scale.numel() * 4 + m * n * 2),
        # operands already e4m3, one scale each: the FP8 rate cuBLAS itself reaches at this shape
        "fp8_tensorwise_cublas": (lambda: F.scaled_mm(a, weight.t(), scale_a=one, scale_recipe_a=F.ScalingType.TensorWise,
                                                      scale_b=one, scale_recipe_b=F.ScalingType.TensorWise,
                                                      output_dtype=torch.bfloat16),
                                  m * k + n * k + m * n * 2),
    }
    out = []
    for label, (fn, nbytes) in cases.items():
        try:
            ms = triton.testing.do_bench(fn, return_mode="median")
        except Exception as e:  # noqa: BLE001 - recorded as missing, the other cases still run
            print(f"[kernels] {label}/{name} {shape}: {type(e).__name__}: {e}", flush=True)
            continue
        out.append({"name": f"{label}/{name}", "shape": shape, "ms": ms, "bytes": nbytes, "flops": 2 * m * n * k})
    peer = next((r["ms"] for r in out if r["name"].startswith("fp8_tensorwise_cublas")), None)
    if peer is not None:
        for record in out[:-1] + [r for r in others if r["name"].startswith("fp8_block_linear")]:
            record["vs_cublas_fp8"] = peer / record["ms"]
    return out
