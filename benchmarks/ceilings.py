"""Hardware ceilings measured in the same run as the benchmarks that are reported against them.

copy_bandwidth: a device-to-device copy of a large random bf16 tensor, bytes read + bytes written
over the median time. matmul rate: an 8192^3 product of random matrices, bf16 through torch.mm
(cuBLAS) and FP8 (e4m3, per-tensor scales) through torch._scaled_mm.
"""

from __future__ import annotations

import torch


def _bench(fn) -> float:
    """Median milliseconds of ``fn`` (triton.testing.do_bench, with warm-up)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def copy_bandwidth(device: str = "cuda", nbytes: int = 2**32) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def matmul_rate(dtype: torch.dtype = torch.bfloat16, n: int = 8192, device: str = "cuda") -> float:
    """FLOP/s of an n x n x n product on random data."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    if dtype == torch.float8_e4m3fn:
        a8, b8 = a.to(dtype), b.to(dtype).t()  # _scaled_mm wants the second operand column-major
        one = torch.ones((), device=device)
        ms = _bench(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    else:
        a, b = a.to(dtype), b.to(dtype)
        ms = _bench(lambda: torch.mm(a, b))
    return 2 * n**3 / (ms * 1e-3)


def measure(device: str = "cuda") -> dict:
    out = {
        "device_name": torch.cuda.get_device_name(device),
        "copy_bytes_per_s": copy_bandwidth(device),
        "bf16_flop_per_s": matmul_rate(torch.bfloat16, device=device),
    }
    try:
        out["fp8_flop_per_s"] = matmul_rate(torch.float8_e4m3fn, device=device)
    except Exception as e:  # no FP8 matrix units (pre-Hopper) or no _scaled_mm
        out["fp8_flop_per_s"] = None
        out["fp8_error"] = f"{type(e).__name__}: {e}"
    torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(measure(), indent=1))
