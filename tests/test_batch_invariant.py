"""Batch-invariant inference (``LLM(batch_invariant=True)``) and deterministic sampling on the CPU
reference: a request's tokens and logprobs are bitwise the same whatever batch it runs in,
whatever its prompt's chunking, and whether or not it was preempted and recomputed; a seeded
request draws the same tokens alone, in any batch, in any order, after a preemption and from the
prefix cache, and another seed draws others."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError
from deepinfer_core.conformance.checkpoints import quantize_fp8_block
from deepinfer_core.hookspecs import SPEC_VERSION, BackendInfo, ProbeResult, hookimpl
from deepinfer_core.ops import REFERENCE_OPS, invariant
from deepinfer_core.platform import Platform
from deepinfer_core.plugins import BackendError, PluginManager
from tests.hf_checkpoints import write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(n: int, seed: int, low: int = 3, high: int = 30) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghij (){}:=\n") for _ in range(rng.randint(low, high))) for _ in range(n)]


def _logprobs(out) -> list[list[tuple[int, float]]]:
    """Every generated token's full logprob dict, in order: the bits that must not move."""
    return [sorted(d.items()) for d in out.outputs[0].logprobs]


# ---- the ops --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n", [(256, 4096), (64, 96), (576, 7168), (1536, 3072)])
def test_invariant_products_give_a_row_the_same_bits_in_any_batch(dtype, k, n):
    """Rows taken from anywhere in a batch of 37, alone or with other rows around them: the same
    bits as in the whole batch. The plain reference product does differ (else this proves nothing)."""
    gen = torch.Generator().manual_seed(k + n)
    x = torch.randn(37, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    whole = invariant.linear(x, w)
    for rows in ([5], [0, 36], list(range(3, 20)), [30, 2, 11, 7, 8, 9, 10, 1, 0]):
        assert torch.equal(invariant.linear(x[rows], w), whole[rows]), rows
    if dtype == torch.float32:
        assert not torch.equal(F.linear(x[5:6], w), F.linear(x, w)[5:6])  # one row alone vs 37: MKL differs
    wh = torch.randn(4, 24, k // 4, generator=gen).to(dtype)
    xh = torch.randn(37, 4, k // 4, generator=gen).to(dtype)
    assert torch.equal(invariant.head_linear(xh[[4, 9, 33]], wh), invariant.head_linear(xh, wh)[[4, 9, 33]])


def test_transcendentals_run_one_token_per_call():
    """torch's vectorised loop and its scalar tail round sigmoid and SiLU differently; which one an
    element gets follows its place in the flattened tensor (and, on two threads, where torch cuts
    the work: the plain SwiGLU gave one row of 301 other bits in a standalone run here, not under
    pytest). The plain sigmoid differs from its rows alone; the batch-invariant SwiGLU does not."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 8, generator=gen)
    assert any(not torch.equal(logits[i : i + 1].clone().sigmoid(), logits.sigmoid()[i : i + 1]) for i in range(40))
    x = torch.randn(301, 2 * 700, generator=gen)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plain, ours = REFERENCE_OPS["silu_and_mul"](x), invariant.silu_and_mul(x)
        assert all(torch.equal(invariant.silu_and_mul(x[i : i + 1].clone()), ours[i : i + 1]) for i in range(301))
    finally:
        torch.set_num_threads(saved)
    torch.testing.assert_close(ours, plain, atol=1e-6, rtol=1e-6)


def test_invariant_moe_and_fp8_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(0)
    t, d, e, i, k = 29, 64, 8, 32, 2
    x = torch.randn(t, d, generator=gen)
    gate = torch.randn(e, d, generator=gen) / 8
    bias = torch.randn(e, generator=gen) * 0.1
    route = dict(top_k=k, scoring_func="sigmoid", topk_method="noaux_tc", n_group=2, topk_group=1, norm_topk_prob=True,
                 routed_scaling_factor=2.5)
    weights, ids = invariant.moe_route(x, gate, bias, **route)
    w13, w2 = torch.randn(e, 2 * i, d, generator=gen) / 8, torch.randn(e, d, i, generator=gen) / 6
    out = invariant.moe_experts(x, w13, w2, weights, ids)
    q, s = quantize_fp8_block(torch.randn(48, d, generator=gen) / 8, (16, 32))
    fp8 = invariant.fp8_block_linear(x, q, s, (16, 32))
    for rows in ([3], [28, 0, 14], list(range(10, 29))):
        w_sub, ids_sub = invariant.moe_route(x[rows], gate, bias, **route)
        assert torch.equal(w_sub, weights[rows]) and torch.equal(ids_sub, ids[rows])
        assert torch.equal(invariant.moe_experts(x[rows], w13, w2, w_sub, ids_sub), out[rows])
        assert torch.equal(invariant.fp8_block_linear(x[rows], q, s, (16, 32)), fp8[rows])
    # and they are the reference ops, within float32 rounding
    torch.testing.assert_close(out, REFERENCE_OPS["moe_experts"](x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fp8, REFERENCE_OPS["fp8_block_linear"](x, q, s, (16, 32)), atol=1e-5, rtol=1e-5)


# ---- the engine -----------------------------------------------------------------------------------
def test_preemption_and_recompute_change_no_bit_in_batch_invariant_mode():
    """The issue's case: bfloat16, 160 prompts in a 4-block KV cache (every sequence preempted
    and recomputed, through prefill, many times) against a large cache. Normal mode computes a
    recomputed token through the prefill path and differs; batch-invariant mode does not."""
    prompts = _prompts(160, seed=0)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)

    def diffs(batch_invariant: bool) -> tuple[int, int]:
        kw = dict(accelerator="cpu", dtype="bfloat16", progress=False, batch_invariant=batch_invariant, enable_prefix_caching=False)
        big = LLM(**kw).generate(prompts, params, use_tqdm=False)
        tight = LLM(num_kv_blocks=4, max_model_len=64, **kw)
        small = tight.generate(prompts, params, use_tqdm=False)
        assert tight.engine.num_preemptions > 50
        tokens = sum(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(big, small))
        logprobs = sum(_logprobs(a) != _logprobs(b) for a, b in zip(big, small))
        return tokens, logprobs

    assert diffs(batch_invariant=True) == (0, 0)
    assert diffs(batch_invariant=False)[1] > 0  # the same comparison can fail


@pytest.fixture(scope="module")
def moe_fp8(tmp_path_factory):
    """A random V3 with group routing, a shared expert and block-FP8 weights (dequantised here)."""
    path = tmp_path_factory.mktemp("bi") / "v3_fp8"
    write_checkpoint("v3_fp8", path)
    return path


@pytest.mark.parametrize("model, dtype", [("default", "bfloat16"), ("default", "float32"), ("v3_fp8", "float32")])
def test_a_request_is_bitwise_the_same_in_any_batch(model, dtype, moe_fp8):
    """One greedy and one seeded top-p request, alone and then among 1..7 random neighbours (other
    prompt lengths, some sharing its prefix, a prompt budget that chunks prefills differently each
    time): tokens and every logprob equal."""
    path = None if model == "default" else str(moe_fp8)
    llm = LLM(model=path, accelerator="cpu", dtype=dtype, progress=False, batch_invariant=True, max_num_batched_tokens=40)
    assert llm.engine.ops.batch_invariant and llm.engine.ops.providers["linear"] == "reference"
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(1)
    target = [rng.randrange(2, vocab) for _ in range(23)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    seeded = SamplingParams(temperature=0.9, top_p=0.8, seed=7, max_tokens=10, ignore_eos=True, logprobs=3)
    alone = [llm.generate([target], p, use_tqdm=False)[0] for p in (greedy, seeded)]
    for size in range(2, 9):
        others = [target[: rng.randint(1, 20)] + [rng.randrange(2, vocab) for _ in range(rng.randint(1, 30))] for _ in range(size - 1)]
        where = rng.randrange(size)
        prompts = others[:where] + [target] + others[where:]
        for p, want in zip((greedy, seeded), alone):
            params = [SamplingParams(temperature=rng.choice([0, 1.0]), seed=rng.randrange(99), max_tokens=rng.randint(1, 12),
                                     ignore_eos=True) for _ in others]
            got = llm.generate(prompts, params[:where] + [p] + params[where:], use_tqdm=False)[where]
            assert got.outputs[0].token_ids == want.outputs[0].token_ids, (size, p.temperature)
            assert _logprobs(got) == _logprobs(want), (size, p.temperature)


def test_batch_invariant_mode_is_refused_where_it_cannot_hold(tmp_path):
    from tests.hf_checkpoints_v4 import write_checkpoint_v4

    path = tmp_path / "v4"
    write_checkpoint_v4("v4_flash_like", path)
    with pytest.raises(ConfigError, match="batch_invariant=True is supported for the MLA models.*'deepseek_v4'"):
        LLM(model=str(path), accelerator="cpu", progress=False, batch_invariant=True)

    module = SimpleNamespace(
        deepinfer_backend=hookimpl(lambda: BackendInfo(name="plainchip", priority=-10, min_spec_version=SPEC_VERSION,
                                                       max_spec_version=SPEC_VERSION)),
        deepinfer_probe=hookimpl(lambda: ProbeResult(True)),
        deepinfer_platform=hookimpl(lambda: Platform(name="plainchip-1", backend="plainchip")),
    )
    manager = PluginManager()
    backend = manager.add("plainchip", module)
    manager.load(backend)  # fine without the mode
    with pytest.raises(BackendError, match="'plainchip' .*does not support batch-invariant inference.*DEEPINFER_BATCH_INVARIANT"):
        manager.load(backend, batch_invariant=True)


def test_a_partial_backend_gets_the_batch_invariant_reference_for_what_it_leaves_out():
    def rms_norm(x, weight, eps):
        return REFERENCE_OPS["rms_norm"](x, weight, eps)

    module = SimpleNamespace(
        deepinfer_backend=hookimpl(lambda: BackendInfo(name="halfchip", priority=-10, min_spec_version=SPEC_VERSION,
                                                       max_spec_version=SPEC_VERSION)),
        deepinfer_probe=hookimpl(lambda: ProbeResult(True)),
        deepinfer_platform=hookimpl(lambda: Platform(name="halfchip-1", backend="halfchip", batch_invariant=True)),
        deepinfer_ops=hookimpl(lambda platform, model_config, batch_invariant: {"rms_norm": rms_norm}),
    )
    manager = PluginManager()
    backend = manager.add("halfchip", module)
    _, ops, _, fallback = manager.load(backend, batch_invariant=True)
    assert ops.batch_invariant and ops.rms_norm is rms_norm and "rms_norm" not in fallback
    assert ops.linear is invariant.linear and ops.moe_route is invariant.moe_route and ops.providers["linear"] == "reference"
    _, plain, _, _ = manager.load(backend)
    assert plain.linear is REFERENCE_OPS["linear"] and not plain.batch_invariant


def test_the_environment_variable_turns_it_on(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    llm = LLM(accelerator="cpu", dtype="float32", progress=False, num_kv_blocks=64)
    assert llm.engine.ops.batch_invariant and llm.engine.runner.prefills_as_rows
    assert "batch-invariant" in llm.engine.ops.implementations["linear"]
    assert not LLM(accelerator="cpu", dtype="float32", progress=False, num_kv_blocks=64, batch_invariant=False).engine.ops.batch_invariant


# ---- deterministic sampling -----------------------------------------------------------------------
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_seeded_requests_draw_the_same_tokens_anywhere(batch_invariant):
    """Seeded requests: the same tokens alone, in a mixed batch, in reverse order, after
    preemptions and from prefix-cache hits; another seed gives other tokens. Unseeded ones follow
    the engine seed and their order. float32 (normal mode) and bfloat16 (batch-invariant mode)."""
    dtype = "bfloat16" if batch_invariant else "float32"
    kw = dict(accelerator="cpu", dtype=dtype, progress=False, batch_invariant=batch_invariant)
    llm = LLM(**kw)
    prompts = _prompts(12, seed=3, low=20, high=40)
    params = [SamplingParams(temperature=1.0, top_k=40 if i % 2 else 0, top_p=0.95, seed=100 + i, max_tokens=12, ignore_eos=True)
              for i in range(12)]
    alone = [llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    backwards = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params[::-1], use_tqdm=False)][::-1]
    cached = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]  # prompts now in the prefix cache
    assert llm.engine.kv.num_hit_tokens > 0
    tight = LLM(num_kv_blocks=8, max_model_len=64, **kw)
    preempted = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.num_preemptions > 0
    assert alone == batch == backwards == cached == preempted
    reseeded = llm.generate(prompts[:4], [q.model_copy(update={"seed": q.seed + 50}) for q in params[:4]], use_tqdm=False)
    assert all(o.outputs[0].token_ids != a for o, a in zip(reseeded, alone))
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    first = [LLM(seed=s, **kw).generate(prompts[:3], unseeded, use_tqdm=False) for s in (5, 5, 6)]
    ids = [[o.outputs[0].token_ids for o in run] for run in first]
    assert ids[0] == ids[1] and ids[0] != ids[2]
