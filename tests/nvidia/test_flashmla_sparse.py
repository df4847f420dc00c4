"""FlashMLA's sparse FP8 decode as the provider of sparse_attention over V4's FP8 records
(deepinfer_nvidia_sm100/flashmla_sparse.py).

CPU: a stand-in ``flash_mla`` module that computes what FlashMLA's sparse decode is documented
to compute (each batch entry's queries over the rows its indices name in k_cache [pages, 64, 1,
584], -1 skipped, plus those of extra_k_cache; scores scaled, softmax with the sink's share
dropped) checks the provider's own work: the split of the op's concatenated row numbers into the
two caches' indices, the -1 padding to FlashMLA's 64-wide index blocks, zeros for queries with no
key, one scheduler metadata per shape, and the fallback for every call FlashMLA does not take.
GPU (``gpu``, skipped where flash_mla does not import): the real kernel against the reference at
V4-Flash and V4-Pro shapes, and a CUDA-graph replay equal to the eager call.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from deepinfer_core.ops import sparse as ref
from deepinfer_core.ops.kv_record import RECORD_BYTES, quantize_v4_records, read_records
from deepinfer_nvidia_sm100 import flashmla, flashmla_sparse
from tests.op_spec import assert_close

BF16 = torch.bfloat16


class _StandIn(types.ModuleType):
    """FlashMLA's sparse FP8 decode as documented, in torch (float32), with call counts."""

    def __init__(self):
        super().__init__("flash_mla")
        self.metadata_made = self.calls = 0
        self.widths = []

    def get_mla_metadata(self, *args, **kwargs):
        self.metadata_made += 1
        return types.SimpleNamespace(filled=False), None

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, meta, softmax_scale=None,
                               causal=False, is_fp8_kvcache=None, indices=None, attn_sink=None, extra_k_cache=None,
                               extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None,
                               use_legacy=False, kv_format=None):
        assert use_legacy and is_fp8_kvcache and not causal and kv_format == "V4" and head_dim_v == 512
        assert block_table is None and cache_seqlens is None and topk_length is None and extra_topk_length is None
        assert k_cache.shape[1:] == (64, 1, RECORD_BYTES) and k_cache.stride(1) == RECORD_BYTES
        assert indices.dtype == torch.int32 and indices.shape[-1] % 64 == 0 and attn_sink.dtype == torch.float32
        self.calls += 1
        meta.filled = True
        self.widths.append((indices.shape[-1], None if extra_indices_in_kvcache is None else extra_indices_in_kvcache.shape[-1]))
        b, s_q, h, d = q.shape
        keys, valid = [], []
        for cache, idx in ((k_cache, indices), (extra_k_cache, extra_indices_in_kvcache)):
            if cache is None:
                continue
            rows = read_records(cache.reshape(-1, RECORD_BYTES), idx.long().clamp(min=0), torch.float32)  # [b, s_q, K, d]
            keys.append(rows)
            valid.append(idx >= 0)
        keys, valid = torch.cat(keys, dim=2), torch.cat(valid, dim=2)
        scores = torch.einsum("bshd,bskd->bshk", q.float(), keys) * softmax_scale
        scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [b, s_q, h]
        out = torch.einsum("bshk,bskd->bshd", torch.softmax(scores, dim=-1).nan_to_num(0.0), keys)
        out = out * (torch.exp(lse) / (torch.exp(lse) + torch.exp(attn_sink)))[..., None]
        return out.to(q.dtype), lse.transpose(1, 2)


@pytest.fixture
def stand_in(monkeypatch):
    fake = _StandIn()
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    monkeypatch.setattr(flashmla_sparse, "DEVICE_TYPES", ("cpu", "cuda"))
    return fake


