"""The NVIDIA backend's whole op table driving the engine end to end, against the reference.

Without a GPU the kernels run in Triton's interpreter on the CPU (float32, tiny checkpoints), so
CI checks how the kernels fit the model (views, strides, packing of prefill and decode tokens,
FP8 weights kept quantised) before any GPU is involved. With a GPU, tests/test_gpu.py does the
same through the real plugin.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.ops import REFERENCE_OPS, V4_OP_NAMES, OpTable, reference_ops
from tests.hf_checkpoints import write_checkpoint

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the NVIDIA kernels cannot run")

PROMPTS = [[5, 17, 42, 99, 3, 64, 7], [11, 12], [150, 2, 2, 8, 33, 41, 90, 100, 120, 7, 6, 5, 4]]
# Logprob bound of both tests: float32 throughout, FP8 weights widened exactly (W8A16), so only the
# kernels' summation order differs from the reference: worst 5.0e-6 (greedy decode) and 6.7e-6
# (FP8 prompt logprobs, down to -16) measured; a 1% error in the FP8 weight scales moves them by ~1.5.
LOGPROB_ATOL = 1e-4
# kv_cache_dtype="fp8": the kernels' float32 summation order moves a layer's output by ~1e-7, and the
# next layers' key rows with it; a value that lands next to an e4m3 rounding boundary then rounds the
# other way, a whole e4m3 step (2^-4 relative). Measured: record kernels 2.5e-3 from the reference
# (the float kernel over the same records dequantised: the same 2.5e-3; float32 KV: 4.3e-6).
FP8_KV_LOGPROB_ATOL = 1e-2


@pytest.fixture
def use_kernels(monkeypatch, device):
    """use_kernels(fp8, fp4, only): from then on, engines built for accelerator="cpu" get the NVIDIA
    op table (interpreted on the CPU), on a platform that keeps FP8 weights when ``fp8`` and MXFP4
    experts packed when ``fp4``; with ``only`` (op names), just those ops of it, the reference's
    for the rest."""
    if device.type != "cpu":
        pytest.skip("on a GPU the real plugin is tested end to end by tests/test_gpu.py")
    import deepinfer_core.plugins as plugins

    original = plugins.load_backend

    def enable(fp8: bool = False, fp4: bool = False, only: tuple[str, ...] | None = None) -> None:
        def load_backend(requested=None, model_config=None, batch_invariant=False):
            from deepinfer_nvidia_sm100 import backend as nvidia

            manager, backend, platform, _, limits = original("cpu", model_config, batch_invariant)
            platform.fp8_weights = fp8
            platform.fp4_experts = fp4
            impls = nvidia.deepinfer_ops(platform=platform, model_config=model_config, batch_invariant=batch_invariant)  # the plugin's own table
            if only is not None:
                impls = {op: impls[op] for op in only}
            providers = {**dict.fromkeys(REFERENCE_OPS, "reference"), **dict.fromkeys(impls, "nvidia")}
            fallback = reference_ops(batch_invariant)  # V4 ops: reference
            return manager, backend, platform, OpTable({**fallback, **impls}, providers, batch_invariant), limits

        monkeypatch.setattr(plugins, "load_backend", load_backend)

    return enable


def assert_same_greedy(expected, got, atol: float = LOGPROB_ATOL) -> None:
    """The same tokens, and logprobs within ``atol``, request by request."""
    for a, b in zip(expected, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and all(abs(la[t] - lb[t]) <= atol for t in la), (la, lb)


def reference_then_kernels(tmp_path, use_kernels, name: str, params: SamplingParams):
    """(the CPU reference's outputs of PROMPTS on checkpoint ``name``, an LLM on the kernels with a
    16-token budget: chunked prefill beside decodes)."""
    path = tmp_path / "ckpt"
    write_checkpoint(name, path)
    expected = LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False).generate(PROMPTS, params, use_tqdm=False)
    use_kernels()
    return expected, LLM(model=str(path), accelerator="cpu", dtype="float32", max_num_batched_tokens=16, progress=False)


def test_greedy_generation_matches_reference(tmp_path, use_kernels):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    expected, llm = reference_then_kernels(tmp_path, use_kernels, "v3_grouped", params)
    assert {p for op, p in llm.engine.ops.providers.items() if op not in V4_OP_NAMES} == {"nvidia"}
    assert llm.engine.ops.backend_provides("norm_rope_write_latent")  # the attention takes the fused path
    got = llm.generate(PROMPTS, params, use_tqdm=False)  # 16-token budget: chunked prefill beside decodes
    assert_same_greedy(expected, got)


def test_fp8_checkpoint_kept_quantised(tmp_path, use_kernels):
    """Partial 32x32 FP8 blocks kept as FP8 through fp8_block_linear and the FP8 expert GEMMs:
    teacher-forced log-probabilities close to the reference's dequantised float32 model."""
    path = tmp_path / "fp8"
    write_checkpoint("v3_fp8", path)
    texts = [p + [9, 10, 11] for p in PROMPTS]
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    expected = LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False).generate(texts, score, use_tqdm=False)
    use_kernels(fp8=True)
    llm = LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False)
    assert llm.engine.model.keep_fp8
    got = llm.generate(texts, score, use_tqdm=False)
    for a, b, ids in zip(expected, got, texts):
        for pos in range(1, len(ids)):
            ref_lp, lp = a.prompt_logprobs[pos][ids[pos]], b.prompt_logprobs[pos][ids[pos]]
            assert abs(ref_lp - lp) <= LOGPROB_ATOL, (pos, ref_lp, lp)


