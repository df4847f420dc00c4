"""The mHC Triton kernels (kernels/hyper.py: mhc_pre, mhc_pre_delayed, mhc_head, mhc_collapse,
mhc_post) against the reference ops.

The conformance kit judges each op (on a CPU in Triton's interpreter, float32, the declared
shapes up to CPU_MAX_ELEMENTS values: the real V4 shapes fit; on a GPU every declared shape in
bf16 and float32). The other tests aim at the design: the split-K partials of the mixes GEMM
(ragged last split, several token blocks), the per-token kernel's channel chunks, hc padded to a
power of two, strided inputs, the exact one-hot collapse, the launch count and CUDA graphs, and
that every kernel compiles for sm_90 without spilling (Triton's ptxas, no GPU needed).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.conformance.checks import check_close
from deepinfer_core.conformance.inputs import HC_EPS, NORM_EPS, make_case
from deepinfer_core.conformance.ops_suite import run_op
from deepinfer_core.conformance.spec import shapes
from deepinfer_core.ops import REFERENCE_OPS

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the NVIDIA kernels cannot run")

from deepinfer_nvidia_sm100.kernels import hyper
from tests.nvidia.sm90 import compile_sm90
from tests.op_spec import assert_close

ON_GPU = torch.cuda.is_available()
CPU_MAX_ELEMENTS = 1 << 21  # as test_conformance_kit.py: the real V4 mHC shapes fit (~0.7M values)
CPU_EXAMPLES = 4
OPS = sorted(hyper.OPS)


def _judge(op: str, dims: dict, dtype, device, seed: int = 0, fn=None):
    """The kit's verdict on one case of ``op`` (inputs as specs/ops.toml draws them)."""
    outcome = check_close(fn or hyper.OPS[op], make_case(op, dims, dtype, device, seed))
    assert outcome.ok, f"{op} {dims} seed {seed}: {outcome.message}"
    return outcome


def _small_splits(monkeypatch, sms: int, block_k=16, max_parts=4, block_t=16, block_d=16):
    """Tiny tiles, so that tiny shapes take every path: several GEMM steps per split and a ragged
    last split, several token blocks, several channel chunks per token."""
    monkeypatch.setattr(hyper, "MIX_BLOCK_K", block_k)
    monkeypatch.setattr(hyper, "MIX_MAX_PARTS", max_parts)
    monkeypatch.setattr(hyper, "MIX_MAX_BLOCK_T", block_t)
    monkeypatch.setattr(hyper, "TOKEN_BLOCK_D", block_d)
    monkeypatch.setattr(hyper, "INTERPRETER_SMS", sms)


# ---- the kit ---------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
def test_the_kit_passes_every_op(op, device, dtype):
    fn = hyper.OPS[op]
    if ON_GPU:
        report = run_op(op, fn, dtype, device)
    else:
        report = run_op(op, fn, dtype, device, examples=CPU_EXAMPLES, max_elements=CPU_MAX_ELEMENTS)
    assert report.result == "PASS", f"{op} ({report.dtype}): {report.detail()}"
    assert report.skipped == 0 and report.cases >= len(shapes(op)), (report.cases, report.skipped)


