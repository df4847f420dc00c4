"""The Ascend plugin's TileLang kernels (plugins/ascend_950/deepinfer_ascend_950/tilelang_ops).

CI (a CPU, no CANN): every kernel is lowered to AscendC with mainline TileLang's Ascend 950
backend (``tilelang.lower`` under an ``ascend`` target: no bisheng, which is CANN's) at DeepSeek's
real shapes, and the source must carry its entry point ``extern "C" __global__ __vector__ void
<name>_kernel(...)`` with exactly the parameters the op glue passes, in the order TileLang
emits them (buffers by name, then scalars, then dynamic dimensions), plus its vector functions.
The same sources lowered for CUDA must give their ``__global__`` entry too. The glue
(``tilelang_ops.ops``) is checked on the CPU against the reference through stand-ins of the
kernels (test-only torch models of each kernel's documented parameters): that tests the glue's
marshalling (argument order, dtypes, layouts, fallbacks), not the kernels, and not the chip.

``gpu``: each kernel JIT-compiled for CUDA and run against the reference op (numerics of the
shared source; not yet run). ``npu``: each op callable on an Ascend 950 (bisheng + torch_npu)
against the reference (not yet run).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from deepinfer_ascend_950 import tilelang_ops
from deepinfer_ascend_950.tilelang_ops import KERNELS, compress, engram, ops, records, route
from deepinfer_core.hook_checks import signature_problem
from deepinfer_core.ops import engram as ref_engram
from deepinfer_core.ops import kv_record
from deepinfer_core.ops import moe as ref_moe
from deepinfer_core.ops import sparse as ref_sparse

needs_tilelang = pytest.mark.skipif(tilelang_ops.unavailable_reason() is not None,
                                    reason=str(tilelang_ops.unavailable_reason()))

# (kernel, factory arguments: DeepSeek-V4 / V4.1's real shapes, the Ascend entry's parameters)
CASES = [
    ("deepinfer_compress_pool", (8, 512, "bfloat16"),  # CSA compressor
     "__gm__ bfloat16_t* entries, __gm__ bfloat16_t* kv, __gm__ float* norm_weight, __gm__ float* score, float eps, int32_t num_windows"),
    ("deepinfer_compress_pool", (8, 128, "bfloat16"),  # CSA indexer compressor
     "__gm__ bfloat16_t* entries, __gm__ bfloat16_t* kv, __gm__ float* norm_weight, __gm__ float* score, float eps, int32_t num_windows"),
    ("deepinfer_compress_pool", (128, 512, "bfloat16"),  # HCA compressor: channel tiles of 64
     "__gm__ bfloat16_t* entries, __gm__ bfloat16_t* kv, __gm__ float* norm_weight, __gm__ float* score, float eps, int32_t num_windows"),
    ("deepinfer_route_topk", (256, 6, True),  # V4 Flash
     "__gm__ float* bias, __gm__ int32_t* ids, __gm__ float* logits, __gm__ float* weights, int32_t num_tokens, float routed_scaling_factor"),
    ("deepinfer_route_topk", (384, 6, True),  # V4 Pro
     "__gm__ float* bias, __gm__ int32_t* ids, __gm__ float* logits, __gm__ float* weights, int32_t num_tokens, float routed_scaling_factor"),
    ("deepinfer_route_fixed", (256, 6, True),  # V4 Flash hash layers
     "__gm__ int32_t* fixed_ids, __gm__ float* logits, __gm__ float* weights, int32_t num_tokens, float routed_scaling_factor"),
    ("deepinfer_engram_hash", (4, 8),  # V4.1: n-grams up to 4, 8 heads
     "__gm__ int64_t* ids, __gm__ int64_t* multipliers, __gm__ int64_t* ngram_ids, __gm__ int64_t* offsets, __gm__ int64_t* primes, int32_t num_tokens, int64_t pad_id"),
    ("deepinfer_engram_gate", (4, 4096, "bfloat16"),  # hc 4, hidden 4096: two chunks of 2048
     "__gm__ bfloat16_t* k_weight, __gm__ bfloat16_t* kv, __gm__ bfloat16_t* out, __gm__ bfloat16_t* q_weight, __gm__ bfloat16_t* x, float eps, int32_t num_tokens"),
    ("deepinfer_write_records", ("bfloat16",),  # V4 FP8 KV records
     "__gm__ uint8_t* cache, __gm__ int32_t* slot_mapping, __gm__ bfloat16_t* values, int32_t num_pages, int32_t num_tokens"),
]
CUDA_CASES = {name: args for name, args, _ in reversed(CASES)}  # one shape per kernel for the CUDA lowering


@pytest.fixture(scope="module")
def tilelang_env(tmp_path_factory):
    """TileLang with its cache in a temporary folder (it keeps one in ~/.tilelang otherwise), and
    bisheng made unreachable: lowering must not compile."""
    saved = os.environ.get("TILELANG_CACHE_DIR")
    os.environ["TILELANG_CACHE_DIR"] = str(tmp_path_factory.mktemp("tilelang-cache"))
    import tilelang.contrib.bisheng as bisheng

    real = bisheng.compile_ascend

    def refuse(*args, **kwargs):
        raise AssertionError("lowering called bisheng")

    bisheng.compile_ascend = refuse
    yield
    bisheng.compile_ascend = real
    if saved is None:
        os.environ.pop("TILELANG_CACHE_DIR", None)
    else:
        os.environ["TILELANG_CACHE_DIR"] = saved


def test_every_kernel_is_lowered_here():
    assert {name for name, _, _ in CASES} == set(KERNELS)
    assert {k.op for k in KERNELS.values()} | {op for k in KERNELS.values() for op in k.composes} == set(ops.OPS)


@needs_tilelang
@pytest.mark.parametrize("name, args, params", CASES, ids=[f"{n}-{'-'.join(map(str, a))}" for n, a, _ in CASES])
def test_lowers_to_ascendc_with_its_entry_point(tilelang_env, name, args, params):
    kernel = KERNELS[name]
    source = tilelang_ops.lower_source(kernel.build(*args, target="ascend"), "ascend")
    assert f'extern "C" __global__ __vector__ void {kernel.entry}({params}) {{' in source, _entries(source)
    assert source.count("__global__") == 1  # one kernel, no stray device entry
    assert re.search(rf"__simt_vf__ .* void {kernel.entry}_simt_vf_0\(", source)  # the vector (SIMT) code
    assert f"asc_vf_call<{kernel.entry}_simt_vf_0>" in source  # ... launched from the kernel
    assert "asc_copy_gm2ub" in source and "asc_copy_ub2gm" in source  # GM -> UB -> GM


@needs_tilelang
@pytest.mark.parametrize("name", sorted(CUDA_CASES))
def test_the_same_source_lowers_for_cuda(tilelang_env, name):
    kernel = KERNELS[name]
    source = tilelang_ops.lower_source(kernel.build(*CUDA_CASES[name], target="cuda"), "cuda")
    assert re.search(rf'extern "C" __global__ void __launch_bounds__\(\d+, 1\) {kernel.entry}\(', source), _entries(source)


def _entries(source: str) -> str:
    return "entries found: " + "; ".join(line.strip() for line in source.splitlines() if "__global__" in line)


# ---- shapes the kernels take (pure Python: no TileLang needed) ---------------------------------
def test_supported_shapes():
    assert compress.supports(8, 512, "bfloat16") and compress.supports(128, 512, "bfloat16") and compress.supports(8, 128, "float32")
    assert compress.channel_tile(128, 512, "bfloat16") == 64 and compress.channel_tile(8, 512, "bfloat16") == 512
    assert not compress.supports(3, 24, "bfloat16")  # the conformance kit's awkward shapes: the reference
    assert route.supports(256, 6) and route.supports(384, 6) and not route.supports(7, 2) and not route.supports(1024, 8)
    assert engram.gate_supports(4, 7168, "bfloat16") and engram.gate_chunk(7168) == 1792 and not engram.gate_supports(4, 100, "float32")
    assert engram.hash_supports(4, 8) and not engram.hash_supports(1, 8)
    with pytest.raises(ValueError, match="unsupported"):
        compress.compress_pool_kernel(3, 24, "bfloat16")
    with pytest.raises(ValueError, match="unknown TileLang target"):
        KERNELS["deepinfer_write_records"].build("bfloat16", target="metal")
    assert records.PAGE_BYTES == 64 * 584 and records.SCALE_PLANE == 64 * 576
    assert (records.PAGE_BYTES, records.SCALE_PLANE, records.DATA_BYTES) == (kv_record.PAGE_BYTES, kv_record.SCALE_PLANE, kv_record.DATA_BYTES)


# ---- the op glue, through stand-ins of the kernels (tests the glue, not the kernels) -----------
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int32": torch.int32,
                "int64": torch.int64, "uint8": torch.uint8}


def _check_arguments(prim_func, args):
    """The glue's arguments against the prim_func's parameters: one each, in order; tensors of the
    declared dtype, rank and static sizes, contiguous; scalars of the declared kind."""
    assert len(args) == len(prim_func.params), (len(args), [p.name for p in prim_func.params])
    for param, arg in zip(prim_func.params, args):
        buffer = prim_func.buffer_map.get(param)
        if buffer is None:  # a scalar
            assert isinstance(arg, float if "float" in str(param.dtype) else int) and not isinstance(arg, bool), (param.name, arg)
            continue
        assert isinstance(arg, torch.Tensor) and arg.is_contiguous(), buffer.name
        assert arg.dtype == TORCH_DTYPES[str(buffer.dtype)], (buffer.name, arg.dtype, buffer.dtype)
        assert arg.dim() == len(buffer.shape), (buffer.name, tuple(arg.shape), buffer.shape)
        for size, dim in zip(arg.shape, buffer.shape):
            if hasattr(dim, "value"):  # static; dynamic dims (Vars) take any size
                assert size == dim.value, (buffer.name, tuple(arg.shape), buffer.shape)


def _softplus_sqrt(logits):
    return torch.where(logits > 20, logits, torch.log1p(torch.exp(logits))).sqrt()


def _scaled(w, renormalize, scale):
    return (w / (w.sum(-1, keepdim=True) + 1e-20) if renormalize else w) * scale


def _stand_in(name, factory_args):
    """A torch model of kernel ``name``'s documented parameters and results."""
    renorm = factory_args[-1] if name.startswith("deepinfer_route") else None

    def compress_pool(kv, score, norm_weight, entries, eps):
        entries.copy_(ref_sparse.compress_pool(kv, score, norm_weight, eps))

    def route_topk(logits, bias, weights, ids, scale):
        s = _softplus_sqrt(logits)
        chosen = torch.sort(s + bias, dim=-1, descending=True, stable=True).indices[:, : ids.shape[1]]
        ids.copy_(chosen)
        weights.copy_(_scaled(s.gather(1, chosen), renorm, scale))

    def route_fixed(logits, fixed_ids, weights, scale):
        weights.copy_(_scaled(_softplus_sqrt(logits).gather(1, fixed_ids.long()), renorm, scale))

    def engram_hash(ngram_ids, multipliers, primes, offsets, ids, pad_id):
        ids.copy_(ref_engram.engram_hash_ids(ngram_ids, multipliers, primes, offsets, pad_id))

    def engram_gate(x, kv, q_weight, k_weight, out, eps):
        out.copy_(ref_engram.engram_gate(x, kv, q_weight, k_weight, eps))

    def write_records(values, slot_mapping, cache):
        keep = slot_mapping >= 0
        kv_record.write_records(cache.view(-1, kv_record.RECORD_BYTES), values[keep], slot_mapping[keep].long())

    fn = {"deepinfer_compress_pool": compress_pool, "deepinfer_route_topk": route_topk, "deepinfer_route_fixed": route_fixed,
          "deepinfer_engram_hash": engram_hash, "deepinfer_engram_gate": engram_gate, "deepinfer_write_records": write_records}[name]
    prim_func = KERNELS[name].build(*factory_args, target="ascend")

    def run(*args):
        _check_arguments(prim_func, args)
        fn(*args)

    return run


