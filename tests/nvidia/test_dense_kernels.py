"""The NVIDIA backend's dense kernels against the reference ops.

Covers fp8_block_linear / linear (kernels/fp8_linear.py), rms_norm / add_rms_norm /
silu_and_mul / rotary_embedding (kernels/elementwise.py) and write_latent_cache /
norm_rope_write_latent / gather_latent_cache (kernels/cache.py). Every case draws inputs as specs/ops.toml's header says
and compares with the spec's tolerance. Small cases run everywhere (on a CPU through Triton's
interpreter, float32); the spec's real shapes are marked ``gpu`` and run in bf16 and float32.
"""

from __future__ import annotations

import functools

import pytest
import torch

from deepinfer_core.conformance.checkpoints import FP8_MAX
from deepinfer_core.conformance.checks import check_close
from deepinfer_core.conformance.inputs import ROPE_PARAMETERS, make_case, quantize_block_fp8
from deepinfer_core.conformance.spec import tolerance
from deepinfer_core.ops import REFERENCE_OPS
from deepinfer_core.ops.rope import rope_cos_sin_table

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the NVIDIA kernels cannot run")

from deepinfer_nvidia_sm100.kernels import cache, elementwise, fp8_linear
from tests.op_spec import assert_close, shapes

EPS = 1e-6
# Spec shapes whose work (elements touched) is at most this also run under the interpreter.
CPU_MAX_ELEMENTS = 16384


def _id(case: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in case.items()).replace(" ", "")


def spec_cases(op: str, size) -> list:
    """The spec's shapes for ``op``, those with size(case) > CPU_MAX_ELEMENTS marked gpu."""
    return [
        pytest.param(case, id=_id(case), marks=() if size(case) <= CPU_MAX_ELEMENTS else pytest.mark.gpu)
        for case in shapes(op)
    ]


def randn(*shape, dtype, device, scale=1.0):
    """N(0, 1) * scale drawn on the CPU (the same numbers on every device), then moved."""
    return (torch.randn(*shape) * scale).to(device=device, dtype=dtype)


def random_fp8_linear(n: int, k: int, block, device, bias: bool = False, dtype=torch.float32):
    q, scale = quantize_block_fp8(torch.randn(n, k) / k**0.5, block)
    b = randn(n, dtype=dtype, device=device) if bias else None
    return q.to(device), scale.to(device), b


