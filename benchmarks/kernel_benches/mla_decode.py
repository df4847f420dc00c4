"""Benchmark of ``deepinfer_nvidia_sm100.kernels.mla_decode`` (the lead runs it on the GPU): the
Triton MLA decode kernel at DeepSeek-V3 and V2-Lite decode shapes, beside FlashMLA (the peer, and
the plugin's ``deepinfer_nvidia_sm100.flashmla`` provider) where it is installed."""

from __future__ import annotations

import torch
import triton

from deepinfer_nvidia_sm100.kernels.mla_decode import mla_decode_attention


def bench(device: str = "cuda") -> list[dict]:
    """Time mla_decode_attention at DeepSeek-V3 (H=128) and V2-Lite (H=16) decode shapes: one
    query row per sequence (plain decode) and, at a few shapes, 4 (speculative decoding
    verifying 3 drafted tokens).

    Where FlashMLA is installed, each shape is also timed through it, side by side in the same
    run: ``flashmla`` is DeepSeek's kernel called directly (queries already [latent | rope], its
    scheduler metadata made once, q_len rows per sequence as its s_q, causal), the peer;
    ``flashmla provider`` is what the op table runs (``deepinfer_nvidia_sm100.flashmla``: the
    concatenation, one FlashMLA sequence per query row, the mask, and here its per-step plan in
    every call where the timing rotates among copies of the inputs; below its rows x heads
    threshold the Triton kernel, as ``provider_path`` says). Each record of ours
    carries ``vs_flashmla`` = FlashMLA's time / ours (1.0: as fast).

    bytes = cache rows actually referenced (sum of seq_lens x 576 x element size) + q + out;
    flops = 2 x H x (d_c + d_r + d_c) per (query row, token) pair.
    """
    results = []
    for model, heads, scale in (("V3", 128, 0.135234), ("V2-Lite", 16, 0.114721)):
        for batch in (1, 8, 32, 64, 128):
            for seq in (1024, 4096, 16384):
                for q_len in (1, 4) if seq == 4096 and batch in (8, 32) else (1,):
                    if batch * seq * 576 * 2 <= 8 * 2**30:
                        results.extend(_bench_one(model, heads, scale, batch, seq, q_len, device))
    return results


def _bench_one(model: str, heads: int, scale: float, batch: int, seq: int, q_len: int, device: str) -> list[dict]:
    from triton.testing import do_bench

    from deepinfer_nvidia_sm100 import flashmla

    dtype = torch.bfloat16
    d_c, d_r, block_size = 512, 64, 64
    elem = torch.finfo(dtype).bits // 8
    rows = batch * q_len
    blocks_per_seq = triton.cdiv(seq, block_size)
    num_blocks = batch * blocks_per_seq
    kv_cache = torch.randn(num_blocks, block_size, d_c + d_r, device=device, dtype=dtype)
    block_tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), seq, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(0, rows + 1, q_len, dtype=torch.int32, device=device)
    q_latent = torch.randn(rows, heads, d_c, device=device, dtype=dtype)
    q_pe = torch.randn(rows, heads, d_r, device=device, dtype=dtype)
    io = (q_latent.numel() + q_pe.numel() + q_latent.numel()) * elem + (block_tables.numel() + 2 * batch + 1) * 4
    record = {
        "shape": {"batch": batch, "seq": seq, "q_len": q_len, "heads": heads, "d_c": d_c, "d_r": d_r, "block_size": block_size},
        "bytes": batch * seq * (d_c + d_r) * elem + io,
        "flops": 2 * rows * seq * heads * (2 * d_c + d_r),
    }
    name = f"mla_decode_attention {model}" + (f" q_len {q_len}" if q_len > 1 else "")
    ours = do_bench(lambda: mla_decode_attention(q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale),
                    return_mode="median")
    out = [{"name": name, "ms": ours, **record}]
    if flashmla.version() is None:
        return out
    import flash_mla

    q = torch.cat([q_latent, q_pe], dim=-1).view(batch, q_len, heads, d_c + d_r)
    k_cache = kv_cache.unsqueeze(2)
    meta, _ = flash_mla.get_mla_metadata()

    def peer():
        return flash_mla.flash_mla_with_kvcache(q, k_cache, block_tables, seq_lens, d_c, meta, softmax_scale=scale,
                                                causal=q_len > 1, use_legacy=True)

    provider = flashmla.FlashMLADecode(mla_decode_attention)  # the Triton kernel below its rows x heads threshold
    path = "flashmla" if flashmla.fits(q_latent, q_pe, kv_cache) else "triton"
    peer_ms = do_bench(peer, return_mode="median")
    provider_ms = do_bench(lambda: provider(q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale),
                           return_mode="median")
    out[0]["vs_flashmla"] = peer_ms / ours
    out.append({"name": f"{name} [flashmla]", "ms": peer_ms, "peer": flashmla.version(), **record})
    out.append({"name": f"{name} [flashmla provider]", "ms": provider_ms, "vs_flashmla": peer_ms / provider_ms,
                "provider_path": path, **record})
    return out