@pytest.mark.parametrize("op", ["mhc_pre", "mhc_pre_delayed", "mhc_head"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_real_shapes_hold_the_float32_bound_over_seeds(op, seed, device):
    """The float32 bound (1e-5) at the real hidden sizes, on more value seeds than the kit's one:
    the mixes sum hc * D = 16k / 28k products in another order than the reference."""
    for dims in shapes(op):
        if dims["tokens"] and dims["hidden"] >= 4096:
            _judge(op, dims, torch.float32, device, seed)


# ---- the mixes GEMM: split-K partials --------------------------------------------------------


@pytest.mark.parametrize("tokens, hc, hidden, n_out", [
    (20, 3, 100, 15),   # ragged channel blocks, 21 steps in splits of 11 and 10, two token blocks of 16
    (1, 4, 64, 24),     # decode: one token in a block of 16
    (5, 1, 40, 3),      # one stream
    (3, 4, 48, 4),      # the head's hc outputs
])
def test_mixes_partials_add_up_to_the_float32_gemm(tokens, hc, hidden, n_out, device, dtype, monkeypatch):
    """Each split's partials (x read in its own dtype, here a strided view), added up, are the
    float32 products flatten(x) @ fn^T and the sums of squares of flatten(x)."""
    _small_splits(monkeypatch, sms=2)
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(tokens, hc, hidden + 3, generator=g).to(device=device, dtype=dtype)
    x = wide[:, :, 3:]  # not contiguous
    fn = (torch.randn(n_out, hc * hidden, generator=g) / (hc * hidden) ** 0.5).to(device)
    parts = hyper._mixes(x, fn, n_out)
    assert parts.shape[0] == tokens and parts.shape[2] == n_out + 1 and parts.dtype == torch.float32
    assert 2 <= parts.shape[1] <= 4  # split, at most MIX_MAX_PARTS times
    flat = x.reshape(tokens, -1).float()
    sums = parts.sum(dim=1)
    torch.testing.assert_close(sums[:, :n_out], flat @ fn.T, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(sums[:, n_out], flat.pow(2).sum(-1), atol=1e-4, rtol=1e-5)


def test_mixes_refuses_a_weight_of_the_wrong_width(device):
    x = torch.randn(2, 4, 32, device=device)
    with pytest.raises(ValueError, match=r"expected \[24, 128\]"):
        hyper.mhc_pre(x, torch.randn(24, 127, device=device), torch.zeros(24, device=device), torch.ones(3, device=device),
                      hc_eps=HC_EPS, rms_eps=NORM_EPS, sinkhorn_iters=20)


# ---- the per-token kernel --------------------------------------------------------------------


@pytest.mark.parametrize("op", ["mhc_pre", "mhc_pre_delayed", "mhc_head", "mhc_collapse"])
@pytest.mark.parametrize("hc", [1, 2, 3, 4])
def test_every_split_and_chunk_path(op, hc, device, dtype, monkeypatch):
    """Several K splits with a ragged last one, two token blocks, several channel chunks (the
    last ragged) per token: each chunk recomputes the same coefficients, chunk 0 stores them."""
    _small_splits(monkeypatch, sms=64)  # K: 3 splits (2, 2, 1 steps at hc = 1); 3 chunks of 32, 32, 6 channels
    dims = {"tokens": 19, "hc": hc, "hidden": 70}
    if op in ("mhc_pre", "mhc_pre_delayed"):
        dims["sinkhorn_iters"] = 5
    if op in ("mhc_pre_delayed", "mhc_collapse"):
        dims["one_hot_tokens"] = 3
    _judge(op, dims, dtype, device, seed=5)


def test_post_channel_blocks(device, dtype, monkeypatch):
    """mhc_post with several channel blocks, the last ragged, and hc = 3 padded to 4."""
    monkeypatch.setattr(hyper, "POST_MIN_BLOCK_D", 16)
    monkeypatch.setattr(hyper, "POST_MAX_BLOCK_D", 16)
    _judge("mhc_post", {"tokens": 6, "hc": 3, "hidden": 50}, dtype, device, seed=2)


@pytest.mark.parametrize("iters", [1, 2, 3])
def test_sinkhorn_round_count(iters, device):
    """comb after exactly ``iters`` rounds: one round more is far outside the float32 bound (early
    rounds still move comb; by 20 they move it by an ulp, so the real count is the kit's)."""
    case = make_case("mhc_pre", {"tokens": 4, "hc": 4, "hidden": 32, "sinkhorn_iters": iters}, torch.float32, device, 3)
    _, comb, _ = hyper.mhc_pre(*case.args, **case.kwargs)
    assert_close(comb, REFERENCE_OPS["mhc_pre"](*case.args, **case.kwargs)[1], "mhc_pre", torch.float32, " comb")
    other = REFERENCE_OPS["mhc_pre"](*case.args, **{**case.kwargs, "sinkhorn_iters": iters + 1})[1]
    assert (comb - other).abs().max() > 1e-4


def test_sinkhorn_needs_a_round(device):
    case = make_case("mhc_pre", {"tokens": 2, "hc": 4, "hidden": 32, "sinkhorn_iters": 1}, torch.float32, device)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        hyper.mhc_pre(*case.args, **{**case.kwargs, "sinkhorn_iters": 0})


def test_strided_inputs(device, dtype):
    """Streams, weights, post and comb as views with other strides than their contiguous layout."""
    g = torch.Generator().manual_seed(11)
    t, hc, d = 5, 4, 40
    x = torch.randn(t, d, hc, generator=g).to(device=device, dtype=dtype).transpose(1, 2)  # stride 1 on hc
    weights = torch.sigmoid(torch.randn(hc, t, generator=g)).to(device).T
    out = torch.randn(t, 2 * d, generator=g).to(device=device, dtype=dtype)[:, ::2]
    post = (2 * torch.sigmoid(torch.randn(hc, t, generator=g))).to(device).T
    comb = torch.rand(t, hc, hc, generator=g).to(device).transpose(1, 2)
    assert_close(hyper.mhc_collapse(x, weights), REFERENCE_OPS["mhc_collapse"](x, weights), "mhc_collapse", dtype)
    assert_close(hyper.mhc_post(out, x, post, comb), REFERENCE_OPS["mhc_post"](out, x, post, comb), "mhc_post", dtype)
    fn = (torch.randn(24, hc * d, generator=g) / (hc * d) ** 0.5).to(device)
    base, scale = (0.1 * torch.randn(48, generator=g)).to(device)[::2], (1 + 0.1 * torch.randn(3, generator=g)).to(device)
    kw = {"hc_eps": HC_EPS, "rms_eps": NORM_EPS, "sinkhorn_iters": 20}
    for got, ref, what in zip(hyper.mhc_pre(x, fn, base, scale, **kw), REFERENCE_OPS["mhc_pre"](x, fn, base, scale, **kw),
                              ("post", "comb", "collapsed")):
        assert_close(got, ref, "mhc_pre", dtype, f" {what}")


def test_one_hot_weights_collapse_to_stream_0_exactly(device, dtype):
    """V4.1's first layer collapses with one-hot pre_in: exactly the embedding copy, stream 0."""
    case = make_case("mhc_pre_delayed", {"tokens": 6, "hc": 4, "hidden": 48, "sinkhorn_iters": 20, "one_hot_tokens": 6},
                     dtype, device)
    x = case.args[0]
    assert torch.equal(hyper.mhc_pre_delayed(*case.args, **case.kwargs)[3], x[:, 0])
    assert torch.equal(hyper.mhc_collapse(x, case.args[1]), x[:, 0])


@pytest.mark.parametrize("op", OPS)
def test_no_tokens(op, device):
    """T = 0: empty outputs of the contract's shapes and dtypes, and no launch."""
    case = make_case(op, {**shapes(op)[1], "tokens": 0}, torch.float32, device)
    got = hyper.OPS[op](*case.args, **case.kwargs)
    ref = REFERENCE_OPS[op](*case.args, **case.kwargs)
    for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
        assert g.shape == r.shape and g.dtype == r.dtype


# ---- launches and CUDA graphs ----------------------------------------------------------------


class _CountLaunches:
    """Stands in for a kernel: counts the launches made through ``kernel[grid](...)``."""

    def __init__(self, kernel, counts: list):
        self.kernel, self.counts = kernel, counts

    def __getitem__(self, grid):
        self.counts.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("op, launches", [("mhc_pre", 2), ("mhc_pre_delayed", 2), ("mhc_head", 2), ("mhc_collapse", 1),
                                          ("mhc_post", 1)])
def test_launch_count(op, launches, device, monkeypatch):
    """Each call is at most two Triton launches (the mixes GEMM, the per-token kernel)."""
    counts: list = []
    for name in ("_mixes_kernel", "_token_kernel", "_post_kernel"):
        monkeypatch.setattr(hyper, name, _CountLaunches(getattr(hyper, name), counts))
    case = make_case(op, shapes(op)[0], torch.float32, device)
    hyper.OPS[op](*case.args, **case.kwargs)
    assert len(counts) == launches, counts


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["mhc_pre", "mhc_pre_delayed", "mhc_head"])
def test_only_two_cuda_kernels(op, device):
    """On the GPU nothing else launches either (no cast of x, no torch op between the kernels)."""
    case = make_case(op, {"tokens": 8, "hc": 4, "hidden": 4096, "sinkhorn_iters": 20, "one_hot_tokens": 0}
                     if op != "mhc_head" else {"tokens": 8, "hc": 4, "hidden": 4096}, torch.bfloat16, device)
    hyper.OPS[op](*case.args, **case.kwargs)  # compile outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        hyper.OPS[op](*case.args, **case.kwargs)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 2, kernels


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64])
def test_a_sublayer_under_cuda_graph(tokens, device):
    """mhc_pre then mhc_post (and V4.1's delayed form) captured equal eager, also after new inputs."""
    dtype = torch.bfloat16
    case = make_case("mhc_pre_delayed", {"tokens": tokens, "hc": 4, "hidden": 4096, "sinkhorn_iters": 20,
                                         "one_hot_tokens": 0}, dtype, device)
    x, pre_in, fn, base, scale = case.args
    block_out = torch.randn(tokens, 4096, device=device, dtype=dtype)

    def step():
        post, comb, y = hyper.mhc_pre(x, fn, base, scale, **case.kwargs)
        pre, _, _, y_d = hyper.mhc_pre_delayed(x, pre_in, fn, base, scale, **case.kwargs)
        return hyper.mhc_post(block_out, x, post, comb), y, pre, y_d, hyper.mhc_collapse(x, pre)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (1, 2):
        x.copy_(make_case("mhc_pre", {"tokens": tokens, "hc": 4, "hidden": 4096, "sinkhorn_iters": 20}, dtype, device, seed).args[0])
        eager = step()
        graph.replay()
        torch.cuda.synchronize()
        for c, e in zip(captured, eager):
            assert torch.equal(c, e), f"graph replay differs from eager (input seed {seed})"


