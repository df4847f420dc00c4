"""Benchmark of ``deepinfer_nvidia_sm100.kernels.compress`` (the lead runs it on the GPU): V4's
``compress_entries`` at V4-Flash's compressors (CSA 512 wide over 8 slots, its indexer's 128,
HCA 512 over 128 slots), decode steps and one prefill chunk, bf16 entries, beside the reference
op on the same inputs (torch: gather, masks, compress_pool's softmax and sum, rms_norm_f32,
rotary_embedding). The pools are laid out as the model's: this step's rows and the state ring,
column slices of V4-Flash's CSA rows (2560 wide: compressor [0, 2048), indexer [2048, 2560))."""

from __future__ import annotations

import torch

from deepinfer_core.ops import sparse as reference
from deepinfer_core.ops.rope import rope_cos_sin_table
from deepinfer_nvidia_sm100.kernels.compress import compress_entries

BENCH_DTYPE = torch.bfloat16
DECODE_TOKENS = (1, 8, 64, 256)
PREFILL_TOKENS = 8192
RING = 128  # state ring rows a sequence (the HCA window's 128)
# name: (ratio, overlap, dim, column offset in the row, row width)
COMPRESSORS = {"csa": (4, True, 512, 0, 2560), "indexer": (4, True, 128, 2048, 2560), "hca": (128, False, 512, 0, 1024)}


def _inputs(ratio: int, overlap: bool, dim: int, col: int, width: int, tokens: int, decode: bool, device, gen):
    """compress_entries' arguments: decode (every token pools a window: its own row last, the
    rest from its sequence's ring) or a prefill chunk from position 0 (the windows that close in it)."""
    span = 2 * ratio if overlap else ratio
    r = 4 * dim if overlap else 2 * dim
    rows = torch.randn(tokens, width, device=device, generator=gen)[:, col : col + r]
    if decode:
        state = torch.randn(tokens * RING, width, device=device, generator=gen)[:, col : col + r]
        b = torch.arange(tokens, device=device)[:, None]
        older = tokens + b * RING + torch.arange(span - 1, device=device)[None, :]
        windows = torch.cat([older, b], dim=1)
        positions = 37 * torch.arange(tokens, device=device) % 3000 // ratio * ratio
    else:
        state = rows[:0]
        ends = torch.arange(tokens // ratio, device=device) * ratio + ratio - 1
        windows = ends[:, None] - span + 1 + torch.arange(span, device=device)[None, :]
        windows = torch.where(windows >= 0, windows, torch.full_like(windows, -1))
        positions = ends - (ratio - 1)
    table = rope_cos_sin_table(64, 10000.0, None, max(4096, tokens)).to(device)
    weight = 1 + 0.1 * torch.randn(dim, device=device, generator=gen)
    return rows, state, windows, positions, weight, 1e-6, table, overlap, BENCH_DTYPE


def bench(device: str = "cuda") -> list[dict]:
    """Median times (ms), Triton and reference (``name[impl]``); the Triton case carries
    ``vs_reference``. bytes: each window's kv and gate values as read (float32, span x 2 dim per
    entry: decode windows are distinct rows), the indices, the entries written."""
    from triton.testing import do_bench

    gen = torch.Generator(device=device).manual_seed(0)
    results = []
    for name, (ratio, overlap, dim, col, width) in COMPRESSORS.items():
        cases = [("decode", t) for t in DECODE_TOKENS] + [("prefill", PREFILL_TOKENS)]
        for phase, tokens in cases:
            args = _inputs(ratio, overlap, dim, col, width, tokens, phase == "decode", device, gen)
            windows = args[2]
            n, span = windows.shape
            nbytes = n * span * 2 * dim * 4 + windows.numel() * 8 + n * dim * BENCH_DTYPE.itemsize
            shape = {"compressor": name, "phase": phase, "tokens": tokens, "entries": n, "span": span, "dim": dim}
            ours = do_bench(lambda: compress_entries(*args), return_mode="median")
            theirs = do_bench(lambda: reference.compress_entries(*args), return_mode="median")
            record = {"shape": shape, "bytes": nbytes, "flops": n * span * dim * 6}
            results.append({"name": f"compress_entries {name} {phase}[triton]", "ms": ours, "vs_reference": theirs / ours,
                            **record})
            results.append({"name": f"compress_entries {name} {phase}[reference]", "ms": theirs, **record})
            del args, windows
        torch.cuda.empty_cache()
    return results