@pytest.fixture
def stand_ins(monkeypatch, tilelang_env):
    """ops.compiled answering with stand-ins; records which kernels the glue asked for."""
    asked = []

    def compiled(name, *args):
        asked.append((name, *args))
        return _stand_in(name, args)

    monkeypatch.setattr(ops, "compiled", compiled)
    return asked


def test_the_op_callables_keep_their_ops_signatures():
    from deepinfer_core.ops import reference_ops

    reference = reference_ops()
    for name, fn in ops.OPS.items():
        assert signature_problem(fn, reference[name]) is None, name


def test_op_table_is_empty_without_tilelang(monkeypatch, caplog):
    monkeypatch.setattr(ops, "unavailable_reason", lambda: "tilelang is not installed")
    assert ops.op_table() == {}
    assert "TileLang kernels off" in caplog.text
    monkeypatch.setattr(ops, "unavailable_reason", lambda: None)
    assert ops.op_table() == ops.OPS


@needs_tilelang
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compress_pool_glue(stand_ins, dtype):
    g = torch.Generator().manual_seed(0)
    for n, slots, channels in ((5, 8, 128), (2, 128, 512), (0, 8, 128), (4, 3, 24)):
        kv = torch.randn(n, slots, channels, generator=g).to(dtype)
        score = torch.randn(n, slots, channels, generator=g)
        score[:1, : slots // 2] = float("-inf")  # a sequence's first window
        weight = torch.rand(channels, generator=g) + 0.5
        out = ops.compress_pool(kv[:, :, :], score, weight, 1e-6)
        torch.testing.assert_close(out, ref_sparse.compress_pool(kv, score, weight, 1e-6), rtol=0, atol=0)
    dt = ops.DTYPE_NAMES[dtype]
    assert stand_ins == [("deepinfer_compress_pool", 8, 128, dt), ("deepinfer_compress_pool", 128, 512, dt)]  # not the empty / awkward ones


@needs_tilelang
@pytest.mark.parametrize("overlap, ratio, dim", [(True, 4, 512), (False, 128, 512)])
def test_compress_entries_glue(stand_ins, overlap, ratio, dim):
    """V4's compressor on the NPU: the reference's gather and RoPE around the pooling kernel, equal
    to the reference op bit for bit when the kernel pools as the reference does."""
    from deepinfer_core.conformance.inputs import make_case

    span = 2 * ratio if overlap else ratio
    dims = {"entries": 4, "tokens": 6, "state_rows": span + 4, "ratio": ratio, "overlap": overlap, "dim": dim,
            "rope_dim": 64, "col_offset": 0, "row_width": 4 * dim if overlap else 2 * dim, "first_windows": 1,
            "gappy_windows": 1, "rope": "v3_yarn", "max_positions": 4096}
    case = make_case("compress_entries", dims, torch.bfloat16, "cpu", seed=3)
    got = ops.compress_entries(*case.args)
    torch.testing.assert_close(got, ref_sparse.compress_entries(*case.args), rtol=0, atol=0)
    assert stand_ins == [("deepinfer_compress_pool", span, dim, "bfloat16")]


@needs_tilelang
@pytest.mark.parametrize("bias, fixed, renorm", [(True, False, True), (False, False, False), (False, True, True), (True, True, False)])
def test_route_glue(stand_ins, bias, fixed, renorm):
    g = torch.Generator().manual_seed(1)
    tokens, hidden, experts, k = 9, 64, 256, 6
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    w = (torch.randn(experts, hidden, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(experts, generator=g) * 0.1 if bias else None
    ids_in = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]) if fixed else None
    kw = dict(top_k=k, norm_topk_prob=renorm, routed_scaling_factor=1.5)
    weights, ids = ops.moe_route_sqrtsoftplus(x, w, b, ids_in, **kw)
    ref_w, ref_ids = ref_moe.moe_route_sqrtsoftplus(x, w, b, ids_in, **kw)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)  # the k slots' order is unspecified
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_w.gather(1, ref_order.indices), rtol=1e-5, atol=1e-5)
    assert stand_ins == [("deepinfer_route_fixed" if fixed else "deepinfer_route_topk", experts, k, renorm)]


