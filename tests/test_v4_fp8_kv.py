"""kv_cache_dtype="fp8" end to end on the CPU reference: a tiny V4 checkpoint with V4's real key
row (head_dim 512, RoPE 64) keeps its window and compressed KV caches as 584-byte FP8 records,
generates close to the float32-KV run, and the engine refuses what it cannot run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_core.api import LLM
from deepinfer_core.config import ConfigError
from deepinfer_core.sampling.params import SamplingParams
from tests.hf_checkpoints_v4 import PROMPT_LEN_V4, random_prompt, write_checkpoint_v4

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 16
# float32 compute, FP8 records against float32 KV, greedy, 5 prompts of 16 tokens (measured: every
# first token equal, the greedy runs agree for 4..14 tokens (38 of 80 tokens before the first
# divergence), chosen-token logprobs differ by at most 0.38 before it): the random tiny model's
# top logits are close, so a 2-4% attention error flips a token after a few steps.
MIN_AGREEING_TOKENS = 3
LOGPROB_BOUND = 0.5
RECORD_GROUPS = ("window", "csa_kv", "hca_kv")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4-fp8kv")
    write_checkpoint_v4("v4_flash_like", path, head_dim=512, qk_rope_head_dim=64, index_head_dim=64)
    return path


def _llm(path, **kwargs) -> LLM:
    return LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False, max_num_seqs=4, **kwargs)


def test_fp8_kv_cache_bytes_and_greedy_generation(checkpoint):
    long = PROMPT_LEN_V4["v4_flash_like"]
    prompts = [random_prompt(long, seed=s) for s in range(1, 5)] + [random_prompt(5, seed=9)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    runs = {}
    for kv in ("auto", "fp8"):
        llm = _llm(checkpoint, kv_cache_dtype=kv)
        runs[kv] = (llm.generate(prompts, params, use_tqdm=False), {g.name: g for g in llm.engine.cache_groups})
    (ref, ref_groups), (fp8, groups) = runs["auto"], runs["fp8"]
    for name, g in groups.items():
        if name in RECORD_GROUPS:  # 584 bytes where bf16 would take 1024 (float32 here: 2048)
            assert (g.dtype, g.entry_dim, g.entry_bytes) == (torch.uint8, 584, 584)
            assert g.entry_bytes * 1024 == ref_groups[name].entry_bytes // 2 * 584
        else:  # indexer keys and compressor states stay as they are
            assert dataclasses.astuple(g) == dataclasses.astuple(ref_groups[name])
    agreeing = []
    for a, b in zip(ref, fp8):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        la = [lp[t] for lp, t in zip(a.outputs[0].logprobs[:n], ta)]
        lb = [lp[t] for lp, t in zip(b.outputs[0].logprobs[:n], tb)]
        assert max(abs(x - y) for x, y in zip(la, lb)) <= LOGPROB_BOUND
        agreeing.append(n)
    assert min(agreeing) >= MIN_AGREEING_TOKENS, agreeing


def test_fp8_decode_steps_write_the_window_first_and_read_the_caches_alone(checkpoint, monkeypatch):
    """Decode-only FP8 steps write their window rows to the ring before the attention and pass
    the caches alone as its pools (what FlashMLA's sparse decode reads); the same requests with
    every step taken as a mixed one (new rows as pool 0, the ring written after) give the same
    tokens and logprobs, and the attention sees 1-2 pools only in the decode-only steps."""
    from deepinfer_core.models.v4 import batch as v4_batch
    from deepinfer_core.models.v4 import model as v4_model

    prompts = [random_prompt(PROMPT_LEN_V4["v4_flash_like"], seed=s) for s in (1, 2)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)
    pool_counts = []
    real_output = v4_model.sparse_output

    def counting(attn, q, pool, *args):
        pool_counts.append(len(pool))
        return real_output(attn, q, pool, *args)

    monkeypatch.setattr(v4_model, "sparse_output", counting)
    first = _llm(checkpoint, kv_cache_dtype="fp8").generate(prompts, params, use_tqdm=False)
    assert min(pool_counts) == 1 and max(pool_counts) == 3  # SWA decode: the ring alone; prefill: new rows, ring, entries
    monkeypatch.setattr(v4_batch.V4Batch, "decode_only", property(lambda self: False))
    pool_counts.clear()
    mixed = _llm(checkpoint, kv_cache_dtype="fp8").generate(prompts, params, use_tqdm=False)
    assert min(pool_counts) == 2  # the new rows always come as pool 0
    for a, b in zip(first, mixed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [lp[t] for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        lb = [lp[t] for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        assert la == pytest.approx(lb, abs=1e-5)


def test_fp8_kv_refused_on_a_platform_without_it(checkpoint, monkeypatch):
    import deepinfer_core.plugins as plugins

    real = plugins.load_backend

    def without(*args, **kwargs):
        manager, backend, platform, ops, limits = real(*args, **kwargs)
        return manager, backend, dataclasses.replace(platform, fp8_kv_cache=False), ops, limits

    monkeypatch.setattr(plugins, "load_backend", without)
    with pytest.raises(ConfigError, match="'reference' backend's ops do not take FP8 KV records .* kv_cache_dtype='auto'"):
        _llm(checkpoint, kv_cache_dtype="fp8")


def test_fp8_kv_refused_for_models_without_records(tmp_path):
    """V3-family (the embedded default), V4.1, and a V4 config whose key rows are not 512 wide."""
    from tests.v41_checkpoints import write_checkpoint_v41

    with pytest.raises(ConfigError, match="supported for DeepSeek-V4 .* not for .*kv_cache_dtype='auto'"):
        LLM(accelerator="cpu", dtype="float32", progress=False, kv_cache_dtype="fp8")
    v41 = write_checkpoint_v41("v41-tiny", tmp_path / "v41", quant=None)
    with pytest.raises(ConfigError, match="supported for DeepSeek-V4 .* not for .*V4.1"):
        LLM(model=str(v41), accelerator="cpu", dtype="float32", progress=False, kv_cache_dtype="fp8")
    small = tmp_path / "v4-small"
    write_checkpoint_v4("v4_flash_like", small)
    with pytest.raises(ValueError, match="head_dim 32, qk_rope_head_dim 8: run it with kv_cache_dtype='auto'"):
        _llm(small, kv_cache_dtype="fp8")
