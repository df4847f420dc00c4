"""Benchmark of ``deepinfer_nvidia_sm100.kernels.cache`` (the lead runs it on the GPU): the paged
MLA latent-cache write and gather kernels."""

from __future__ import annotations

import torch
import triton

from deepinfer_nvidia_sm100.kernels.cache import gather_latent_cache, write_latent_cache


BENCH_TOKENS = (1, 64, 4096)


def bench(device: str = "cuda") -> list[dict]:
    """Median times (ms) and bytes moved of the cache kernels (V3/V2-Lite MLA: 512 + 64, bf16)."""
    dt, el = torch.bfloat16, 2
    num_blocks, block_size, d_c, d_r = 4096, 64, 512, 64
    cache = torch.randn(num_blocks, block_size, d_c + d_r, device=device, dtype=dt)
    results = []
    for t in BENCH_TOKENS:
        kv = torch.randn(t, d_c + d_r, device=device, dtype=dt)  # kv_a_proj output: latent | k_pe
        latent, k_pe = kv[:, :d_c], kv[:, d_c:]
        slots = torch.randperm(num_blocks * block_size, device=device)[:t]
        shape = {"tokens": t, "block_size": block_size, "entry": d_c + d_r}
        entry_bytes = t * (d_c + d_r) * el
        ms = triton.testing.do_bench(lambda: write_latent_cache(cache, latent, k_pe, slots), return_mode="median")
        results.append({"name": "write_latent_cache", "shape": shape, "ms": ms, "bytes": 2 * entry_bytes + t * 8, "flops": 0})
        ms = triton.testing.do_bench(lambda: gather_latent_cache(cache, slots), return_mode="median")
        results.append({"name": "gather_latent_cache", "shape": shape, "ms": ms, "bytes": 2 * entry_bytes + t * 8, "flops": 0})
    return results
