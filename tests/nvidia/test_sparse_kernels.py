"""deepinfer_nvidia_sm100.kernels.sparse (DeepSeek-V4's sparse-attention ops): the conformance kit
on each op (CPU: the interpreter, the spec's shapes that fit CPU_MAX_ELEMENTS; GPU: every declared
shape, bf16 and float32), plus the edge cases of the kernels' design: key splits and their
combine, head counts that are not a multiple of the head block, blocks of -1 columns, empty
queries, an empty pool, negative cache slots, windows with empty slots, exact score ties."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the NVIDIA kernels cannot run")

from deepinfer_core.conformance.ops_suite import run_op  # noqa: E402
from deepinfer_core.conformance.spec import shapes  # noqa: E402
from deepinfer_core.ops import sparse as ref  # noqa: E402
from deepinfer_nvidia_sm100.kernels import sparse  # noqa: E402

ON_GPU = torch.cuda.is_available()
CPU_MAX_ELEMENTS = 1 << 21
CPU_EXAMPLES = 4
KV_RECORDS = True  # the kit's FP8 KV record shapes (backend.FP8_KV_CACHE: the kernels take V4 FP8 records)


@pytest.mark.parametrize("op", sorted(sparse.OPS))
def test_kit(op, device, dtype):
    fn = sparse.OPS[op]
    if ON_GPU:
        report = run_op(op, fn, dtype, device, kv_records=KV_RECORDS)
    else:
        report = run_op(op, fn, dtype, device, examples=CPU_EXAMPLES, max_elements=CPU_MAX_ELEMENTS, kv_records=KV_RECORDS)
    assert report.result == "PASS", f"{op} ({report.dtype}): {report.detail()}"
    assert report.cases >= len(shapes(op)) - report.skipped > 0, (report.cases, report.skipped)


def test_every_op_says_what_runs():
    assert sparse.OPS and all(isinstance(fn.impl, str) and fn.impl for fn in sparse.OPS.values())


# ---- sparse_attention ------------------------------------------------------------------------

def _index_rows(counts: list[int], width: int, pool: int, gen: torch.Generator) -> torch.Tensor:
    rows = torch.full((len(counts), width), -1, dtype=torch.int64)
    for i, n in enumerate(counts):
        rows[i, torch.randperm(width, generator=gen)[:n]] = torch.randperm(pool, generator=gen)[:n]
    return rows


def _attention_case(t, h, d, pool, k, counts, device, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=gen).to(device, dtype)
    kv = torch.randn(pool, d, generator=gen).to(device, dtype)
    sinks = torch.randn(h, generator=gen).to(device)
    idx = _index_rows(counts, k, pool, gen).to(device)
    return q, kv, idx, sinks, d**-0.5


def _close(out, want, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=max(tol, 1e-4))


@pytest.mark.parametrize("heads", [1, 3, 17])  # under, at and past one head block of 16
def test_attention_splits_and_ragged_heads(heads, device, dtype):
    """One query over 100 columns: several key splits (the interpreter assumes 4 SMs) and their
    combine; head counts not a multiple of the tile."""
    args = _attention_case(1, heads, 32, 120, 100, [77], device, dtype)
    num_splits, _ = sparse._attn_splits(1, 1, 16, 100, sparse._attn_tiles(heads, dtype)[1], device)
    assert num_splits > 1
    _close(sparse.sparse_attention(*args), ref.sparse_attention(*args), dtype)


def test_attention_split_without_keys_and_empty_query(device, dtype):
    """Query 0 names keys only in its last columns (its first splits see nothing but -1); query 1
    none at all: zeros, whatever the sink."""
    q, kv, idx, sinks, scale = _attention_case(2, 4, 32, 90, 96, [0, 0], device, dtype)
    idx[0, 90:] = torch.arange(6, device=device)
    out = sparse.sparse_attention(q, kv, idx, sinks, scale)
    _close(out, ref.sparse_attention(q, kv, idx, sinks, scale), dtype)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0


@pytest.mark.parametrize("t", [1, 12])  # split and unsplit
def test_attention_sink_dominates(t, device, dtype):
    """A sink far above every score takes nearly all the probability: outputs ~0, not NaN/inf."""
    q, kv, idx, sinks, scale = _attention_case(t, 2, 16, 40, 40, [40] * t, device, dtype)
    sinks = torch.full_like(sinks, 80.0)
    out = sparse.sparse_attention(q, kv, idx, sinks, scale)
    assert torch.isfinite(out).all()
    _close(out, ref.sparse_attention(q, kv, idx, sinks, scale), dtype)


def test_attention_empty_pool_and_zero_sizes(device, dtype):
    q, kv, idx, sinks, scale = _attention_case(3, 2, 16, 0, 5, [0, 0, 0], device, dtype)
    out = sparse.sparse_attention(q, kv, idx, sinks, scale)
    assert torch.equal(out, torch.zeros_like(out))
    q0, kv0, idx0, sinks0, _ = _attention_case(0, 2, 16, 4, 5, [], device, dtype)
    assert sparse.sparse_attention(q0, kv0, idx0, sinks0, scale).shape == (0, 2, 16)


def test_attention_strided_inputs(device, dtype):
    """q a head slice of a wider tensor, kv a column slice, indices a column slice."""
    q, kv, idx, sinks, scale = _attention_case(5, 6, 32, 50, 40, [40, 3, 17, 1, 25], device, dtype)
    qw = torch.cat([q, q], dim=1)[:, 3:9]
    kvw = torch.cat([kv, kv], dim=1)[:, 32:]
    idxw = torch.cat([idx, idx], dim=1)[:, 40:]
    _close(sparse.sparse_attention(qw, kvw, idxw, sinks, scale), ref.sparse_attention(qw, kvw, idxw, sinks, scale), dtype)


def _cut(kv: torch.Tensor, sizes: list[int], extra: int = 0) -> tuple[torch.Tensor, ...]:
    """``kv`` as consecutive pools of ``sizes`` rows; with ``extra``, each a row-strided view of
    rows ``extra`` columns wider (a column slice of a cache row)."""
    parts, start = [], 0
    for n in sizes:
        rows = kv[start : start + n]
        if extra:
            wide = torch.full((n, kv.shape[1] + extra), float("nan"), dtype=kv.dtype, device=kv.device)
            wide[:, extra:] = rows  # NaN where a wrong stride or offset would read
            rows = wide[:, extra:]
        parts.append(rows.clone() if not extra else rows)
        start += n
    return tuple(parts)


@pytest.mark.parametrize("t", [1, 12])  # split and unsplit
@pytest.mark.parametrize("sizes", [[20, 30, 40], [20, 0, 70], [0, 90], [90], [45, 45, 0], [0, 0, 90]])
def test_attention_key_pools_equal_their_concatenation(t, sizes, device, dtype):
    """1, 2 and 3 pools (empty ones first, in the middle, last), each a row-strided view, give the
    very bits of the concatenated pool, and the contract's reference within the tolerance."""
    counts = [64 - 5 * i for i in range(t)]
    q, kv, idx, sinks, scale = _attention_case(t, 3, 32, 90, 64, counts, device, dtype, seed=len(sizes))
    whole = sparse.sparse_attention(q, kv, idx, sinks, scale)
    pools = _cut(kv, sizes, extra=8)
    assert all(p.stride(0) == 40 for p in pools)
    out = sparse.sparse_attention(q, pools, idx, sinks, scale)
    assert torch.equal(out, whole)
    assert torch.equal(sparse.sparse_attention(q, list(pools), idx, sinks, scale), whole)
    _close(out, ref.sparse_attention(q, pools, idx, sinks, scale), dtype)


