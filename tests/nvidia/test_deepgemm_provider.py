"""DeepGEMM as the provider of moe_experts for block-FP8 experts (deepinfer_nvidia_sm100/deepgemm.py).

CPU (kernels interpreted): a stand-in ``deep_gemm`` whose grouped GEMM checks what DeepGEMM's
m-grouped contiguous layout demands (rows in M-aligned expert segments, -1 on padding, the
activation scales M-major with 16-byte aligned rows) and computes the block-scaled product; the
provider's output against a W8A8 emulation of the reference and against the reference within the
spec's FP8 tolerance; the dispatch and the backend table. GPU (``gpu``, where ``deep_gemm``
imports on sm_90): the real GEMMs against the reference, and the conformance kit.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from deepinfer_core.conformance.inputs import make_case
from deepinfer_core.conformance.spec import tolerance
from deepinfer_core.ops import REFERENCE_OPS
from deepinfer_core.ops.moe import dequantize_fp8_block

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the NVIDIA kernels cannot run")

from deepinfer_nvidia_sm100 import backend as nvidia  # noqa: E402
from deepinfer_nvidia_sm100 import deepgemm  # noqa: E402
from deepinfer_nvidia_sm100.kernels import fp8_linear, moe  # noqa: E402
from tests.nvidia.test_dense_kernels import quantize_dequantize_activations  # noqa: E402
from tests.nvidia.test_moe_kernels import w8a8_emulation  # noqa: E402

BLOCK = (128, 128)
# Against the W8A8 emulation: an element of x or h may round to the neighbouring e4m3 value
# (2^-3 apart) where the kernel's x * (1 / s) and the emulation's x / s straddle a boundary.
# A quarter of the spec's FP8 tolerance (atol 0.2): a wrong expert or slot is off by O(1).
EMULATION_SLACK = dict(atol=5e-2, rtol=2e-2)


class _DeepGemm:
    """deep_gemm's m-grouped contiguous FP8 GEMM as it runs on sm_90, its layout demands checked."""

    def __init__(self, alignment: int):
        self.alignment = alignment
        self.calls = 0
        self.__version__ = "stand-in"

    def get_mk_alignment_for_contiguous_layout(self):
        return self.alignment

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, grouped_layout):
        self.calls += 1
        (a, sa), (w, sw) = a, b
        m, k = a.shape
        n = w.shape[1]
        assert a.dtype == w.dtype == torch.float8_e4m3fn and m % self.alignment == 0
        assert grouped_layout.dtype == torch.int32 and grouped_layout.shape == (m,)
        assert sa.shape == (m, k // 128) and sa.stride() == (1, -(-m // 4) * 4)  # M-major, TMA-aligned
        assert sw.shape == (w.shape[0], n // 128, k // 128) and d.shape == (m, n)
        assert d.dtype == (torch.bfloat16 if d.is_cuda else torch.float32)  # the interpreter's kernels run float32
        # (The real kernel skips an M-block by its first row's group; this checks the segments whole.)
        segments = grouped_layout.view(-1, self.alignment)
        for seg in segments:  # each aligned segment: one expert's rows, then padding (-1)
            ids = seg[seg >= 0]
            assert ids.numel() == 0 or (bool((ids == ids[0]).all()) and bool((seg[: ids.numel()] >= 0).all()))
        a_f = (a.float().view(m, k // 128, 128) * sa[:, :, None]).view(m, k)
        for e in grouped_layout[grouped_layout >= 0].unique().tolist():
            rows = grouped_layout == e
            d[rows] = (a_f[rows] @ dequantize_fp8_block(w[e], sw[e], BLOCK, torch.float32).t()).to(d.dtype)


@pytest.fixture
def stand_in(monkeypatch):
    """deep_gemm replaced by the stand-in, alignment 16 (DeepGEMM's is 128) to keep it small."""
    dg = _DeepGemm(16)
    monkeypatch.setattr(deepgemm, "module", lambda: dg)
    monkeypatch.setattr(deepgemm, "version", lambda: "stand-in 0")
    return dg


def _case(tokens=40, hidden=256, inter=128, experts=4, top_k=3, seed=0, device="cpu"):
    dims = dict(tokens=tokens, hidden=hidden, intermediate=inter, experts=experts, top_k=top_k, fp8_block=list(BLOCK))
    return make_case("moe_experts", dims, torch.bfloat16, device, seed=seed)


def _w8a8(x, w13, w2, weights, ids, s13, s2):
    """The reference with both GEMMs' activations rounded per 128 channels to e4m3 (what the
    provider multiplies), gate | up and silu rounded to x's dtype as the provider writes them."""
    return w8a8_emulation(x, w13, w2, weights, ids, s13, s2, BLOCK, round_gate_up=True, quantize=quantize_dequantize_activations)


def test_quantize_gathers_rows_and_gates(device):
    """quantize_activations' modes for DeepGEMM: rows gathered through pair indices (padding where
    the index is not a pair), and silu(gate) * up quantised in the same pass."""
    torch.manual_seed(2)
    x = torch.randn(5, 256).to(device)
    pairs = torch.tensor([7, 0, 10, 10, 3, 14, 10, 10], dtype=torch.int32, device=device)  # 10: not a pair (k=2)
    q = torch.empty((8, 256), device=device).to(torch.float8_e4m3fn)
    scales = torch.empty((2, 8), device=device).t()
    fp8_linear.quantize_activations(x, q, scales, 128, rows=pairs, num_valid=10, row_div=2)
    deq = (q.float().view(8, 2, 128) * scales[:, :, None]).view(8, 256)
    expect = torch.zeros(8, 256, device=device)
    for r, p in enumerate(pairs.tolist()):
        if p < 10:
            expect[r] = quantize_dequantize_activations(x[p // 2: p // 2 + 1], 128)[0]
    torch.testing.assert_close(deq, expect, atol=1e-6, rtol=0.13)  # one e4m3 step of slack, as for the plain mode
    assert (q[2:4].float() == 0).all() and (q[6:].float() == 0).all()

    gate_up = torch.randn(6, 512).to(device)
    q = torch.empty((6, 256), device=device).to(torch.float8_e4m3fn)
    scales = torch.empty((2, 8), device=device).t()[:6]
    fp8_linear.quantize_activations(gate_up, q, scales, 128, gated=True)
    deq = (q.float().view(6, 2, 128) * scales[:, :, None]).view(6, 256)
    torch.testing.assert_close(deq, quantize_dequantize_activations(REFERENCE_OPS["silu_and_mul"](gate_up), 128), atol=1e-6, rtol=0.13)
    with pytest.raises(ValueError, match="columns"):  # gate | up is twice the quantised width
        fp8_linear.quantize_activations(gate_up, q, scales, 128)
    with pytest.raises(ValueError, match="num_valid"):
        fp8_linear.quantize_activations(x, q, scales, 128, rows=pairs)


def test_sum_slots_gathers_and_weights(device):
    torch.manual_seed(3)
    y = torch.randn(9, 64).to(device)
    rows = torch.tensor([4, 0, 8, 2, 1, 5], dtype=torch.int32, device=device)  # 3 tokens x 2 slots
    weights = torch.rand(6, device=device)
    out = torch.empty(3, 64, device=device)
    moe.sum_slots(y, out, 2, rows=rows, weights=weights)
    expect = (y[rows.long()] * weights[:, None]).view(3, 2, 64).sum(1)
    torch.testing.assert_close(out, expect)
    moe.sum_slots(y[:6], out, 2)  # the plain mode: consecutive rows, unweighted
    torch.testing.assert_close(out, y[:6].view(3, 2, 64).sum(1))


@pytest.mark.parametrize("tokens,top_k,experts,chunked", [(40, 3, 4, False), (40, 3, 4, True), (7, 2, 8, False), (64, 1, 3, True)],
                         ids=["pad_every_expert", "chunked_align", "some_empty", "one_slot"])
def test_grouped_experts_against_w8a8_and_the_reference(stand_in, tokens, top_k, experts, chunked, device, monkeypatch):
    if chunked:  # the align real calls take (thousands of pairs), not the one-program one of small batches
        monkeypatch.setattr(moe, "ALIGN_SINGLE_PROGRAM_MAX_PAIRS", 0)
    case = _case(tokens=tokens, top_k=top_k, experts=experts, device=device)
    x, w13, w2, weights, ids, s13, s2, block = case.args
    if device.type == "cpu":  # the interpreter's kernels take float32; the product stays the bf16 one
        x = x.float()
    out = deepgemm.grouped_experts(x, w13, w2, weights, ids, s13, s2)
    assert stand_in.calls == 2 and out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.float(), _w8a8(x, w13, w2, weights, ids, s13, s2).float(), **EMULATION_SLACK)
    ref = REFERENCE_OPS["moe_experts"](*case.args)
    torch.testing.assert_close(out.to(ref.dtype).float(), ref.float(), **tolerance("moe_experts", torch.bfloat16, case.dims))


def test_a_wrong_expert_fails_the_fp8_tolerance(stand_in, device):
    """The looser FP8 tolerance still catches a pair routed to the wrong expert."""
    case = _case(device=device)
    x, w13, w2, weights, ids, s13, s2, block = case.args
    wrong = ids.clone()
    wrong[3, 0] = next(e for e in range(w13.shape[0]) if e not in ids[3].tolist())
    assert not torch.equal(wrong, ids)
    out = deepgemm.grouped_experts(x.float() if device.type == "cpu" else x, w13, w2, weights, wrong, s13, s2)
    ref = REFERENCE_OPS["moe_experts"](*case.args)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out.to(ref.dtype).float(), ref.float(), **tolerance("moe_experts", torch.bfloat16, case.dims))


def test_dispatch_by_shape(stand_in, monkeypatch):
    monkeypatch.setattr(deepgemm, "supported", lambda device: True)
    fallback_calls = []

    def fallback(*args):
        fallback_calls.append(args)
        return "fallback"

    fallback.impl = "triton experts"
    fallback.shared_expert_max_tokens = {torch.bfloat16: 16}
    monkeypatch.setattr(deepgemm, "grouped_experts", lambda *args: "deepgemm")
    op = deepgemm.provide({"moe_experts": fallback}, "cuda")["moe_experts"]
    assert op.impl.startswith("deepgemm (stand-in 0") and op.impl.endswith("else triton experts")
    assert op.shared_expert_max_tokens == fallback.shared_expert_max_tokens

    x, w13, w2, weights, ids, s13, s2, block = _case(tokens=40, experts=4, top_k=3).args  # 30 pairs per expert
    assert op(x, w13, w2, weights, ids, s13, s2, block) == "deepgemm"
    changes = {
        "few_pairs": dict(ids=ids[:8]),  # 6 per expert < MIN_PAIRS_PER_EXPERT
        "float32": dict(x=x.float()),
        "bf16_experts": dict(w13=w13.to(torch.bfloat16), s13=None, s2=None, block=None),
        "block_32": dict(block=(32, 32)),
    }
    for name, change in changes.items():
        args = {**dict(x=x, w13=w13, w2=w2, weights=weights, ids=ids, s13=s13, s2=s2, block=block), **change}
        if name == "few_pairs":
            args["x"], args["weights"] = x[:8], weights[:8]
        assert op(*args.values()) == "fallback", name
    assert len(fallback_calls) == len(changes)


def test_the_backend_table(stand_in, monkeypatch):
    monkeypatch.setattr(deepgemm, "supported", lambda device: True)
    platform = types.SimpleNamespace(device=torch.device("cuda", 0))
    ops = nvidia.deepinfer_ops(platform=platform, model_config=None, batch_invariant=False)
    assert ops["moe_experts"].impl.startswith("deepgemm (stand-in 0")
    invariant = nvidia.deepinfer_ops(platform=platform, model_config=None, batch_invariant=True)
    assert not invariant["moe_experts"].impl.startswith("deepgemm")
    monkeypatch.setenv("DEEPINFER_EXTERNAL_KERNELS", "0")
    assert not nvidia.deepinfer_ops(platform=platform, model_config=None, batch_invariant=False)["moe_experts"].impl.startswith("deepgemm")


def test_a_build_for_another_torch_is_not_used(caplog):
    """A host module that misreads tensors (the sgl wheel on torch 2.11) is refused, with a warning."""
    good, bad = types.SimpleNamespace(get_mn_major_tma_aligned_tensor=lambda sf: sf), types.SimpleNamespace()

    def broken(sf):
        raise RuntimeError("Assertion error (layout.hpp:16): dim == 2 or dim == 3")

    bad.get_mn_major_tma_aligned_tensor = broken
    assert deepgemm.host_code_works(good, torch.device("cpu"))
    assert not deepgemm.host_code_works(bad, torch.device("cpu"))
    assert "built for another torch" in caplog.text and "dim == 2" in caplog.text


def test_without_deep_gemm_nothing_changes(monkeypatch):
    monkeypatch.setattr(deepgemm, "module", lambda: None)
    ops = {"moe_experts": object()}
    assert deepgemm.provide(ops, "cuda") is ops
    assert not deepgemm.supported("cpu")


# ------------------------------------------------------------------------------------------------
# the real DeepGEMM


def _real_deep_gemm():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not deepgemm.supported("cuda"):
        pytest.skip("deep_gemm does not import here or the GPU is not sm_90 (see deepgemm.py's install note)")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", [(256, 1024, 512, 8, 4), (300, 7168, 2048, 16, 8), (33, 512, 256, 2, 2)],
                         ids=["kit_shape", "v3_dims", "ragged"])
def test_deepgemm_against_the_reference(tokens, hidden, inter, experts, top_k):
    _real_deep_gemm()
    case = _case(tokens=tokens, hidden=hidden, inter=inter, experts=experts, top_k=top_k, seed=5, device="cuda")
    out = deepgemm.grouped_experts(*case.args[:7])
    ref = REFERENCE_OPS["moe_experts"](*case.args)
    torch.testing.assert_close(out.float(), ref.float(), **tolerance("moe_experts", torch.bfloat16, case.dims))
    torch.testing.assert_close(out.float(), _w8a8(*case.args[:7]).float(), **EMULATION_SLACK)


@pytest.mark.gpu
def test_deepgemm_under_cuda_graph_replay():
    """Captured once (as a large decode batch would be), replayed on new tokens and routes: equal
    to the eager call on them."""
    _real_deep_gemm()
    x, w13, w2, weights, ids, s13, s2, _ = _case(tokens=256, hidden=1024, inter=512, experts=8, top_k=4, seed=6, device="cuda").args
    deepgemm.grouped_experts(x, w13, w2, weights, ids, s13, s2)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = deepgemm.grouped_experts(x, w13, w2, weights, ids, s13, s2)
    other = _case(tokens=256, hidden=1024, inter=512, experts=8, top_k=4, seed=7, device="cuda").args
    for mine, new in zip((x, weights, ids), (other[0], other[3], other[4])):
        mine.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, deepgemm.grouped_experts(x, w13, w2, weights, ids, s13, s2))


@pytest.mark.gpu
def test_deepgemm_passes_the_kit(monkeypatch):
    """The conformance kit on the provider, DeepGEMM taking every FP8 call it can (the threshold
    would leave the kit's small cases to the Triton kernels, judged on their own)."""
    _real_deep_gemm()
    monkeypatch.setattr(deepgemm, "MIN_PAIRS_PER_EXPERT", 0)
    from deepinfer_core.conformance.ops_suite import run_op
    from deepinfer_nvidia_sm100.kernels import moe

    op = deepgemm.provide({"moe_experts": moe.moe_experts}, "cuda")["moe_experts"]
    report = run_op("moe_experts", op, torch.bfloat16, "cuda")
    assert report.result == "PASS", report.detail()