# ---- compiled for sm_90 (no GPU needed) ------------------------------------------------------

_COMPILE_SM90 = r'''
from deepinfer_nvidia_sm100.kernels import hyper

for x in ("bf16", "fp32"):
    for block_t in (16, 32, 64):
        spills(hyper._mixes_kernel, {"x_ptr": "*" + x, "fn_ptr": "*fp32", "parts_ptr": "*fp32"},
               {"N_OUT": 24, "BLOCK_T": block_t, "BLOCK_N": 32, "BLOCK_K": hyper.MIX_BLOCK_K, "PDL": True}, hyper.MIX_NUM_WARPS)
    for mode, hc in ((0, 4), (0, 3), (1, 4), (2, 4), (3, 4), (0, 1)):
        n_out = hc if mode == 2 else (2 + hc) * hc
        ptrs = {n: "*fp32" for n in ("parts_ptr", "base_ptr", "scale_ptr", "w_in_ptr", "pre_ptr", "post_ptr", "comb_ptr")}
        spills(hyper._token_kernel, {**ptrs, "x_ptr": "*" + x, "y_ptr": "*" + x, "rms_eps": "fp32", "hc_eps": "fp32"},
               {"HC": hc, "MODE": mode, "HC_PAD": max(2, triton.next_power_of_2(hc)), "BLOCK_P": hyper.MIX_MAX_PARTS,
                "BLOCK_N": max(16, triton.next_power_of_2(n_out + 1)), "BLOCK_D": hyper.TOKEN_BLOCK_D, "PDL": True},
               hyper.TOKEN_NUM_WARPS)
    for hc in (3, 4):
        spills(hyper._post_kernel, {"out_ptr": "*" + x, "x_ptr": "*" + x, "post_ptr": "*fp32", "comb_ptr": "*fp32", "new_ptr": "*" + x},
               {"HC": hc, "HC_PAD": 4, "BLOCK_D": hyper.POST_MAX_BLOCK_D, "PDL": True}, 4)
'''


def test_kernels_compile_for_sm90_without_spills():
    """Every kernel, at the tile sizes the launchers pick, compiles for sm_90 with Triton's own
    ptxas and keeps its values in registers (CI has no GPU; this is what can be checked there)."""
    compile_sm90(_COMPILE_SM90)