@pytest.mark.parametrize("sizes", [[5, 3, 4], [5, 0, 7], [0, 5, 7], [5, 7]])
def test_attention_key_pools_boundary_rows(sizes, device, dtype):
    """Each query names one row, the first or the last of a pool, among -1s; with a negligible
    sink its output is exactly that row (a neighbour's row, or another pool's, would not be)."""
    n = sum(sizes)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    boundary = sorted({r for s, m in zip(starts, sizes) if m for r in (s, s + m - 1)})
    q, kv, _, sinks, scale = _attention_case(len(boundary), 2, 16, n, 4, [], device, dtype)
    idx = torch.full((len(boundary), 4), -1, dtype=torch.int64)
    for i, row in enumerate(boundary):
        idx[i, i % 4] = row
    out = sparse.sparse_attention(q, _cut(kv, sizes, extra=16), idx.to(device), torch.full_like(sinks, -1e4), scale)
    for i, row in enumerate(boundary):
        assert torch.equal(out[i], kv[row].expand(2, -1)), (sizes, row)


def test_attention_key_pools_cache_views(device, dtype):
    """The model's pools: new rows, a paged window ring [blocks, rows, d] viewed as [-1, d], and
    the compressed entries a slice of rows of a wider cache, all read in place."""
    gen = torch.Generator().manual_seed(5)
    t, h, d = 3, 4, 32
    new = torch.randn(t, d, generator=gen).to(device, dtype)
    ring = torch.randn(4, 8, d, generator=gen).to(device, dtype)  # 32 window rows
    entries_cache = torch.randn(30, d + 24, generator=gen).to(device, dtype)
    entries = entries_cache[5:25, 24:]  # 20 entries, row stride d + 24, offset storage
    pools = (new, ring.view(-1, d), entries)
    n = 3 + 32 + 20
    idx = _index_rows([40, 17, 1], 40, n, gen)
    idx[2] = -1
    idx[2, 7] = n - 1  # the last entry alone
    idx = idx.to(device)
    q = torch.randn(t, h, d, generator=gen).to(device, dtype)
    sinks = torch.randn(h, generator=gen).to(device)
    whole = torch.cat([new, ring.view(-1, d), entries])
    out = sparse.sparse_attention(q, pools, idx, sinks, d**-0.5)
    assert torch.equal(out, sparse.sparse_attention(q, whole, idx, sinks, d**-0.5))
    _close(out, ref.sparse_attention(q, whole, idx, sinks, d**-0.5), dtype)


