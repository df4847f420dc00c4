"""Sweeps of the NVIDIA kernels' tunables (module constants), timed as CUDA-graph replays.

    python -m benchmarks.tune --out results/ [--only mla_decode --only moe --only fp8_linear]

Prints, per shape, every configuration's time, and writes tune.json: the evidence behind the
constants chosen in deepinfer_nvidia_sm100/kernels/*.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from benchmarks.kernels import time_graph


def _time(fn) -> float:
    return time_graph(fn, rep=50)


def _set(module, values: dict) -> dict:
    old = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    return old


def _timed(module, values: dict, fn) -> dict:
    """{"us": one call of ``fn``} with ``module``'s constants set to ``values`` (restored after), or
    {"error": ...} for a configuration that does not compile or launch here."""
    old = _set(module, values)
    try:
        return {"us": _time(fn) * 1e3}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    finally:
        _set(module, old)


def _decode_inputs(heads: int, batch: int, seq: int, block_size: int, device):
    """Random paged-MLA decode inputs (V3's latent 512 + rope 64): q, q_pe, cache, block tables,
    lengths (all ``seq``), query start offsets (one row per sequence)."""
    blocks = batch * (seq // block_size)
    cache = torch.randn(blocks, block_size, 576, device=device, dtype=torch.bfloat16)
    tables = torch.randperm(blocks, device=device, dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), seq, device=device, dtype=torch.int32)
    q = torch.randn(batch, heads, 512, device=device, dtype=torch.bfloat16)
    qpe = torch.randn(batch, heads, 64, device=device, dtype=torch.bfloat16)
    return q, qpe, cache, tables, lens, torch.arange(batch + 1, dtype=torch.int32, device=device)


def tune_mla_decode(device="cuda") -> list[dict]:
    from deepinfer_nvidia_sm100.kernels import mla_decode as m

    out = []
    block_size = 16
    shapes = [(16, b, s) for b, s in ((1, 1024), (32, 1024), (64, 4096), (128, 1024), (128, 4096))]
    shapes += [(128, b, s) for b, s in ((1, 4096), (32, 4096), (64, 1024))]
    grid = {"BLOCK_N": (32, 64), "NUM_STAGES": (2, 3), "MIN_SPLIT_TOKENS": (64, 256), "SPLIT_WAVES": (1.0, 4.0)}
    for heads, batch, seq in shapes:
        q, qpe, cache, tables, lens, qsl = _decode_inputs(heads, batch, seq, block_size, device)
        nbytes = batch * seq * 576 * 2
        for values in itertools.product(*grid.values()):
            cfg = dict(zip(grid, values))
            if heads >= 64 and cfg["BLOCK_N"] == 64:
                continue  # shared memory: 64 x 576 tiles with 64 heads do not fit every chip
            row = {"heads": heads, "batch": batch, "seq": seq, **cfg,
                   **_timed(m, cfg, lambda: m.mla_decode_attention(q, qpe, cache, tables, lens, qsl, 0.1))}
            if "us" in row:
                row["kv_gb_per_s"] = nbytes / row["us"] / 1e3
            out.append(row)
        best = min((r for r in out if r.get("us") and (r["heads"], r["batch"], r["seq"]) == (heads, batch, seq)), key=lambda r: r["us"])
        default = next(r for r in out if (r["heads"], r["batch"], r["seq"]) == (heads, batch, seq) and all(r[k] == getattr(m, k) for k in grid))
        print(f"[tune] mla_decode H={heads:3d} B={batch:3d} L={seq:5d}: default {default.get('us', float('nan')):7.1f} us "
              f"({default.get('kv_gb_per_s', 0):5.0f} GB/s), best {best['us']:7.1f} us ({best['kv_gb_per_s']:5.0f} GB/s) "
              f"{ {k: best[k] for k in grid} }", flush=True)
        del cache
    return out


def tune_mla_decode_small(device="cuda") -> list[dict]:
    """Decode attention at small batches (SMALL_BATCH and below), where the kernel is latency-bound:
    the shortest split there (ONE_ROW_MIN_SPLIT_TOKENS at one query row, SMALL_BATCH_MIN_SPLIT_TOKENS
    above: ``min_split`` sets both), the tile length, and the combine's unrolled step."""
    from deepinfer_nvidia_sm100.kernels import mla_decode as m

    out = []
    grid = {"min_split": (32, 64, 128), "BLOCK_N": (32, 64), "COMBINE_BLOCK_S": (1, 8, 16)}
    for heads, batch, seq in itertools.product((16, 128), (1, 8), (1024, 4096)):
        q, qpe, cache, tables, lens, qsl = _decode_inputs(heads, batch, seq, 64, device)
        applies = "ONE_ROW_MIN_SPLIT_TOKENS" if batch <= 1 else "SMALL_BATCH_MIN_SPLIT_TOKENS"
        rows = []
        for split, block_n, combine in itertools.product(*grid.values()):
            if heads >= 64 and block_n == 64:
                continue  # shared memory (see tune_mla_decode)
            if split < block_n:
                continue  # a split is whole tiles: the kernel would round it up to block_n (a repeat of split = block_n)
            cfg = {"ONE_ROW_MIN_SPLIT_TOKENS": split, "SMALL_BATCH_MIN_SPLIT_TOKENS": split, "BLOCK_N": block_n,
                   "COMBINE_BLOCK_S": combine}
            rows.append({"heads": heads, "batch": batch, "seq": seq, "min_split": split, "BLOCK_N": block_n,
                         "COMBINE_BLOCK_S": combine, "current": (split, block_n, combine) == (getattr(m, applies), m.BLOCK_N, m.COMBINE_BLOCK_S),
                         **_timed(m, cfg, lambda: m.mla_decode_attention(q, qpe, cache, tables, lens, qsl, 0.1))})
        out += rows
        ok = [r for r in rows if "us" in r]
        best = min(ok, key=lambda r: r["us"])
        current = next(r for r in ok if r["current"])
        print(f"[tune] mla_decode small H={heads:3d} B={batch} L={seq:5d}: current {current['us']:6.1f} us, best {best['us']:6.1f} us "
              f"{ {k: best[k] for k in grid} }", flush=True)
        del cache
    return out


def tune_moe(device="cuda") -> list[dict]:
    from deepinfer_nvidia_sm100.kernels import moe as m

    out = []
    models = {"V2-Lite": (2048, 1408, 64, 6, None), "V3-fp8": (7168, 2048, 256, 8, (128, 128))}
    candidates = [
        m.ExpertTiles(16, 64, 64, 128, 4, 4), m.ExpertTiles(16, 32, 32, 128, 4, 4), m.ExpertTiles(16, 64, 64, 256, 4, 3),
        m.ExpertTiles(16, 128, 128, 128, 4, 3), m.ExpertTiles(16, 32, 64, 256, 2, 4), m.ExpertTiles(16, 64, 128, 128, 8, 4),
    ]
    for name, (d, i, e, k, block) in models.items():
        for tokens in (1, 8, 32, 64):
            x = torch.randn(tokens, d, device=device, dtype=torch.bfloat16)
            if block:
                w13 = torch.randn(e, 2 * i, d, device=device).to(torch.float8_e4m3fn)
                w2 = torch.randn(e, d, i, device=device).to(torch.float8_e4m3fn)
                s13 = torch.rand(e, 2 * i // 128, d // 128, device=device) * 0.01
                s2 = torch.rand(e, d // 128, i // 128, device=device) * 0.01
            else:
                w13 = torch.randn(e, 2 * i, d, device=device, dtype=torch.bfloat16) * 0.02
                w2 = torch.randn(e, d, i, device=device, dtype=torch.bfloat16) * 0.02
                s13 = s2 = None
            ids = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(tokens)])
            weights = torch.rand(tokens, k, device=device)
            hit = ids.unique().numel()
            nbytes = hit * 3 * d * i * w13.element_size()
            for tiles in candidates:
                row = {"model": name, "tokens": tokens, "tiles": tiles._asdict(), **_timed(
                    m, {"EXPERT_TILES": ((float("inf"), tiles),)}, lambda: m.moe_experts(x, w13, w2, weights, ids, s13, s2, block))}
                if "us" in row:
                    row["gb_per_s"] = nbytes / row["us"] / 1e3
                out.append(row)
            rows = [r for r in out if r["model"] == name and r["tokens"] == tokens and "us" in r]
            best = min(rows, key=lambda r: r["us"])
            print(f"[tune] moe {name:7s} T={tokens:3d}: " + "  ".join(f"{r['us']:6.1f}" for r in rows)
                  + f" us; best {best['gb_per_s']:5.0f} GB/s {tuple(best['tiles'].values())}", flush=True)
    return out


def tune_fp8_linear(device="cuda") -> list[dict]:
    from deepinfer_nvidia_sm100.kernels import fp8_linear as m

    out = []
    shapes = {"q_a": (1536, 7168), "kv_a": (576, 7168), "q_b": (24576, 1536), "o_proj": (7168, 16384), "dense_down": (7168, 18432),
              # V4-Flash's FP8 linears (benchmarks/models.py's config): o_a is one of its 8 groups, launched 8 times a layer
              "v4_q_a": (1024, 4096), "v4_q_b": (32768, 1024), "v4_kv": (512, 4096), "v4_o_a_group": (1024, 4096),
              "v4_o_b": (4096, 8192), "v4_index_q_b": (8192, 1024), "v4_shared_gate_up": (4096, 4096), "v4_shared_down": (4096, 2048)}
    tiles = [(16, 64, 4, 5), (16, 32, 4, 6), (16, 128, 4, 4), (16, 64, 2, 6), (16, 128, 8, 4)]
    splits = (1, 2, 4)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
        s = torch.rand((n + 127) // 128, (k + 127) // 128, device=device) * 0.01
        for tokens in (1, 16):
            x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
            nbytes = n * k
            rows = []
            for tile, ctas in itertools.product(tiles, splits):
                row = {"linear": name, "tokens": tokens, "tile": tile, "split_ctas_per_sm": ctas, **_timed(
                    m, {"FP8_DECODE_TILE": tile, "FP8_SPLIT_K_CTAS_PER_SM": ctas}, lambda: m.fp8_block_linear(x, w, s, (128, 128)))}
                if "us" in row:
                    row["gb_per_s"] = nbytes / row["us"] / 1e3
                rows.append(row)
            out += rows
            ok = [r for r in rows if "us" in r]
            best = min(ok, key=lambda r: r["us"])
            print(f"[tune] fp8 {name:10s} M={tokens:2d}: default {ok[0]['us']:6.1f} us, best {best['us']:6.1f} us "
                  f"({best['gb_per_s']:5.0f} GB/s) tile {best['tile']} split/SM {best['split_ctas_per_sm']}", flush=True)
    return out


def _packed_experts(e: int, n: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 experts [e, n, k] (uint8 codes, two a byte) with UE8M0 scales around 2^-7."""
    codes = torch.randint(0, 256, (e, n, k // 2), device=device, dtype=torch.uint8)
    scales = torch.randint(118, 122, (e, n, k // 32), device=device, dtype=torch.uint8)
    return codes, scales


MXFP4_TOKENS = (1, 8, 32, 64, 512, 2048)


def tune_mxfp4(device="cuda", tokens_list=MXFP4_TOKENS, saved=lambda rows: None) -> list[dict]:
    """The MXFP4 expert GEMM (kernels/moe_mxfp4.py) at V4-Flash's and V4-Pro's expert shapes: its
    tiles x how many programs an SM split-K aims for (0: no split), decode (1-64 tokens) and prefill
    chunks. GB/s counts the packed weights and scales of the experts the tokens hit (what decode
    must read), beside the copy bandwidth measured here. ``saved(rows so far)`` after each shape: a
    run cut off by its time limit keeps what it timed."""
    from benchmarks.ceilings import copy_bandwidth
    from deepinfer_nvidia_sm100.kernels import moe_mxfp4 as m

    copy_gbs = copy_bandwidth(device) / 1e9
    print(f"[tune] mxfp4: copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    t = m.ExpertTiles
    # BLOCK_K 32: one scale group a step (with bf16: the byte-permute decode); 64: the e4m3 decode
    decode = [t(16, 64, 64, 32, 4, 4), t(16, 128, 128, 32, 4, 4), t(16, 128, 128, 32, 8, 4), t(16, 64, 64, 32, 2, 4),
              t(16, 32, 32, 32, 4, 4), t(16, 64, 64, 64, 4, 4), t(16, 128, 128, 64, 4, 4), t(16, 64, 64, 128, 4, 3)]
    prefill = [t(16, 128, 128, 32, 4, 4), t(32, 64, 128, 32, 4, 4), t(32, 128, 128, 64, 4, 3), t(64, 64, 128, 64, 4, 3),
               t(64, 128, 128, 64, 8, 3), t(64, 64, 128, 32, 4, 4), t(128, 64, 128, 64, 8, 3), t(128, 128, 128, 32, 8, 3)]
    models = {"V4-Flash": (4096, 2048, 256, 6), "V4-Pro": (7168, 3072, 384, 6)}
    out = []
    for name, (d, i, e, k) in models.items():
        w13, s13 = _packed_experts(e, 2 * i, d, device)
        w2, s2 = _packed_experts(e, d, i, device)
        for tokens in tokens_list:
            if name == "V4-Pro" and tokens not in (1, 64, 2048):
                continue
            x = torch.randn(tokens, d, device=device, dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(tokens)])
            weights = torch.rand(tokens, k, device=device).softmax(-1)
            hit = ids.unique().numel()
            nbytes = hit * 3 * d * i * (0.5 + 1 / 32)
            # swap: the dots as W @ A^T (the decoded weights the first operand); lean: MXFP4_SHIFT_DECODE,
            # MXFP4_SCALE_WEIGHTS and MXFP4_SPLIT_LOAD together (fewer instructions: benchmarks/sass_profile.py);
            # maxnreg: MXFP4_MAXNREG (GEMM 2 capped at 96 registers: 5 programs an SM, no spill)
            plain = (None, None)
            if tokens <= 64:
                # (BLOCK_K >= 64: two or four scale groups a step, the wide byte-permute decode against the e4m3 one)
                grid = [(tiles, pps, wide, False, False, plain) for tiles in decode for pps in (0, 4, 8)
                        for wide in ((False, True) if tiles.block_k > 32 else (False,))]
                grid += [(tiles, pps, tiles.block_k > 32, True, False, plain) for tiles in (decode[1], decode[7]) for pps in (4, 8)]
                grid += [(tiles, pps, tiles.block_k > 32, False, True, plain) for tiles in decode for pps in (4, 8)]
                grid += [(tiles, pps, True, False, True, (None, 96)) for tiles in decode if tiles.block_k > 32 for pps in (4, 8)]
            else:  # wide: BLOCK_K >= 64 tiles through the byte-permute decode too
                grid = [(tiles, 4, wide, swap, False, plain) for tiles in prefill for wide in (False, True) for swap in (False, True)
                        if tiles.block_k > 32 or not wide]
                grid += [(tiles, 4, tiles.block_k > 32, False, True, plain) for tiles in prefill]
            rows = []
            for tiles, pps, wide, swap, lean, maxnreg in grid:
                values = {"MXFP4_PROGRAMS_PER_SM": max(pps, 1), "MXFP4_MAX_SPLITS": 16 if pps else 1, "MXFP4_ASM_WIDE": wide,
                          "MXFP4_SWAP_AB": swap, "MXFP4_SHIFT_DECODE": lean, "MXFP4_SCALE_WEIGHTS": lean,
                          "MXFP4_SPLIT_LOAD": lean, "MXFP4_MAXNREG": maxnreg}
                row = {"model": name, "tokens": tokens, "experts_hit": hit, "tiles": tiles._asdict(), "programs_per_sm": pps,
                       "asm_wide": wide, "swap_ab": swap, "lean": lean, "maxnreg": maxnreg,
                       **_timed(m, values, lambda: m.run_mxfp4_experts(x, w13, w2, weights, ids, 10.0, s13, s2, tiles))}
                if "us" in row:
                    row["gb_per_s"] = nbytes / row["us"] / 1e3
                    row["of_copy"] = row["gb_per_s"] / copy_gbs
                    row["tflop_per_s"] = 2 * tokens * k * 3 * d * i / row["us"] / 1e6
                rows.append(row)
            out += rows
            saved(out)
            ok = [r for r in rows if "us" in r]
            if not ok:
                print(f"[tune] mxfp4 {name} T={tokens}: every configuration failed: {rows[0].get('error')}", flush=True)
                continue
            best = min(ok, key=lambda r: r["us"])
            print(f"[tune] mxfp4 {name:8s} T={tokens:4d} ({hit} experts): first {ok[0]['us']:7.1f} us, best {best['us']:7.1f} us "
                  f"({best['gb_per_s']:5.0f} GB/s, {100 * best['of_copy']:3.0f}% of copy) tiles {tuple(best['tiles'].values())} "
                  f"programs/SM {best['programs_per_sm']}{' wide byte-permute' if best['asm_wide'] else ''}"
                  f"{' swapped' if best['swap_ab'] else ''}{' lean' if best['lean'] else ''}"
                  f"{' maxnreg ' + str(best['maxnreg']) if any(best['maxnreg']) else ''}, "
                  f"{best['tflop_per_s']:.0f} TFLOP/s", flush=True)
        del w13, w2, s13, s2
        torch.cuda.empty_cache()
    return out


def tune_indexer_select(device="cuda") -> list[dict]:
    """indexer_topk's selection (kernels/sparse.py INDEXER_SELECT: a stable sort of every score or
    the threshold from torch.topk) at V4's top-k (Flash 512, Pro 1024) over a row of C candidate
    entries (C = L / 4: 2k to 64k tokens), for decode batches and a prefill chunk."""
    from deepinfer_nvidia_sm100.kernels import sparse as m

    out = []
    for k in (512, 1024):
        for c in (512, 4096, 16384):
            for t in (1, 8, 64, 2048):
                scores = torch.randn(t, c, device=device).relu_()  # ReLU'd sums: many exact zeros
                rows = [{"top_k": k, "candidates": c, "tokens": t, "select": mode,
                         **_timed(m, {"INDEXER_SELECT": mode}, lambda: m.top_k_columns(scores, min(k, c)))}
                        for mode in ("sort", "threshold")]
                out += rows
                print(f"[tune] indexer select k={k:4d} C={c:5d} T={t:4d}: "
                      + "  ".join(f"{r['select']} {r.get('us', float('nan')):8.1f} us" for r in rows), flush=True)
    return out


def tune_invariant_mla_decode(device="cuda") -> list[dict]:
    """The batch-invariant decode attention's split size (INV_SPLIT_TOKENS_PER_HEAD x heads, at
    clamped to [INV_MIN_SPLIT_TOKENS, INV_MAX_SPLIT_TOKENS]) against the normal kernel at the same shape."""
    from deepinfer_nvidia_sm100.kernels import mla_decode as m

    out = []
    block_size = 16
    shapes = [(16, b, s) for b in (1, 8, 32, 64) for s in (256, 1024, 4096)] + [(128, b, 1024) for b in (1, 32)]
    for heads, batch, seq in shapes:
        q, qpe, cache, tables, lens, qsl = _decode_inputs(heads, batch, seq, block_size, device)
        normal_us = _time(lambda: m.mla_decode_attention(q, qpe, cache, tables, lens, qsl, 0.1)) * 1e3
        rows = []
        for per_head, min_split in itertools.product((2, 4, 8, 16), (32, 64, 128)):
            row = {"heads": heads, "batch": batch, "seq": seq, "per_head": per_head, "min_split": min_split, "normal_us": normal_us,
                   **_timed(m, {"INV_SPLIT_TOKENS_PER_HEAD": per_head, "INV_MIN_SPLIT_TOKENS": min_split},
                            lambda: m.invariant_mla_decode_attention(q, qpe, cache, tables, lens, qsl, 0.1))}
            if "us" in row:
                row["over_normal"] = row["us"] / normal_us
            rows.append(row)
        out += rows
        ok = [r for r in rows if "us" in r]
        best = min(ok, key=lambda r: r["us"])
        print(f"[tune] invariant attention H={heads} B={batch} L={seq}: normal {normal_us:6.1f} us; "
              + ", ".join(f"{r['per_head']}x/{r['min_split']}: {r['us']:.1f}" for r in ok)
              + f"; best {best['us']:.1f} us", flush=True)
    return out


def tune_invariant_linear(device="cuda") -> list[dict]:
    """The batch-invariant GEMM on every bf16 linear of V2-Lite's decode step (one configuration
    serves every M, so each is timed at M = 1 and 64) against cuBLAS on the same product, inputs
    rotated out of L2 as in the step. Prints, per shape, the current configuration, the best at
    M = 1, and the best for both M (least summed time over cuBLAS's)."""
    from deepinfer_nvidia_sm100.kernels import fp8_linear as m

    out = []
    shapes = {"q_proj": (3072, 2048), "kv_a": (576, 2048), "o_proj": (2048, 2048), "shared_gate_up": (5632, 2048),
              "shared_down": (2048, 2816), "router": (64, 2048), "dense_gate_up": (21888, 2048), "dense_down": (2048, 10944),
              "lm_head": (102400, 2048)}
    tiles = [(16, 32, 4, 6), (16, 64, 4, 5), (16, 128, 4, 4)]
    current = {"INVARIANT_TILE": m.INVARIANT_TILE, "INVARIANT_PLAIN_SPLIT_K_CTAS_PER_SM": m.INVARIANT_PLAIN_SPLIT_K_CTAS_PER_SM,
               "PLAIN_BLOCK_K": m.PLAIN_BLOCK_K, "FP8_SPLIT_K_MIN_K_BLOCKS": m.FP8_SPLIT_K_MIN_K_BLOCKS}
    configs = [current] + [{"INVARIANT_TILE": t, "INVARIANT_PLAIN_SPLIT_K_CTAS_PER_SM": c, "PLAIN_BLOCK_K": bk, "FP8_SPLIT_K_MIN_K_BLOCKS": mk}
                           for t, c, bk, mk in itertools.product(tiles, (1, 2, 4), (64, 128), (2, 4))]
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        xs = {tokens: torch.randn(tokens, k, device=device, dtype=torch.bfloat16) for tokens in (1, 64)}
        cublas = {t: _time(lambda x=x: torch.nn.functional.linear(x, w)) * 1e3 for t, x in xs.items()}
        rows = []
        for i, cfg in enumerate(configs):
            row = {"linear": name, "n": n, "k": k, "current": i == 0, **{c.lower(): v for c, v in cfg.items()}}
            for tokens, x in xs.items():
                t = _timed(m, cfg, lambda x=x: m.invariant_linear(x, w))
                row[f"m{tokens}_us"], row[f"m{tokens}_cublas_us"] = t.get("us"), cublas[tokens]
                if "error" in t:
                    row["error"] = t["error"]
            rows.append(row)
        out += rows
        ok = [r for r in rows if r.get("m1_us") and r.get("m64_us")]
        if not ok:
            continue
        cur, best1 = ok[0], min(ok, key=lambda r: r["m1_us"])
        both = min(ok, key=lambda r: r["m1_us"] / cublas[1] + r["m64_us"] / cublas[64])

        def show(r):
            return (f"{r['m1_us']:6.1f}/{r['m64_us']:6.1f} us ({r['invariant_tile']} ctas {r['invariant_plain_split_k_ctas_per_sm']} "
                    f"bk {r['plain_block_k']} min_k {r['fp8_split_k_min_k_blocks']})")

        print(f"[tune] invariant {name:14s} M=1/64: cuBLAS {cublas[1]:6.1f}/{cublas[64]:6.1f} us; current {show(cur)}; "
              f"best at M=1 {show(best1)}; best for both {show(both)}", flush=True)
    return out


def tune_invariant_head_linear(device="cuda") -> list[dict]:
    """The batch-invariant per-head GEMM at V2-Lite's absorbed-MLA shapes against cuBLAS (einsum)."""
    from deepinfer_nvidia_sm100.kernels import fp8_linear as m

    out = []
    for name, (n, k) in {"w_uk_t": (512, 128), "w_uv": (128, 512)}.items():  # 16 heads
        w = torch.randn(16, n, k, device=device, dtype=torch.bfloat16) / k**0.5
        for tokens in (1, 32, 64):
            x = torch.randn(tokens, 16, k, device=device, dtype=torch.bfloat16)
            row = {"linear": name, "tokens": tokens, "tile": m.INVARIANT_TILE, "block_k": m.PLAIN_BLOCK_K,
                   "cublas_us": _time(lambda: torch.einsum("thk,hnk->thn", x, w)) * 1e3,
                   "us": _time(lambda: m.invariant_head_linear(x, w)) * 1e3}
            row["over_cublas"] = row["us"] / row["cublas_us"]
            out.append(row)
            print(f"[tune] invariant head_linear {name} M={tokens:2d}: cuBLAS {row['cublas_us']:6.1f} us, ours {row['us']:6.1f} us", flush=True)
    return out


TUNERS = {"mxfp4": tune_mxfp4, "indexer_select": tune_indexer_select, "mla_decode": tune_mla_decode, "mla_decode_small": tune_mla_decode_small, "moe": tune_moe, "fp8_linear": tune_fp8_linear, "invariant_linear": tune_invariant_linear,
          "invariant_head_linear": tune_invariant_head_linear,
          "invariant_mla_decode": tune_invariant_mla_decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--only", action="append", choices=sorted(TUNERS))
    parser.add_argument("--mxfp4-tokens", type=lambda v: tuple(int(x) for x in v.split(",")), default=MXFP4_TOKENS,
                        help="token counts the mxfp4 tuner times (comma-separated; default %(default)s)")
    args = parser.parse_args()
    result = {}
    args.out.mkdir(parents=True, exist_ok=True)

    def save(name, rows):  # after every tuner (and every mxfp4 shape): a cut-off run keeps what it timed
        result[name] = rows
        (args.out / "tune.json").write_text(json.dumps(result, indent=1, default=str))

    for name in args.only or TUNERS:
        if name == "mxfp4":
            rows = tune_mxfp4(tokens_list=args.mxfp4_tokens, saved=lambda rows: save("mxfp4", rows))
        else:
            rows = TUNERS[name]()
        save(name, rows)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
