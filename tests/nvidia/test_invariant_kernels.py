"""The NVIDIA backend's batch-invariant op table (``deepinfer_ops(batch_invariant=True)``).

Each replaced kernel passes the conformance kit against the reference, and gives a row the same
bits whatever other rows share the call. On a GPU any rows are compared. Under Triton's
interpreter a tile's ``tl.dot`` is numpy's matmul, whose OpenBLAS rounds a row differently at
different positions of the tile (tests/test_batch_invariant.py shows the CPU side of that), so
there the compared rows keep their position in their BLOCK_M tile: what is checked is that no
tile, split or K order follows the number of rows. Attention programs hold heads, not rows, so
its rows are compared freely everywhere.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the NVIDIA kernels cannot run")

from deepinfer_core.conformance.checkpoints import quantize_fp8_block  # noqa: E402
from deepinfer_core.conformance.ops_suite import run_op  # noqa: E402
from deepinfer_core.ops import REFERENCE_OPS  # noqa: E402
from deepinfer_nvidia_sm100 import backend as nvidia  # noqa: E402
from deepinfer_nvidia_sm100.kernels import fp8_linear, mla_decode  # noqa: E402
from tests.nvidia.conftest import HAS_CUDA  # noqa: E402

NORMAL = nvidia.deepinfer_ops(platform=None, model_config=None, batch_invariant=False)
INVARIANT = nvidia.deepinfer_ops(platform=None, model_config=None, batch_invariant=True)
REPLACED = sorted(name for name in INVARIANT if INVARIANT[name] is not NORMAL[name])
TILE = fp8_linear.INVARIANT_TILE[0]  # the invariant GEMMs' BLOCK_M


def test_the_invariant_table_replaces_what_follows_the_batch():
    assert REPLACED == ["fp8_block_linear", "head_linear", "linear", "mla_decode_attention", "moe_experts", "moe_route", "sample_tokens"]
    assert all("batch-invariant" in INVARIANT[name].impl for name in REPLACED)


@pytest.mark.parametrize("op", REPLACED)
def test_every_invariant_kernel_passes_the_kit(op, device, dtype):
    if HAS_CUDA:
        report = run_op(op, INVARIANT[op], dtype, device)
    elif op == "sample_tokens":
        pytest.skip("interpreted sampling draws take minutes: tests/nvidia/test_sampling_kernels.py covers the kernel")
    else:
        report = run_op(op, INVARIANT[op], dtype, device, examples=2, max_elements=1 << 20)
    assert report.result == "PASS", f"{op} ({report.dtype}): {report.detail()}"


def _subsets(rows: int) -> list[list[int]]:
    """Row subsets to compare: any on a GPU; whole BLOCK_M tiles in the interpreter."""
    if HAS_CUDA:
        return [[5], [0, rows - 1], list(range(3, 20)), [30, 2, 11, 7, 8, 9, 10, 1, 0]]
    return [list(range(TILE, 2 * TILE)), list(range(TILE, rows)), list(range(2 * TILE))]


def test_gemm_rows_do_not_follow_the_batch(device, dtype):
    gen = torch.Generator().manual_seed(0)
    rows, k, n = 3 * TILE + 5, 300, 70
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    q, s = quantize_fp8_block(torch.randn(96, k, generator=gen) / k**0.5, (32, 128))
    q, s = q.to(device), s.to(device)
    xh = torch.randn(rows, 4, 40, generator=gen).to(device, dtype)[..., :32]
    wh = torch.randn(4, 32, 48, generator=gen).to(device, dtype).transpose(1, 2)
    products = {
        "linear": lambda a: INVARIANT["linear"](a, w),
        "fp8_block_linear": lambda a: INVARIANT["fp8_block_linear"](a, q, s, (32, 128)),
        "head_linear": lambda a: INVARIANT["head_linear"](a, wh),
    }
    inputs = {"linear": x, "fp8_block_linear": x, "head_linear": xh}
    for name, fn in products.items():
        whole = fn(inputs[name])
        for subset in _subsets(rows):
            assert torch.equal(fn(inputs[name][subset]), whole[subset]), (name, subset)
    # the normal FP8 GEMM does choose its tile and K splits by M; the invariant one never does
    assert fp8_linear.fp8_config(1, 576, 7168, 128, torch.bfloat16, device) != fp8_linear.fp8_config(4096, 576, 7168, 128, torch.bfloat16, device)


def test_fp8_gemm_splits_k_the_same_way_at_any_m(device, dtype, monkeypatch):
    """The invariant FP8 GEMM launches one configuration for every M. With 4 SMs (pinned, so the
    shapes mean the same on a GPU) the shape heuristic would split this product's K into 4 for 16
    rows and into 8 for 48 (another tile, fewer row tiles to fill the SMs): the partials would
    then be summed in another order, and a row's bits would follow the batch."""
    monkeypatch.setattr(fp8_linear, "num_sms", lambda device, interpreter_sms: 4)
    n, k, block = 128, 512, (64, 16)
    heuristic = [fp8_linear.fp8_config(m, n, k, block[1], dtype, device).split_k for m in (TILE, 3 * TILE)]
    assert heuristic[0] != heuristic[1], heuristic  # the shapes still tell the two configurations apart
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3 * TILE, k, generator=gen).to(device, dtype)
    q, s = quantize_fp8_block(torch.randn(n, k, generator=gen) / k**0.5, block)
    q, s = q.to(device), s.to(device)
    whole = INVARIANT["fp8_block_linear"](x, q, s, block)
    for rows in (slice(0, TILE), slice(TILE, 2 * TILE)):
        assert torch.equal(INVARIANT["fp8_block_linear"](x[rows], q, s, block), whole[rows]), rows


