"""Benchmark of ``deepinfer_nvidia_sm100.kernels.elementwise`` (the lead runs it on the GPU):
RMSNorm, add + RMSNorm, SiLU-and-mul and RoPE at DeepSeek-V3 and V2-Lite dims."""

from __future__ import annotations

import torch
import triton

from deepinfer_nvidia_sm100.kernels.elementwise import add_rms_norm, rms_norm, rotary_embedding, silu_and_mul


BENCH_TOKENS = (1, 64, 4096)


def bench(device: str = "cuda") -> list[dict]:
    """Median times (ms) and bytes moved of the elementwise kernels at DeepSeek-V3 and V2-Lite dims, bf16."""
    dt = torch.bfloat16
    el = 2
    results = []

    def run(name, shape, fn, nbytes, flops=0):
        ms = triton.testing.do_bench(fn, return_mode="median")
        results.append({"name": name, "shape": shape, "ms": ms, "bytes": nbytes, "flops": flops})

    for t in BENCH_TOKENS:
        for model, hidden in (("v3", 7168), ("v3_q_lora", 1536), ("kv_lora", 512), ("v2lite", 2048)):
            x = torch.randn(t, hidden, device=device, dtype=dt)
            res = torch.randn_like(x)
            w = 1 + 0.1 * torch.randn(hidden, device=device, dtype=dt)
            shape = {"tokens": t, "hidden": hidden}
            run(f"rms_norm/{model}", shape, lambda: rms_norm(x, w, 1e-6), 2 * t * hidden * el + hidden * el, 4 * t * hidden)
            run(f"add_rms_norm/{model}", shape, lambda: add_rms_norm(x, res, w, 1e-6), 4 * t * hidden * el + hidden * el, 5 * t * hidden)
        for model, inter in (("v3_dense", 18432), ("v3_expert", 2048), ("v2lite_expert", 1408)):
            x = torch.randn(t, 2 * inter, device=device, dtype=dt)
            run(f"silu_and_mul/{model}", {"tokens": t, "intermediate": inter}, lambda: silu_and_mul(x), 3 * t * inter * el, 6 * t * inter)
        for model, heads in (("v3", 128), ("v2lite", 16)):
            # q_pe / k_pe are column slices of wider tensors, as in MLA: q [T, H, 192], kv_a out [T, 576].
            q = torch.randn(t, heads, 192, device=device, dtype=dt)[..., 128:]
            k = torch.randn(t, 576, device=device, dtype=dt)[:, 512:]
            cos_sin = torch.randn(163840, 64, device=device)
            pos = torch.randint(0, 163840, (t,), device=device)
            nbytes = 2 * (t * heads * 64 + t * 64) * el + t * 64 * 4 + t * 8
            run(f"rotary_embedding/{model}", {"tokens": t, "heads": heads, "rope_dim": 64}, lambda: rotary_embedding(q, k, pos, cos_sin, True), nbytes, 6 * t * (heads + 1) * 32)
    return results
