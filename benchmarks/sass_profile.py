"""Static profile of the MXFP4 expert GEMM's sm_90 code, without a GPU.

    python -m benchmarks.sass_profile --out results/ [--model V4-Flash] [--tiles 16,128,128,32,4,4 ...]

Compiles _mxfp4_expert_gemm_kernel (kernels/moe_mxfp4.py) for sm_90 with Triton's bundled ptxas
(deepinfer_nvidia_sm100/offline.py), through the arguments its launch passes
(moe_mxfp4.gemm_launch), for each set of variant flags and tiles, and reads the SASS: warp
instructions in one trip of the K loop, by opcode, registers, local-memory stack (spills), shared
memory. Prints a table and writes sass_profile.json.

Why instructions: at decode the kernel is bound by instruction issue. An H100 issues ~927 G warp
instructions a second (132 SMs x 4 schedulers x 1.755 GHz) and copies ~3.0 TB/s, i.e. ~5.7 T
packed weights a second at 0.53 bytes each: the K loop keeps up with the copy bandwidth only below
~0.16 warp instructions a weight (an H200: ~0.12, 4.2 TB/s at a similar clock). The column
``issue_bound_of_copy`` is that bound over the variant's count, capped at 1: an estimate of the
most the kernel could reach, not a measurement. Latency, occupancy and the split-K epilogue come
on top; only a GPU run (benchmarks/tune.py --only mxfp4) says what a variant gives.

Runs in a process without TRITON_INTERPRET (kernels compiled, not interpreted)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

H100_BUDGET = 0.16  # warp instructions a weight that keep up with an H100's copy bandwidth (above)
MODELS = {"V4-Flash": (4096, 2048), "V4-Pro": (7168, 3072)}  # hidden, expert intermediate
# Every flag set in every variant (independent of the module's defaults). "plain": the byte-permute
# decode at BLOCK_K 32 only (the e4m3 one at wider tiles), the scale on the sums, stride-2 loads:
# the defaults before 2026-12-08; "lean": the defaults since.
_PLAIN = {"MXFP4_ASM_WIDE": False, "MXFP4_SHIFT_DECODE": False, "MXFP4_SCALE_WEIGHTS": False, "MXFP4_SPLIT_LOAD": False,
          "MXFP4_SWAP_AB": False, "MXFP4_MAXNREG": (None, None)}
_WIDE = {**_PLAIN, "MXFP4_ASM_WIDE": True}  # BLOCK_K >= 64 tiles decode in PTX too
VARIANTS = {
    "plain": _PLAIN,
    "wide": _WIDE,
    "shift": {**_WIDE, "MXFP4_SHIFT_DECODE": True},
    "scale_weights": {**_WIDE, "MXFP4_SCALE_WEIGHTS": True},
    "split_load": {**_WIDE, "MXFP4_SPLIT_LOAD": True},
    "lean": {**_WIDE, "MXFP4_SHIFT_DECODE": True, "MXFP4_SCALE_WEIGHTS": True, "MXFP4_SPLIT_LOAD": True},
    "swap": {**_WIDE, "MXFP4_SWAP_AB": True},
    "lean_down_96_registers": {**_WIDE, "MXFP4_SHIFT_DECODE": True, "MXFP4_SCALE_WEIGHTS": True, "MXFP4_SPLIT_LOAD": True,
                               "MXFP4_MAXNREG": (None, 96)},
}
DECODE_TILES = ((16, 64, 64, 128, 4, 3), (16, 128, 128, 32, 4, 4), (16, 128, 128, 64, 4, 4))
PREFILL_TILES = ((64, 64, 128, 64, 4, 3), (128, 64, 128, 64, 8, 3))


def profile(model: str, tiles, gated: bool, flags: dict, splits: int, experts: int = 2, top_k: int = 6) -> dict:
    """One compile: the K loop's instruction mix and the kernel's resources."""
    from benchmarks.tune import _set
    from deepinfer_nvidia_sm100.kernels import moe_mxfp4 as m
    from deepinfer_nvidia_sm100 import offline
    from deepinfer_nvidia_sm100.kernels.moe import ExpertLayout

    hidden, inter = MODELS[model]
    tiles = m.ExpertTiles(*tiles)
    n, k = (inter, hidden) if gated else (hidden, inter)
    block_n = tiles.block_n_up if gated else tiles.block_n_down
    pairs = top_k  # one token: the strides and specialisations do not depend on it
    # CPU tensors of the launch's dtypes and strides; two experts (an expert's stride does not
    # depend on how many there are)
    a = torch.empty(pairs if not gated else 1, k, dtype=torch.bfloat16)
    w = torch.empty(experts, 2 * n if gated else n, k // 2, dtype=torch.uint8)
    scales = torch.empty(experts, w.shape[1], k // 32, dtype=torch.uint8)
    out = torch.empty(pairs, n, dtype=torch.bfloat16)
    part = torch.empty(splits, pairs, 2 * n if gated else n) if splits > 1 else out
    max_blocks = pairs
    layout = ExpertLayout(torch.empty(max_blocks * tiles.block_m, dtype=torch.int32), torch.empty(max_blocks, dtype=torch.int32),
                          torch.empty(1, dtype=torch.int32), max_blocks)
    old = _set(m, flags)
    try:
        _, args, kwargs = m.gemm_launch(a, w, scales, out, torch.empty(pairs), part, layout, tiles, n=n, k=k, block_n=block_n,
                                        num_pairs=pairs, row_div=top_k if gated else 1, gated=gated,
                                        limit=10.0 if gated else None, weighted=not gated, splits=splits, compiled=True)
        compiled = offline.compile_for(m._mxfp4_expert_gemm_kernel, args, {**kwargs, "PDL": True, "launch_pdl": True})
    finally:
        _set(m, old)
    res = offline.resources(compiled)
    loop = offline.inner_loop(offline.sass(compiled))
    weights = block_n * tiles.block_k * (2 if gated else 1)  # a program's K step
    per_weight = loop.instructions * tiles.num_warps / weights
    return {"model": model, "gemm": "gate_up" if gated else "down", "tiles": tiles._asdict(), "splits": splits, "flags": flags,
            "loop_warp_instructions": loop.instructions, "warp_instructions_a_weight": per_weight,
            "issue_bound_of_copy": min(1.0, H100_BUDGET / per_weight),
            "tensor_core": loop.of("HMMA", "HGMMA"), "barriers": loop.of("BAR"), "opcodes": dict(loop.opcodes.most_common()),
            "registers": res.registers, "stack_bytes": res.stack, "shared_bytes": res.shared}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--model", action="append", choices=sorted(MODELS))
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS))
    parser.add_argument("--tiles", action="append", type=lambda v: tuple(int(x) for x in v.split(",")),
                        help="block_m,block_n_up,block_n_down,block_k,num_warps,num_stages (default: decode and prefill tiles)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        parser.error("unset TRITON_INTERPRET: the kernels must compile, not be interpreted")
    rows = []
    tiles_list = [(t, 8 if t[0] <= 16 else 1) for t in (args.tiles or DECODE_TILES + PREFILL_TILES)]  # decode: split K
    print(f"{'model':8s} {'gemm':7s} {'tiles':24s} {'variant':22s} {'instr/step':>10s} {'a weight':>8s} {'issue/copy':>10s} "
          f"{'regs':>4s} {'stack':>5s} {'smem':>6s} {'bar':>3s}")
    for model in args.model or ["V4-Flash"]:
        for tiles, splits in tiles_list:
            for gated in (True, False):
                for name in args.variant or VARIANTS:
                    try:
                        row = profile(model, tiles, gated, VARIANTS[name], splits)
                    except Exception as e:  # a variant that does not compile is a result too
                        row = {"model": model, "gemm": "gate_up" if gated else "down", "tiles": tiles, "flags": VARIANTS[name],
                               "error": f"{type(e).__name__}: {e}"[:300]}
                        print(f"{model:8s} {row['gemm']:7s} {str(tiles):24s} {name:22s} does not compile: {row['error'][:80]}")
                    else:
                        print(f"{model:8s} {row['gemm']:7s} {str(tiles):24s} {name:22s} {row['loop_warp_instructions']:10d} "
                              f"{row['warp_instructions_a_weight']:8.3f} {row['issue_bound_of_copy']:10.2f} {row['registers']:4d} "
                              f"{row['stack_bytes']:5d} {row['shared_bytes']:6d} {row['barriers']:3d}", flush=True)
                    row["variant"] = name
                    rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sass_profile.json").write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