def test_batch_invariant_kernels_drive_the_engine(tmp_path, use_kernels):
    """The NVIDIA batch-invariant table end to end: prompts computed as rows through the decode
    kernel (no KV split), one GEMM tile for every batch, full-sort sampling; greedy tokens and
    logprobs as the reference's batch-invariant engine gives them, with chunked prefill and
    preemptions. (Bitwise invariance is the GPU test's: the interpreter's dots are numpy's.)"""
    path = tmp_path / "fp8"
    write_checkpoint("v3_fp8", path)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    kw = dict(model=str(path), accelerator="cpu", dtype="float32", progress=False, batch_invariant=True)
    expected = LLM(**kw).generate(PROMPTS, params, use_tqdm=False)
    use_kernels(fp8=True)
    llm = LLM(max_num_batched_tokens=8, num_kv_blocks=3, block_size=8, **kw)
    assert llm.engine.ops.batch_invariant and llm.engine.model.keep_fp8
    assert {op for op, impl in llm.engine.ops.implementations.items() if "batch-invariant" in impl} >= {
        "linear", "fp8_block_linear", "head_linear", "mla_decode_attention", "moe_route", "moe_experts", "sample_tokens"}
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    assert_same_greedy(expected, got)


def test_shared_experts_in_the_grouped_pass_drive_the_engine(tmp_path, use_kernels, monkeypatch):
    """The shared experts appended to the routed ones (MoE.fuse_shared), for every batch of this
    run (prompt chunks and decodes up to 16 tokens): the same greedy tokens and logprobs as the
    reference. The shipped hint names bf16 only, so float32 is added here."""
    import torch
    from deepinfer_nvidia_sm100.kernels import moe as kmoe

    monkeypatch.setattr(kmoe.moe_experts, "shared_expert_max_tokens", {torch.float32: 16})
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    expected, llm = reference_then_kernels(tmp_path, use_kernels, "v3_shared2", params)
    moe = [layer.mlp for layer in llm.engine.model.model.layers if hasattr(layer.mlp, "with_shared")]
    assert moe and all(m.with_shared is not None for m in moe)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_same_greedy(expected, got)


@pytest.mark.parametrize("name", ["v4_flash_like", "v4_swa_nohash", "v41-tiny", "v4_flash_like+fp4"])
def test_v4_kernels_drive_the_engine(tmp_path, use_kernels, name):
    """DeepSeek-V4 and V4.1 on the plugin's table (its V4 kernels, the reference for the ops it
    leaves to it) give the CPU reference's greedy tokens, through chunked prefill beside decodes;
    "+fp4": MXFP4 experts kept packed through the W4A16 kernel, against the reference's dequantised ones."""
    from deepinfer_nvidia_sm100 import backend as nvidia
    from tests.hf_checkpoints_v4 import write_checkpoint_v4
    from tests.v41_checkpoints import write_checkpoint_v41

    name, fp4 = name.removesuffix("+fp4"), name.endswith("+fp4")
    path = tmp_path / name
    if name.startswith("v41"):
        write_checkpoint_v41(name, path)
    else:
        write_checkpoint_v4(name, path, quant="fp8+fp4" if fp4 else None, block=(32, 32))
    prompts = [[(7 * i + 3) % 150 + 2 for i in range(n)] for n in (40, 9)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    # the same 16-token budget on both sides: V4.1's bounded replay approximates by chunk
    expected = LLM(model=str(path), accelerator="cpu", dtype="float32", max_num_batched_tokens=16,
                   progress=False).generate(prompts, params, use_tqdm=False)
    use_kernels(fp4=fp4)
    llm = LLM(model=str(path), accelerator="cpu", dtype="float32", max_num_batched_tokens=16, progress=False)
    ours = {op for op, p in llm.engine.ops.providers.items() if p == "nvidia"}
    assert ours == set(REFERENCE_OPS) - nvidia.LEFT_TO_REFERENCE
    experts = llm.engine.model.model.layers[0].mlp.experts.gate_up_proj
    assert experts.dtype == (torch.uint8 if fp4 else torch.float32)
    assert_same_greedy(expected, llm.generate(prompts, params, use_tqdm=False))


def test_fp8_kv_record_kernels_drive_the_engine(tmp_path, use_kernels):
    """kv_cache_dtype="fp8" on a tiny V4 with V4's real 512-wide key rows, the record kernels in
    the reference's table (the other kernels see no records; the whole table in the interpreter
    would take ~45 s): write_cache alone gives the reference's very logprobs (every record it
    writes, into the window ring, the compressed caches and this step's pool, is the reference's
    bytes); with sparse_attention too, the same greedy tokens, logprobs within FP8_KV_LOGPROB_ATOL."""
    from tests.hf_checkpoints_v4 import write_checkpoint_v4

    path = tmp_path / "v4"
    write_checkpoint_v4("v4_flash_like", path, head_dim=512, qk_rope_head_dim=64, index_head_dim=64)
    prompts = [[(7 * i + 3) % 150 + 2 for i in range(n)] for n in (40, 9)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    # 32 blocks of 16 tokens hold both requests: an interpreted launch copies the whole cache in and out
    kw = dict(model=str(path), accelerator="cpu", dtype="float32", max_num_batched_tokens=16, num_kv_blocks=32,
              progress=False, kv_cache_dtype="fp8")
    expected = LLM(**kw).generate(prompts, params, use_tqdm=False)
    for only, atol in ((("write_cache",), 0.0), (("write_cache", "sparse_attention"), FP8_KV_LOGPROB_ATOL)):
        use_kernels(only=only)
        llm = LLM(**kw)
        assert {op for op, p in llm.engine.ops.providers.items() if p == "nvidia"} == set(only)
        assert {g.name: g.dtype for g in llm.engine.cache_groups}["window"] == torch.uint8
        assert_same_greedy(expected, llm.generate(prompts, params, use_tqdm=False), atol)