def quantize_dequantize_activations(x: torch.Tensor, bk: int) -> torch.Tensor:
    """What the W8A8 path multiplies: x rounded per token and per bk channels to e4m3 (float32)."""
    m, k = x.shape
    kp = -(-k // bk) * bk
    blocks = torch.nn.functional.pad(x.float(), (0, kp - k)).view(m, kp // bk, bk)
    scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    q = (blocks * (1.0 / scale)).to(torch.float8_e4m3fn).float()
    return (q * scale).view(m, kp)[:, :k]


@functools.cache
def cos_sin_table(rope: str, rope_dim: int, max_positions: int) -> torch.Tensor:
    return rope_cos_sin_table(rope_dim, 10000.0, ROPE_PARAMETERS[rope], max_positions)


# ---------------------------------------------------------------------------------------------
# fp8_block_linear / linear


def _fp8_size(c):
    return c["tokens"] * c["in_features"] + c["in_features"] * c["out_features"]


@pytest.mark.parametrize("case", spec_cases("fp8_block_linear", _fp8_size))
def test_fp8_block_linear_spec_shapes(case, device, dtype):
    torch.manual_seed(0)
    block = tuple(case["block"])
    weight, scale, _ = random_fp8_linear(case["out_features"], case["in_features"], block, device)
    x = randn(case["tokens"], case["in_features"], dtype=dtype, device=device)
    out = fp8_linear.fp8_block_linear(x, weight, scale, block)
    assert out.shape == (case["tokens"], case["out_features"]) and out.dtype == dtype
    assert_close(out, REFERENCE_OPS["fp8_block_linear"](x, weight, scale, block), "fp8_block_linear", dtype)


@pytest.mark.parametrize("lead", [(5,), (2, 3), ()], ids=["2d", "3d", "1d"])
def test_fp8_block_linear_bias_and_leading_dims(lead, device, dtype):
    torch.manual_seed(1)
    block = (32, 32)
    weight, scale, bias = random_fp8_linear(72, 100, block, device, bias=True, dtype=dtype)
    x = randn(*lead, 100, dtype=dtype, device=device)
    out = fp8_linear.fp8_block_linear(x, weight, scale, block, bias)
    assert out.shape == (*lead, 72)
    assert_close(out, REFERENCE_OPS["fp8_block_linear"](x, weight, scale, block, bias), "fp8_block_linear", dtype)


@pytest.mark.parametrize("block_n,split_k", [(32, 2), (16, 4), (64, 3)])
def test_fp8_block_linear_split_k(block_n, split_k, device, dtype):
    """Forced split-K (K = 100 is 4 blocks of 32, the last partial) with bias, and a strided x."""
    torch.manual_seed(2)
    block = (32, 32)
    weight, scale, bias = random_fp8_linear(72, 100, block, device, bias=True, dtype=dtype)
    x = randn(3, 130, dtype=dtype, device=device)[:, 7:107]
    cfg = fp8_linear.Fp8Config(16, block_n, 4, 2, split_k, fp8_linear.W8A16)
    out = fp8_linear.fp8_block_linear_with_config(x, weight, scale, block, bias, cfg)
    assert_close(out, REFERENCE_OPS["fp8_block_linear"](x, weight, scale, block, bias), "fp8_block_linear", dtype)


# W8A8 against the reference on the activations it quantised, in every dtype: the spec's W8A8 row
# (float32's contract is weight-only), since on the GPU Triton's approximate division can move a
# scaled activation across an e4m3 rounding boundary (one e4m3 step, ~1e-3 in the output).
W8A8_TOLERANCE = tolerance("fp8_block_linear", torch.bfloat16)


def _w8a8_check(x, weight, scale, block, bias, cfg, dtype):
    """W8A8 equals the reference on the activations it quantised; its distance to the exact
    reference is the e4m3 activation rounding (relative RMS ~0.026 for N(0,1) data)."""
    out = fp8_linear.fp8_block_linear_with_config(x, weight, scale, block, bias, cfg)
    x_q = quantize_dequantize_activations(x.reshape(-1, x.shape[-1]), block[1])
    ref_q = REFERENCE_OPS["fp8_block_linear"](x_q, weight, scale, block, None if bias is None else bias.float())
    torch.testing.assert_close(out.reshape(ref_q.shape).float().cpu(), ref_q.to(dtype).float().cpu(), **W8A8_TOLERANCE,
                               msg=lambda m: f"fp8_block_linear (W8A8 vs quantised x): {m}")
    ref = REFERENCE_OPS["fp8_block_linear"](x, weight, scale, block, bias).float().reshape(ref_q.shape)
    rel_rms = ((out.float().reshape(ref.shape) - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
    assert rel_rms < 0.05, f"W8A8 relative RMS error {rel_rms:.3f} is larger than e4m3 activation rounding explains"


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("mode", ["fused", "prequant"])
def test_fp8_block_linear_w8a8_small(mode, split_k, device, dtype):
    torch.manual_seed(3)
    block = (32, 32)
    weight, scale, bias = random_fp8_linear(72, 100, block, device, bias=True, dtype=dtype)
    x = randn(19, 100, dtype=dtype, device=device)
    x[3] = 0.0  # an all-zero token: the scale floor must keep it finite (and zero)
    mode_id = {"fused": fp8_linear.W8A8_FUSED, "prequant": fp8_linear.W8A8_PREQUANT}[mode]
    _w8a8_check(x, weight, scale, block, bias, fp8_linear.Fp8Config(16, 32, 4, 2, split_k, mode_id), dtype)


def test_fp8_block_linear_float32_never_quantises_activations():
    """The op's float32 contract is the dequantising reference within 1e-5 (specs/ops.toml), so
    float32 activations take W8A16 at every M; bf16/fp16 switch to W8A8 at FP8_W8A8_MIN_M."""
    cpu = torch.device("cpu")
    big = fp8_linear.FP8_W8A8_MIN_M * 4
    assert fp8_linear.fp8_config(big, 7168, 16384, 128, torch.float32, cpu).mode == fp8_linear.W8A16
    assert fp8_linear.fp8_config(big, 7168, 16384, 128, torch.bfloat16, cpu).mode != fp8_linear.W8A16


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fused", "prequant"])
@pytest.mark.parametrize("tokens", [200, 1024])
@pytest.mark.parametrize("n,k", [(576, 7168), (1536, 7168), (24576, 1536), (7168, 16384)], ids=["kv_a", "q_a", "q_b", "o_proj"])
def test_fp8_block_linear_prefill_w8a8(mode, tokens, n, k, device, dtype, monkeypatch):
    """Prefill sizes: the heuristic's tiles and split, in either W8A8 variant (W8A8 forced on
    from 128 rows, whatever the threshold the backend ships with)."""
    monkeypatch.setattr(fp8_linear, "FP8_W8A8_MIN_M", 128)
    torch.manual_seed(4)
    block = (128, 128)
    weight, scale, _ = random_fp8_linear(n, k, block, device)
    x = randn(tokens, k, dtype=dtype, device=device)
    cfg = fp8_linear.fp8_config(tokens, n, k, 128, dtype, x.device)
    assert (cfg.mode != fp8_linear.W8A16) == (dtype != torch.float32)  # float32 is the exact mode: W8A16
    mode_id = {"fused": fp8_linear.W8A8_FUSED, "prequant": fp8_linear.W8A8_PREQUANT}[mode]
    _w8a8_check(x, weight, scale, block, None, cfg._replace(mode=mode_id), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 64])
@pytest.mark.parametrize("n,k", [(576, 7168), (7168, 18432), (32768, 512)], ids=["kv_a", "dense_down", "kv_b"])
def test_fp8_block_linear_decode_sizes(tokens, n, k, device, dtype):
    torch.manual_seed(5)
    block = (128, 128)
    weight, scale, _ = random_fp8_linear(n, k, block, device)
    x = randn(tokens, k, dtype=dtype, device=device)
    out = fp8_linear.fp8_block_linear(x, weight, scale, block)
    assert_close(out, REFERENCE_OPS["fp8_block_linear"](x, weight, scale, block), "fp8_block_linear", dtype)


def test_fp8_block_linear_empty(device, dtype):
    weight, scale, _ = random_fp8_linear(72, 100, (32, 32), device)
    out = fp8_linear.fp8_block_linear(torch.empty(0, 100, dtype=dtype, device=device), weight, scale, (32, 32))
    assert out.shape == (0, 72) and out.dtype == dtype


def _linear_size(c):
    return c["tokens"] * c["in_features"] + c["in_features"] * c["out_features"]


@pytest.mark.parametrize("case", spec_cases("linear", _linear_size))
def test_linear_spec_shapes(case, device, dtype):
    torch.manual_seed(6)
    k, n = case["in_features"], case["out_features"]
    x = randn(case["tokens"], k, dtype=dtype, device=device)
    w = randn(n, k, dtype=dtype, device=device, scale=k**-0.5)
    b = randn(n, dtype=dtype, device=device) if case["bias"] else None
    assert_close(fp8_linear.linear(x, w, b), REFERENCE_OPS["linear"](x, w, b), "linear", dtype)


# ---------------------------------------------------------------------------------------------
# rms_norm / add_rms_norm


def _row_size(c):
    return c["tokens"] * c["hidden"]


@pytest.mark.parametrize("case", spec_cases("rms_norm", _row_size))
def test_rms_norm_spec_shapes(case, device, dtype):
    torch.manual_seed(7)
    x = randn(case["tokens"], case["hidden"], dtype=dtype, device=device)
    w = 1 + randn(case["hidden"], dtype=dtype, device=device, scale=0.1)
    out = elementwise.rms_norm(x, w, EPS)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, REFERENCE_OPS["rms_norm"](x, w, EPS), "rms_norm", dtype)


def test_rms_norm_strided_and_3d(device, dtype):
    """kv_a_layernorm normalises a column slice [T, :512] of the [T, 576] kv_a output; 3-D x too."""
    torch.manual_seed(8)
    kv = randn(6, 40, dtype=dtype, device=device)
    latent = kv[:, :32]
    w = 1 + randn(32, dtype=dtype, device=device, scale=0.1)
    assert_close(elementwise.rms_norm(latent, w, EPS), REFERENCE_OPS["rms_norm"](latent, w, EPS), "rms_norm", dtype)
    x3 = randn(2, 3, 96, dtype=dtype, device=device)
    w3 = 1 + randn(96, dtype=dtype, device=device, scale=0.1)
    assert_close(elementwise.rms_norm(x3, w3, EPS), REFERENCE_OPS["rms_norm"](x3, w3, EPS), "rms_norm", dtype)


@pytest.mark.gpu
def test_rms_norm_float32_weight_on_bf16():
    """A float32 weight on bf16 activations multiplies in float32 before the final cast."""
    torch.manual_seed(9)
    x = randn(7, 1536, dtype=torch.bfloat16, device="cuda")
    w = 1 + randn(1536, dtype=torch.float32, device="cuda", scale=0.1)
    assert_close(elementwise.rms_norm(x, w, EPS), REFERENCE_OPS["rms_norm"](x, w, EPS), "rms_norm", torch.bfloat16)


@pytest.mark.parametrize("case", spec_cases("add_rms_norm", _row_size) + [pytest.param({"tokens": 0, "hidden": 64}, id="tokens0")])
def test_add_rms_norm_spec_shapes(case, device, dtype):
    torch.manual_seed(10)
    x = randn(case["tokens"], case["hidden"], dtype=dtype, device=device)
    res = randn(case["tokens"], case["hidden"], dtype=dtype, device=device)
    w = 1 + randn(case["hidden"], dtype=dtype, device=device, scale=0.1)
    x0, res0 = x.clone(), res.clone()
    y, summed = elementwise.add_rms_norm(x, res, w, EPS)
    ref_y, ref_sum = REFERENCE_OPS["add_rms_norm"](x, res, w, EPS)
    assert torch.equal(x, x0) and torch.equal(res, res0), "add_rms_norm modified its inputs"
    assert summed.dtype == dtype and torch.equal(summed, ref_sum), "the residual output must be exactly x + residual"
    assert_close(y, ref_y, "add_rms_norm", dtype)


# ---------------------------------------------------------------------------------------------
# silu_and_mul


@pytest.mark.parametrize("case", spec_cases("silu_and_mul", lambda c: 3 * c["tokens"] * c["intermediate"]))
def test_silu_and_mul_spec_shapes(case, device, dtype):
    torch.manual_seed(11)
    x = randn(case["tokens"], 2 * case["intermediate"], dtype=dtype, device=device, scale=2.0)
    out = elementwise.silu_and_mul(x)
    assert out.shape == (case["tokens"], case["intermediate"]) and out.dtype == dtype
    assert_close(out, REFERENCE_OPS["silu_and_mul"](x), "silu_and_mul", dtype)


def test_silu_and_mul_strided_3d(device, dtype):
    torch.manual_seed(12)
    x = randn(2, 3, 2 * 1100 + 10, dtype=dtype, device=device)[..., 5:-5]  # I = 1100 spans 2 column blocks
    assert_close(elementwise.silu_and_mul(x), REFERENCE_OPS["silu_and_mul"](x), "silu_and_mul", dtype)


# ---------------------------------------------------------------------------------------------
# rotary_embedding


def _rope_inputs(case, dtype, device):
    t, h, r = case["tokens"], case["heads"], case["rope_dim"]
    # q_pe is the tail of each head's [nope | rope] query, k_pe the tail of the [latent | rope] kv_a output.
    q = randn(t, h, r + 16, dtype=dtype, device=device)[..., 16:]
    k = randn(t, r + 32, dtype=dtype, device=device)[:, 32:]
    positions = torch.randint(0, case["max_positions"], (t,)).to(device)
    table = cos_sin_table(case["rope"], r, case["max_positions"]).to(device)
    return q, k, positions, table


@pytest.mark.parametrize("case", spec_cases("rotary_embedding", lambda c: c["tokens"] * (c["heads"] + 1) * c["rope_dim"]))
def test_rotary_embedding_spec_shapes(case, device, dtype):
    torch.manual_seed(13)
    q, k, positions, table = _rope_inputs(case, dtype, device)
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = elementwise.rotary_embedding(q, k, positions, table, case["interleaved"])
    ref_q, ref_k = REFERENCE_OPS["rotary_embedding"](q, k, positions, table, case["interleaved"])
    assert torch.equal(q, q0) and torch.equal(k, k0), "rotary_embedding modified its inputs"
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == dtype
    assert_close(q_out, ref_q, "rotary_embedding", dtype, " (q)")
    assert_close(k_out, ref_k, "rotary_embedding", dtype, " (k)")


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_embedding_many_heads(interleaved, device, dtype):
    """More heads than one program takes (ROPE_BLOCK_H), a head count that is not a multiple of it."""
    torch.manual_seed(14)
    case = {"tokens": 3, "heads": elementwise.ROPE_BLOCK_H + 3, "rope_dim": 16, "max_positions": 64, "rope": "v3_yarn"}
    q, k, positions, table = _rope_inputs(case, dtype, device)
    q_out, k_out = elementwise.rotary_embedding(q, k, positions, table, interleaved)
    ref_q, ref_k = REFERENCE_OPS["rotary_embedding"](q, k, positions, table, interleaved)
    assert_close(q_out, ref_q, "rotary_embedding", dtype, " (q)")
    assert_close(k_out, ref_k, "rotary_embedding", dtype, " (k)")


def test_rotary_embedding_empty(device, dtype):
    q = torch.empty(0, 4, 8, dtype=dtype, device=device)
    k = torch.empty(0, 8, dtype=dtype, device=device)
    table = cos_sin_table("default", 8, 16).to(device)
    q_out, k_out = elementwise.rotary_embedding(q, k, torch.empty(0, dtype=torch.int64, device=device), table, True)
    assert q_out.shape == q.shape and k_out.shape == k.shape


# ---------------------------------------------------------------------------------------------
# write_latent_cache / gather_latent_cache


def _cache_size(c):
    return c["tokens"] * (c["kv_lora_rank"] + c["rope_dim"])


# A small case with padding tokens (the spec's padded case is a real-size one).
PADDED_WRITE = pytest.param(
    {"tokens": 7, "num_blocks": 4, "block_size": 4, "kv_lora_rank": 40, "rope_dim": 8, "padding_tokens": 3}, id="small-padded"
)


def _write_inputs(case, dtype, device):
    t, d_c, d_r = case["tokens"], case["kv_lora_rank"], case["rope_dim"]
    n_slots = case["num_blocks"] * case["block_size"]
    slots = torch.randperm(n_slots)[:t]
    slots[torch.randperm(t)[: case["padding_tokens"]]] = -1
    kv = randn(t, d_c + d_r, dtype=dtype, device=device)  # kv_a output: latent | k_pe, written from its slices
    return kv[:, :d_c], kv[:, d_c:], slots.to(device)


@pytest.mark.parametrize("case", spec_cases("write_latent_cache", _cache_size) + [PADDED_WRITE])
def test_write_latent_cache_spec_shapes(case, device, dtype):
    torch.manual_seed(15)
    latent, k_pe, slots = _write_inputs(case, dtype, device)
    shape = (case["num_blocks"], case["block_size"], case["kv_lora_rank"] + case["rope_dim"])
    kv_cache = randn(*shape, dtype=dtype, device=device)
    expected = kv_cache.clone()
    REFERENCE_OPS["write_latent_cache"](expected, latent, k_pe, slots)
    assert cache.write_latent_cache(kv_cache, latent, k_pe, slots) is None
    assert_close(kv_cache, expected, "write_latent_cache", dtype)


@pytest.mark.parametrize("case", spec_cases("write_latent_cache", _cache_size) + [PADDED_WRITE])
def test_write_latent_cache_poisoned(case, device, dtype):
    """Targeted rows hold exactly [latent | k_pe]; every other row keeps its NaN poison."""
    torch.manual_seed(16)
    latent, k_pe, slots = _write_inputs(case, dtype, device)
    d = case["kv_lora_rank"] + case["rope_dim"]
    kv_cache = torch.full((case["num_blocks"], case["block_size"], d), float("nan"), dtype=dtype, device=device)
    cache.write_latent_cache(kv_cache, latent, k_pe, slots)
    flat = kv_cache.view(-1, d).cpu()
    slots_cpu = slots.cpu()
    keep = slots_cpu >= 0
    assert torch.equal(flat[slots_cpu[keep]], torch.cat([latent, k_pe], dim=-1).cpu()[keep])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots_cpu[keep]] = False
    assert flat[untouched].isnan().all(), "rows not targeted (or padding tokens) were written"


@pytest.mark.gpu
def test_write_latent_cache_casts_to_cache_dtype():
    torch.manual_seed(17)
    case = {"tokens": 13, "num_blocks": 16, "block_size": 16, "kv_lora_rank": 512, "rope_dim": 64, "padding_tokens": 3}
    latent, k_pe, slots = _write_inputs(case, torch.float32, "cuda")
    kv_cache = randn(16, 16, 576, dtype=torch.bfloat16, device="cuda")
    expected = kv_cache.clone()
    REFERENCE_OPS["write_latent_cache"](expected, latent, k_pe, slots)
    cache.write_latent_cache(kv_cache, latent, k_pe, slots)
    assert torch.equal(kv_cache, expected)


def test_write_latent_cache_empty(device, dtype):
    kv_cache = randn(2, 4, 12, dtype=dtype, device=device)
    before = kv_cache.clone()
    cache.write_latent_cache(kv_cache, kv_cache.new_empty(0, 8), kv_cache.new_empty(0, 4), torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(kv_cache, before)


def _fused_size(c):
    return c["tokens"] * (c["kv_lora_rank"] + c["rope_dim"] * (1 + c["heads"]))


@pytest.mark.parametrize("case", spec_cases("norm_rope_write_latent", _fused_size))
def test_norm_rope_write_latent_passes_the_kit(case, device, dtype):
    """The conformance kit's own inputs (strided kv and q_pe, padding slots) and judge: the cache
    rows and the rotated q_pe against the reference, poisoned outputs, other rows untouched."""
    op_case = make_case("norm_rope_write_latent", case, dtype, device, seed=21)
    outcome = check_close(cache.norm_rope_write_latent, op_case)
    assert outcome.ok, outcome.message


@pytest.mark.parametrize("case", spec_cases("norm_rope_write_latent", _fused_size))
def test_norm_rope_write_latent_is_the_three_kernels_bit_for_bit(case, device, dtype):
    """The fused launch rounds as elementwise.rms_norm, elementwise.rotary_embedding and
    cache.write_latent_cache do one after the other: the same bits in the cache and in q."""
    args = make_case("norm_rope_write_latent", case, dtype, device, seed=22).args
    kv_cache, kv, w, eps, q_pe, positions, cos_sin, interleaved, slots = args
    apart = kv_cache.clone()
    d_c = w.shape[0]
    latent = elementwise.rms_norm(kv[:, :d_c], w, eps)
    q_apart, k_pe = elementwise.rotary_embedding(q_pe, kv[:, d_c:], positions, cos_sin, interleaved)
    cache.write_latent_cache(apart, latent, k_pe, slots)
    q_fused = cache.norm_rope_write_latent(kv_cache, kv, w, eps, q_pe, positions, cos_sin, interleaved, slots)
    assert torch.equal(kv_cache, apart) and torch.equal(q_fused, q_apart)


@pytest.mark.parametrize("case", spec_cases("gather_latent_cache", lambda c: c["slots"] * c["entry_dim"]) + [pytest.param({"slots": 0, "num_blocks": 2, "block_size": 4, "entry_dim": 40}, id="slots0")])
def test_gather_latent_cache_spec_shapes(case, device, dtype):
    torch.manual_seed(18)
    kv_cache = randn(case["num_blocks"], case["block_size"], case["entry_dim"], dtype=dtype, device=device)
    slots = torch.randint(0, case["num_blocks"] * case["block_size"], (case["slots"],)).to(device)
    out = cache.gather_latent_cache(kv_cache, slots)
    assert out.shape == (case["slots"], case["entry_dim"]) and out.dtype == dtype
    assert_close(out, REFERENCE_OPS["gather_latent_cache"](kv_cache, slots), "gather_latent_cache", dtype)


# ---------------------------------------------------------------------------------------------
# float16 and CUDA graphs (GPU only)


@pytest.mark.gpu
def test_float16_all_ops():
    dt, dev = torch.float16, "cuda"
    torch.manual_seed(19)
    x = randn(33, 2048, dtype=dt, device=dev)
    res = randn(33, 2048, dtype=dt, device=dev)
    w = 1 + randn(2048, dtype=dt, device=dev, scale=0.1)
    assert_close(elementwise.rms_norm(x, w, EPS), REFERENCE_OPS["rms_norm"](x, w, EPS), "rms_norm", dt)
    y, s = elementwise.add_rms_norm(x, res, w, EPS)
    ref_y, ref_s = REFERENCE_OPS["add_rms_norm"](x, res, w, EPS)
    assert torch.equal(s, ref_s)
    assert_close(y, ref_y, "add_rms_norm", dt)
    g = randn(7, 2 * 1408, dtype=dt, device=dev, scale=2.0)
    assert_close(elementwise.silu_and_mul(g), REFERENCE_OPS["silu_and_mul"](g), "silu_and_mul", dt)
    case = {"tokens": 9, "heads": 16, "rope_dim": 64, "max_positions": 163840, "rope": "v2lite_yarn"}
    q, k, pos, table = _rope_inputs(case, dt, dev)
    for out, ref in zip(elementwise.rotary_embedding(q, k, pos, table, True), REFERENCE_OPS["rotary_embedding"](q, k, pos, table, True)):
        assert_close(out, ref, "rotary_embedding", dt)
    weight, scale, bias = random_fp8_linear(576, 7168, (128, 128), dev, bias=True, dtype=dt)
    xa = randn(17, 7168, dtype=dt, device=dev)
    assert_close(fp8_linear.fp8_block_linear(xa, weight, scale, (128, 128), bias),
                 REFERENCE_OPS["fp8_block_linear"](xa, weight, scale, (128, 128), bias), "fp8_block_linear", dt)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_decode_step_under_cuda_graph(tokens, dtype):
    """norm -> kv_a fp8 linear (split-K) -> rope -> cache write, captured once and replayed on new inputs."""
    dev = torch.device("cuda")
    torch.manual_seed(20)
    block = (128, 128)
    w_kva, s_kva, _ = random_fp8_linear(576, 7168, block, dev)
    norm_w = 1 + randn(7168, dtype=dtype, device=dev, scale=0.1)
    table = cos_sin_table("v3_yarn", 64, 163840).to(dev)
    static_x = randn(tokens, 7168, dtype=dtype, device=dev)
    static_res = randn(tokens, 7168, dtype=dtype, device=dev)
    static_q = randn(tokens, 128, 192, dtype=dtype, device=dev)
    static_pos = torch.randint(0, 163840, (tokens,), device=dev)
    static_slots = torch.randperm(16 * 64, device=dev)[:tokens]
    static_slots[0] = -1
    kv_cache = torch.zeros(16, 64, 576, dtype=dtype, device=dev)

    def step(cache_tensor):
        h, summed = elementwise.add_rms_norm(static_x, static_res, norm_w, EPS)
        h = elementwise.rms_norm(h, norm_w, EPS)
        kv = fp8_linear.fp8_block_linear(h, w_kva, s_kva, block)
        q_pe, k_pe = elementwise.rotary_embedding(static_q[..., 128:], kv[:, 512:], static_pos, table, True)
        cache.write_latent_cache(cache_tensor, kv[:, :512], k_pe, static_slots)
        rows = cache.gather_latent_cache(cache_tensor, static_slots.clamp_min(0))
        return summed, kv, q_pe, k_pe, rows

    assert fp8_linear.fp8_config(tokens, 576, 7168, 128, dtype, dev).split_k > 1
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile every kernel before capture
        step(kv_cache)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step(kv_cache)

    for seed in (21, 22):
        torch.manual_seed(seed)
        static_x.copy_(randn(tokens, 7168, dtype=dtype, device=dev))
        static_res.copy_(randn(tokens, 7168, dtype=dtype, device=dev))
        static_q.copy_(randn(tokens, 128, 192, dtype=dtype, device=dev))
        static_pos.copy_(torch.randint(0, 163840, (tokens,), device=dev))
        kv_cache.zero_()
        graph.replay()
        torch.cuda.synchronize()
        graph_cache = kv_cache.clone()
        kv_cache.zero_()
        eager_out = step(kv_cache)
        for g, e in zip(graph_out, eager_out):
            assert torch.equal(g, e)
        assert torch.equal(graph_cache, kv_cache)
