"""The TileLang kernels as DeepInfer op callables on the NPU (the plugin's op table takes them
from ``op_table()``).

Each callable has its op's signature (``deepinfer_core.ops``), JIT-compiles its kernel for the
shapes it meets (``tilelang.compile(..., target="ascend")``: bisheng from CANN; once per shape
key, cached here and in TileLang's own cache) and runs it on the tensors' NPU stream through
TileLang's torch_npu exchange. Shapes a kernel does not take (``supports``) and empty batches go to
the reference implementation, which runs on the NPU like on any torch device. The glue does
what the kernels leave to torch: the router's float32 gate GEMM (as the reference computes it),
dtype and layout preparation (contiguous, float32 norm weights, int32 ids / slots), int32 -> int64
ids.

Nothing here has run on an Ascend chip: the ``npu``-marked tests (tests/test_ascend_tilelang.py)
compare each callable with the reference there.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from deepinfer_core.ops import engram as ref_engram
from deepinfer_core.ops import kv_record
from deepinfer_core.ops import moe as ref_moe
from deepinfer_core.ops import sparse as ref_sparse

from deepinfer_ascend_950.tilelang_ops import KERNELS, unavailable_reason

log = logging.getLogger("deepinfer")
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@functools.lru_cache(maxsize=None)
def compiled(name: str, *args):
    """The JIT-compiled kernel ``name`` (KERNELS) for factory arguments ``args`` on the Ascend target."""
    import tilelang

    return tilelang.compile(KERNELS[name].build(*args, target="ascend"), target="ascend")


def compress_pool(kv: torch.Tensor, score: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    from deepinfer_ascend_950.tilelang_ops.compress import supports

    n, slots, channels = kv.shape
    dtype = DTYPE_NAMES.get(kv.dtype)
    if n == 0 or dtype is None or not supports(slots, channels, dtype):
        return ref_sparse.compress_pool(kv, score, norm_weight, eps)
    out = kv.new_empty((n, channels))
    kernel = compiled("deepinfer_compress_pool", slots, channels, dtype)
    kernel(kv.contiguous(), score.float().contiguous(), norm_weight.float().contiguous(), out, float(eps))
    return out


def moe_route_sqrtsoftplus(x, gate_weight, correction_bias, fixed_ids, *, top_k, norm_topk_prob, routed_scaling_factor):
    from deepinfer_ascend_950.tilelang_ops.route import supports

    tokens, experts = x.shape[0], gate_weight.shape[0]
    if tokens == 0 or not supports(experts, top_k):
        return ref_moe.moe_route_sqrtsoftplus(x, gate_weight, correction_bias, fixed_ids, top_k=top_k,
                                              norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)
    logits = F.linear(x.float(), gate_weight.float())  # the reference's gate GEMM, float32
    weights = logits.new_empty((tokens, top_k))
    renorm = bool(norm_topk_prob)
    if fixed_ids is not None:
        kernel = compiled("deepinfer_route_fixed", experts, top_k, renorm)
        kernel(logits, fixed_ids.to(torch.int32).contiguous(), weights, float(routed_scaling_factor))
        return weights, fixed_ids.long()
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=x.device)
    bias = correction_bias.float().contiguous() if correction_bias is not None else logits.new_zeros(experts)
    kernel = compiled("deepinfer_route_topk", experts, top_k, renorm)
    kernel(logits, bias, weights, ids, float(routed_scaling_factor))
    return weights, ids.long()


def engram_hash_ids(ngram_ids, multipliers, primes, offsets, pad_id):
    from deepinfer_ascend_950.tilelang_ops.engram import hash_supports

    tokens, n = ngram_ids.shape
    heads = primes.shape[-1]
    if tokens == 0 or primes.shape[0] != n - 1 or not hash_supports(n, heads):
        return ref_engram.engram_hash_ids(ngram_ids, multipliers, primes, offsets, pad_id)
    dev = ngram_ids.device
    out = torch.empty((tokens, (n - 1) * heads), dtype=torch.int64, device=dev)
    kernel = compiled("deepinfer_engram_hash", n, heads)
    kernel(ngram_ids.long().contiguous(), multipliers.to(dev, torch.int64).contiguous(), primes.to(dev, torch.int64).contiguous(),
           offsets.to(dev, torch.int64).contiguous(), out, int(pad_id))
    return out


def engram_gate(x, kv, q_weight, k_weight, eps):
    from deepinfer_ascend_950.tilelang_ops.engram import gate_supports

    tokens, hc, hidden = x.shape
    dtype = DTYPE_NAMES.get(x.dtype)
    if tokens == 0 or dtype is None or not gate_supports(hc, hidden, dtype):
        return ref_engram.engram_gate(x, kv, q_weight, k_weight, eps)
    out = torch.empty_like(x)
    kernel = compiled("deepinfer_engram_gate", hc, hidden, dtype)
    kernel(x.contiguous(), kv.to(x.dtype).contiguous(), q_weight.to(x.dtype).contiguous(), k_weight.to(x.dtype).contiguous(),
           out, float(eps))
    return out


def write_cache(cache, values, slot_mapping):
    """V4 FP8 record caches through the kernel; any other cache through the reference (a row copy)."""
    dtype = DTYPE_NAMES.get(values.dtype)
    if (not kv_record.is_record_cache(cache) or dtype is None or values.dim() != 2 or values.shape[-1] != kv_record.ROW_DIM
            or values.shape[0] == 0):
        return ref_sparse.write_cache(cache, values, slot_mapping)
    pages = kv_record.planes(cache)[0].shape[0]  # checks the layout (contiguous uint8, whole pages)
    kernel = compiled("deepinfer_write_records", dtype)
    kernel(values.contiguous(), slot_mapping.to(torch.int32).contiguous(), cache.view(pages, kv_record.PAGE_BYTES))


def compress_entries(rows, state, windows, positions, norm_weight, eps, cos_sin, overlap, dtype):
    """V4's compressor: the reference's gather and RoPE around the pooling kernel (compress_pool
    above: the kernel where it takes the shapes, else the reference). No fused kernel yet."""
    return ref_sparse.compress_entries_with(compress_pool, rows, state, windows, positions, norm_weight, eps, cos_sin,
                                            overlap, dtype)


OPS = {
    "compress_pool": compress_pool,
    "compress_entries": compress_entries,
    "moe_route_sqrtsoftplus": moe_route_sqrtsoftplus,
    "engram_hash_ids": engram_hash_ids,
    "engram_gate": engram_gate,
    "write_cache": write_cache,
}


def op_table() -> dict:
    """The ops above, or ``{}`` (the reference for all of them) when TileLang is not installed."""
    reason = unavailable_reason()
    if reason is not None:
        log.warning("ascend: TileLang kernels off, their ops fall back to the reference: %s", reason)
        return {}
    return dict(OPS)
