"""MLA attention Triton kernels (decode and prefill) against the reference ops.

Tiny float32 cases run everywhere (in Triton's interpreter without a GPU); the spec's real-dimension
cases, a long-context decode case and the CUDA-graph check are marked ``gpu``.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.conformance.checks import poisoned_outputs
from deepinfer_core.conformance.inputs import ATTENTION_SCALES, attention_scale, make_case
from deepinfer_core.ops import attention as ref_ops

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the NVIDIA kernels cannot run")

from deepinfer_nvidia_sm100.kernels import mla_decode, mla_prefill
from tests.op_spec import assert_close, shapes


def _real(case: dict, dim: str, value: int) -> list:
    """pytest marks of a spec case: gpu when its `dim` has the real (slow under the interpreter) size."""
    return [pytest.mark.gpu] if case[dim] == value else []


def _cases(op: str, dim: str, value: int) -> list:
    return [pytest.param(c, id=f"case{i}", marks=_real(c, dim, value)) for i, c in enumerate(shapes(op))]


# ------------------------------------------------------------------------------------------------
# mla_decode_attention


def _decode_inputs(seq_lens, heads, d_c, d_r, block_size, dtype, device, seed=0, query_lens=None):
    """The conformance kit's inputs (the spec's generator): N(0, 1) cache and queries, block tables
    taken from a random permutation of the block pool as a non-contiguous view, q_pe strided;
    ``query_lens`` query rows per sequence (default one each), as query_start_loc."""
    dims = dict(seq_lens=list(seq_lens), heads=heads, kv_lora_rank=d_c, rope_dim=d_r, block_size=block_size, scale="default")
    if query_lens is not None:
        dims["query_lens"] = list(query_lens)
    args = make_case("mla_decode_attention", dims, dtype, device, seed).args[:6]  # the scale is the test's
    assert not args[3].is_contiguous()
    return args


@pytest.fixture(params=["default", "many_splits"])
def split_mode(request, monkeypatch):
    """'many_splits' shrinks tiles and split lengths so tiny sequences span several splits
    (including empty ones) and the combine kernel runs, loading 2 splits at a time (so its loop
    takes several steps, the last one part-masked where the valid splits are odd)."""
    if request.param == "many_splits":
        monkeypatch.setattr(mla_decode, "BLOCK_N", 16)
        monkeypatch.setattr(mla_decode, "FP32_BLOCK_N", 16)
        monkeypatch.setattr(mla_decode, "MIN_SPLIT_TOKENS", 16)
        monkeypatch.setattr(mla_decode, "SMALL_BATCH_MIN_SPLIT_TOKENS", 16)
        monkeypatch.setattr(mla_decode, "ONE_ROW_MIN_SPLIT_TOKENS", 16)
        monkeypatch.setattr(mla_decode, "INTERPRETER_SMS", 64)
        monkeypatch.setattr(mla_decode, "SPLIT_WAVES", 64.0)
        monkeypatch.setattr(mla_decode, "SPLIT_WAVES_SMALL_HEAD_BLOCKS", 64.0)
        monkeypatch.setattr(mla_decode, "COMBINE_BLOCK_S", 2)
    return request.param


def _check_decode(seq_lens, heads, d_c, d_r, block_size, scale, dtype, device, seed=0, query_lens=None):
    args = _decode_inputs(seq_lens, heads, d_c, d_r, block_size, dtype, device, seed, query_lens)
    with poisoned_outputs(torch.device(device)):
        out = mla_decode.mla_decode_attention(*args, scale)
    ref = ref_ops.mla_decode_attention(*args, scale)
    assert out.shape == ref.shape and out.dtype == dtype and out.device == args[0].device
    assert_close(out, ref, "mla_decode_attention", dtype, f" seq_lens={seq_lens} query_lens={query_lens} H={heads}")
    return out, ref


@pytest.mark.parametrize("case", _cases("mla_decode_attention", "kv_lora_rank", 512))
def test_decode_spec_shapes(case, split_mode, dtype, device):
    d_c, d_r = case["kv_lora_rank"], case["rope_dim"]
    _check_decode(case["seq_lens"], case["heads"], d_c, d_r, case["block_size"],
                  attention_scale(case["scale"], d_c + d_r), dtype, device, query_lens=case.get("query_lens"))


@pytest.mark.parametrize(
    "seq_lens,heads,block_size",
    [
        ([1, 2, 3, 4, 5, 17], 3, 4),   # lengths around block boundaries, H < 16 padded
        ([70, 1, 33], 20, 8),          # two head blocks (BLOCK_H = 16), several tiles
        ([45], 2, 1),                  # block_size 1: every token on its own page
        ([9, 40], 4, 64),              # one page larger than the sequences
    ],
)
def test_decode_awkward(seq_lens, heads, block_size, split_mode, dtype, device):
    _check_decode(seq_lens, heads, 32, 8, block_size, 40**-0.5, dtype, device, seed=1)


@pytest.mark.parametrize(
    "seq_lens,query_lens,heads,block_size",
    [
        ([7, 1, 13], [4, 1, 3], 3, 4),      # mixed q_lens: rows see 4..7, 1, 11..13 entries
        ([5, 3, 34], [5, 3, 2], 4, 4),      # q_len == seq_len: a sequence's first row sees one entry
        ([70, 40, 2], [4, 0, 2], 20, 8),    # two head blocks, a sequence without rows, rows over tiles
        ([33, 17], [8, 2], 2, 1),           # block_size 1, a row per token of a long tail
        ([64, 65], [3, 3], 4, 16),          # rows ending just before / on / after a page boundary
    ],
)
def test_decode_query_rows(seq_lens, query_lens, heads, block_size, split_mode, dtype, device):
    """Several query rows per sequence (speculative decoding's 1 + k), causal within the sequence."""
    _check_decode(seq_lens, heads, 32, 8, block_size, 40**-0.5, dtype, device, seed=5, query_lens=query_lens)


def test_decode_query_rows_are_the_op_on_each_row_alone(split_mode, dtype, device):
    """Row i of a sequence with q rows and n entries equals the kernel on that row alone as plain
    decode over n - q + 1 + i entries (within the spec's tolerance: split counts may differ)."""
    lens, query_lens = [9, 30], [3, 4]
    q_latent, q_pe, kv_cache, block_tables, seq_lens, starts = _decode_inputs(lens, 4, 32, 8, 4, dtype, device, 6, query_lens)
    out = mla_decode.mla_decode_attention(q_latent, q_pe, kv_cache, block_tables, seq_lens, starts, 0.2)
    one = torch.tensor([0, 1], dtype=torch.int32, device=device)
    for b, (n, q) in enumerate(zip(lens, query_lens)):
        for i in range(q):
            row = int(starts[b]) + i
            alone = mla_decode.mla_decode_attention(q_latent[row : row + 1], q_pe[row : row + 1], kv_cache, block_tables[b : b + 1],
                                                    torch.tensor([n - q + 1 + i], dtype=torch.int32, device=device), one, 0.2)
            assert_close(out[row : row + 1], alone, "mla_decode_attention", dtype, f" sequence {b} row {i}")


def test_decode_combine_step_leaves_the_bits_alone(monkeypatch, dtype, device):
    """The combine loads COMBINE_BLOCK_S splits at a time but adds them one by one in split order:
    1, 2 and 8 splits per step give the same bits (here 9 splits a sequence of 16-token tiles, of
    which 8, 8 and 2 hold tokens: with 8 a step, a second, part-masked step)."""
    for name, value in (("BLOCK_N", 16), ("FP32_BLOCK_N", 16), ("MIN_SPLIT_TOKENS", 16), ("SMALL_BATCH_MIN_SPLIT_TOKENS", 16),
                        ("INTERPRETER_SMS", 64), ("SPLIT_WAVES", 64.0), ("SPLIT_WAVES_SMALL_HEAD_BLOCKS", 64.0)):
        monkeypatch.setattr(mla_decode, name, value)
    args = _decode_inputs([120, 31, 128], 4, 32, 8, 16, dtype, device, 8)
    outs = []
    for step in (1, 2, 8):
        monkeypatch.setattr(mla_decode, "COMBINE_BLOCK_S", step)
        outs.append(mla_decode.mla_decode_attention(*args, 0.2))
    assert mla_decode._num_splits(3, 1, args[3].shape[1] * 16, args[0].device, 16) == 9
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_decode_many_sequences_in_several_lookups(monkeypatch, dtype, device):
    """More sequences than one query_start_loc block (MAX_BLOCK_B) holds: a row's sequence is
    found over several blocks of the lookup."""
    monkeypatch.setattr(mla_decode, "MAX_BLOCK_B", 2)
    _check_decode([3, 6, 1, 9, 4], 2, 32, 8, 4, 0.3, dtype, device, seed=7, query_lens=[2, 1, 1, 3, 4])


def test_decode_odd_dims(split_mode, dtype, device):
    """Latent and rope widths that are not powers of two (masked padding)."""
    _check_decode([5, 23], 4, 24, 6, 4, 0.2, dtype, device, seed=2)
    _check_decode([5, 23], 4, 24, 6, 4, 0.2, dtype, device, seed=2, query_lens=[2, 3])


def test_decode_padding_sequence_gives_zeros(split_mode, dtype, device):
    """seq_len 0 (a padded row of a captured batch) attends to nothing: zeros, like the reference;
    so do rows whose causal count seq_len - q_len + 1 + i is <= 0."""
    args = _decode_inputs([0, 6], 4, 32, 8, 4, dtype, device)
    with poisoned_outputs(torch.device(device)):
        out = mla_decode.mla_decode_attention(*args, 0.15)
    assert_close(out, ref_ops.mla_decode_attention(*args, 0.15), "mla_decode_attention", dtype)
    assert torch.count_nonzero(out[0]) == 0
    q_latent, q_pe, kv_cache, block_tables, _, _ = _decode_inputs([2, 6, 1], 4, 32, 8, 4, dtype, device, query_lens=[2, 3, 1])
    seq_lens = torch.tensor([0, 1, 6], dtype=torch.int32, device=device)  # rows see -1, 0 | -1, 0, 1 | 6 entries
    starts = torch.tensor([0, 2, 5, 6], dtype=torch.int32, device=device)
    with poisoned_outputs(torch.device(device)):
        out = mla_decode.mla_decode_attention(q_latent, q_pe, kv_cache, block_tables, seq_lens, starts, 0.15)
    assert_close(out, ref_ops.mla_decode_attention(q_latent, q_pe, kv_cache, block_tables, seq_lens, starts, 0.15),
                 "mla_decode_attention", dtype)
    assert torch.count_nonzero(out[:4]) == 0 and all(torch.count_nonzero(out[r]) > 0 for r in (4, 5))


def test_decode_empty_batch(device):
    args = _decode_inputs([1], 4, 32, 8, 4, torch.float32, device)
    q_latent, q_pe, kv_cache, block_tables, lens, starts = args
    out = mla_decode.mla_decode_attention(q_latent[:0], q_pe[:0], kv_cache, block_tables[:0], lens[:0], starts[:1], 0.1)
    assert out.shape == (0, 4, 32)
    out = mla_decode.mla_decode_attention(q_latent[:0], q_pe[:0], kv_cache, block_tables, lens, torch.zeros_like(starts), 0.1)
    assert out.shape == (0, 4, 32)  # a sequence without query rows: nothing to compute


def test_decode_split_count_from_shapes_only(monkeypatch):
    """The number of splits depends on the shapes (query rows, heads, block table width), not on values."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(mla_decode, "INTERPRETER_SMS", 132)
    assert mla_decode._num_splits(128, 2, 4096, cpu) == 1          # large batch: one wave already
    assert mla_decode._num_splits(64, 2, 4096, cpu) == 1           # 128 of 132 SMs busy: no partials
    assert mla_decode._num_splits(1, 2, 16384, cpu) == 64          # one long sequence: many splits
    assert mla_decode._num_splits(1, 2, 300, cpu) == 10            # capped by the one-row minimum split (32)
    assert mla_decode._num_splits(2, 2, 300, cpu) == 5             # ... and the small-batch one (64)
    assert mla_decode._num_splits(32, 2, 300, cpu) == 2            # ... and by MIN_SPLIT_TOKENS (256) beyond
    assert mla_decode._num_splits(4, 2, 4096, cpu) == 16
    assert mla_decode._num_splits(64, 1, 4096, cpu, block_h=16) == 8  # light programs: four waves


@pytest.mark.gpu
def test_decode_long_context(dtype, device):
    _check_decode([4096, 4000, 1, 2049], 128, 512, 64, 64, ATTENTION_SCALES["v3_yarn"], dtype, device, seed=3)
    _check_decode([4096, 4000, 2049], 16, 512, 64, 64, ATTENTION_SCALES["v2lite_yarn"], dtype, device, seed=3,
                  query_lens=[4, 2, 4])


@pytest.mark.gpu
@pytest.mark.parametrize("heads,block_size", [(128, 64), (16, 16)])
@pytest.mark.parametrize("query_lens", [None, [4, 1, 2, 3]], ids=["one_row", "query_rows"])
def test_decode_cuda_graph(heads, block_size, query_lens, dtype, device):
    """Captured once, replayed: same bits as eager, and new seq_lens / query_start_loc / block
    tables are honoured."""
    q_latent, q_pe, kv_cache, block_tables, lens, starts = _decode_inputs(
        [700, 1, 64, 333], heads, 512, 64, block_size, dtype, device, seed=4, query_lens=query_lens
    )
    scale = ATTENTION_SCALES["v3_yarn"]

    def call():
        return mla_decode.mla_decode_attention(q_latent, q_pe, kv_cache, block_tables, lens, starts, scale)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    eager = call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)

    lens.copy_(torch.tensor([5, 720, 3, 100], dtype=torch.int32, device=device))
    if query_lens is not None:  # the same number of rows, spread differently over the sequences
        starts.copy_(torch.tensor([0, 2, 7, 10, 10], dtype=torch.int32, device=device))
    block_tables.copy_(block_tables.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, call())
    assert_close(captured, ref_ops.mla_decode_attention(q_latent, q_pe, kv_cache, block_tables, lens, starts, scale),
                 "mla_decode_attention", dtype)


# ------------------------------------------------------------------------------------------------
# mla_prefill_attention


def _prefill_inputs(lens_q, lens_k, heads, d_qk, d_v, dtype, device, seed=0):
    """The conformance kit's inputs, shaped and strided as the model makes them: q a view of a wider
    tensor, k the concatenation [k_nope | shared k_pe], v a view into the [S, H, nope + v] projection."""
    dims = dict(seq_lens_q=list(lens_q), seq_lens_k=list(lens_k), heads=heads, qk_dim=d_qk, v_dim=d_v, scale="default")
    return make_case("mla_prefill_attention", dims, dtype, device, seed).args[:5]  # the scale is the test's


@pytest.fixture(params=["default", "small_tiles", "sdpa"])
def prefill_tiles(request, monkeypatch):
    """The prefill implementation under test: the Triton kernel ('small_tiles' makes the tiny
    sequences span several query and key tiles) or the SDPA one the op table uses."""
    if request.param == "small_tiles":
        for prefix in ("", "FP32_"):
            monkeypatch.setattr(mla_prefill, f"{prefix}BLOCK_M", 16)
            monkeypatch.setattr(mla_prefill, f"{prefix}BLOCK_N", 16)
            monkeypatch.setattr(mla_prefill, f"{prefix}NUM_WARPS", 4)
    if request.param == "sdpa":
        return mla_prefill.mla_prefill_attention_sdpa
    return mla_prefill.mla_prefill_attention


def _check_prefill(lens_q, lens_k, heads, d_qk, d_v, scale, dtype, device, seed=0, impl=None):
    args = _prefill_inputs(lens_q, lens_k, heads, d_qk, d_v, dtype, device, seed)
    with poisoned_outputs(torch.device(device)):
        out = (impl or mla_prefill.mla_prefill_attention)(*args, scale)
    ref = ref_ops.mla_prefill_attention(*args, scale)
    assert out.shape == ref.shape and out.dtype == dtype
    if ref.shape[0]:
        assert_close(out, ref, "mla_prefill_attention", dtype, f" lq={lens_q} lk={lens_k}")


@pytest.mark.parametrize("case", _cases("mla_prefill_attention", "qk_dim", 192))
def test_prefill_spec_shapes(case, prefill_tiles, dtype, device):
    _check_prefill(case["seq_lens_q"], case["seq_lens_k"], case["heads"], case["qk_dim"], case["v_dim"],
                   attention_scale(case["scale"], case["qk_dim"]), dtype, device, impl=prefill_tiles)


@pytest.mark.parametrize(
    "lens_q,lens_k",
    [
        ([0, 5, 0, 3], [4, 5, 2, 9]),   # sequences with no new token in the batch
        ([40, 1], [75, 50]),            # long cached prefixes, one single-token chunk
        ([33], [33]),                   # plain causal, partial tiles
        ([3, 2, 5], [17, 17, 68]),      # prefixes of 14, 15, 63: the diagonal just before a key tile's end
        ([0], [7]),                     # nothing to compute at all
    ],
)
def test_prefill_awkward(lens_q, lens_k, prefill_tiles, dtype, device):
    _check_prefill(lens_q, lens_k, 2, 24, 16, 24**-0.5, dtype, device, seed=1, impl=prefill_tiles)


def test_prefill_power_of_two_dims(prefill_tiles, dtype, device):
    """d_qk a power of two: no remainder part."""
    _check_prefill([6, 20], [10, 20], 3, 16, 16, 0.25, dtype, device, seed=2, impl=prefill_tiles)


def test_prefill_empty(device):
    q, k, v, cu_q, cu_k = _prefill_inputs([2], [2], 2, 24, 16, torch.float32, device)
    out = mla_prefill.mla_prefill_attention(q[:0], k, v, torch.zeros_like(cu_q), cu_k, 0.2)
    assert out.shape == (0, 2, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "sdpa"])
def test_prefill_long(impl, dtype, device):
    fn = mla_prefill.mla_prefill_attention_sdpa if impl == "sdpa" else mla_prefill.mla_prefill_attention
    _check_prefill([1000, 300, 0, 517], [1000, 1324, 64, 517], 16, 192, 128, ATTENTION_SCALES["v2lite_yarn"], dtype, device, impl=fn)
