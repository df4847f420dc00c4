"""DeepSeek-V4's MoE kernels (kernels/moe.py): moe_route_sqrtsoftplus and moe_experts_clamped.

The conformance kit judges both callables directly (without CUDA: the declared shapes that fit
the interpreter, float32; with CUDA: every declared shape, bf16 and float32), then targeted cases
of the design: the gate-partials and torch gate paths, the hash layers' gathered gate rows, ties,
extreme logits (softplus' log1p), empty inputs, the clamp in GEMM 1's epilogue through every
tile config and the chunked align. Cases too large for the interpreter are marked `gpu`.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.conformance.checks import check_moe_route_sqrtsoftplus
from deepinfer_core.conformance.inputs import OpCase, quantize_block_fp8
from deepinfer_core.conformance.ops_suite import run_op
from deepinfer_core.conformance.spec import shapes
from deepinfer_core.ops import REFERENCE_OPS

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the NVIDIA kernels cannot run")

from deepinfer_nvidia_sm100.kernels import moe as kmoe  # noqa: E402
from deepinfer_nvidia_sm100.kernels import moe_mxfp4  # noqa: E402
from tests.op_spec import assert_close  # noqa: E402

ON_GPU = torch.cuda.is_available()
CPU_MAX_ELEMENTS = 1 << 21  # as test_conformance_kit.py: the declared shapes the interpreter runs in seconds
CPU_EXAMPLES = 4
V4_OPS = ("moe_route_sqrtsoftplus", "moe_experts_clamped")


def _generator(device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@pytest.mark.parametrize("op", V4_OPS)
def test_the_kit_passes(op, device, dtype):
    # the clamped op as the plugin's table has it: the spec's MXFP4 shapes go to moe_mxfp4's kernel
    fn = moe_mxfp4.with_mxfp4(kmoe.OPS[op])[op] if op == "moe_experts_clamped" else kmoe.OPS[op]
    if ON_GPU:
        report = run_op(op, fn, dtype, device)
    else:
        report = run_op(op, fn, dtype, device, examples=CPU_EXAMPLES, max_elements=CPU_MAX_ELEMENTS)
    assert report.result == "PASS", f"{op} ({report.dtype}): {report.detail()}"
    assert report.cases >= len(shapes(op)) - report.skipped > 0, (report.cases, report.skipped)
    assert fn.impl


# ============================================================================================
# moe_route_sqrtsoftplus
# ============================================================================================


def _route_inputs(t, d, e, k, device, dtype, *, bias=True, fixed=False, seed=0, x_scale=1.0):
    g = _generator(device, seed)
    x = (x_scale * torch.randn(t, d, generator=g, device=device)).to(dtype)
    gate = (torch.randn(e, d, generator=g, device=device) / math.sqrt(d)).to(dtype)
    b = 0.1 * torch.randn(e, generator=g, device=device) if bias else None
    ids = None
    if fixed:
        ids = torch.stack([torch.randperm(e, generator=g, device=device)[:k] for _ in range(t)]) if t else \
            torch.empty(0, k, dtype=torch.int64, device=device)
    return x, gate, b, ids


def _judge(x, gate, bias, fixed, dtype, **kw):
    """The kit's judge on these inputs (ids as sets, free at ties within tie_eps; then the weights)."""
    case = OpCase("moe_route_sqrtsoftplus", {}, dtype, (x, gate, bias, fixed), kw)
    outcome = check_moe_route_sqrtsoftplus(kmoe.moe_route_sqrtsoftplus, case)
    assert outcome.ok, outcome.message


ROUTE_CASES = [
    # tokens, hidden, experts, top_k, bias, norm_topk_prob
    (5, 40, 24, 6, True, True),  # experts not a power of two, hidden not one either
    (3, 64, 48, 6, False, False),  # 384 / 8 experts, no bias, no renormalisation
    (9, 32, 8, 8, True, True),  # k = E: every expert
    (4, 32, 16, 1, True, False),  # one slot
]