@needs_tilelang
def test_engram_glue(stand_ins):
    from deepinfer_core.models.v41.engram_tables import engram_multipliers, engram_offsets, engram_primes

    g = torch.Generator().manual_seed(2)
    n, heads, vocab = 4, 8, 99092
    primes = torch.tensor(engram_primes(16000000, [1, 14], n, heads)[1])
    mult = torch.tensor(engram_multipliers(1, vocab, n))
    offsets = torch.tensor(engram_offsets(primes.tolist()))
    ngram = torch.randint(0, vocab, (13, n), generator=g)
    ngram[0, 1:] = -1  # a sequence's first token
    ids = ops.engram_hash_ids(ngram, mult, primes, offsets, 2)
    assert torch.equal(ids, ref_engram.engram_hash_ids(ngram, mult, primes, offsets, 2))
    x = torch.randn(5, 4, 4096, generator=g).to(torch.bfloat16)
    kv = torch.randn(5, 5 * 4096, generator=g).to(torch.bfloat16)
    qw, kw = (torch.rand(4, 4096, generator=g) + 0.5).to(torch.bfloat16), (torch.rand(4, 4096, generator=g) + 0.5).to(torch.bfloat16)
    torch.testing.assert_close(ops.engram_gate(x, kv, qw, kw, 1e-6), ref_engram.engram_gate(x, kv, qw, kw, 1e-6), rtol=0, atol=0)
    assert stand_ins == [("deepinfer_engram_hash", n, heads), ("deepinfer_engram_gate", 4, 4096, "bfloat16")]


