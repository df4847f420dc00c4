"""Benchmark of ``deepinfer_nvidia_sm100.kernels.sampling`` (the lead runs it on the GPU): the shapes,
and a cost model; ``sample_tokens`` whole, its sampling kernels alone, and the reference op."""

from __future__ import annotations

import torch

# _race and _thresholds are private helpers of the kernel module, imported by name: the bench times
# the sampling kernels alone (_race) on thresholds computed beforehand (_thresholds).
from deepinfer_nvidia_sm100.kernels.sampling import _race, _thresholds, sample_tokens


# bench(): the shapes, and a cost model. Logits are read once; per token of a sampled row the
# kernel spends about this many float ops besides Philox (scale, two logs, series, compares, selects).
BENCH_VOCABS = (129280, 102400)  # DeepSeek-V3, V2-Lite
BENCH_ROWS = (1, 32, 256)
BENCH_CASES = {  # name: (temperature, top_k, top_p)
    "greedy": (0.0, 0, 1.0),
    "temperature": (0.8, 0, 1.0),
    "top_p0.9_top_k50": (0.8, 50, 0.9),
}
SAMPLED_FLOPS_PER_TOKEN = 16
GREEDY_FLOPS_PER_TOKEN = 2


def bench(device="cuda") -> list[dict]:
    """Median times (ms, triton.testing.do_bench) at BENCH_VOCABS x BENCH_ROWS x BENCH_CASES of:
    ``triton`` the whole op (thresholds, the one host read, kernels), ``triton-kernel`` the
    sampling kernels alone (thresholds precomputed), and ``reference`` the reference op."""
    from triton.testing import do_bench

    from deepinfer_core.ops.sampling import sample_tokens as reference

    results = []
    gen = torch.Generator(device=device).manual_seed(0)
    for vocab in BENCH_VOCABS:
        for rows in BENCH_ROWS:
            logits = torch.randn(rows, vocab, device=device, generator=gen) * 3
            seeds = torch.arange(rows, dtype=torch.int64, device=device)
            steps = torch.full((rows,), 5, dtype=torch.int64, device=device)
            out = torch.empty(rows, dtype=torch.int64, device=device)
            for case, (t, k, p) in BENCH_CASES.items():
                args = (
                    logits,
                    torch.full((rows,), t, device=device),
                    torch.full((rows,), k, dtype=torch.int64, device=device),
                    torch.full((rows,), p, device=device),
                    torch.zeros(rows, device=device),
                    seeds,
                    steps,
                )
                threshold = _thresholds(*args[:5], host_read=True)
                impls = {
                    "triton": lambda: sample_tokens(*args),
                    "triton-kernel": lambda: _race(logits, args[1], threshold, seeds, steps, out),
                    "reference": lambda: reference(*args),
                }
                nbytes = logits.numel() * logits.element_size() + rows * (4 + 8 + 4 + 4 + 8 + 8) + rows * 8
                per_token = GREEDY_FLOPS_PER_TOKEN if t == 0 else SAMPLED_FLOPS_PER_TOKEN
                for impl, fn in impls.items():
                    results.append(
                        {
                            "name": f"sample_tokens[{impl}] {case}",
                            "shape": {"rows": rows, "vocab": vocab},
                            "ms": do_bench(fn, return_mode="median"),
                            "bytes": nbytes,
                            "flops": rows * vocab * per_token,
                        }
                    )
    return results
