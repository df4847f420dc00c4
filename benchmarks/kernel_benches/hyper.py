"""Benchmark of ``deepinfer_nvidia_sm100.kernels.hyper`` (the lead runs it on the GPU): the mHC
ops (mhc_pre, mhc_pre_delayed, mhc_head, mhc_collapse, mhc_post) against the reference ops at
DeepSeek-V4-Flash and V4-Pro dims (hc = 4), decode and prefill token counts, bf16 streams."""

from __future__ import annotations

import functools

import torch

from deepinfer_nvidia_sm100.kernels import hyper

BENCH_TOKENS = (1, 8, 64, 2048)  # decode batches, one prefill chunk
BENCH_MODELS = {"V4-Flash": 4096, "V4-Pro": 7168}  # hidden size D
BENCH_HC = 4
BENCH_SINKHORN_ITERS = 20
BENCH_DTYPE = torch.bfloat16
EPS = {"hc_eps": 1e-6, "rms_eps": 1e-6}


def bench(device: str = "cuda") -> list[dict]:
    """Median times (ms) of each op, Triton and reference (``name[impl]``); the Triton case carries
    ``vs_reference`` = the reference's time / ours. bytes: x, out and the mixing weights read once,
    the outputs written once; flops: the mixes GEMM, 2 T N hc D (N = 24 outputs, hc for the head)."""
    from triton.testing import do_bench

    from deepinfer_core.ops import hyper as reference

    hc, el = BENCH_HC, BENCH_DTYPE.itemsize
    n_mix = (2 + hc) * hc
    gen = torch.Generator(device=device).manual_seed(0)
    results = []
    for model, hidden in BENCH_MODELS.items():
        fan_in = hc * hidden
        fn = torch.randn(n_mix, fan_in, device=device, generator=gen) / fan_in**0.5
        head_fn = fn[:hc].contiguous()
        base = 0.1 * torch.randn(n_mix, device=device, generator=gen)
        scale = 1 + 0.1 * torch.randn(3, device=device, generator=gen)
        head_base, head_scale = base[:hc].contiguous(), scale[:1].contiguous()
        for tokens in BENCH_TOKENS:
            x = torch.randn(tokens, hc, hidden, device=device, generator=gen).to(BENCH_DTYPE)
            out = torch.randn(tokens, hidden, device=device, generator=gen).to(BENCH_DTYPE)
            pre = torch.sigmoid(torch.randn(tokens, hc, device=device, generator=gen))
            post = 2 * pre
            comb = torch.softmax(torch.randn(tokens, hc, hc, device=device, generator=gen), dim=-1)
            streams, row = tokens * fan_in * el, tokens * hidden * el
            coefficients = tokens * (2 * hc + hc * hc) * 4
            pre_kw = {**EPS, "sinkhorn_iters": BENCH_SINKHORN_ITERS}
            cases = {  # op: (args, kwargs, bytes, flops)
                "mhc_pre": ((x, fn, base, scale), pre_kw, streams + fn.numel() * 4 + row + coefficients,
                            2 * tokens * n_mix * fan_in),
                "mhc_pre_delayed": ((x, pre, fn, base, scale), pre_kw,
                                    streams + fn.numel() * 4 + row + coefficients + tokens * hc * 4, 2 * tokens * n_mix * fan_in),
                "mhc_head": ((x, head_fn, head_base, head_scale), EPS, streams + head_fn.numel() * 4 + row, 2 * tokens * hc * fan_in),
                "mhc_collapse": ((x, pre), {}, streams + tokens * hc * 4 + row, 2 * tokens * fan_in),
                "mhc_post": ((out, x, post, comb), {}, 2 * streams + row + coefficients, 2 * tokens * (hc + 1) * fan_in),
            }
            for op, (args, kwargs, nbytes, flops) in cases.items():
                shape = {"T": tokens, "hc": hc, "D": hidden, "model": model}
                ours = do_bench(functools.partial(getattr(hyper, op), *args, **kwargs), return_mode="median")
                theirs = do_bench(functools.partial(getattr(reference, op), *args, **kwargs), return_mode="median")
                results.append({"name": f"{op}[triton]", "shape": shape, "ms": ours, "bytes": nbytes, "flops": flops,
                                "vs_reference": theirs / ours})
                results.append({"name": f"{op}[reference]", "shape": shape, "ms": theirs, "bytes": nbytes, "flops": flops})
            del x, out
        torch.cuda.empty_cache()
    return results
