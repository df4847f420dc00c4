"""On an NVIDIA GPU, end to end: the nvidia backend (Triton kernels, CUDA graphs, FP8 GEMMs) gives
the CPU reference's results on tiny checkpoints. Skipped without a GPU (see conftest.py); the
op-by-op checks are in tests/nvidia/."""

from __future__ import annotations

import pytest

from deepinfer_core import LLM, SamplingParams
from tests.hf_checkpoints import write_checkpoint

pytestmark = pytest.mark.gpu

# Each engine's share of the GPU: the tests run in parallel workers on one device (tools/gpu_session.sh),
# and at the default 0.9 the first engine's KV cache left the others none.
GPU_SHARE = 0.05

PROMPTS = [[5, 17, 42, 99, 3, 64, 7], [11, 12], [150, 2, 2, 8, 33, 41, 90, 100, 120, 7, 6, 5, 4]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "ckpt"
    write_checkpoint("v3_grouped", path)
    return path


def test_nvidia_backend_matches_cpu_reference(checkpoint):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    cpu = LLM(model=str(checkpoint), accelerator="cpu", dtype="float32", progress=False).generate(PROMPTS, params, use_tqdm=False)
    gpu_llm = LLM(model=str(checkpoint), accelerator="nvidia", gpu_memory_utilization=GPU_SHARE, dtype="float32", progress=False)
    assert gpu_llm.engine.platform.name in ("nvidia-sm90", "nvidia-sm100")
    assert gpu_llm.engine.device.type == "cuda"
    _assert_same_greedy(cpu, gpu_llm.generate(PROMPTS, params, use_tqdm=False), 1e-3)  # TF32/cuBLAS vs CPU float32


def _assert_same_greedy(cpu, gpu, atol: float) -> None:
    """The same greedy tokens, and every logprob of the CPU run within ``atol`` on the GPU."""
    for a, b in zip(cpu, gpu):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t, v in la.items():
                assert abs(v - lb[t]) < atol


@pytest.mark.parametrize("name", ["v3_shared2", "v2_greedy"])
def test_shared_experts_in_the_grouped_pass_match_cpu_reference(tmp_path, monkeypatch, name):
    """MoE.fuse_shared on the compiled kernels, CUDA graphs on: float32 (the shipped hint names
    bf16 only, so float32 is added here) against the CPU reference, and bf16 fused against bf16
    apart (hint emptied) on the same prompts."""
    import torch
    from deepinfer_nvidia_sm100.kernels import moe as kmoe

    path = tmp_path / "ckpt"
    write_checkpoint(name, path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    cpu = LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False).generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.setattr(kmoe.moe_experts, "shared_expert_max_tokens", {**kmoe.SHARED_EXPERT_MAX_TOKENS, torch.float32: 16})
    runs = {}
    for dtype, hint in (("float32", None), ("bfloat16", None), ("bfloat16", {})):
        if hint is not None:
            monkeypatch.setattr(kmoe.moe_experts, "shared_expert_max_tokens", hint)
        llm = LLM(model=str(path), accelerator="nvidia", gpu_memory_utilization=GPU_SHARE, dtype=dtype, progress=False)
        moe = [layer.mlp for layer in llm.engine.model.model.layers if hasattr(layer.mlp, "with_shared")]
        assert moe and all((m.with_shared is not None) == (hint is None) for m in moe)
        runs[dtype, hint is None] = llm.generate(PROMPTS, params, use_tqdm=False)
    _assert_same_greedy(cpu, runs["float32", True], 1e-3)
    for a, b in zip(runs["bfloat16", False], runs["bfloat16", True]):  # bf16 rounding apart: logprobs, first token
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert all(abs(v - lb[t]) < 5e-2 for t, v in la.items() if t in lb)


def test_nvidia_backend_runs_bf16_and_sampling(checkpoint):
    llm = LLM(model=str(checkpoint), accelerator="nvidia", gpu_memory_utilization=GPU_SHARE, dtype="bfloat16", progress=False)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True, n=2)
    a = llm.generate(PROMPTS, params, use_tqdm=False)
    b = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    assert all(len(c.token_ids) == 16 for o in a for c in o.outputs)


