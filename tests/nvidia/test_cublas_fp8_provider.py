"""cuBLAS's block-scaled FP8 GEMM as the provider of fp8_block_linear (deepinfer_nvidia_sm100/cublas_fp8.py).

CPU: the activation pre-pass (interpreted) writes padding rows as zeros and scales in any layout;
a stand-in ``scaled_mm`` that checks the operand layouts torch's DeepSeek recipe asks for on
sm_90 (scales K-block-major, M in 4s, weight scales padded to 4 K blocks and transposed) and
computes the block-scaled product checks what the provider hands over; the dispatch and the
backend table. GPU (``gpu``, skipped where the recipe does not run: not sm_90, CUDA < 12.9): the
real GEMM against the reference on the activations it quantised, at sizes that need padding, and
in a CUDA graph.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from deepinfer_core.ops import REFERENCE_OPS

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the NVIDIA kernels cannot run")

from benchmarks.kernel_benches.fp8_linear import _cublas_cases  # noqa: E402
from deepinfer_nvidia_sm100 import backend as nvidia  # noqa: E402
from deepinfer_nvidia_sm100 import cublas_fp8  # noqa: E402
from deepinfer_nvidia_sm100.kernels import fp8_linear  # noqa: E402
from tests.nvidia.test_dense_kernels import (  # noqa: E402
    W8A8_TOLERANCE,
    quantize_dequantize_activations,
    randn,
    random_fp8_linear,
)


def test_quantize_activations_padding_rows_and_layout(device):
    torch.manual_seed(0)
    x = torch.randn(5, 96)
    x[2] = 0.0  # an all-zero token stays finite (the amax floor) and zero
    x = x.to(device)
    q = torch.full((8, 96), float("nan"), device=device).to(torch.float8_e4m3fn)
    scales = torch.full((3, 8), float("nan"), device=device).t()  # [8, 3], K-block-major as cuBLAS reads it
    fp8_linear.quantize_activations(x, q, scales, 32)
    expect = x.view(5, 3, 32).abs().amax(-1).clamp_min(1e-12) / fp8_linear.FP8_MAX
    torch.testing.assert_close(scales[:5], expect)
    assert torch.equal(q[5:].float(), torch.zeros(3, 96, device=device)) and torch.isfinite(scales[5:]).all()
    # one e4m3 step (2^-3 relative) of slack: on the GPU x * (1 / s) may round to the neighbouring value
    torch.testing.assert_close((q[:5].float().view(5, 3, 32) * scales[:5, :, None]).view(5, 96),
                               quantize_dequantize_activations(x, 32), atol=1e-6, rtol=0.13)


class _ScaledMM:
    """torch's scaled_mm as the DeepSeek recipe runs on sm_90, with its layout demands checked."""

    def __init__(self):
        self.calls = 0

    def __call__(self, a, b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, output_dtype, **_):
        self.calls += 1
        (m, k), n = a.shape, b.shape[1]
        k_blocks, n_blocks = k // 128, -(-n // 128)
        assert a.dtype == b.dtype == torch.float8_e4m3fn and m % 4 == 0 and b.stride() == (1, k)
        assert scale_recipe_a == F.ScalingType.BlockWise1x128 and scale_recipe_b == F.ScalingType.BlockWise128x128
        assert scale_a.shape == (m, k_blocks) and scale_a.stride() == (1, m)
        l4 = -(-k_blocks // 4) * 4
        assert scale_b.shape == (l4, n_blocks) and scale_b.stride() == (1, l4)
        a_f = (a.float().view(m, k_blocks, 128) * scale_a[:, :, None]).view(m, k)
        w_scale = scale_b.t()[:, :k_blocks].repeat_interleave(128, 0)[:n]
        b_f = (b.t().float().view(n, k_blocks, 128) * w_scale[:, :, None]).view(n, k)
        return (a_f @ b_f.t()).to(output_dtype)


@pytest.mark.parametrize("m,n,k", [(6, 200, 384), (8, 128, 512), (1, 72, 128)], ids=["pad_rows_and_scales", "aligned", "one_row"])
def test_the_operands_handed_to_cublas(m, n, k, device, monkeypatch):
    fake = _ScaledMM()
    monkeypatch.setattr(F, "scaled_mm", fake)
    torch.manual_seed(1)
    weight, scale, bias = random_fp8_linear(n, k, (128, 128), device, bias=True)
    x = torch.randn(2, m, k).to(device)
    out = cublas_fp8.block_fp8_linear(x, weight, scale, bias)
    assert fake.calls == 1 and out.shape == (2, m, n)
    x_q = quantize_dequantize_activations(x.reshape(-1, k), 128)
    torch.testing.assert_close(out.reshape(-1, n), REFERENCE_OPS["fp8_block_linear"](x_q, weight, scale, (128, 128), bias),
                               **W8A8_TOLERANCE)


@pytest.mark.parametrize("change", [None, "few_rows_large_weight", "float32", "block64", "k_not_128s", "n_not_8s",
                                    "few_rows", "no_rows", "cpu_device"])
def test_what_cublas_takes(change, monkeypatch):
    monkeypatch.setattr(cublas_fp8, "supported", lambda device: torch.device(device).type == "meta")
    n, k, m, dtype, block, device = 256, 512, cublas_fp8.MIN_M, torch.bfloat16, (128, 128), "meta"
    if change == "float32":
        dtype = torch.float32  # the op's exact mode stays W8A16 (specs/ops.toml)
    elif change == "block64":
        block = (64, 64)
    elif change == "k_not_128s":
        k = 576
    elif change == "n_not_8s":
        n = 252
    elif change == "few_rows":
        m -= 1
    elif change == "few_rows_large_weight":  # large weights take cuBLAS at any row count
        m, n, k = 1, 32768, 1024
    elif change == "no_rows":
        m, n, k = 0, 32768, 1024
    elif change == "cpu_device":
        device = "cpu"
    x = torch.empty(m, k, dtype=dtype, device=device)
    weight = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(-(-n // block[0]), -(-k // block[1]), device=device)
    assert cublas_fp8.fits(x, weight, scale, block) == (change in (None, "few_rows_large_weight"))


def test_the_table_dispatches_and_falls_back(monkeypatch):
    calls = []
    monkeypatch.setattr(cublas_fp8, "supported", lambda device: True)
    monkeypatch.setattr(cublas_fp8, "fits", lambda x, *a: x.dtype == torch.bfloat16)
    monkeypatch.setattr(cublas_fp8, "block_fp8_linear", lambda *a: calls.append("cublas"))
    fallback = lambda *a: calls.append("fallback")  # noqa: E731
    fallback.impl = "triton: the fallback"
    op = cublas_fp8.provide({"fp8_block_linear": fallback}, "cuda:0")["fp8_block_linear"]
    op(torch.empty(1, dtype=torch.bfloat16), None, None, (128, 128))
    op(torch.empty(1), None, None, (128, 128))
    assert calls == ["cublas", "fallback"]
    assert op.impl.startswith("cublas (torch scaled_mm") and op.impl.endswith("else triton: the fallback")


def test_the_backend_table(monkeypatch):
    platform = types.SimpleNamespace(device="cuda:0", fp8_weights=True)
    monkeypatch.setattr(cublas_fp8, "supported", lambda device: True)
    impl = nvidia.deepinfer_ops(platform=platform, model_config=None, batch_invariant=False)["fp8_block_linear"].impl
    assert impl.startswith("cublas")
    invariant = nvidia.deepinfer_ops(platform=platform, model_config=None, batch_invariant=True)["fp8_block_linear"]
    assert invariant is fp8_linear.invariant_fp8_block_linear
    monkeypatch.setenv("DEEPINFER_EXTERNAL_KERNELS", "0")
    assert nvidia.deepinfer_ops(platform=platform, model_config=None, batch_invariant=False)["fp8_block_linear"] \
        is fp8_linear.fp8_block_linear
    monkeypatch.delenv("DEEPINFER_EXTERNAL_KERNELS")
    monkeypatch.setattr(cublas_fp8, "supported", lambda device: False)  # not sm_90, or an older CUDA
    assert nvidia.deepinfer_ops(platform=platform, model_config=None, batch_invariant=False)["fp8_block_linear"] \
        is fp8_linear.fp8_block_linear
    assert nvidia.deepinfer_ops(platform=None, model_config=None, batch_invariant=False)["fp8_block_linear"] \
        is fp8_linear.fp8_block_linear


def test_the_kernel_bench_ratios(monkeypatch):
    """benchmarks/kernels.py's FP8 cases: the provider and the Triton GEMM get vs_cublas_fp8 = the
    tensor-wise peer's time / theirs; a failing case is left out, not the others."""
    import triton

    times = iter([2.0, 1.0])
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, return_mode=None: next(times))
    others = [{"name": "fp8_block_linear/q", "ms": 4.0}, {"name": "bf16_cublas/q", "ms": 3.0}]
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    out = _cublas_cases("q", x, torch.zeros(8, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1), others)
    assert [(r["name"], r.get("vs_cublas_fp8")) for r in out] == [("fp8_block_linear[cublas]/q", 0.5),
                                                                  ("fp8_tensorwise_cublas/q", None)]
    assert others[0]["vs_cublas_fp8"] == 0.25 and "vs_cublas_fp8" not in others[1]

    def fails(fn, return_mode=None):
        raise RuntimeError("not on this device")

    monkeypatch.setattr(triton.testing, "do_bench", fails)
    assert _cublas_cases("q", x, torch.zeros(8, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1), []) == []


# ------------------------------------------------------------------------------------------------
# the real GEMM


def _real_cublas():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not cublas_fp8.supported("cuda"):
        pytest.skip("cuBLAS's DeepSeek-scaled FP8 GEMM needs sm_90, CUDA >= 12.9 and torch's BlockWise recipes")


def _check(out, x, weight, scale, bias=None):
    """The W8A8 check of test_dense_kernels: equal to the reference on the activations the pre-pass
    quantised (within the op's bf16 tolerance), and no further from the exact reference than e4m3
    activation rounding explains."""
    x2 = x.reshape(-1, x.shape[-1])
    ref_q = REFERENCE_OPS["fp8_block_linear"](quantize_dequantize_activations(x2, 128), weight, scale, (128, 128),
                                              None if bias is None else bias.float())
    torch.testing.assert_close(out.reshape(ref_q.shape).float(), ref_q.to(out.dtype).float(), **W8A8_TOLERANCE)
    ref = REFERENCE_OPS["fp8_block_linear"](x2.float(), weight, scale, (128, 128), None if bias is None else bias.float())
    rel_rms = ((out.float().reshape(ref.shape) - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
    assert rel_rms < 0.05, f"relative RMS error {rel_rms:.3f} is larger than e4m3 activation rounding explains"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 67, 1024, 4099])
@pytest.mark.parametrize("n,k", [(576, 7168), (24576, 1536), (7168, 16384), (1024, 640)], ids=["kv_a", "q_b", "o_proj", "k_blocks_not_4s"])
def test_cublas_against_the_reference(tokens, n, k):
    _real_cublas()
    torch.manual_seed(6)
    weight, scale, _ = random_fp8_linear(n, k, (128, 128), "cuda")
    x = randn(tokens, k, dtype=torch.bfloat16, device="cuda")
    if tokens > 3:
        x[3] = 0.0  # an all-zero token: the scale floor keeps it finite (and zero)
    _check(cublas_fp8.block_fp8_linear(x, weight, scale), x, weight, scale)


@pytest.mark.gpu
def test_cublas_bias_leading_dims_and_cuda_graph():
    _real_cublas()
    torch.manual_seed(7)
    weight, scale, bias = random_fp8_linear(1536, 7168, (128, 128), "cuda", bias=True, dtype=torch.bfloat16)
    op = cublas_fp8.provide({"fp8_block_linear": fp8_linear.fp8_block_linear}, "cuda")["fp8_block_linear"]
    x = randn(3, 43, 7168, dtype=torch.bfloat16, device="cuda")
    eager = op(x, weight, scale, (128, 128), bias)
    _check(eager, x, weight, scale, bias)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(x, weight, scale, (128, 128), bias)
    x.copy_(randn(3, 43, 7168, dtype=torch.bfloat16, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    _check(captured, x, weight, scale, bias)


@pytest.mark.gpu
def test_cublas_passes_the_kit(monkeypatch):
    """The conformance kit on the provider with cuBLAS taking every call it fits (the kit's
    declared shapes have few rows; the op table leaves those below MIN_M to the Triton GEMM)."""
    _real_cublas()
    monkeypatch.setattr(cublas_fp8, "MIN_M", 1)
    from deepinfer_core.conformance.ops_suite import run_op

    op = cublas_fp8.provide({"fp8_block_linear": fp8_linear.fp8_block_linear}, "cuda")["fp8_block_linear"]
    report = run_op("fp8_block_linear", op, torch.bfloat16, "cuda")
    assert report.result == "PASS", report.detail()