def test_attention_key_pools_refused():
    kv = torch.zeros(4, 8)
    for bad in [(), (kv, kv, kv, kv), (kv, kv[:, :4]), (kv, kv.double()), (kv, kv[None])]:
        with pytest.raises(ValueError, match="kv"):
            sparse.sparse_attention(torch.zeros(1, 1, 8), bad, torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1), 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="real sizes: GPU only")
@pytest.mark.parametrize("t,heads,k", [(1, 64, 640), (8, 128, 1152), (64, 64, 640), (2048, 128, 640)])
def test_attention_real_sizes(t, heads, k, device, dtype):
    """Decode (split) and prefill (unsplit) at V4's real widths, against the reference."""
    counts = [k - (i % 7) * 13 for i in range(t)]
    args = _attention_case(t, heads, 512, 4096, k, counts, device, dtype)
    _close(sparse.sparse_attention(*args), ref.sparse_attention(*args), dtype)


# ---- write_cache -------------------------------------------------------------------------------

@pytest.mark.parametrize("cache_dtype", [None, torch.float16])  # the values' dtype, another one
def test_write_cache_skips_negative_slots_exactly(cache_dtype, device, dtype):
    """Strided values, slots -1 and -7 skipped, a cache of another dtype: the stored rows equal the
    values cast as torch casts them, every other row keeps its bits."""
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(3, 4, 300, generator=gen).to(device, cache_dtype or dtype)
    wide = torch.randn(6, 600, generator=gen).to(device, dtype)
    values = wide[:, 300:]
    slots = torch.tensor([5, -1, 0, 11, -7, 2], device=device)
    want = cache.clone()
    ref.write_cache(want, values, slots)
    sparse.write_cache(cache, values, slots)
    assert torch.equal(cache, want)


def test_write_cache_nothing_to_write(device, dtype):
    cache = torch.randn(2, 4, 16).to(device, dtype)
    before = cache.clone()
    sparse.write_cache(cache, torch.empty(0, 16, device=device, dtype=dtype), torch.empty(0, dtype=torch.int64, device=device))
    sparse.write_cache(cache, torch.ones(2, 16, device=device, dtype=dtype), torch.tensor([-1, -1], device=device))
    assert torch.equal(cache, before)


# ---- compress_pool -----------------------------------------------------------------------------

