"""V4's FP8 KV record (ops/kv_record.py) and the ops that take record caches / pools:
write_cache quantises, sparse_attention dequantises, and FP8-KV attention stays within a stated
bound of bf16-KV attention on the same rows."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.conformance.checks import check
from deepinfer_core.conformance.inputs import make_case
from deepinfer_core.conformance.spec import shapes
from deepinfer_core.ops.kv_record import (PAGE_BYTES, RECORD_BYTES, dequantize_v4_records, flashmla_view, planes,
                                          quantize_rows, quantize_v4_records, read_records)
from deepinfer_core.ops.sparse import key_pool, sparse_attention, write_cache

BF16, F32 = torch.bfloat16, torch.float32

# FP8-KV attention against bf16-KV attention on the same bf16 rows (q, sinks, indices equal), over
# sparse_attention's kv_record shapes: elementwise |o_fp8 - o_bf16| <= ATOL + RTOL |o_bf16| and the
# relative Frobenius error ||o_fp8 - o_bf16|| / ||o_bf16|| <= REL_NORM. e4m3 moves a value by up to
# 2^-4 of its tile's scale range and the scores move with the keys, so the softmax weights shift
# too; measured over seeds 0..9: worst 0.81 of the elementwise bound, relative norm 0.040 (2-4%
# typical). The test runs seeds 0..2.
FP8_KV_ATOL = FP8_KV_RTOL = 2.0**-3
FP8_KV_REL_NORM = 0.05


def test_record_layout_bytes():
    """One hand-made row at row 65 (page 1, slot 1): tile 0 all 3.0 (scale 2^-7: 3 / 448 rounds
    up to 2^-7, q = 384), tile 1 all zero (the floor's scale 2^-22), the other tiles 1.0 (scale
    2^-8, q = 256), RoPE part -2.5 in bf16. Its 576 data bytes sit at page 1's byte 576 (the
    data plane), its scales' bytes 127 + e and a zero pad at page 1's byte 36864 + 8 (the scale
    plane after the page's 64 data rows), as FlashMLA's MODEL1 FP8 format has them."""
    row = torch.ones(512)
    row[:64], row[64:128], row[448:] = 3.0, 0.0, -2.5
    rows = torch.zeros(66, 512)
    rows[65] = row
    cache = quantize_v4_records(rows)
    assert cache.shape == (128, RECORD_BYTES) and cache.dtype == torch.uint8
    page = cache.view(-1)[PAGE_BYTES:2 * PAGE_BYTES]
    data, scales = page[576:1152], page[36864 + 8:36864 + 16]
    assert scales.tolist() == [120, 105, 119, 119, 119, 119, 119, 0]
    nope = data[:448].view(torch.float8_e4m3fn).float()
    assert nope[:64].eq(384).all() and nope[64:128].eq(0).all() and nope[128:].eq(256).all()
    assert data[448:].view(torch.bfloat16).float().eq(-2.5).all()
    assert torch.equal(read_records(cache, torch.tensor([65]), F32)[0], row)
    assert torch.equal(dequantize_v4_records(cache, F32)[65], row)
    data_plane, scale_plane = planes(cache)
    assert data_plane[1, 2:].eq(0).all() and scale_plane[1, 2:].eq(0).all()  # rows 66..127: padding, zero bytes


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_round_trip_exact_on_representable_rows(dtype):
    """Rows that records represent (what a dequantisation gives) come back bit for bit, over
    magnitudes 1e-6..1e4 (and an all-zero row); any row comes back within e4m3's 2^-4 relative
    step of its tile's amax in the NoPE part and bf16's rounding in the RoPE part."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 512, generator=g) * torch.logspace(-6, 4, 300)[:, None]).to(dtype)
    x[0] = 0
    y = dequantize_v4_records(quantize_v4_records(x), dtype)[:300]
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(dequantize_v4_records(quantize_v4_records(y), dtype)[:300], y)
    tiles = x[:, :448].float().view(-1, 7, 64)
    step = tiles.abs().amax(-1, keepdim=True) * 2.0**-3  # one e4m3 ulp at the tile's amax, at most
    assert ((y[:, :448].float().view(-1, 7, 64) - tiles).abs() <= step).all()
    assert torch.equal(y[:, 448:], x[:, 448:].to(BF16).to(dtype))


def test_records_refuse_wrong_shapes():
    with pytest.raises(ValueError, match="512"):
        quantize_v4_records(torch.zeros(2, 576))
    with pytest.raises(ValueError, match="584"):
        dequantize_v4_records(torch.zeros(64, 576, dtype=torch.uint8), F32)
    with pytest.raises(ValueError, match="multiple of 64"):
        dequantize_v4_records(torch.zeros(65, RECORD_BYTES, dtype=torch.uint8), F32)
    with pytest.raises(ValueError, match="not contiguous"):
        dequantize_v4_records(torch.zeros(64, RECORD_BYTES + 8, dtype=torch.uint8)[:, :RECORD_BYTES], F32)


def test_write_cache_quantises_into_a_record_cache():
    """A record cache [blocks, rows, 584] gets quantize_rows(values)'s bytes in the slots' data and
    scale planes, nothing else changes."""
    cache = quantize_v4_records(torch.randn(128, 512)).view(4, 32, RECORD_BYTES)
    before = cache.clone()
    values = torch.randn(3, 512, dtype=BF16)
    slots = torch.tensor([70, -1, 0])
    write_cache(cache, values, slots)
    data, scales = planes(cache)
    old_data, old_scales = planes(before)
    d, sc = quantize_rows(values[[0, 2]])
    assert torch.equal(data[1, 6], d[0]) and torch.equal(scales[1, 6], sc[0])
    assert torch.equal(data[0, 0], d[1]) and torch.equal(scales[0, 0], sc[1])
    keep = torch.ones(2, 64, dtype=torch.bool)
    keep[1, 6] = keep[0, 0] = False
    assert torch.equal(data[keep], old_data[keep]) and torch.equal(scales[keep], old_scales[keep])


def test_flashmla_view_is_its_paged_k_cache():
    """FlashMLA's sparse decode reads k_cache [pages, 64, 1, 584] with stride(1) = 584 bytes a
    token and row r at page r // 64: a view of the cache, not a copy."""
    cache = quantize_v4_records(torch.randn(130, 512))
    view = flashmla_view(cache)
    assert view.shape == (3, 64, 1, RECORD_BYTES) and view.stride()[:2] == (PAGE_BYTES, RECORD_BYTES)
    assert view.data_ptr() == cache.data_ptr()


def test_sparse_attention_reads_record_pools_as_their_dequantised_rows():
    """Record pools (a tuple of them, each whole pages) give exactly the attention over the
    dequantised rows in q's dtype; a mix of record and float pools, and a record pool that is
    not whole pages, are refused."""
    g = torch.Generator().manual_seed(1)
    q, rows = torch.randn(3, 4, 512, generator=g, dtype=F32), torch.randn(10, 512, generator=g)
    first, second = quantize_v4_records(rows[:4]), quantize_v4_records(rows[4:])
    idx = torch.tensor([[0, 3, 64 + 5, -1], [64 + 1, -1, -1, -1], [-1, -1, -1, -1]])
    sinks, scale = torch.randn(4, generator=g), 512**-0.5
    want = sparse_attention(q, torch.cat([dequantize_v4_records(first, F32), dequantize_v4_records(second, F32)]),
                            idx, sinks, scale)
    assert torch.equal(sparse_attention(q, (first, second), idx, sinks, scale), want)
    with pytest.raises(ValueError, match="share dtype"):
        sparse_attention(q, (rows[:4], second), idx, sinks, scale)
    with pytest.raises(ValueError, match="multiple of 64"):
        sparse_attention(q, (first[:10], second), idx.clamp(max=9), sinks, scale)


@pytest.mark.parametrize("op", ["write_cache", "sparse_attention"])
def test_kit_record_shapes_pass_on_the_reference(op):
    """The spec's kv_record shapes build record inputs and pass the kit against the reference."""
    declared = [d for d in shapes(op) if d.get("kv_record")]
    assert declared
    for dims in declared:
        case = make_case(op, dims, BF16, "cpu", seed=0)
        assert any(isinstance(a, torch.Tensor) and a.dtype == torch.uint8 and a.shape[-1] == RECORD_BYTES for a in case.args) \
            or any(p.dtype == torch.uint8 for p in case.args[1])
        outcome = check(__import__("deepinfer_core.ops", fromlist=["REFERENCE_OPS"]).REFERENCE_OPS[op], case)
        assert outcome.ok, (dims, outcome.message)


def test_kit_catches_a_write_that_does_not_quantise_as_specified():
    """A backend that rounds the scale to the nearest power of two instead of up fails the byte check."""
    from deepinfer_core.ops import kv_record

    def bad(cache, values, slots):
        keep = slots >= 0
        kv_record.write_records(cache, values[keep], slots[keep])
        _, scales = kv_record.planes(cache)
        s = slots[keep]
        scales[s // 64, s % 64, :7] -= 1  # scale halved (NoPE values would clamp at 448)

    dims = next(d for d in shapes("write_cache") if d.get("kv_record"))
    outcome = check(bad, make_case("write_cache", dims, BF16, "cpu", seed=0))
    assert not outcome.ok and "in place" in outcome.message


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fp8_kv_attention_within_its_bound_of_bf16_kv(seed):
    """The same q, rows, indices and sinks: attention over the rows' records against over the
    bf16 rows (module constants FP8_KV_*)."""
    for dims in [d for d in shapes("sparse_attention") if d.get("kv_record")]:
        fp8 = make_case("sparse_attention", dims, BF16, "cpu", seed=seed)
        bf16 = make_case("sparse_attention", {k: v for k, v in dims.items() if k != "kv_record"}, BF16, "cpu", seed=seed)
        assert torch.equal(fp8.args[0], bf16.args[0])
        # the same keys, named past each record pool's padding rows: within e4m3's step of the bf16 rows
        records, rows = key_pool(fp8.args[1]), key_pool(bf16.args[1])
        idx8, idx16 = fp8.args[2], bf16.args[2]
        assert torch.equal(idx8 < 0, idx16 < 0)
        got, want = read_records(records, idx8.clamp(min=0), F32), rows[idx16.clamp(min=0)].float()
        assert ((got - want).abs() <= want.abs().amax(-1, keepdim=True) * 2.0**-3).all()
        o8, o16 = sparse_attention(*fp8.args).float(), sparse_attention(*bf16.args).float()
        worst = float(((o8 - o16).abs() / (FP8_KV_ATOL + FP8_KV_RTOL * o16.abs())).max()) if o16.numel() else 0.0
        rel = float((o8 - o16).norm() / o16.norm().clamp(min=1e-30))
        assert worst <= 1.0 and rel <= FP8_KV_REL_NORM, (dims, worst, rel)


def test_kit_leaves_record_shapes_out_on_a_platform_without_fp8_kv_cache():
    from deepinfer_core.conformance.ops_suite import run_op
    from deepinfer_core.ops import REFERENCE_OPS

    report = run_op("write_cache", REFERENCE_OPS["write_cache"], BF16, "cpu", examples=0, kv_records=False)
    assert report.result == "PASS" and report.records_not_run == sum(1 for d in shapes("write_cache") if d.get("kv_record"))
    assert "FP8 KV record shapes not run" in report.detail()
