"""Hardware ceilings measured in the same run as the benchmarks that are reported against them.

copy_bandwidth: a device-to-device copy of a large random bf16 tensor (4 GiB, 80x an H200's
50 MB L2, so it is read from HBM; smaller only where free memory is short, and never below
``MIN_COPY_L2_MULTIPLE`` x L2), bytes read + bytes written over the median time. matmul rate: an
8192^3 product of random matrices, bf16 through torch.mm (cuBLAS) and FP8 (e4m3, per-tensor
scales) through torch._scaled_mm. All three are timed eagerly with triton's do_bench (it
zeroes a 256 MB buffer before each call): their operands are far above L2 (4 GiB; 3 x 128 MB),
and one call takes milliseconds, so launch gaps do not count. Not as CUDA-graph replays like the
kernel cases: measured on the H200 on 2026-12-01, a captured ``copy_`` becomes a graph memcpy node
that ran at 2.72 TB/s against 4.2 TB/s eagerly (it is not what a kernel can read at), and 214
back-to-back 8192^3 products replayed in one graph reached 668 against ~790 TFLOP/s. What each one
did is recorded next to its number (``*_l2`` keys).
"""

from __future__ import annotations

import torch

MIN_COPY_L2_MULTIPLE = 16


def _bench(fn, info: dict | None = None) -> float:
    """Median milliseconds of ``fn`` (triton.testing.do_bench, with warm-up and its L2 flush)."""
    import triton.testing

    from benchmarks.kernels import TRITON_FLUSH, held_tensors, storage_bytes

    if info is not None:
        ws = storage_bytes(held_tensors(fn))
        info.update(working_set_bytes=ws, l2_copies=1, l2_rotation_bytes=ws, l2_method="flushed", l2=TRITON_FLUSH)
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def copy_buffer_bytes(nbytes: int, available: int, l2: int) -> int:
    """The copy's source size: ``nbytes``, or less where source + destination would take more
    than half of ``available``, but at least MIN_COPY_L2_MULTIPLE x ``l2`` (even numbers of bytes)."""
    return max(min(nbytes, available // 4), MIN_COPY_L2_MULTIPLE * l2) // 2 * 2


def copy_bandwidth(device: str = "cuda", nbytes: int = 2**32, info: dict | None = None) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    from benchmarks.kernels import available_bytes, l2_bytes

    nbytes = copy_buffer_bytes(nbytes, available_bytes(), l2_bytes())
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src), info)
    if info is not None:
        info["copy_buffer_bytes"] = nbytes
    return 2 * nbytes / (ms * 1e-3)


def matmul_rate(dtype: torch.dtype = torch.bfloat16, n: int = 8192, device: str = "cuda", info: dict | None = None) -> float:
    """FLOP/s of an n x n x n product on random data."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    if dtype == torch.float8_e4m3fn:
        a8, b8 = a.to(dtype), b.to(dtype).t()  # _scaled_mm wants the second operand column-major
        one = torch.ones((), device=device)
        del a, b
        ms = _bench(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), info)
    else:
        a, b = a.to(dtype), b.to(dtype)
        ms = _bench(lambda: torch.mm(a, b), info)
    return 2 * n**3 / (ms * 1e-3)


def measure(device: str = "cuda") -> dict:
    copy_l2, bf16_l2, fp8_l2 = {}, {}, {}
    out = {
        "device_name": torch.cuda.get_device_name(device),
        "timing": "triton do_bench, eager (see benchmarks/ceilings.py)",
        "copy_bytes_per_s": copy_bandwidth(device, info=copy_l2),
        "bf16_flop_per_s": matmul_rate(torch.bfloat16, device=device, info=bf16_l2),
    }
    try:
        out["fp8_flop_per_s"] = matmul_rate(torch.float8_e4m3fn, device=device, info=fp8_l2)
    except Exception as e:  # no FP8 matrix units (pre-Hopper) or no _scaled_mm
        out["fp8_flop_per_s"] = None
        out["fp8_error"] = f"{type(e).__name__}: {e}"
    out.update(copy_l2=copy_l2, bf16_l2=bf16_l2, fp8_l2=fp8_l2)
    torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(measure(), indent=1))