@pytest.mark.parametrize("t,d,e,k,bias,norm", ROUTE_CASES)
@pytest.mark.parametrize("block_d", [16, 512], ids=["several-partials", "one-partial"])
def test_route_matches_reference(t, d, e, k, bias, norm, block_d, device, dtype, monkeypatch):
    """Top-k of s + bias after the gate GEMV, its channel blocks added in order by the kernel."""
    monkeypatch.setattr(kmoe, "GATE_BLOCK_D", block_d)
    x, gate, b, _ = _route_inputs(t, d, e, k, device, dtype, bias=bias, seed=t)
    assert (kmoe.gate_partials(x, gate).shape[0] > 1) == (block_d < d)
    _judge(x, gate, b, None, dtype, top_k=k, norm_topk_prob=norm, routed_scaling_factor=1.5)


def test_route_beyond_the_gemv_takes_torch_gate(device, dtype, monkeypatch):
    """Past ROUTE_GEMV_MAX_TOKENS the logits come from torch's float32 GEMM (one partial)."""
    monkeypatch.setattr(kmoe, "ROUTE_GEMV_MAX_TOKENS", 4)
    x, gate, b, _ = _route_inputs(11, 32, 24, 6, device, dtype)
    assert kmoe.gate_partials(x, gate).shape[0] == 1
    _judge(x, gate, b, None, dtype, top_k=6, norm_topk_prob=True, routed_scaling_factor=2.5)


@pytest.mark.parametrize("block_d", [16, 512])
@pytest.mark.parametrize("norm", [True, False])
def test_hash_route_takes_the_fixed_ids_in_order(block_d, norm, device, dtype, monkeypatch):
    """Hash layers: ids are the given ones, slot for slot (int32 or int64, strided), whatever the
    bias; weights = s at them, from the gathered gate rows (several channel steps at block_d 16)."""
    monkeypatch.setattr(kmoe, "HASH_ROUTE_BLOCK_D", block_d)
    x, gate, b, fixed = _route_inputs(6, 40, 24, 6, device, dtype, fixed=True, seed=2)
    kw = dict(top_k=6, norm_topk_prob=norm, routed_scaling_factor=2.5)
    for ids_in in (fixed, fixed.to(torch.int32), torch.cat([fixed, fixed], dim=1)[:, ::2]):
        weights, ids = kmoe.moe_route_sqrtsoftplus(x, gate, b, ids_in, **kw)
        assert ids.dtype == torch.int64 and torch.equal(ids, ids_in.long())
        ref_w, ref_ids = REFERENCE_OPS["moe_route_sqrtsoftplus"](x, gate, b, ids_in, **kw)
        assert torch.equal(ref_ids, ids)
        assert_close(weights, ref_w, "moe_route_sqrtsoftplus", dtype)
    _judge(x, gate, b, fixed, dtype, **kw)


@pytest.mark.parametrize("fixed", [False, True], ids=["top-k", "hash"])
def test_route_keeps_sqrt_softplus_accurate_at_extreme_logits(fixed, device):
    """Logits spread over about +-60: softplus(z) ~ exp(z) far below 0 (a naive log(1 + exp(z))
    rounds to 0 there and s loses all its digits) and ~ z above torch's threshold of 20. Without
    renormalisation the weights are the scores themselves, held to 1e-5 relative."""
    x, gate, _, ids = _route_inputs(7, 64, 16, 16 if not fixed else 4, device, torch.float32, bias=False, fixed=fixed,
                                    seed=4, x_scale=30.0)
    logits = x @ gate.T
    assert logits.min() < -30 and logits.max() > 30
    k = 16 if not fixed else 4  # top-k over every expert: every score is compared
    kw = dict(top_k=k, norm_topk_prob=False, routed_scaling_factor=1.0)
    weights, out_ids = kmoe.moe_route_sqrtsoftplus(x, gate, None, ids, **kw)
    ref_w, ref_ids = REFERENCE_OPS["moe_route_sqrtsoftplus"](x, gate, None, ids, **kw)
    assert (ref_w < 1e-6).any() and (ref_w > 5).any()
    order, ref_order = out_ids.sort(dim=1), ref_ids.sort(dim=1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_w.gather(1, ref_order.indices), atol=0.0, rtol=1e-5)