def _case(t, heads, sizes, keys_per_pool, device="cpu", seed=0, empty_queries=()):
    """q [t, heads, 512] bf16, record pools of ``sizes`` rows (whole pages), indices naming up to
    ``keys_per_pool[i]`` random rows of pool i per query (-1 padded), sinks, scale."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, 512, generator=g).to(BF16)
    pools = tuple(quantize_v4_records(torch.randn(n, 512, generator=g)) if n else
                  torch.zeros(0, RECORD_BYTES, dtype=torch.uint8) for n in sizes)
    cols, start = [], 0
    for p, n, k in zip(pools, sizes, keys_per_pool):
        if k:
            picks = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)]) + start
            drop = torch.rand(t, k, generator=g) < 0.2
            cols.append(torch.where(drop, -1, picks))
        start += p.shape[0]
    idx = torch.cat(cols, dim=1)
    idx = idx[:, torch.randperm(idx.shape[1], generator=g)]  # the pools' keys interleaved: any order
    for e in empty_queries:
        idx[e] = -1
    sinks = torch.randn(heads, generator=g)
    return (q.to(device), tuple(p.to(device) for p in pools), idx.to(device), sinks.to(device), 512**-0.5)


@pytest.mark.parametrize("sizes,keys", [((256,), (128,)), ((256, 4096), (100, 512)), ((0, 128, 640), (0, 120, 500)),
                                        ((128, 0), (128, 0))])
def test_split_indices_and_zeros_for_empty_queries(stand_in, sizes, keys):
    args = _case(3, 64, sizes, keys, empty_queries=(1,))
    op = flashmla_sparse.FlashMLASparse(lambda *a: pytest.fail("the fallback ran"), "stand-in 0")
    got = op(*args)
    assert stand_in.calls == 1 and all(w % 64 == 0 for w in stand_in.widths[0] if w)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert_close(got, ref.sparse_attention(*args), "sparse_attention", BF16)


def test_one_metadata_per_shape(stand_in):
    op = flashmla_sparse.FlashMLASparse(None, "stand-in 0")
    a, b = _case(2, 64, (256, 640), (128, 512), seed=1), _case(2, 64, (256, 640), (128, 512), seed=2)
    c = _case(2, 64, (256,), (128,), seed=3)
    for args in (a, b, c, a):
        op(*args)
    assert stand_in.calls == 4 and stand_in.metadata_made == 2


@pytest.mark.parametrize("what", ["heads", "three pools", "bf16 pools", "float32 q", "not whole pages"])
def test_what_flashmla_does_not_take_goes_to_the_fallback(stand_in, what):
    q, pools, idx, sinks, scale = _case(2, 64, (128, 256), (64, 64))
    if what == "heads":
        q = q[:, :32]
        sinks = sinks[:32]
    elif what == "three pools":
        pools = pools + (quantize_v4_records(torch.randn(64, 512)),)
    elif what == "bf16 pools":
        pools = tuple(torch.randn(p.shape[0], 512, dtype=BF16) for p in pools)
    elif what == "float32 q":
        q = q.float()
    else:
        pools = (pools[0][:100], pools[1])
        idx = idx.clamp(max=99)
    calls = []
    op = flashmla_sparse.FlashMLASparse(lambda *a: calls.append(a) or "fallback", "stand-in 0")
    assert op(q, pools, idx, sinks, scale) == "fallback" and calls and stand_in.calls == 0


def test_provided_with_flashmla_only(stand_in, monkeypatch):
    monkeypatch.setattr(flashmla, "version", lambda: "stand-in 0")
    fallback = object()
    ops = flashmla.provide({"sparse_attention": fallback})
    assert isinstance(ops["sparse_attention"], flashmla_sparse.FlashMLASparse)
    assert ops["sparse_attention"].fallback is fallback and "sparse FP8 decode" in ops["sparse_attention"].impl
    monkeypatch.setattr(flashmla, "version", lambda: None)
    assert flashmla.provide({"sparse_attention": fallback})["sparse_attention"] is fallback


# ------------------------------------------------------------------------------------------------
# the real kernel


def _real_flash_mla():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if flashmla.version() is None:
        pytest.skip("flash_mla does not import (pip install 'deepinfer-nvidia-sm100[flashmla]')")


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("t,sizes,keys", [(1, (256,), (128,)), (8, (8192, 16384), (128, 512)),
                                          (33, (0, 4096, 2048), (0, 128, 1024)), (4, (1024, 640), (128, 17))])
def test_flashmla_sparse_against_the_reference(heads, t, sizes, keys):
    _real_flash_mla()
    args = _case(t, heads, sizes, keys, device="cuda", seed=5, empty_queries=(0,))
    op = flashmla_sparse.FlashMLASparse(lambda *a: pytest.fail("the fallback ran"), flashmla.version())
    assert_close(op(*args), ref.sparse_attention(*args), "sparse_attention", BF16)


@pytest.mark.gpu
def test_flashmla_sparse_cuda_graph_replay():
    """Captured once and replayed over new indices and new rows: the eager call's bits."""
    _real_flash_mla()
    q, pools, idx, sinks, scale = _case(4, 64, (512, 1024), (128, 512), device="cuda", seed=6)
    op = flashmla_sparse.FlashMLASparse(lambda *a: pytest.fail("the fallback ran"), flashmla.version())
    op(q, pools, idx, sinks, scale)  # warm: the metadata of this shape exists before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(q, pools, idx, sinks, scale)
    new = _case(4, 64, (512, 1024), (128, 512), device="cuda", seed=7)
    q.copy_(new[0])
    idx.copy_(new[2])
    for p, n in zip(pools, new[1]):
        p.copy_(n)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, op(q, pools, idx, sinks, scale))
    assert_close(captured, ref.sparse_attention(q, pools, idx, sinks, scale), "sparse_attention", BF16)
