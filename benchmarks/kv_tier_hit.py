"""A prefix served from the host KV tier, against the same prefix recomputed and found in the
device's own cache, through ``LLM.generate``.

    python -m benchmarks.kv_tier_hit [--model default|v2-lite|...] [--layers 4] [--lengths 512,2048] --out results/

Per prompt length L: the time of a one-token ``generate`` of a prompt of L tokens (1) recomputed
(prefix caching off), (2) with its prefix in the device's pool (a repeat), and (3) with its
prefix in the host tier (evicted from a pool that holds one prompt, by a second prompt). Each
is the median of ``--repeats`` runs, with fresh prompts for (1) and (3). From (3), the bytes
the tier copied back per second: the blocks loaded times the bytes of one block (every paged
group), over the time (3) spends beyond (2). Writes kv_tier_hit.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.generate import metadata, model_with_tokenizer


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(length)]


def _timed(llm, prompt: list[int], params) -> tuple[float, object]:
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    llm.engine.platform.synchronize()
    return time.perf_counter() - start, out


def main(argv=None) -> None:
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.engine.kv_tiers import block_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--accelerator", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lengths", default="256,1024")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    args = p.parse_args(argv)
    path = model_with_tokenizer(args.model, args.layers)
    lengths = [int(x) for x in args.lengths.split(",")]
    common = dict(model=path, accelerator=args.accelerator, dtype=args.dtype, progress=False, max_num_seqs=1,
                  load_format="dummy" if path else "safetensors")
    params = SamplingParams(temperature=0, max_tokens=1)
    report = {"meta": metadata(args), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "points": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for length in lengths:
        probe = LLM(**common, max_model_len=length + 16, enable_prefix_caching=False)
        vocab, block = probe.engine.model_config.vocab_size, probe.engine.kv.block_size
        blocks = -(-(length + 16) // block)  # a pool for one prompt: the second evicts the first
        per_block = block_bytes(probe.engine.cache_groups, block)
        _timed(probe, _prompt(length, 0, vocab), params)  # warm-up (kernels for this length)
        recompute = [_timed(probe, _prompt(length, 1000 + r, vocab), params)[0] for r in range(args.repeats)]
        del probe
        llm = LLM(**common, max_model_len=length + 16, num_kv_blocks=blocks, kv_offload_gb=max(1e-3, 4 * blocks * per_block / 2**30))
        device, host, loaded = [], [], []
        for r in range(args.repeats):
            a, b = _prompt(length, 2000 + r, vocab), _prompt(length, 3000 + r, vocab)
            _timed(llm, a, params)
            device.append(_timed(llm, a, params)[0])  # its prefix in the pool
            _timed(llm, b, params)  # evicts a's blocks to the host tier
            seconds, out = _timed(llm, a, params)
            host.append(seconds)
            loaded.append(out.num_cached_tokens_by_tier["host"])
        llm.close()
        del llm
        med = {k: statistics.median(v) for k, v in (("recompute_s", recompute), ("device_hit_s", device), ("host_hit_s", host))}
        tokens = statistics.median(loaded)
        copied = -(-int(tokens) // block) * per_block
        extra = med["host_hit_s"] - med["device_hit_s"]
        point = {"prompt_tokens": length, **med, "host_tokens": tokens, "host_bytes": copied,
                 "host_copy_gb_per_s": copied / extra / 1e9 if extra > 0 else None}
        report["points"].append(point)
        print(f"[kv_tier_hit] {length} tokens: recompute {med['recompute_s'] * 1e3:.1f} ms, device hit "
              f"{med['device_hit_s'] * 1e3:.1f} ms, host hit {med['host_hit_s'] * 1e3:.1f} ms ({tokens:.0f} tokens, "
              f"{copied / 2**20:.1f} MiB back from host"
              + (f", {point['host_copy_gb_per_s']:.2f} GB/s over the device hit)" if point["host_copy_gb_per_s"] else ")"),
              flush=True)
        (args.out / "kv_tier_hit.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out / 'kv_tier_hit.json'}", flush=True)


if __name__ == "__main__":
    main()