def test_route_ties_go_to_the_lowest_expert(device):
    """All scores equal (zero gate, no bias): the kernel takes the lowest ids, weights 1/k each."""
    x = torch.randn(3, 16, device=device)
    weights, ids = kmoe.moe_route_sqrtsoftplus(x, torch.zeros(12, 16, device=device), None, None, top_k=3,
                                               norm_topk_prob=True, routed_scaling_factor=1.5)
    assert ids.cpu().tolist() == [[0, 1, 2]] * 3
    torch.testing.assert_close(weights.cpu(), torch.full((3, 3), 0.5), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fixed", [False, True], ids=["top-k", "hash"])
def test_route_no_tokens(fixed, device):
    x, gate, b, ids = _route_inputs(0, 32, 16, 4, device, torch.float32, fixed=fixed)
    weights, out = kmoe.moe_route_sqrtsoftplus(x, gate, b, ids, top_k=4, norm_topk_prob=True, routed_scaling_factor=1.0)
    assert weights.shape == out.shape == (0, 4) and weights.dtype == torch.float32 and out.dtype == torch.int64


@pytest.mark.parametrize("bad,match", [
    (dict(top_k=0), "top_k"), (dict(top_k=17), "top_k"),
    (dict(fixed=(3, 3)), r"fixed_ids is \(3, 3\)"), (dict(gate=(16, 40)), r"gate weight is \(16, 40\)"),
])
def test_route_refuses_inconsistent_shapes(bad, match, device):
    x = torch.randn(3, 32, device=device)
    gate = torch.randn(*bad.get("gate", (16, 32)), device=device)
    fixed = torch.zeros(*bad["fixed"], dtype=torch.int64, device=device) if "fixed" in bad else None
    with pytest.raises(ValueError, match=match):
        kmoe.moe_route_sqrtsoftplus(x, gate, None, fixed, top_k=bad.get("top_k", 4), norm_topk_prob=True,
                                    routed_scaling_factor=1.0)


# ============================================================================================
# moe_experts_clamped
# ============================================================================================


def _expert_inputs(t, d, i, e, k, device, dtype, *, std=4.0, block=None, seed=0):
    """gate/up ~ N(0, std^2) (the clamp bites at limits below std), outputs O(1); ids distinct per
    token from about 3/4 of the experts, so that some receive no token."""
    g = _generator(device, seed)
    x = torch.randn(t, d, generator=g, device=device).to(dtype)
    w13 = torch.randn(e, 2 * i, d, generator=g, device=device) * (std / math.sqrt(d))
    w2 = torch.randn(e, d, i, generator=g, device=device) / (math.sqrt(i) * std**2)
    if block:
        (w13, s13), (w2, s2) = quantize_block_fp8(w13, block), quantize_block_fp8(w2, block)
    else:
        w13, w2, s13, s2 = w13.to(dtype), w2.to(dtype), None, None
    allowed = torch.randperm(e, generator=g, device=device)[: max(k, e - max(1, e // 4))]
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g, device=device)[:k]] for _ in range(t)]) if t \
        else torch.empty(0, k, dtype=torch.int64, device=device)
    weights = torch.randn(t, k, generator=g, device=device).softmax(dim=-1)
    return x, w13, w2, weights, ids, s13, s2, block


def _clamped(args, limit, fn=REFERENCE_OPS["moe_experts_clamped"]):
    x, w13, w2, weights, ids, s13, s2, block = args
    return fn(x, w13, w2, weights, ids, limit, s13, s2, block)


@pytest.mark.parametrize("tiles", [t for _, t in kmoe.EXPERT_TILES], ids=lambda t: f"block_m={t.block_m}")
@pytest.mark.parametrize("block", [None, (32, 32)], ids=["bf16-weights", "fp8"])
def test_clamped_every_tile_config(tiles, block, device, dtype):
    """The clamp in GEMM 1's epilogue at every tile config; it bites (the unclamped op is far off)."""
    args = _expert_inputs(24, 96, 40, 5, 3, device, dtype, block=block, seed=1)  # partial FP8 blocks: 96, 40
    x, w13, w2, weights, ids, s13, s2, _ = args
    out = kmoe._run_experts(x, w13, w2, weights, ids, s13, s2, block, tiles, False, limit=1.5)
    ref = _clamped(args, 1.5)
    assert_close(out, ref, "moe_experts_clamped", dtype)
    unclamped = REFERENCE_OPS["moe_experts"](*args)
    assert (unclamped.float() - ref.float()).abs().max() > 0.5


