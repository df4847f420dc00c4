"""Benchmark of ``deepinfer_nvidia_sm100.kernels.sparse`` (the lead runs it on the GPU): V4's
sparse_attention at decode and prefill shapes, beside the reference op (torch: gather + einsum +
softmax, deepinfer_core.ops.sparse) on the same inputs, and the same pool passed as the V4
model's three pools in place (``[3 pools]``: NEW_ROWS new rows, a paged window ring viewed as
rows, the compressed entries a row-strided slice of a wider cache) against concatenating them
first, as the model did (``[cat + 1 pool]``)."""

from __future__ import annotations

import torch

from deepinfer_core.ops import sparse as reference
from deepinfer_nvidia_sm100.kernels.sparse import sparse_attention

HEAD_DIM = 512
POOL = 8192  # key pool rows: the batch's window rings and compressed entries
NEW_ROWS, RING_ROWS = 64, 4096  # the [3 pools] split: new rows, window ring rows, then the entries


def _three_pools(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kv`` as the model's pools: new rows (contiguous), the window ring [blocks, 128, d] viewed
    as [-1, d], the entries a row slice of a cache 64 columns wider (row-strided)."""
    d = kv.shape[1]
    new = kv[:NEW_ROWS].clone()
    ring = kv[NEW_ROWS : NEW_ROWS + RING_ROWS].clone().view(-1, 128, d).view(-1, d)
    rest = kv[NEW_ROWS + RING_ROWS :]
    wide = torch.empty(rest.shape[0], d + 64, dtype=kv.dtype, device=kv.device)
    wide[:, :d] = rest
    return new, ring, wide[:, :d]


def _cases():
    """(T, H, K): decode T = 1, 8, 64 at Flash (64) and Pro (128) heads over a CSA row (window
    128 + top-512 = 640) and a Pro CSA row (128 + top-1024 = 1152); prefill 2048 queries x 640."""
    for heads in (64, 128):
        for keys in (640, 1152):
            for t in (1, 8, 64):
                yield "decode", t, heads, keys
    for heads in (64, 128):
        yield "prefill", 2048, heads, 640


def bench(device: str = "cuda") -> list[dict]:
    """Time sparse_attention (ours, and the reference op as ``[reference]``), bf16.

    bytes = the kv rows the queries name, as each query reads them (T x K x 512 x 2: decode
    queries name distinct rows; prefill neighbours share most of theirs, which L2 serves) + q +
    out + the index rows; ``unique_kv_bytes`` = the distinct pool rows named (what HBM must
    deliver at least). flops = 2 x T x H x K x (512 + 512): q . k and p v.
    """
    from triton.testing import do_bench

    dtype = torch.bfloat16
    elem = torch.finfo(dtype).bits // 8
    scale = HEAD_DIM**-0.5
    results = []
    gen = torch.Generator(device=device).manual_seed(0)
    for phase, t, heads, keys in _cases():
        q = torch.randn(t, heads, HEAD_DIM, device=device, dtype=dtype, generator=gen)
        kv = torch.randn(POOL, HEAD_DIM, device=device, dtype=dtype, generator=gen)
        sinks = torch.randn(heads, device=device, generator=gen)
        # distinct rows per query: a shared permutation's first K entries shifted per query
        perm = torch.randperm(POOL, device=device, generator=gen)[:keys]
        shift = torch.randint(0, POOL, (t, 1), device=device, generator=gen)
        indices = (perm[None, :] + shift) % POOL
        unique = torch.unique(indices).numel()
        record = {
            "shape": {"phase": phase, "tokens": t, "heads": heads, "keys": keys, "head_dim": HEAD_DIM, "pool": POOL},
            "bytes": t * keys * HEAD_DIM * elem + 2 * q.numel() * elem + indices.numel() * 8,
            "unique_kv_bytes": unique * HEAD_DIM * elem,
            "flops": 2 * t * heads * keys * 2 * HEAD_DIM,
        }
        name = f"sparse_attention {phase} H={heads} K={keys}"
        ours = do_bench(lambda: sparse_attention(q, kv, indices, sinks, scale), return_mode="median")
        peer = do_bench(lambda: reference.sparse_attention(q, kv, indices, sinks, scale), return_mode="median")
        results.append({"name": name, "ms": ours, "vs_reference": peer / ours, **record})
        results.append({"name": f"{name} [reference]", "ms": peer, **record})
        pools = _three_pools(kv)
        split = do_bench(lambda: sparse_attention(q, pools, indices, sinks, scale), return_mode="median")
        cat = do_bench(lambda: sparse_attention(q, torch.cat(pools), indices, sinks, scale), return_mode="median")
        results.append({"name": f"{name} [3 pools]", "ms": split, "vs_one_pool": ours / split, "vs_cat": cat / split, **record})
        results.append({"name": f"{name} [cat + 1 pool]", "ms": cat, **record})
        del q, kv, sinks, indices, pools
    return results