@needs_tilelang
def test_write_cache_glue(stand_ins):
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 512, generator=g).to(torch.bfloat16)
    slots = torch.tensor([3, -1, 64, 127, 5, -1])
    cache, ref = torch.zeros(128, 584, dtype=torch.uint8), torch.zeros(128, 584, dtype=torch.uint8)
    ops.write_cache(cache, rows, slots)
    ref_sparse.write_cache(ref, rows, slots)
    assert torch.equal(cache, ref)
    plain, ref_plain = torch.zeros(4, 16, 8), torch.zeros(4, 16, 8)  # not a record cache: the reference's row copy
    values = torch.randn(3, 8, generator=g)
    ops.write_cache(plain, values, torch.tensor([0, 63, -1]))
    ref_sparse.write_cache(ref_plain, values, torch.tensor([0, 63, -1]))
    assert torch.equal(plain, ref_plain)
    assert stand_ins == [("deepinfer_write_records", "bfloat16")]


# ---- numerics of the shared source: the CUDA lowering on a GPU (not yet run) --------------------
def _cuda_inputs(name, g):
    """(factory args, the kernel's arguments on the GPU, the outputs to compare, the reference's)."""
    dev = "cuda"
    if name == "deepinfer_compress_pool":
        kv = torch.randn(37, 8, 512, generator=g).to(torch.bfloat16)
        score = torch.randn(37, 8, 512, generator=g)
        score[0, :4] = float("-inf")
        w = torch.rand(512, generator=g) + 0.5
        out = torch.empty(37, 512, dtype=torch.bfloat16, device=dev)
        ref = ref_sparse.compress_pool(kv, score, w, 1e-6)
        return (8, 512, "bfloat16"), (kv.to(dev), score.to(dev), w.to(dev), out, 1e-6), [out], [ref], 2e-2
    if name in ("deepinfer_route_topk", "deepinfer_route_fixed"):
        logits = torch.randn(70, 256, generator=g)
        bias = torch.randn(256, generator=g) * 0.1
        fixed = torch.stack([torch.randperm(256, generator=g)[:6] for _ in range(70)])
        s = _softplus_sqrt(logits)
        weights = torch.empty(70, 6, device=dev)
        if name == "deepinfer_route_fixed":
            ref = _scaled(s.gather(1, fixed), True, 2.5)
            return (256, 6, True), (logits.to(dev), fixed.int().to(dev), weights, 2.5), [weights], [ref], 1e-5
        ids = torch.empty(70, 6, dtype=torch.int32, device=dev)
        ref_ids = torch.sort(s + bias, -1, descending=True, stable=True).indices[:, :6]
        ref = _scaled(s.gather(1, ref_ids), True, 2.5)
        return (256, 6, True), (logits.to(dev), bias.to(dev), weights, ids, 2.5), [weights, ids], [ref, ref_ids.int()], 1e-5
    if name == "deepinfer_engram_hash":
        from deepinfer_core.models.v41.engram_tables import engram_multipliers, engram_offsets, engram_primes

        primes = torch.tensor(engram_primes(16000000, [1, 14], 4, 8)[1])
        mult, offsets = torch.tensor(engram_multipliers(1, 99092, 4)), torch.tensor(engram_offsets(primes.tolist()))
        ngram = torch.randint(0, 99092, (100, 4), generator=g)
        ngram[::7, 2:] = -1
        ids = torch.empty(100, 24, dtype=torch.int64, device=dev)
        ref = ref_engram.engram_hash_ids(ngram, mult, primes, offsets, 2)
        return (4, 8), (ngram.to(dev), mult.to(dev), primes.to(dev), offsets.to(dev), ids, 2), [ids], [ref], 0
    if name == "deepinfer_engram_gate":
        x = torch.randn(9, 4, 4096, generator=g).to(torch.bfloat16)
        kv = torch.randn(9, 5 * 4096, generator=g).to(torch.bfloat16)
        qw, kw = [(torch.rand(4, 4096, generator=g) + 0.5).to(torch.bfloat16) for _ in range(2)]
        out = torch.empty_like(x, device=dev)
        ref = ref_engram.engram_gate(x, kv, qw, kw, 1e-6)
        return (4, 4096, "bfloat16"), (x.to(dev), kv.to(dev), qw.to(dev), kw.to(dev), out, 1e-6), [out], [ref], 1.6e-2
    rows = torch.randn(20, 512, generator=g).to(torch.bfloat16)
    slots = torch.randperm(256, generator=g)[:20]
    slots[3] = -1
    ref = torch.zeros(256, 584, dtype=torch.uint8)
    ref_sparse.write_cache(ref, rows, slots)
    cache = torch.zeros(4, 64 * 584, dtype=torch.uint8, device=dev)
    return ("bfloat16",), (rows.to(dev), slots.int().to(dev), cache), [cache], [ref.view(4, -1)], 0


