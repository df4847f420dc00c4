"""Benchmark of ``deepinfer_nvidia_sm100.kernels.mla_prefill`` (the lead runs it on the GPU): the
Triton varlen causal MLA prefill kernel beside SDPA at DeepSeek-V3 and V2-Lite prefill shapes."""

from __future__ import annotations

import torch

from deepinfer_nvidia_sm100.kernels.mla_prefill import mla_prefill_attention, mla_prefill_attention_sdpa


def _causal_pairs(lq: int, lk: int) -> int:
    """Number of (query, key) pairs attended when the lq queries are the last of lk keys."""
    return lq * (lk - lq) + lq * (lq + 1) // 2


def bench(device: str = "cuda") -> list[dict]:
    """Time mla_prefill_attention (and SDPA with a lower-right causal mask, for comparison) at
    DeepSeek-V3 (H=128) and V2-Lite (H=16) prefill shapes.

    bytes = q + k + v read once + out written once; flops = 2 x causal pairs x H x (d_qk + d_v).
    """
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right
    from triton.testing import do_bench

    dtype = torch.bfloat16
    d_nope, d_rope, d_v = 128, 64, 128
    d_qk = d_nope + d_rope
    elem = torch.finfo(dtype).bits // 8
    results = []
    for model, heads, scale in (("V3", 128, 0.135234), ("V2-Lite", 16, 0.114721)):
        for lens in ([1024], [4096], [1024] * 8):
            batch, lq = len(lens), lens[0]
            total = batch * lq
            cu = torch.arange(0, total + 1, lq, device=device, dtype=torch.int32)
            q = torch.randn(total, heads, d_qk, device=device, dtype=dtype)
            # k and v as the model makes them: views of one [S, H, nope + v] tensor (+ k_pe).
            kv = torch.randn(total, heads, d_nope + d_v, device=device, dtype=dtype)
            k_pe = torch.randn(total, 1, d_rope, device=device, dtype=dtype)
            k = torch.cat([kv[..., :d_nope], k_pe.expand(total, heads, d_rope)], dim=-1)
            v = kv[..., d_nope:]
            pairs = batch * _causal_pairs(lq, lq)
            flops = 2 * pairs * heads * (d_qk + d_v)
            nbytes = (q.numel() + k.numel() + total * heads * d_v + total * heads * d_v) * elem
            shape = {"seqs": batch, "lq": lq, "lk": lq, "heads": heads, "d_qk": d_qk, "d_v": d_v}
            ms = do_bench(lambda: mla_prefill_attention(q, k, v, cu, cu, scale), return_mode="median")
            results.append({"name": f"mla_prefill_attention {model}", "shape": shape, "ms": ms,
                            "bytes": nbytes, "flops": flops})

            qb = q.view(batch, lq, heads, d_qk).transpose(1, 2)
            kb = k.view(batch, lq, heads, d_qk).transpose(1, 2)
            vb = v.reshape(batch, lq, heads, d_v).transpose(1, 2)
            mask = causal_lower_right(lq, lq)
            try:
                ms = do_bench(lambda: F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale),
                              return_mode="median")
            except RuntimeError as e:  # no SDPA backend for these head dims: record why
                ms = float("nan")
                shape = {**shape, "error": str(e).splitlines()[0]}
            results.append({"name": f"sdpa lower-right causal {model}", "shape": shape, "ms": ms,
                            "bytes": nbytes, "flops": flops})
            ms = do_bench(lambda: mla_prefill_attention_sdpa(q, k, v, cu, cu, scale), return_mode="median")
            results.append({"name": f"mla_prefill_attention_sdpa {model}", "shape": shape, "ms": ms,
                            "bytes": nbytes, "flops": flops})
            del q, k, v, kv, k_pe, qb, kb, vb
    return results
