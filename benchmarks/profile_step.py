"""Where a decode step's time goes: GPU kernel time per step, grouped by kernel, from
torch.profiler over graph-replayed steps of the e2e benchmark's engine.

    python -m benchmarks.profile_step --model v2-lite --point 1x1024 --point 32x1024 --out results/
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.e2e import decode_point
from benchmarks.models import write_config


def kernel_ms(prof) -> dict[str, float]:
    """GPU time (ms) per kernel of a torch.profiler run, summed by whole kernel name (templated
    kernels share long prefixes: a cut name would merge them)."""
    kernels: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.device_time_total / 1e3  # us -> ms
    return kernels


def profile(name: str, points: list[tuple[int, int]], steps: int = 8, batch_invariant: bool = False) -> dict:
    import tempfile

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from deepinfer_core import LLM

    model_dir = write_config(name, Path(tempfile.mkdtemp(prefix="deepinfer-prof-")))
    llm = LLM(
        model=str(model_dir), accelerator="nvidia", dtype="bfloat16", load_format="dummy",
        max_num_seqs=max(b for b, _ in points), max_num_batched_tokens=16384,
        max_model_len=max(c for _, c in points) + 64, progress=False, batch_invariant=batch_invariant,
    )
    for cache in llm.engine.kv_cache.tensors.values():
        cache.normal_()
    out = {}
    for batch, context in points:
        decode_point(llm, batch, context, steps=2)  # capture this point's graph
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            point = decode_point(llm, batch, context, steps=steps)
        total_steps = steps + 3  # decode_point's warm-up steps ran under the profiler too
        rows = sorted(((k, v / total_steps) for k, v in kernel_ms(prof).items()), key=lambda r: -r[1])
        gpu_ms = sum(v for _, v in rows)
        print(f"[{name}{' batch-invariant' if batch_invariant else ''}] B={batch} L={context}: wall step {point['step_s'] * 1e3:.2f} ms, GPU kernels {gpu_ms:.2f} ms/step", flush=True)
        for kname, ms in rows[:18]:
            print(f"    {ms * 1e3:9.1f} us  {kname[:90]}", flush=True)
        out[f"{batch}x{context}"] = {"step_ms": point["step_s"] * 1e3, "gpu_ms": gpu_ms, "kernels_ms": dict(rows)}
    del llm
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--point", action="append", required=True, help="BATCHxCONTEXT, e.g. 32x1024")
    parser.add_argument("--batch-invariant", action="store_true", help="also profile LLM(batch_invariant=True)")
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    args = parser.parse_args()
    points = [tuple(int(v) for v in p.split("x")) for p in args.point]
    result = {name: profile(name, points) for name in args.model}
    if args.batch_invariant:
        result.update({f"{name}/batch_invariant": profile(name, points, batch_invariant=True) for name in args.model})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