@pytest.mark.parametrize("splits", ["default", "short"])
def test_attention_rows_are_the_same_alone_in_a_batch_and_in_a_prompt_chunk(device, dtype, splits, monkeypatch):
    """A sequence's newest row: decoded alone, decoded beside other sequences, with a wider block
    table, and as the last row of a prompt chunk computed as one long row (how batch-invariant
    engines prefill). "short": splits of 16 tokens, at most 3 a row, and partials for 2 rows a
    launch, so rows of a prompt chunk are cut where their own lengths say, not their sequence's."""
    if splits == "short":
        monkeypatch.setattr(mla_decode, "INV_MIN_SPLIT_TOKENS", 16)
        monkeypatch.setattr(mla_decode, "INV_SPLIT_TOKENS_PER_HEAD", 1)
        monkeypatch.setattr(mla_decode, "INV_MAX_SPLITS", 3)
        monkeypatch.setattr(mla_decode, "INV_PARTIAL_BYTES", 2 * 3 * 16 * 64 * 4)
    gen = torch.Generator().manual_seed(1)
    heads, d_c, d_r, block = 16, 64, 16, 16
    lens = [70, 5, 33, 130]
    blocks_per = [-(-n // block) for n in lens]
    cache = torch.randn(sum(blocks_per) + 2, block, d_c + d_r, generator=gen).to(device, dtype)
    perm = torch.randperm(sum(blocks_per), generator=gen)
    tables = torch.zeros(len(lens), max(blocks_per) + 24, dtype=torch.int32)
    start = 0
    for b, m in enumerate(blocks_per):
        tables[b, :m] = perm[start : start + m]
        start += m
    tables = tables.to(device)
    q = torch.randn(sum(lens), heads, d_c, generator=gen).to(device, dtype)
    q_pe = torch.randn(sum(lens), heads, d_r, generator=gen).to(device, dtype)
    fn = INVARIANT["mla_decode_attention"]

    def call(seqs: list[int], q_lens: list[int], rows: list[torch.Tensor], width: int = max(blocks_per), seq_lens=lens):
        qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=device)
        lens_t = torch.tensor([seq_lens[b] for b in seqs], dtype=torch.int32, device=device)
        idx = torch.cat(rows)
        return fn(q[idx], q_pe[idx], cache, tables[seqs, :width], lens_t, qsl, 0.1)

    ends = torch.tensor(lens).cumsum(0)
    last = [torch.tensor([int(ends[b]) - 1]) for b in range(len(lens))]  # each sequence's newest row
    alone = [call([b], [1], [last[b]]) for b in range(len(lens))]
    batch = call(list(range(len(lens))), [1] * len(lens), last)
    wide = call(list(range(len(lens))), [1] * len(lens), last, width=tables.shape[1])
    chunk = call([3, 0], [40, 1], [torch.arange(int(ends[3]) - 40, int(ends[3])), last[0]])
    for b in range(len(lens)):
        assert torch.equal(batch[b], alone[b][0]) and torch.equal(wide[b], alone[b][0]), b
    assert torch.equal(chunk[39], alone[3][0]) and torch.equal(chunk[40], alone[0][0])
    # an earlier row of the chunk (91 entries: 3 splits of 32 by its own length, 48 by its
    # sequence's) is that row decoded alone
    first = call([3], [1], [torch.tensor([int(ends[3]) - 40])], seq_lens={3: 91})
    assert torch.equal(chunk[0], first[0])
    # and it is the reference op, within the kit's tolerance
    ref = REFERENCE_OPS["mla_decode_attention"](q[last[3]], q_pe[last[3]], cache, tables[[3]],
                                                torch.tensor([lens[3]], dtype=torch.int32, device=device),
                                                torch.tensor([0, 1], dtype=torch.int32, device=device), 0.1)
    torch.testing.assert_close(alone[3].float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert mla_decode._num_splits(1, 1, 16384, device) > 1  # the normal kernel would split by the batch's shape


def test_sampling_ranks_a_row_the_same_way_in_any_batch(device):
    """A top-p row beside a top-k row: the normal op ranks both with a top-k as wide as the batch's
    largest; the invariant one sorts the whole row, as it does alone."""
    from deepinfer_nvidia_sm100.kernels import sampling

    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 3000, generator=gen) * 3).to(device)
    t = torch.tensor([0.8, 0.8], device=device)
    k, p = torch.tensor([0, 50], device=device), torch.tensor([0.9, 0.9], device=device)
    minp = torch.zeros(2, device=device)
    host = (t.cpu(), k.cpu(), p.cpu(), minp.cpu())
    both = sampling._thresholds(logits, t, k, p, minp, host_read=False, host_params=host, full_sort=True)
    alone = sampling._thresholds(logits[:1], t[:1], k[:1], p[:1], minp[:1], host_read=False,
                                 host_params=tuple(h[:1] for h in host), full_sort=True)
    assert torch.equal(both[:1], alone)
