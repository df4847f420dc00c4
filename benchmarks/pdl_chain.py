"""What programmatic dependent launch saves per kernel boundary: a CUDA graph of N dependent
Triton kernels (each reads what the one before wrote), replayed with the plugin's launch
(``kernels/device.py``: ``await_inputs`` first, ``launch_options``) and with PDL off, at a few grid
sizes and alternating with a cuBLAS GEMM (a kernel that launches without PDL). Prints and writes
DIR/pdl_chain.json: microseconds per kernel (median of the replays) and the largest difference
from an eager run without PDL (0: the same bits).

    python -m benchmarks.pdl_chain --out DIR [--kernels 200]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.generate import metadata
from deepinfer_nvidia_sm100.kernels import device as device_module
from deepinfer_nvidia_sm100.kernels.device import await_inputs, launch_options

BLOCK = 1024
CASES = (  # (label, elements, every other kernel a cuBLAS GEMM [rows, 2048] x [2048, 2048])
    ("1 program", BLOCK, False),
    ("8 programs", 8 * BLOCK, False),
    ("528 programs (4 per H100/H200 SM)", 528 * BLOCK, False),
    ("alternating with a cuBLAS 8x2048x2048 GEMM", 8 * 2048, True),
)


@triton.jit
def _step_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 0.5 + 1.0, mask=mask)


def _chain(a: torch.Tensor, b: torch.Tensor, kernels: int, gemm_weight: torch.Tensor | None) -> torch.Tensor:
    for i in range(kernels):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        if gemm_weight is not None and i % 2:
            torch.matmul(src.view(-1, gemm_weight.shape[0]), gemm_weight, out=dst.view(-1, gemm_weight.shape[1]))
        else:
            _step_kernel[(triton.cdiv(src.numel(), BLOCK),)](src, dst, src.numel(), BLOCK=BLOCK, num_warps=4,
                                                            **launch_options(src.device))
    return a if kernels % 2 == 0 else b


def _time(elements: int, kernels: int, gemm: bool, pdl: bool, replays: int = 30) -> tuple[float, float]:
    """(median us per kernel of the graph's replays, max |graph - eager without PDL|)."""
    torch.manual_seed(0)
    x0 = torch.randn(elements, device="cuda")
    weight = torch.randn(2048, 2048, device="cuda") / 45 if gemm else None
    device_module.PDL = False
    want = _chain(x0.clone(), torch.empty_like(x0), kernels, weight).clone()
    device_module.PDL = pdl
    a, b = x0.clone(), torch.empty_like(x0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _chain(a, b, kernels, weight)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _chain(a, b, kernels, weight)
    times, err = [], 0.0
    for _ in range(replays):
        a.copy_(x0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / kernels)
        err = max(err, (got - want).abs().max().item())
    times.sort()
    return times[len(times) // 2], err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--kernels", type=int, default=200)
    args = parser.parse_args()
    report = {"meta": metadata(argparse.Namespace(accelerator="nvidia")), "kernels_per_graph": args.kernels, "cases": []}
    saved = device_module.PDL
    try:
        for label, elements, gemm in CASES:
            plain, plain_err = _time(elements, args.kernels, gemm, pdl=False)
            pdl, pdl_err = _time(elements, args.kernels, gemm, pdl=True)
            report["cases"].append({"case": label, "us_per_kernel_plain": plain, "us_per_kernel_pdl": pdl,
                                    "saved_us_per_kernel": plain - pdl, "max_err_plain": plain_err, "max_err_pdl": pdl_err})
            print(f"{label:46s} plain {plain:6.3f} us/kernel  PDL {pdl:6.3f}  saved {plain - pdl:6.3f}  "
                  f"max err {plain_err:.3g} / {pdl_err:.3g}", flush=True)
    finally:
        device_module.PDL = saved
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pdl_chain.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
