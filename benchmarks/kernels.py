"""Kernel benchmarks of the NVIDIA backend at DeepSeek-V3 and V2-Lite shapes, against ceilings
measured in the same run.

    python -m benchmarks.kernels --out results/

Every kernel module of ``deepinfer_nvidia_sm100.kernels`` may define ``bench(device)``, which
returns cases ``{name, shape, ms, bytes, flops}`` (bytes: each input read once and each output
written once; ms: median of triton.testing.do_bench, replaced here by CUDA-graph replays for
the decode-path modules). This script adds achieved GB/s and TFLOP/s
and their ratios to the measured copy bandwidth and matmul rate (the FP8 rate for cases whose
name says fp8), and writes kernels.json.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import traceback
from pathlib import Path

import torch

from benchmarks.ceilings import measure


# Modules whose ops are all capturable: their cases are timed as CUDA-graph replays, which is how
# the engine runs them in decode steps (no Python launch overhead in the numbers). The others
# (prefill attention, sampling: host reads allowed) are timed with plain do_bench.
GRAPH_TIMED = ("elementwise", "cache", "fp8_linear", "mla_decode", "moe")


def time_graph(fn, rep: int = 100, return_mode: str = "median") -> float:
    """Milliseconds of ``fn`` replayed in a CUDA graph (run once first: kernels compile outside the capture)."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode=return_mode)


@contextlib.contextmanager
def graph_timing():
    """Make triton.testing.do_bench time CUDA-graph replays of the benchmarked callable."""
    import triton.testing

    plain = triton.testing.do_bench

    def do_bench(fn, warmup=25, rep=100, return_mode="median", **_):
        return time_graph(fn, rep=rep, return_mode=return_mode)

    triton.testing.do_bench = do_bench
    try:
        yield
    finally:
        triton.testing.do_bench = plain


def run(out_dir: Path, ceilings: dict | None = None, only: list[str] | None = None) -> dict:
    from deepinfer_nvidia_sm100.backend import KERNEL_MODULES

    ceilings = ceilings or measure()
    bw, bf16, fp8 = ceilings["copy_bytes_per_s"], ceilings["bf16_flop_per_s"], ceilings.get("fp8_flop_per_s") or ceilings["bf16_flop_per_s"]
    report = {"ceilings": ceilings, "cases": [], "errors": {}}
    for name in KERNEL_MODULES:
        if only and name not in only:
            continue
        module = importlib.import_module(f"deepinfer_nvidia_sm100.kernels.{name}")
        bench = getattr(module, "bench", None)
        if bench is None:
            continue
        try:
            with graph_timing() if name in GRAPH_TIMED else contextlib.nullcontext():
                cases = bench("cuda")
        except Exception:  # one module's failure must not hide the others' numbers
            report["errors"][name] = traceback.format_exc()
            print(f"[kernels] {name}: bench failed\n{report['errors'][name]}", flush=True)
            continue
        for case in cases:
            seconds = case["ms"] * 1e-3
            rate = fp8 if "fp8" in case["name"].lower() else bf16
            case = {"module": name, "timing": "cuda-graph replay" if name in GRAPH_TIMED else "do_bench", **case}
            case["gb_per_s"] = case.get("bytes", 0) / seconds / 1e9
            case["bw_ratio"] = case.get("bytes", 0) / seconds / bw
            case["tflop_per_s"] = case.get("flops", 0) / seconds / 1e12
            case["flop_ratio"] = case.get("flops", 0) / seconds / rate
            report["cases"].append(case)
            print(f"[kernels] {name:12s} {case['name']:40s} {str(case.get('shape')):50s} {case['ms'] * 1e3:9.1f} us "
                  f"{case['gb_per_s']:7.0f} GB/s ({case['bw_ratio']:5.1%} of copy) "
                  f"{case['tflop_per_s']:6.1f} TFLOP/s ({case['flop_ratio']:5.1%})", flush=True)
        torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description="NVIDIA kernel benchmarks against measured ceilings")
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--only", action="append", help="kernel module(s) to run (default: all)")
    args = parser.parse_args()
    run(args.out, only=args.only)


if __name__ == "__main__":
    main()
