"""Where a prefill's GPU time goes, through LLM.generate: B prompts of L random tokens,
max_tokens=1, two unprofiled calls, then one under torch.profiler; kernel times summed by name.

    python -m benchmarks.profile_prefill --out DIR [--model v3-slice] [--batch 16] [--length 1024]

Random weights (the model's dtype or FP8), prefix caching off, the op table as the backend
builds it (``DEEPINFER_EXTERNAL_KERNELS`` decides whether peer libraries provide ops). Prints the
top kernels and writes DIR/prefill_profile.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from benchmarks.generate import params, prompts, timed, write_model
from benchmarks.profile_step import kernel_ms

OPS_SHOWN = ("fp8_block_linear", "moe_experts", "mla_prefill_attention")


def profile(name: str, batch: int, length: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from deepinfer_core import LLM

    model_dir = write_model(name, None, Path(tempfile.mkdtemp(prefix="deepinfer-prefill-")))
    llm = LLM(model=str(model_dir), accelerator="nvidia", load_format="dummy", max_num_seqs=batch,
              max_model_len=length + 76, progress=False, enable_prefix_caching=False)
    group = prompts(random.Random(0), llm.engine.model_config.vocab_size, batch, length)
    implementations = {op: llm.engine.ops.implementations.get(op) for op in OPS_SHOWN}
    unprofiled = [timed(llm, group, params(1))[0] for _ in range(2)]
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = timed(llm, group, params(1))[0]
    rows = sorted(kernel_ms(prof).items(), key=lambda r: -r[1])
    gpu_ms = sum(v for _, v in rows)
    print(f"[{name}] prefill {batch}x{length}: unprofiled {[round(batch * length / t) for t in unprofiled]} tok/s; "
          f"profiled wall {wall * 1e3:.1f} ms, GPU kernels {gpu_ms:.1f} ms", flush=True)
    for kname, ms in rows[:25]:
        print(f"  {ms:8.2f} ms {ms / gpu_ms:6.1%}  {kname[:100]}", flush=True)
    return {"model": name, "batch": batch, "length": length, "implementations": implementations,
            "unprofiled_s": unprofiled, "wall_ms": wall * 1e3, "gpu_ms": gpu_ms, "kernels_ms": dict(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="v3-slice")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    args = parser.parse_args()
    result = profile(args.model, args.batch, args.length)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
