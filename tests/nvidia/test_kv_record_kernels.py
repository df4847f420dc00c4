"""The NVIDIA kernels on DeepSeek-V4's FP8 KV records (deepinfer_core.ops.kv_record): write_cache
quantises byte for byte as the reference does (rounding ties, exact powers of two, the amax floor,
huge and subnormal magnitudes, negative slots, paged caches), and sparse_attention over record
pools (1-3 parts, empty parts, -1 columns, page boundaries) is the attention over their exactly
dequantised rows. The kit's kv_record shapes run in test_sparse_kernels.py (KV_RECORDS)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the NVIDIA kernels cannot run")

from deepinfer_core.ops import sparse as ref  # noqa: E402
from deepinfer_core.ops.kv_record import (E4M3_MAX, RECORD_BYTES, dequantize_v4_records, quantize_v4_records,  # noqa: E402
                                          record_rows)
from deepinfer_nvidia_sm100.kernels import sparse  # noqa: E402
from tests.nvidia.sm90 import compile_sm90  # noqa: E402


def _e4m3_values() -> torch.Tensor:
    """0, every finite positive e4m3 value, the midpoints between neighbours (ties: half round
    down to an even mantissa, half up; the subnormals' too), the float32 values either side of
    each midpoint, and values past the last tie below 448 (they round to 448)."""
    grid = torch.cat([torch.zeros(1), torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()])
    mid = (grid[1:] + grid[:-1]) / 2
    return torch.cat([grid, mid, torch.nextafter(mid, torch.tensor(0.0)), torch.nextafter(mid, torch.tensor(E4M3_MAX)),
                      torch.tensor([440.0, 447.99, 432.0001, 2.0**-10 + 2.0**-40, 2.0**-12])])


def _bf16_ties() -> torch.Tensor:
    """64 RoPE values: bf16 rounding ties 1 + (2k + 1) 2^-8 (to even: half down, half up), the
    float32 values just above them, and both negated."""
    ties = 1 + (2 * torch.arange(16) + 1) * 2.0**-8
    near = torch.cat([ties, torch.nextafter(ties, torch.tensor(2.0))])
    return torch.cat([near, -near])


def _rows_covering(values: torch.Tensor, e: int) -> torch.Tensor:
    """Rows [T, 512] holding ``values`` and their negations in NoPE tiles whose first value is
    448 (so amax / 448 is exactly 1), the RoPE parts _bf16_ties(); all times 2^e (exact)."""
    signed = torch.cat([values, -values])
    nope = torch.cat([signed, signed[:(-len(signed)) % 441]]).view(-1, 7, 63)
    nope = torch.cat([torch.full((nope.shape[0], 7, 1), E4M3_MAX), nope], dim=2).view(-1, 448)
    return torch.cat([nope, _bf16_ties().expand(nope.shape[0], -1)], dim=1) * 2.0**e


def _write_both(cache: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, device: torch.device) -> None:
    """The kernel's write on ``device`` against the reference's on the CPU, byte for byte; ``cache``
    (a CPU tensor) then holds the result, for a next write."""
    want = cache.clone()
    ref.write_cache(want, values, slots)
    got = cache.to(device)
    sparse.write_cache(got, values.to(device), slots.to(device))
    cache.copy_(got.cpu())
    diff = (cache != want).nonzero()
    assert diff.numel() == 0, f"{len(diff)} bytes differ, first at {diff[:4].tolist()}"


def test_write_rounds_every_e4m3_case_as_torch(device):
    """Every e4m3 value, tie and near-tie, both signs, under scales 2^e from the floor's 2^-22 to
    2^119 (448 * 2^119 is near float32's largest), and bf16 ties in the RoPE parts: the same bytes
    as the reference (which casts with torch)."""
    rows = torch.cat([_rows_covering(_e4m3_values(), e) for e in (0, -22, -9, 5, 60, 119)])
    cache = torch.zeros(record_rows(rows.shape[0]), RECORD_BYTES, dtype=torch.uint8)
    _write_both(cache, rows, torch.arange(rows.shape[0]), device)


def test_write_scale_exponents_at_their_edges(device):
    """amax / 448 exactly a power of two, one float32 step above and below it, at the floor
    (1e-4) and below it, an all-zero tile, float32 subnormals, values near float32's largest,
    and random magnitudes 1e-30..1e30: scale bytes and data as the reference's frexp gives them."""
    g = torch.Generator().manual_seed(0)
    amax = []
    for e in (-22, -21, -1, 0, 1, 7, 30, 119):
        exact = torch.tensor(E4M3_MAX * 2.0**e)
        amax += [exact, torch.nextafter(exact, torch.tensor(0.0)), torch.nextafter(exact, torch.tensor(float("inf")))]
    amax += [torch.tensor(x) for x in (1e-4, 0.99e-4, 0.0, 1e-40, 3.0e38, 3.4028235e38)]
    amax = torch.stack(amax).float()
    tiles = torch.rand(len(amax), 64, generator=g) * 2 - 1
    tiles = tiles / tiles.abs().amax(-1, keepdim=True) * amax[:, None]  # every tile's amax as listed
    tiles[amax == 0] = 0
    nope = torch.cat([tiles, torch.zeros((-len(amax)) % 7, 64)]).view(-1, 448)
    rope = torch.cat([torch.tensor([1e-40, -1e-40, 3.0e38, 2.0**-133]), torch.randn(60, generator=g)])
    rows = torch.cat([nope, rope.expand(nope.shape[0], -1)], dim=1)
    rows = torch.cat([rows, torch.randn(9, 512, generator=g) * torch.logspace(-30, 30, 9)[:, None]])
    cache = torch.zeros(record_rows(rows.shape[0]), RECORD_BYTES, dtype=torch.uint8)
    _write_both(cache, rows, torch.arange(rows.shape[0]), device)


@pytest.mark.parametrize("values_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_paged_cache_strided_values_negative_slots(values_dtype, device):
    """A record cache [blocks, 32, 584] (two blocks a page) written from a column slice of wider
    values, slots -1 and -5 skipped, rows on both sides of page boundaries: the reference's bytes,
    every other byte kept."""
    g = torch.Generator().manual_seed(1)
    cache = quantize_v4_records(torch.randn(192, 512, generator=g)).view(6, 32, RECORD_BYTES)
    wide = (torch.randn(7, 1024, generator=g) * 3).to(values_dtype)
    slots = torch.tensor([63, -1, 64, 0, -5, 191, 127])
    _write_both(cache, wide[:, 512:], slots, device)
    _write_both(cache, wide[:0, 512:], slots[:0], device)  # nothing to write
    _write_both(cache, wide[:2, 512:], torch.tensor([-1, -1]), device)


def test_write_refuses_what_is_not_a_record_write():
    cache = torch.zeros(64, RECORD_BYTES, dtype=torch.uint8)
    slots = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="float rows"):
        sparse.write_cache(cache, torch.zeros(2, 448), slots)
    with pytest.raises(ValueError, match="multiple of 64"):
        sparse.write_cache(cache[:10], torch.zeros(2, 512), slots)


# ---- sparse_attention over record pools --------------------------------------------------------

def _record_case(sizes: list[int], t: int, heads: int, k: int, seed: int):
    """(q, record pools holding N(0, 1) rows (sizes[i] rows, whole pages), their dequantised
    concatenation, indices naming valid rows in their concatenated numbering with -1s, sinks)."""
    g = torch.Generator().manual_seed(seed)
    pools = tuple(quantize_v4_records(torch.randn(n, 512, generator=g)) for n in sizes)
    starts = [sum(p.shape[0] for p in pools[:i]) for i in range(len(pools))]
    valid = torch.cat([torch.arange(n) + s for n, s in zip(sizes, starts)] + [torch.zeros(0, dtype=torch.int64)])
    idx = torch.full((t, k), -1, dtype=torch.int64)
    for i in range(t):
        n = min(len(valid), k - 3 * i)
        if n > 0:
            idx[i, torch.randperm(k, generator=g)[:n]] = valid[torch.randperm(len(valid), generator=g)[:n]]
    q = torch.randn(t, heads, 512, generator=g)
    rows = torch.cat([dequantize_v4_records(p, torch.float32) for p in pools])
    return q, pools, rows, idx, torch.randn(heads, generator=g)


@pytest.mark.parametrize("t", [1, 5])  # split and unsplit
@pytest.mark.parametrize("sizes", [[70], [3, 40, 100], [0, 20, 70], [30, 0], [0, 0, 50]])
def test_attention_over_record_pools(t, sizes, device):
    """1-3 record pools (empty ones first, in the middle, last; 1-2 pages each) and -1 columns:
    the very bits of the kernel over the dequantised rows (the same tiles and splits), and the
    reference (on the CPU) over the records within the spec's tolerance."""
    q, pools, rows, idx, sinks = _record_case(sizes, t, 3, 48, seed=len(sizes) + t)
    on = [x.to(device) for x in (q, idx, sinks)]
    out = sparse.sparse_attention(on[0], tuple(p.to(device) for p in pools), on[1], on[2], 512**-0.5)
    assert torch.equal(out, sparse.sparse_attention(on[0], rows.to(device), on[1], on[2], 512**-0.5))
    torch.testing.assert_close(out.cpu(), ref.sparse_attention(q, pools, idx, sinks, 512**-0.5), atol=1e-5, rtol=1e-4)


def test_attention_reads_each_record_row_from_its_page(device):
    """Each query names one row among -1s, the first or last slot of a page of each pool, with a
    negligible sink: its output is exactly that row, dequantised (a wrong page, slot, plane or
    pool would give another)."""
    sizes = [64, 128, 64]  # three pools: one page, two pages, one page
    q, pools, rows, _, sinks = _record_case(sizes, 1, 2, 4, seed=7)
    boundary = [0, 63, 64, 127, 128, 191, 192, 255]
    idx = torch.full((len(boundary), 4), -1, dtype=torch.int64)
    for i, row in enumerate(boundary):
        idx[i, i % 4] = row
    q = q.expand(len(boundary), -1, -1).contiguous()
    out = sparse.sparse_attention(q.to(device), tuple(p.to(device) for p in pools), idx.to(device),
                                  torch.full_like(sinks, -1e4).to(device), 512**-0.5).cpu()
    for i, row in enumerate(boundary):
        assert torch.equal(out[i], rows[row].expand(2, -1)), row


def test_attention_refuses_record_mixes():
    q = torch.zeros(1, 1, 512)
    idx = torch.zeros(1, 1, dtype=torch.int64)
    records = torch.zeros(64, RECORD_BYTES, dtype=torch.uint8)
    with pytest.raises(ValueError, match="share dtype"):
        sparse.sparse_attention(q, (records, torch.zeros(64, 512)), idx, torch.zeros(1), 1.0)
    with pytest.raises(ValueError, match="multiple of 64"):
        sparse.sparse_attention(q, (records, records[:10]), idx, torch.zeros(1), 1.0)
    with pytest.raises(ValueError, match="width 512"):
        sparse.sparse_attention(torch.zeros(1, 1, 256), records, idx, torch.zeros(1), 1.0)


# ---- compiled for sm_90 (no GPU needed) ------------------------------------------------------

_COMPILE_SM90 = r'''
import torch
from deepinfer_nvidia_sm100.kernels import sparse

for values in ("fp32", "bf16", "fp16"):
    spills(sparse._write_records_kernel, {"cache_ptr": "*u8", "val_ptr": "*" + values, "slot_ptr": "*i64"}, {"PDL": True},
           sparse.RECORD_WRITE_NUM_WARPS)
for heads in (64, 16):  # the bf16 tiles: 64 heads a program, and 16
    block_h, block_n, warps = sparse._attn_tiles(heads, torch.bfloat16)
    for split, pools in ((True, 1), (False, 3)):
        stack = {}
        for records in (True, False):
            kv = "*u8" if records else "*bf16"
            ptrs = {"q_ptr": "*bf16", "kv_ptr": kv, "kv1_ptr": kv, "kv2_ptr": kv, "idx_ptr": "*i64", "sink_ptr": "*fp32",
                    "out_ptr": "*bf16", "part_ptr": "*fp32", "lse_ptr": "*fp32", "scale_log2": "fp32"}
            consts = {"D": 512, "BLOCK_D": 512, "BLOCK_H": block_h, "BLOCK_N": block_n, "HEAD_BLOCKS": 1, "SPLIT": split,
                      "DOT_PRECISION": "tf32", "POOLS": pools, "RECORDS": records, "PDL": True}
            stack[records] = build(sparse._sparse_attn_kernel, ptrs, consts, warps, sparse.ATTN_NUM_STAGES)
        if stack[True] > stack[False]:
            failed.append(f"sparse attention over records, {heads} heads, split {split}, {pools} pools: "
                          f"{stack[True]} stack bytes, over rows' {stack[False]}")
'''


def test_record_kernels_compile_for_sm90():
    """The write kernel compiles for sm_90 (Triton's ptxas) without spills, the bf16 attention over
    records compiles and spills no more than over bf16 rows at the same tiles (which, compiled
    so, without the launch's alignment hints, spill a few hundred bytes already)."""
    compile_sm90(_COMPILE_SM90)
