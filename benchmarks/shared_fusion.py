"""The shared experts as extra experts of the routed grouped pass (``MoE.fuse_shared``) against
the shared MLP computed apart, through ``LLM.generate``, side by side in one run: what picks the
NVIDIA backend's ``SHARED_EXPERT_MAX_TOKENS``.

    python -m benchmarks.shared_fusion --out DIR [--models v2-lite,v3-slice] [--batches 1,4,8,16,32,64]
        [--contexts 1024] [--max-tokens 17] [--repeats 2]

Two LLMs live side by side, built as ``benchmarks.decode_peers`` builds its ``peers`` LLM (random
weights, 64-token KV blocks, 40% of the GPU's memory each (``--memory-share``)): ``apart`` with the backend's
``moe_experts`` hint emptied while it loads (no fusion), ``fused`` with it set to the largest
batch for every weight dtype (bf16 and FP8 experts alike: every decode step fused). The timing,
floor and interleaving are ``decode_peers.points``'.
Writes DIR/shared_fusion.json after every point.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.decode_peers import BLOCK_SIZE, build, parse_args, variant_points
from benchmarks.generate import metadata, write_model


def build_pair(model_dir: Path, max_batch: int, max_len: int, memory_share: float) -> dict:
    from deepinfer_nvidia_sm100.kernels import moe as kmoe

    hinted = kmoe.OPS["moe_experts"]  # the callable the op table hands the model; fuse_shared reads its hint
    llms = {}
    try:
        every_dtype = dict.fromkeys((torch.bfloat16, torch.float16, torch.float8_e4m3fn), max_batch)
        for i, (label, limits) in enumerate((("apart", {}), ("fused", every_dtype))):
            hinted.shared_expert_max_tokens = limits
            llms[label] = build(model_dir, "peers", max_batch, max_len, memory_share * (i + 1))
    finally:
        hinted.shared_expert_max_tokens = kmoe.SHARED_EXPERT_MAX_TOKENS
    fused = [m for m in llms["fused"].engine.model.modules() if getattr(m, "with_shared", None) is not None]
    if not fused:
        raise RuntimeError("the 'fused' LLM has no MoE layer with the shared experts appended: nothing to compare")
    return llms


def run(args) -> dict:
    from benchmarks.ceilings import measure

    args.out.mkdir(parents=True, exist_ok=True)
    ceilings = measure()
    report = {"meta": metadata(argparse.Namespace(accelerator="nvidia")), "ceilings": ceilings,
              "args": {k: str(v) for k, v in vars(args).items()}, "points": [], "ratios": []}
    path = args.out / "shared_fusion.json"
    max_len = -(-(max(args.contexts) + args.max_tokens + 16) // BLOCK_SIZE) * BLOCK_SIZE
    for name in args.models:
        llms = build_pair(write_model(name, None, Path(tempfile.mkdtemp(prefix="deepinfer-shared-"))), max(args.batches), max_len, args.memory_share)
        variant_points("shared", name, llms, ("fused", "apart"), args, ceilings["copy_bytes_per_s"], report, path)
        del llms
        gc.collect()
        torch.cuda.empty_cache()
    return report


def main(argv=None) -> None:
    run(parse_args(__doc__, argv, batches="1,4,8,16,32,64", contexts="1024", max_tokens=17))


if __name__ == "__main__":
    main()