@pytest.mark.gpu
@needs_tilelang
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_cuda_lowering_matches_the_reference(name, tilelang_env):
    import tilelang

    g = torch.Generator().manual_seed(4)
    factory_args, args, outs, refs, tol = _cuda_inputs(name, g)
    kernel = tilelang.compile(KERNELS[name].build(*factory_args, target="cuda"), target="cuda")
    kernel(*args)
    torch.cuda.synchronize()
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol)


# ---- on an Ascend 950: the op callables against the reference (not yet run) ----------------------
@pytest.mark.npu
@needs_tilelang
@pytest.mark.parametrize("op", sorted(ops.OPS))
def test_op_on_the_npu_matches_the_reference(op):
    import torch_npu  # noqa: F401 - only on the Ascend machine (registers the npu device)

    if not torch.npu.is_available():
        pytest.skip("no NPU visible")
    g = torch.Generator().manual_seed(5)
    dev = "npu"
    if op == "compress_pool":
        kv, score, w = torch.randn(37, 8, 512, generator=g).to(torch.bfloat16), torch.randn(37, 8, 512, generator=g), torch.rand(512, generator=g) + 0.5
        got = ops.compress_pool(kv.to(dev), score.to(dev), w.to(dev), 1e-6).cpu()
        torch.testing.assert_close(got, ref_sparse.compress_pool(kv, score, w, 1e-6), rtol=2e-2, atol=2e-2)
    elif op == "moe_route_sqrtsoftplus":
        x, w, b = torch.randn(33, 4096, generator=g).to(torch.bfloat16), (torch.randn(256, 4096, generator=g) * 0.02).to(torch.bfloat16), torch.randn(256, generator=g) * 0.1
        kw = dict(top_k=6, norm_topk_prob=True, routed_scaling_factor=1.5)
        weights, ids = ops.moe_route_sqrtsoftplus(x.to(dev), w.to(dev), b.to(dev), None, **kw)
        ref_w, ref_ids = ref_moe.moe_route_sqrtsoftplus(x, w, b, None, **kw)
        assert torch.equal(ids.cpu().sort(-1).values, ref_ids.sort(-1).values)
        torch.testing.assert_close(weights.cpu().sort(-1).values, ref_w.sort(-1).values, rtol=1e-5, atol=1e-5)
    elif op == "engram_hash_ids":
        from deepinfer_core.models.v41.engram_tables import engram_multipliers, engram_offsets, engram_primes

        primes = torch.tensor(engram_primes(16000000, [1, 14], 4, 8)[1])
        mult, offsets = torch.tensor(engram_multipliers(1, 99092, 4)), torch.tensor(engram_offsets(primes.tolist()))
        ngram = torch.randint(0, 99092, (100, 4), generator=g)
        got = ops.engram_hash_ids(ngram.to(dev), mult.to(dev), primes.to(dev), offsets.to(dev), 2).cpu()
        assert torch.equal(got, ref_engram.engram_hash_ids(ngram, mult, primes, offsets, 2))
    elif op == "engram_gate":
        x, kv = torch.randn(9, 4, 4096, generator=g).to(torch.bfloat16), torch.randn(9, 5 * 4096, generator=g).to(torch.bfloat16)
        qw, kw = [(torch.rand(4, 4096, generator=g) + 0.5).to(torch.bfloat16) for _ in range(2)]
        got = ops.engram_gate(x.to(dev), kv.to(dev), qw.to(dev), kw.to(dev), 1e-6).cpu()
        torch.testing.assert_close(got, ref_engram.engram_gate(x, kv, qw, kw, 1e-6), rtol=1.6e-2, atol=1.6e-2)
    else:
        rows, slots = torch.randn(20, 512, generator=g).to(torch.bfloat16), torch.randperm(256, generator=g)[:20]
        ref, cache = torch.zeros(256, 584, dtype=torch.uint8), torch.zeros(256, 584, dtype=torch.uint8, device=dev)
        ops.write_cache(cache, rows.to(dev), slots.to(dev))
        ref_sparse.write_cache(ref, rows, slots)
        assert torch.equal(cache.cpu(), ref)
