"""The W4A16 grouped GEMM over packed MXFP4 experts (kernels/moe_mxfp4.py) against the reference
ops (which dequantise with ops.linear.dequantize_mxfp4).

Tiny float32 cases run everywhere (on a CPU in Triton's interpreter); the spec's real V4-Flash
and V4-Pro MXFP4 shapes and bf16 run on a GPU (marked `gpu`).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.conformance.ops_suite import run_op
from deepinfer_core.ops import REFERENCE_OPS
from deepinfer_core.ops.linear import dequantize_mxfp4
from deepinfer_core.ops.moe import is_mxfp4

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the NVIDIA kernels cannot run")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from deepinfer_nvidia_sm100.kernels import moe_mxfp4 as kfp4  # noqa: E402
from tests.op_spec import assert_close  # noqa: E402

OP = "moe_experts_clamped"


def clamped_with_kernel(x, w13, w2, topk_weights, topk_ids, limit, w13_scale=None, w2_scale=None, block=None):
    """moe_experts_clamped as the plugin will route it: MXFP4 experts to the kernel, the rest to the reference."""
    if is_mxfp4(w13, w2):
        return kfp4.mxfp4_experts(x, w13, w2, topk_weights, topk_ids, limit, w13_scale, w2_scale)
    return REFERENCE_OPS[OP](x, w13, w2, topk_weights, topk_ids, limit, w13_scale, w2_scale, block)


def test_the_kit_passes_the_kernel_on_the_mxfp4_shapes(device, dtype):
    """The conformance kit on moe_experts_clamped's declared shapes (the MXFP4 ones run the kernel)
    and hypothesis' variations; on a CPU only the shapes that fit the interpreter."""
    on_gpu = device.type == "cuda"
    report = run_op(OP, clamped_with_kernel, dtype, device, examples=4, max_elements=None if on_gpu else 1 << 21)
    assert report.result == "PASS", report.detail()


# ---- the dequantisation, exactly --------------------------------------------------------------