def test_clamped_chunked_align(device, dtype, monkeypatch):
    """More pairs than the one-program align takes: the three-launch align feeds the clamped GEMMs."""
    monkeypatch.setattr(kmoe, "ALIGN_SINGLE_PROGRAM_MAX_PAIRS", 0)
    monkeypatch.setattr(kmoe, "ALIGN_BLOCK_N", 16)
    args = _expert_inputs(30, 64, 32, 6, 6, device, dtype, seed=2)
    assert_close(_clamped(args, 2.0, kmoe.moe_experts_clamped), _clamped(args, 2.0), "moe_experts_clamped", dtype)


@pytest.mark.parametrize("block", [None, (32, 32)], ids=["bf16-weights", "fp8"])
def test_clamped_without_a_binding_limit_is_moe_experts(block, device, dtype):
    """A limit no value reaches leaves the clamped kernel bit-identical to moe_experts: the flag
    adds the clamp and nothing else (the same tiles, the same order of products)."""
    args = _expert_inputs(9, 64, 32, 8, 2, device, dtype, std=1.0, block=block, seed=3)
    assert torch.equal(_clamped(args, 1e30, kmoe.moe_experts_clamped), kmoe.moe_experts(*args))
    assert not torch.equal(_clamped(args, 0.5, kmoe.moe_experts_clamped), kmoe.moe_experts(*args))


def test_clamped_no_tokens(device):
    args = _expert_inputs(0, 64, 32, 8, 2, device, torch.float32)
    out = _clamped(args, 10.0, kmoe.moe_experts_clamped)
    assert out.shape == (0, 64) and out.dtype == torch.float32


def test_deepgemm_provider_leaves_the_clamped_op_alone(monkeypatch):
    """DeepGEMM's provider (as if it ran here) wraps moe_experts only: the clamped op, whose
    activation DeepGEMM's pass does not clamp, keeps the Triton callable."""
    from deepinfer_nvidia_sm100 import deepgemm

    monkeypatch.setattr(deepgemm, "supported", lambda device: True)
    monkeypatch.setattr(deepgemm, "version", lambda: "deep_gemm (stand-in)")
    provided = deepgemm.provide(dict(kmoe.OPS), "cuda:0")
    assert provided["moe_experts"] is not kmoe.moe_experts
    assert provided["moe_experts_clamped"] is kmoe.moe_experts_clamped
    assert "triton only" in kmoe.moe_experts_clamped.impl


# ============================================================================================
# CUDA graphs
# ============================================================================================


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 200])  # 200 * 6 pairs take the chunked align
@pytest.mark.parametrize("hashed", [False, True], ids=["top-k", "hash"])
def test_v4_route_and_experts_under_cuda_graph(tokens, hashed, device):
    """V4-Flash-like MoE (E=256, k=6, D=4096 gate; small experts) captured and replayed with new inputs."""
    dtype = torch.bfloat16
    x, gate, b, fixed = _route_inputs(tokens, 4096, 256, 6, device, dtype, bias=not hashed, fixed=hashed)
    w13 = (torch.randn(256, 2 * 64, 4096, device=device) * (4 / 64)).to(dtype)
    w2 = (torch.randn(256, 4096, 64, device=device) / 128).to(dtype)
    kw = dict(top_k=6, norm_topk_prob=True, routed_scaling_factor=1.5)

    def step():
        weights, ids = kmoe.moe_route_sqrtsoftplus(x, gate, b, fixed, **kw)
        return kmoe.moe_experts_clamped(x, w13, w2, weights, ids, 10.0)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn_like(x))
    if hashed:
        fixed.copy_(fixed.roll(1, dims=0))
    graph.replay()
    weights, ids = REFERENCE_OPS["moe_route_sqrtsoftplus"](x, gate, b, fixed, **kw)
    assert_close(out, REFERENCE_OPS["moe_experts_clamped"](x, w13, w2, weights, ids, 10.0), "moe_experts_clamped", dtype)
