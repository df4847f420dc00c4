"""KV-cache bytes per token of context, per cache group, for the real DeepSeek configs.

    python -m benchmarks.cache_bytes --out benchmarks/results/cache_bytes.json
    python -m benchmarks.cache_bytes --model v4-flash --model v4-pro --kv-cache-dtype fp8

The models are built on the meta device (no memory) from benchmarks.models' config.json copies;
the bytes are those of the engine's cache groups in bf16 (no speculative lookahead): paged groups
grow with the context, ring groups are fixed per sequence, so their bytes per token fall as the
context grows. Prints a markdown table (the README's) and writes JSON. ``--kv-cache-dtype fp8``:
V4's window and compressed KV caches as FP8 records (584 bytes a token-row; V4 models only).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch

from benchmarks.models import write_config

CONTEXTS = (8192, 131072, 1048576)


def group_bytes(name: str, fp8_kv_cache: bool = False) -> dict:
    from deepinfer_core.models.registry import read_config
    from deepinfer_core.engine.kv_cache import KVCache
    from deepinfer_core.models.registry import get_model_class
    from deepinfer_core.ops import OpTable

    config = read_config(write_config(name, Path(tempfile.mkdtemp(prefix="deepinfer-bytes-"))))
    model = get_model_class(config.model_type)(config, OpTable.reference(), torch.bfloat16, torch.device("meta"),
                                                            **({"fp8_kv_cache": True} if fp8_kv_cache else {}))
    block = model.default_block_size
    out = {"block_size": block, "groups": {}}
    for g in model.cache_groups():
        if g.kind == "paged":
            per_token, fixed = g.bytes_per_token(), 0
        else:
            per_token, fixed = 0.0, KVCache.bytes_per_sequence([g], block, 0)
        out["groups"][g.name] = {
            "kind": g.kind, "layers": len(g.layers),
            "bytes_per_token": {str(n): (math.ceil(n / block) * block * per_token + fixed) / n for n in CONTEXTS},
        }
    out["total_bytes_per_token"] = {str(n): sum(g["bytes_per_token"][str(n)] for g in out["groups"].values()) for n in CONTEXTS}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    args = parser.parse_args()
    results = {name: group_bytes(name, args.kv_cache_dtype == "fp8") for name in (args.model or ["v41-flash", "v4-flash", "v4-pro", "v3"])}
    print("| model | cache group | layers | " + " | ".join(f"{n // 1024}k tokens" if n < 2**20 else "1M tokens" for n in CONTEXTS) + " |")
    print("|---|---|---|" + "---|" * len(CONTEXTS))
    for name, r in results.items():
        for gname, g in r["groups"].items():
            cells = " | ".join(f"{g['bytes_per_token'][str(n)]:,.1f}" for n in CONTEXTS)
            print(f"| {name} | {gname} ({g['kind']}) | {g['layers']} | {cells} |")
        cells = " | ".join(f"**{r['total_bytes_per_token'][str(n)]:,.1f}**" for n in CONTEXTS)
        print(f"| {name} | **total** | | {cells} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