def test_compress_pool_finite_slots_only_in_a_later_tile(device, dtype):
    """HCA-like: 40 slots read 8 at a time (channels 512); in window 0 every slot but the last is
    empty, so the first tiles see only -inf for every channel (the running max stays -inf)."""
    gen = torch.Generator().manual_seed(2)
    n, s, c = 3, 40, 512
    kv = torch.randn(n, s, c, generator=gen).to(device, dtype)
    score = torch.randn(n, s, c, generator=gen).to(device)
    score[0, :-1] = float("-inf")
    score[1, ::2] = float("-inf")
    w = (1 + 0.1 * torch.randn(c, generator=gen)).to(device)
    out = sparse.compress_pool(kv, score, w, 1e-6)
    want = ref.compress_pool(kv, score, w, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    # one finite slot: the entry is that slot's row, normalised
    torch.testing.assert_close(out[0].float(), ref.rms_norm_f32(kv[0, -1], w, 1e-6).float(), atol=tol, rtol=tol)
    assert sparse.compress_pool(kv[:0], score[:0], w, 1e-6).shape == (0, c)


# ---- indexer_topk ------------------------------------------------------------------------------

def test_indexer_scores_match_the_reference(device, dtype):
    """20 heads (a padded head block), 24-dim keys (padded), 150 candidates over 3 blocks."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 20, 24, generator=gen).to(device, dtype)
    w = (torch.randn(3, 20, generator=gen) / 20**0.5).to(device)
    keys = torch.randn(200, 24, generator=gen).to(device, dtype)
    cands = _index_rows([150, 40, 0], 150, 200, gen).to(device)
    got = sparse.indexer_scores(q, w, keys, cands, 24**-0.5)
    want = ref._scores(q, w, keys, cands, 24**-0.5)
    assert torch.equal(got == float("-inf"), cands < 0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.fixture(params=["sort", "threshold"])
def select(request, monkeypatch):
    """Both ways indexer_topk picks its columns (sparse.INDEXER_SELECT)."""
    monkeypatch.setattr(sparse, "INDEXER_SELECT", request.param)
    return request.param


def test_top_k_columns_by_either_way_follow_the_tie_rule(select):
    """Rows with ties at the k-th score, -0.0 beside +0.0, -inf columns, k = C: the same columns as
    a stable descending sort (as a set: the order is free), whatever the selection."""
    gen = torch.Generator().manual_seed(6)
    scores = torch.randint(-3, 4, (64, 40), generator=gen).float()  # many exact ties
    scores[::3] *= -1.0  # -0.0 in some rows
    scores[5, :30] = float("-inf")
    scores[6] = float("-inf")
    for k in (1, 7, 16, 40):
        want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k].sort(-1).values
        got = sparse.top_k_columns(scores, k)
        assert torch.equal(got.sort(-1).values, want), (select, k)


def test_the_kit_passes_indexer_topk_by_threshold(device, dtype, monkeypatch):
    """The conformance kit's indexer_topk shapes (tied queries, duplicate keys) with the threshold
    selection (test_kit runs the default, the sort)."""
    monkeypatch.setattr(sparse, "INDEXER_SELECT", "threshold")
    if ON_GPU:
        report = run_op("indexer_topk", sparse.indexer_topk, dtype, device)
    else:
        report = run_op("indexer_topk", sparse.indexer_topk, dtype, device, examples=CPU_EXAMPLES, max_elements=CPU_MAX_ELEMENTS)
    assert report.result == "PASS", report.detail()


def test_indexer_zero_ties_go_to_the_earlier_columns(device, dtype, select):
    """Every head weighed negatively and every key opposite the queries: all scores are exactly 0
    (+0.0 or -0.0 before the kernel's +0.0), so the first top_k valid columns must be chosen."""
    gen = torch.Generator().manual_seed(4)
    q = torch.rand(2, 4, 16, generator=gen).add(0.1).to(device, dtype)
    w = -torch.rand(2, 4, generator=gen).add(0.1).to(device)
    keys = -torch.rand(30, 16, generator=gen).add(0.1).to(device, dtype)
    cands = torch.randperm(30, generator=gen)[:20].repeat(2, 1).to(device)
    cands[1, :5] = -1
    got = sparse.indexer_topk(q, w, keys, cands, 6, 0.25)
    assert torch.equal(got[0], cands[0, :6])
    assert torch.equal(got[1], cands[1, 5:11])


def test_indexer_short_rows_and_wide_k(device, dtype, select):
    """top_k above C: rows of C; a query without valid candidates: all -1."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 2, 16, generator=gen).to(device, dtype)
    w = torch.randn(2, 2, generator=gen).to(device)
    keys = torch.randn(10, 16, generator=gen).to(device, dtype)
    cands = torch.tensor([[3, -1, 7, 1], [-1, -1, -1, -1]], device=device)
    got = sparse.indexer_topk(q, w, keys, cands, 9, 0.25)
    assert got.shape == (2, 4)
    assert sorted(got[0].tolist()) == [-1, 1, 3, 7]
    assert got[1].tolist() == [-1] * 4
    assert sparse.indexer_topk(q[:0], w[:0], keys, cands[:0], 9, 0.25).shape == (0, 4)