def test_default_model_on_gpu():
    llm = LLM(accelerator="nvidia", gpu_memory_utilization=GPU_SHARE, progress=False)
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert out.outputs[0].token_ids and out.outputs[0].finish_reason in ("stop", "length")


def test_decode_graphs_match_eager(checkpoint):
    """CUDA-graph replay (padded to a batch bucket) computes what the eager steps compute."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    runs = {}
    for eager in (True, False):
        llm = LLM(model=str(checkpoint), accelerator="nvidia", gpu_memory_utilization=GPU_SHARE, dtype="float32", enforce_eager=eager, progress=False)
        assert (llm.engine.runner.graphs is None) == eager
        runs[eager] = llm.generate(PROMPTS, params, use_tqdm=False)
        if not eager:
            assert llm.engine.runner.graphs.graphs, "no decode step was replayed from a graph"
    for a, b in zip(runs[True], runs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and all(abs(la[t] - lb[t]) < 1e-4 for t in la)


def test_fp8_checkpoint_kept_fp8_matches_cpu_dequantised(tmp_path):
    """A block-FP8 checkpoint (partial 32x32 blocks) stays FP8 on the GPU (FP8 GEMMs and FP8
    expert GEMMs); teacher-forced log-probabilities stay close to the CPU reference, which
    dequantises the weights. Both in float32, so that the difference is the FP8 path's alone."""
    path = tmp_path / "fp8"
    write_checkpoint("v3_fp8", path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cpu_llm = LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False)
    texts = [p + o.outputs[0].token_ids for p, o in zip(PROMPTS, cpu_llm.generate(PROMPTS, params, use_tqdm=False))]
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    gpu_llm = LLM(model=str(path), accelerator="nvidia", gpu_memory_utilization=GPU_SHARE, dtype="float32", progress=False)
    assert gpu_llm.engine.model.keep_fp8
    cpu = cpu_llm.generate(texts, score, use_tqdm=False)
    gpu = gpu_llm.generate(texts, score, use_tqdm=False)
    for a, b, ids in zip(cpu, gpu, texts):
        for pos in range(1, len(ids)):
            ref, got = a.prompt_logprobs[pos][ids[pos]], b.prompt_logprobs[pos][ids[pos]]
            assert abs(ref - got) <= 0.02 + 0.01 * abs(ref), (pos, ref, got)


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_engine_core_on_gpu_emits_what_plain_synchronous_decoding_does(checkpoint, monkeypatch):
    """On the GPU the engine overlaps steps (sampled ids stay on the device), captures graphs at
    start-up, shares cached prefixes and verifies n-gram drafts through (batch, 1 + k) graphs: each
    gives what synchronous, uncached, non-speculative decoding gives (greedy, seeded sampling)."""
    shared = list(range(40, 80))
    prompts = [shared + p for p in PROMPTS]
    cases = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True, n=2)]
    monkeypatch.setenv("DEEPINFER_ASYNC_SCHEDULING", "0")
    plain = LLM(model=str(checkpoint), accelerator="nvidia", gpu_memory_utilization=GPU_SHARE, dtype="float32", enable_prefix_caching=False, progress=False)
    monkeypatch.delenv("DEEPINFER_ASYNC_SCHEDULING")
    core = LLM(model=str(checkpoint), accelerator="nvidia", gpu_memory_utilization=GPU_SHARE, dtype="float32", progress=False)
    spec = LLM(model=str(checkpoint), accelerator="nvidia", gpu_memory_utilization=GPU_SHARE, dtype="float32", progress=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    assert core.engine.async_scheduling and not plain.engine.async_scheduling
    assert core.engine.runner.graphs.graphs and (1, 4) in spec.engine.runner.graphs.graphs
    for params in cases:
        expected = _tokens(plain.generate(prompts, params, use_tqdm=False))
        assert _tokens(core.generate(prompts, params, use_tqdm=False)) == expected
        again = core.generate(prompts, params, use_tqdm=False)
        assert _tokens(again) == expected and all(o.num_cached_tokens >= 32 for o in again)
        assert _tokens(spec.generate(prompts, params, use_tqdm=False)) == expected
    assert spec.engine.num_draft_tokens > 0


@pytest.mark.parametrize("quant", [None, "fp8+fp4"])
def test_v4_nvidia_matches_cpu_reference(tmp_path, quant):
    """DeepSeek-V4 on the nvidia backend (its kernels where it has them, reference ops on the GPU
    elsewhere; FP8 linears kept FP8 when quantised) gives the CPU reference's greedy tokens."""
    from tests.hf_checkpoints_v4 import write_checkpoint_v4

    path = tmp_path / "v4"
    write_checkpoint_v4("v4_flash_like", path, quant=quant, block=(32, 32))  # FP8 kernels need blocks >= 32
    prompts = [[(7 * i + 3) % 150 + 2 for i in range(n)] for n in (70, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    cpu = LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False).generate(prompts, params, use_tqdm=False)
    gpu_llm = LLM(model=str(path), accelerator="nvidia", gpu_memory_utilization=GPU_SHARE, dtype="float32", progress=False)
    assert gpu_llm.engine.device.type == "cuda"
    # FP8 kept FP8 on the GPU (its GEMMs) against weights dequantised on the CPU
    _assert_same_greedy(cpu, gpu_llm.generate(prompts, params, use_tqdm=False), 2e-2 if quant else 1e-3)


@pytest.mark.parametrize("name", ["v41-tiny", "v41-sources"])
def test_v41_nvidia_matches_cpu_reference(tmp_path, name):
    """DeepSeek-V4.1 (original layout, FP8 32x32 + MXFP4; bounded replay on, its default) on the
    nvidia backend gives the CPU reference's greedy tokens."""
    from tests.v41_checkpoints import write_checkpoint_v41

    path = write_checkpoint_v41(name, tmp_path / name)
    prompts = [[(7 * i + 3) % 1990 + 3 for i in range(n)] for n in (70, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    cpu = LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False).generate(prompts, params, use_tqdm=False)
    gpu_llm = LLM(model=str(path), accelerator="nvidia", gpu_memory_utilization=GPU_SHARE, dtype="float32", progress=False)
    assert gpu_llm.engine.device.type == "cuda"
    _assert_same_greedy(cpu, gpu_llm.generate(prompts, params, use_tqdm=False), 2e-2)


def test_mtp_on_gpu_emits_what_plain_decoding_does():
    """The default model's MTP drafts on the nvidia backend (verification rows through the (batch,
    1 + k) graphs, the MTP module's decode rows through its own graphs, drafts sampled by the
    backend's sampling kernel): greedy and
    seeded (coupled) tokens equal plain decoding's, and drafts are accepted."""
    code = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n", "for i in range(10):\n    print(i)\n", "import os\n"]
    cases = [SamplingParams(temperature=0, max_tokens=32), SamplingParams(temperature=0.7, seed=5, max_tokens=32, n=2)]
    plain = LLM(accelerator="nvidia", gpu_memory_utilization=GPU_SHARE, dtype="float32", progress=False, enable_prefix_caching=False)
    spec = LLM(accelerator="nvidia", gpu_memory_utilization=GPU_SHARE, dtype="float32", progress=False, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    assert (1, 4) in spec.engine.runner.graphs.graphs and (1, 4) in spec.engine.proposer.graphs.graphs
    for params in cases:
        assert _tokens(spec.generate(code, params, use_tqdm=False)) == _tokens(plain.generate(code, params, use_tqdm=False))
    assert spec.engine.spec_stats.acceptance_by_position[0] > 0.3


def _bitwise(outs) -> list:
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("name", ["v3_grouped", "v3_fp8"])
def test_batch_invariant_mode_on_gpu_is_bitwise_in_any_batch_and_after_preemption(tmp_path, name):
    """bfloat16 on the nvidia backend's batch-invariant table (decode graphs on, overlapped steps):
    a greedy and a seeded request give the same tokens and every logprob bit alone, beside 1..15
    random neighbours, and when a tight cache preempts and recomputes them."""
    import random

    path = tmp_path / name
    write_checkpoint(name, path)
    kw = dict(model=str(path), accelerator="nvidia", gpu_memory_utilization=GPU_SHARE, dtype="bfloat16", progress=False, batch_invariant=True)
    llm = LLM(**kw)
    assert llm.engine.ops.batch_invariant and llm.engine.runner.graphs.graphs and llm.engine.async_scheduling
    rng = random.Random(0)
    target = [rng.randrange(2, 150) for _ in range(37)]
    cases = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=0.9, top_p=0.8, seed=11, max_tokens=16, ignore_eos=True, logprobs=2)]
    for params in cases:
        alone = _bitwise(llm.generate([target], params, use_tqdm=False))[0]
        for size in (2, 3, 5, 8, 13, 16):
            others = [target[: rng.randint(0, 30)] + [rng.randrange(2, 150) for _ in range(rng.randint(1, 60))] for _ in range(size - 1)]
            where = rng.randrange(size)
            neighbours = [SamplingParams(temperature=rng.choice([0, 1.0]), top_k=rng.choice([0, 5]), seed=rng.randrange(99),
                                         max_tokens=rng.randint(1, 20), ignore_eos=True) for _ in others]
            outs = llm.generate(others[:where] + [target] + others[where:], neighbours[:where] + [params] + neighbours[where:],
                                use_tqdm=False)
            assert _bitwise([outs[where]])[0] == alone, (size, params.temperature)
    prompts = [[rng.randrange(2, 150) for _ in range(rng.randint(5, 40))] for _ in range(24)]
    big = _bitwise(llm.generate(prompts, cases[0], use_tqdm=False))
    tight = LLM(num_kv_blocks=6, max_model_len=64, **kw)
    assert _bitwise(tight.generate(prompts, cases[0], use_tqdm=False)) == big
    assert tight.engine.num_preemptions > 0


def test_kv_tiers_on_gpu_give_what_recomputing_gives(checkpoint):
    """Multi-turn conversations through a device pool too small for them, with a host tier whose
    copies run on their own stream, overlapping the step in flight (overlapped steps, decode graphs
    on): every turn gives the tokens and logprobs of the same pool without tiers (which recomputes
    the evicted prefixes), and the host tier served some of them."""
    import random

    rng = random.Random(3)
    kw = dict(model=str(checkpoint), accelerator="nvidia", gpu_memory_utilization=GPU_SHARE, dtype="float32", progress=False,
              block_size=64, num_kv_blocks=12, max_model_len=256, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    plain, tiered = LLM(**kw), LLM(kv_offload_gb=0.05, **kw)
    assert tiered.engine.async_scheduling and tiered.engine.kv.tiers.stream is not None
    conversations = [[rng.randrange(2, 150) for _ in range(70)] for _ in range(8)]
    for _ in range(3):
        want = plain.generate(conversations, params, use_tqdm=False)
        _assert_same_greedy(want, tiered.generate(conversations, params, use_tqdm=False), 1e-3)
        conversations = [c + o.outputs[0].token_ids + [rng.randrange(2, 150) for _ in range(30)] for c, o in zip(conversations, want)]
    assert tiered.engine.gauges()["prefix_hit_tokens_host"] > 0
