"""Benchmark of ``deepinfer_nvidia_sm100.kernels.bitmask`` (the lead runs it on the GPU):
``apply_token_bitmask`` against the reference op at V3's and V2-Lite's vocabularies."""

from __future__ import annotations

import torch
import triton

from deepinfer_nvidia_sm100.kernels.bitmask import apply_token_bitmask


def bench(device="cuda") -> list[dict]:
    """Median times (ms, triton.testing.do_bench) of the kernel and the reference at V3's and
    V2-Lite's vocabularies, 1..256 rows, half the tokens allowed."""
    from triton.testing import do_bench

    from deepinfer_core.ops.sampling import apply_token_bitmask as reference

    results = []
    gen = torch.Generator(device=device).manual_seed(0)
    for vocab in (129280, 102400):
        words = triton.cdiv(vocab, 32)
        for rows in (1, 32, 256):
            logits = torch.randn(rows, vocab, device=device, generator=gen)
            bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, device=device, generator=gen)
            for impl, fn in {"triton": apply_token_bitmask, "reference": reference}.items():
                results.append({
                    "name": f"apply_token_bitmask[{impl}]",
                    "shape": {"rows": rows, "vocab": vocab},
                    "ms": do_bench(lambda fn=fn: fn(logits, bitmask), return_mode="median"),
                    "bytes": 2 * logits.numel() * 4 + bitmask.numel() * 4,
                    "flops": 0,
                })
    return results