@triton.jit
def _dequantize_tile_kernel(codes_ptr, scales_ptr, out_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The kernel's dequantisation of one [BLOCK_N, BLOCK_K] tile, written back interleaved."""
    rows = tl.arange(0, BLOCK_N)[:, None]
    kb = tl.arange(0, BLOCK_K // 2)[None, :]
    packed = tl.load(codes_ptr + rows * (BLOCK_K // 2) + kb)
    scales = tl.load(scales_ptr + rows * (BLOCK_K // 32) + kb // 16)
    even, odd = kfp4._dequantize(packed, kfp4._scales(scales))
    tl.store(out_ptr + rows * BLOCK_K + 2 * kb, even)
    tl.store(out_ptr + rows * BLOCK_K + 2 * kb + 1, odd)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 6 * 2^127 is inf, as in the reference
def test_every_byte_and_scale_dequantises_exactly(device):
    """All 256 code pairs under scale bytes from 0 (2^-127) through 127 (1) to 254, and 255 (NaN):
    bit for bit dequantize_mxfp4's values (both nibble orders). On a GPU the rows whose products
    are float32 subnormals (scale bytes 0 and 1) are left out: compiled code may flush them."""
    n, k = 16, 64
    codes = torch.arange(n * k // 2, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(n, k // 2)
    row_scale = torch.tensor([0, 1, 100, 126, 127, 128, 140, 254, 255, 120, 121, 122, 123, 124, 125, 2], dtype=torch.uint8)
    scales = row_scale[:, None].expand(n, k // 32).contiguous()
    out = torch.empty((n, k), dtype=torch.float32, device=device)
    _dequantize_tile_kernel[(1,)](codes.to(device), scales.to(device), out, BLOCK_N=n, BLOCK_K=k)
    out, want = out.cpu(), dequantize_mxfp4(codes, scales, torch.float32)
    nan_row = row_scale == 255
    assert torch.isnan(out[nan_row]).all() and torch.isnan(want[nan_row]).all()
    rows = ~nan_row & ((row_scale > 1) | (device.type != "cuda"))
    assert torch.equal(out[rows].view(torch.int32), want[rows].view(torch.int32))  # -0.0 included
    if device.type != "cuda":
        assert out[0, 4].item() == 2.0**-127  # byte 2's low nibble, code 2 (1.0), times scale byte 0


@triton.jit
def _permute_decode_kernel(codes_ptr, out_ptr, N: tl.constexpr, SHIFT: tl.constexpr):
    """The PTX decode (kfp4._e2m1_bf16) of N bytes, written back interleaved (even, odd)."""
    i = tl.arange(0, N)
    even, odd = kfp4._e2m1_bf16(tl.load(codes_ptr + i), SHIFT)
    tl.store(out_ptr + 2 * i, even)
    tl.store(out_ptr + 2 * i + 1, odd)


@pytest.mark.gpu
@pytest.mark.parametrize("shift", [False, True], ids=["byte-permutes", "shifts"])
def test_the_byte_permute_decode_gives_every_code_pair_exactly(shift):
    """All 256 bytes through the PTX lookup tables (or MXFP4_SHIFT_DECODE's shifts, whose 0.5 is a
    bf16 subnormal before the multiply by 2^126): bit for bit the E2M1 values (scale 1) of both
    nibbles in bf16, -0.0 included, and in the right order within each 4-byte register."""
    device = torch.device("cuda:0")
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    out = torch.empty(512, dtype=torch.bfloat16, device=device)
    _permute_decode_kernel[(1,)](codes.to(device), out, N=256, SHIFT=shift)
    want = dequantize_mxfp4(codes.view(1, 256), torch.full((1, 16), 127, dtype=torch.uint8), torch.bfloat16).view(512)
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))


# ---- edge cases ----------------------------------------------------------------------------

def _mxfp4(gen, e: int, n: int, k: int, std: float, device):
    """Random MXFP4 weights [e, n, k] (packed) whose values have about ``std``."""
    codes = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8)
    centre = 127 + round(torch.log2(torch.tensor(std / 2.93)).item())
    scales = torch.randint(centre - 1, centre + 2, (e, n, -(-k // 32)), generator=gen, dtype=torch.uint8)
    return codes.to(device), scales.to(device)


def _case(device, dtype, *, tokens, hidden, inter, experts, top_k, ids=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13, s13 = _mxfp4(gen, experts, 2 * inter, hidden, hidden**-0.5, device)
    w2, s2 = _mxfp4(gen, experts, hidden, inter, inter**-0.5, device)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.randn(tokens, top_k, generator=gen).softmax(-1)
    return x, w13, w2, weights.to(device), ids.to(device), s13, s2


EDGES = {
    "one-token": dict(tokens=1, hidden=64, inter=32, experts=8, top_k=2),
    "top_k=E": dict(tokens=3, hidden=64, inter=32, experts=4, top_k=4),
    "top_k=1": dict(tokens=5, hidden=64, inter=32, experts=4, top_k=1),
    "I-not-a-tile-multiple": dict(tokens=6, hidden=96, inter=80, experts=4, top_k=2),  # I 80: 64 + 16, scale group 32 + 32 + 16
}


GROUP_DOT = kfp4.ExpertTiles(16, 32, 32, 32, 4, 3)  # one scale group a K step, scaling the dot's sums
SCALE_MODES = {  # (scales by address, tiles, K slices, other flags)
    "group-scales": (False, None, 0, {}),  # a group's scale byte loaded once, broadcast over its 16 bytes
    "byte-scales": (True, None, 0, {}),  # each byte's scale loaded by address
    # one scale group a K step, the scale on the dot's float32 sums
    "group-dot": (False, GROUP_DOT, 0, {"MXFP4_SCALE_WEIGHTS": False}),
    # float32 partial sums of 2 K slices, reduced by the epilogue kernel
    "group-dot-split-k": (False, GROUP_DOT, 2, {"MXFP4_SCALE_WEIGHTS": False}),
    # one scale group a K step, the scale on the weights (as wider tiles do), not on the sums
    "group-scale-weights": (False, GROUP_DOT, 2, {"MXFP4_SCALE_WEIGHTS": True}),
    # the activations as two stride-2 loads, or loaded whole and split into even / odd inputs (K
    # masked where I = 80)
    "stride-2-loads": (False, None, 0, {"MXFP4_SPLIT_LOAD": False}),
    "split-load": (False, None, 0, {"MXFP4_SPLIT_LOAD": True}),
    "group-dot-split-load": (False, GROUP_DOT, 2, {"MXFP4_SPLIT_LOAD": True, "MXFP4_SCALE_WEIGHTS": False}),
}


@pytest.mark.parametrize("mode", SCALE_MODES)
@pytest.mark.parametrize("limit", [1.0, None], ids=["clamped", "plain"])
@pytest.mark.parametrize("name", EDGES)
def test_edge_cases_match_the_reference(device, dtype, name, limit, mode, monkeypatch):
    """Every way the kernel reads the scales and the activations (see SCALE_MODES)."""
    gather, tiles, splits, flags = SCALE_MODES[mode]
    for flag, value in flags.items():
        monkeypatch.setattr(kfp4, flag, value)
    monkeypatch.setattr(kfp4, "MXFP4_SCALE_GATHER", gather)
    monkeypatch.setattr(kfp4, "MXFP4_FORCE_SPLITS", splits)
    if tiles:
        monkeypatch.setattr(kfp4, "MXFP4_TILES", ((float("inf"), tiles),))
    x, w13, w2, weights, ids, s13, s2 = _case(device, dtype, **EDGES[name])
    out = kfp4.mxfp4_experts(x, w13, w2, weights, ids, limit, s13, s2)
    if limit is None:  # plain SwiGLU: moe_experts
        ref = REFERENCE_OPS["moe_experts"](x, w13, w2, weights, ids, s13, s2)
    else:
        ref = REFERENCE_OPS[OP](x, w13, w2, weights, ids, limit, s13, s2)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_close(out, ref, OP, dtype, f" {name}")


SWAP_TILES = {"group-dot": GROUP_DOT, "wide": kfp4.ExpertTiles(16, 32, 64, 64, 4, 3)}


@pytest.mark.parametrize("splits", [0, 2])
@pytest.mark.parametrize("tiles", SWAP_TILES)
@pytest.mark.parametrize("name", ["one-token", "I-not-a-tile-multiple"])
def test_the_swapped_dots_match_the_reference(device, dtype, name, tiles, splits, monkeypatch):
    """MXFP4_SWAP_AB: the tile accumulated as W @ A^T and transposed back, at one scale group a K
    step and at BLOCK_K 64 (K masked where I = 80), whole and split along K."""
    monkeypatch.setattr(kfp4, "MXFP4_SWAP_AB", True)
    monkeypatch.setattr(kfp4, "MXFP4_TILES", ((float("inf"), SWAP_TILES[tiles]),))
    monkeypatch.setattr(kfp4, "MXFP4_FORCE_SPLITS", splits)
    x, w13, w2, weights, ids, s13, s2 = _case(device, dtype, **EDGES[name])
    out = kfp4.mxfp4_experts(x, w13, w2, weights, ids, 1.0, s13, s2)
    assert_close(out, REFERENCE_OPS[OP](x, w13, w2, weights, ids, 1.0, s13, s2), OP, dtype, f" {name}")


@pytest.mark.parametrize("splits", [2, 4])
def test_split_k_adds_the_slices_in_order(device, monkeypatch, splits):
    """K cut into 2 or 4 slices (GEMM 1's 128 inputs, GEMM 2's 64 or 128): the epilogue kernel's
    sums in slice order give the reference (float32: within its tolerance); a split that does not
    divide the steps falls back to one slice."""
    monkeypatch.setattr(kfp4, "MXFP4_TILES", ((float("inf"), GROUP_DOT),))
    monkeypatch.setattr(kfp4, "MXFP4_FORCE_SPLITS", splits)
    assert kfp4.k_splits(8, 128, 32, device) == splits and kfp4.k_splits(8, 96, 32, device) == (3 % splits == 0 and splits or 1)
    x, w13, w2, weights, ids, s13, s2 = _case(device, torch.float32, tokens=5, hidden=128, inter=64, experts=4, top_k=2)
    out = kfp4.mxfp4_experts(x, w13, w2, weights, ids, 1.0, s13, s2)
    assert_close(out, REFERENCE_OPS[OP](x, w13, w2, weights, ids, 1.0, s13, s2), OP, torch.float32)


def test_experts_with_no_token_and_no_tokens_at_all(device, dtype):
    """Tokens routed to experts 1 and 3 of 6 only (the others' tiles never run), and T = 0."""
    ids = torch.tensor([[1, 3], [3, 1], [1, 3]])
    x, w13, w2, weights, ids, s13, s2 = _case(device, dtype, tokens=3, hidden=64, inter=32, experts=6, top_k=2, ids=ids)
    out = kfp4.mxfp4_experts(x, w13, w2, weights, ids, 10.0, s13, s2)
    assert_close(out, REFERENCE_OPS[OP](x, w13, w2, weights, ids, 10.0, s13, s2), OP, dtype)
    empty = kfp4.mxfp4_experts(x[:0], w13, w2, weights[:0], ids[:0], 10.0, s13, s2)
    assert empty.shape == (0, 64)


def test_prefill_tiles(device, dtype):
    """The largest tiles (BLOCK_M 128) whatever the batch: M-blocks padded across experts."""
    x, w13, w2, weights, ids, s13, s2 = _case(device, dtype, tokens=40, hidden=64, inter=32, experts=4, top_k=3)
    out = kfp4.run_mxfp4_experts(x, w13, w2, weights, ids, 10.0, s13, s2, kfp4.MXFP4_TILES[-1][1])
    assert_close(out, REFERENCE_OPS[OP](x, w13, w2, weights, ids, 10.0, s13, s2), OP, dtype)


def test_with_mxfp4_routes_packed_experts_to_the_kernel(device):
    """The table entries backend.py adds: uint8 experts to the kernel, the rest to the given ops."""
    calls = []

    def clamped(*args):
        calls.append("clamped")
        return REFERENCE_OPS[OP](*args)

    def plain(*args):
        calls.append("plain")
        return REFERENCE_OPS["moe_experts"](*args)

    plain.shared_expert_max_tokens = {torch.bfloat16: 16}
    table = kfp4.with_mxfp4(clamped, plain)
    assert table["moe_experts"].shared_expert_max_tokens == {torch.bfloat16: 16}
    x, w13, w2, weights, ids, s13, s2 = _case(device, torch.float32, tokens=3, hidden=64, inter=32, experts=4, top_k=2)
    assert_close(table[OP](x, w13, w2, weights, ids, 1.0, s13, s2), REFERENCE_OPS[OP](x, w13, w2, weights, ids, 1.0, s13, s2),
                 OP, torch.float32)
    assert_close(table["moe_experts"](x, w13, w2, weights, ids, s13, s2),
                 REFERENCE_OPS["moe_experts"](x, w13, w2, weights, ids, s13, s2), OP, torch.float32)
    assert calls == []
    deq13, deq2 = dequantize_mxfp4(w13, s13, x.dtype), dequantize_mxfp4(w2, s2, x.dtype)
    table[OP](x, deq13, deq2, weights, ids, 1.0)
    table["moe_experts"](x, deq13, deq2, weights, ids)
    assert calls == ["clamped", "plain"]


def test_wrong_shapes_are_refused(device):
    x, w13, w2, weights, ids, s13, s2 = _case(device, torch.float32, tokens=2, hidden=64, inter=32, experts=4, top_k=2)
    with pytest.raises(ValueError, match="MXFP4 experts"):
        kfp4.mxfp4_experts(x, w13, w2, weights, ids, 1.0, s13[..., :1], s2)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 512])
def test_real_flash_shapes_under_a_cuda_graph(tokens):
    """V4-Flash expert dims (D 4096, I 2048), 16 experts, top-6, bf16: captured as a CUDA graph
    (no host synchronisation) and replayed, equal to the eager call and close to the reference."""
    device, dtype = torch.device("cuda:0"), torch.bfloat16
    x, w13, w2, weights, ids, s13, s2 = _case(device, dtype, tokens=tokens, hidden=4096, inter=2048, experts=16, top_k=6)
    eager = kfp4.mxfp4_experts(x, w13, w2, weights, ids, 10.0, s13, s2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kfp4.mxfp4_experts(x, w13, w2, weights, ids, 10.0, s13, s2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    assert_close(eager, REFERENCE_OPS[OP](x, w13, w2, weights, ids, 10.0, s13, s2), OP, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [kfp4.ExpertTiles(64, 64, 128, 64, 4, 3), kfp4.ExpertTiles(128, 64, 128, 64, 8, 3),
                                   kfp4.ExpertTiles(64, 64, 128, 128, 4, 3), kfp4.ExpertTiles(16, 64, 64, 128, 4, 3)], ids=str)
def test_the_wide_byte_permute_decode_equals_the_e4m3_one(tiles, monkeypatch):
    """MXFP4_ASM_WIDE (BLOCK_K >= 64): the PTX decode (the default's, shifts or byte permutes) with the scale
    multiplied in bf16 feeds the dots the same bf16 weights as the e4m3 decode (both exact), so at
    the same tiles the outputs are equal bit for bit, and close to the reference; V4-Flash's expert
    dims, 512 tokens over 32 experts."""
    device, dtype = torch.device("cuda:0"), torch.bfloat16
    x, w13, w2, weights, ids, s13, s2 = _case(device, dtype, tokens=512, hidden=4096, inter=2048, experts=32, top_k=6)
    outs = {}
    for wide in (False, True):
        monkeypatch.setattr(kfp4, "MXFP4_ASM_WIDE", wide)
        outs[wide] = kfp4.run_mxfp4_experts(x, w13, w2, weights, ids, 10.0, s13, s2, tiles)
    assert torch.equal(outs[True], outs[False]), (outs[True] - outs[False]).abs().max()
    assert_close(outs[True], REFERENCE_OPS[OP](x, w13, w2, weights, ids, 10.0, s13, s2), OP, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("wide", [False, True], ids=["e4m3-wide", "permute-wide"])
@pytest.mark.parametrize("tokens", [1, 16, 512, 2048])
def test_the_swapped_dots_on_real_flash_shapes(tokens, wide, monkeypatch):
    """MXFP4_SWAP_AB with the compiled decodes (the byte permutes at one scale group a step; at
    BLOCK_K >= 64, with and without MXFP4_ASM_WIDE) on V4-Flash's expert dims, the default tiles
    for each token count (split-K at decode), bf16: close to the reference."""
    device, dtype = torch.device("cuda:0"), torch.bfloat16
    monkeypatch.setattr(kfp4, "MXFP4_SWAP_AB", True)
    monkeypatch.setattr(kfp4, "MXFP4_ASM_WIDE", wide)
    x, w13, w2, weights, ids, s13, s2 = _case(device, dtype, tokens=tokens, hidden=4096, inter=2048, experts=32, top_k=6)
    out = kfp4.mxfp4_experts(x, w13, w2, weights, ids, 10.0, s13, s2)
    assert_close(out, REFERENCE_OPS[OP](x, w13, w2, weights, ids, 10.0, s13, s2), OP, dtype)


PLAIN = {"MXFP4_SHIFT_DECODE": False, "MXFP4_SCALE_WEIGHTS": False, "MXFP4_SPLIT_LOAD": False}  # before 2026-12-08
LEAN = {"MXFP4_SHIFT_DECODE": True, "MXFP4_SCALE_WEIGHTS": True, "MXFP4_SPLIT_LOAD": True}


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [{"MXFP4_SHIFT_DECODE": True}, {"MXFP4_SPLIT_LOAD": True}, {"MXFP4_SCALE_WEIGHTS": True}, LEAN],
                         ids=["shift", "split-load", "scale-weights", "lean"])
@pytest.mark.parametrize("wide", [False, True], ids=["e4m3-wide", "ptx-wide"])
@pytest.mark.parametrize("tokens", [1, 16, 512, 2048])
def test_the_lean_flags_on_real_flash_shapes(tokens, wide, flags, monkeypatch):
    """Each lean flag against none of them, at the default tiles for each token count (split-K at
    decode) and MXFP4_ASM_WIDE off and on: MXFP4_SHIFT_DECODE and MXFP4_SPLIT_LOAD feed the dots
    the same bf16 values (shifts vs byte permutes; one load split vs two stride-2 loads), so the
    outputs are equal bit for bit; MXFP4_SCALE_WEIGHTS (the scale on the bf16 weights, not on the
    float32 sums at BLOCK_K 32: another rounding order) and all three are close to the reference.
    V4-Flash's expert dims over 32 experts, bf16."""
    device, dtype = torch.device("cuda:0"), torch.bfloat16
    x, w13, w2, weights, ids, s13, s2 = _case(device, dtype, tokens=tokens, hidden=4096, inter=2048, experts=32, top_k=6)
    monkeypatch.setattr(kfp4, "MXFP4_ASM_WIDE", wide)
    for flag, value in PLAIN.items():
        monkeypatch.setattr(kfp4, flag, value)
    plain = kfp4.mxfp4_experts(x, w13, w2, weights, ids, 10.0, s13, s2)
    for flag, value in flags.items():
        monkeypatch.setattr(kfp4, flag, value)
    out = kfp4.mxfp4_experts(x, w13, w2, weights, ids, 10.0, s13, s2)
    if "MXFP4_SCALE_WEIGHTS" not in flags:
        assert torch.equal(out, plain), (out.float() - plain.float()).abs().max()
    assert_close(out, REFERENCE_OPS[OP](x, w13, w2, weights, ids, 10.0, s13, s2), OP, dtype)


# ---- the PTX decodes, emulated on the CPU -------------------------------------------------------

def _run_ptx(asm: str, operands: dict[str, int]) -> dict[str, int]:
    """The straight-line b32 PTX the decodes use (mov, and, or, shl, shr, prmt in its default mode:
    selector bit 3 replicates the chosen byte's sign bit), run on Python ints."""
    regs = dict(operands)

    def val(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0) & 0xFFFFFFFF

    for line in asm.replace("{", "\n").replace("}", "\n").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        x = [val(s) for s in src]
        if op == "mov.b32":
            r = x[0]
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "or.b32":
            r = x[0] | x[1]
        elif op == "shl.b32":
            r = x[0] << x[1]
        elif op == "shr.b32":
            r = x[0] >> x[1]
        elif op == "prmt.b32":
            pool = x[0] | (x[1] << 32)
            r = 0
            for i in range(4):
                sel = (x[2] >> (4 * i)) & 0xF
                byte = (pool >> (8 * (sel & 7))) & 0xFF
                if sel & 8:
                    byte = 0xFF if byte & 0x80 else 0
                r |= byte << (8 * i)
        else:
            raise AssertionError(f"no emulation for {op}")
        regs[dst] = r & 0xFFFFFFFF
    return regs


@pytest.mark.parametrize("asm,unscale", [(kfp4._E2M1_BF16_ASM, 1.0), (kfp4._E2M1_SHIFT_ASM, kfp4.E2M1_SHIFT_UNSCALE)],
                         ids=["byte-permutes", "shifts"])
def test_the_ptx_decodes_give_every_code_exactly_when_emulated(asm, unscale):
    """The decodes' PTX text itself (run on the GPU by test_the_byte_permute_decode_gives_every_code_
    pair_exactly), emulated instruction by instruction: every byte in every position of the 32-bit
    register gives bit for bit the bf16 E2M1 values of its two nibbles (times 2^-126 for the shift
    decode), in the order inline_asm_elementwise(pack=4) unpacks them."""
    asm = getattr(asm, "value", asm)
    unscale = float(getattr(unscale, "value", unscale))
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    want = dequantize_mxfp4(codes.view(1, 256), torch.full((1, 16), 127, dtype=torch.uint8), torch.float32).view(256, 2)
    for shift in range(4):  # byte b at position shift, its neighbours other bytes
        for b in range(256):
            word = [(b + 77 * j) % 256 for j in range(4)]
            word = word[-shift:] + word[:-shift] if shift else word
            regs = _run_ptx(asm, {"$4": sum(v << (8 * j) for j, v in enumerate(word))})
            halves = [(regs[r] >> (16 * h)) & 0xFFFF for r in ("$0", "$1") for h in (0, 1)]  # even values, bytes 0-3
            halves += [(regs[r] >> (16 * h)) & 0xFFFF for r in ("$2", "$3") for h in (0, 1)]  # odd values
            got = torch.tensor(halves, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float() * unscale
            for j, v in enumerate(word):
                assert torch.equal(got[j].view(torch.int32), want[v, 0].view(torch.int32)), (asm[:20], shift, j, v)
                assert torch.equal(got[4 + j].view(torch.int32), want[v, 1].view(torch.int32)), (asm[:20], shift, j, v)
