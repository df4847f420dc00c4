"""DeepSeek-V4.1 end to end on tiny random checkpoints in DeepSeek's original layout (CPU).

There is no transformers V4.1, so runs are checked against each other: incremental decode
against one full forward of the same tokens, chunked against unchunked prefill, preempted and
prefix-cached runs against plain ones (bounded replay off: exact), and bounded replay's row
skipping against its definition (§4.4).
"""

from __future__ import annotations

import logging

import pytest
import torch

from deepinfer_core import LLM
from deepinfer_core.engine.engine import RequestError
from deepinfer_core.sampling.params import SamplingParams
from tests.v41_checkpoints import IMAGE_TOKEN, write_checkpoint_v41

NEW = 8
ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(name: str, quant: str | None = "fp8+fp4"):
        if (name, quant) not in made:
            path = tmp_path_factory.mktemp(f"{name}-{quant or 'bf16'}".replace("+", "-"))
            extra = {"vision.patch_embed.weight": torch.zeros(4, 4), "aligner.proj.weight": torch.zeros(2, 2)}
            made[name, quant] = write_checkpoint_v41(name, path, quant=quant, extra=extra)
        return made[name, quant]

    return get


@pytest.fixture
def exact(monkeypatch):
    monkeypatch.setenv("DEEPINFER_SWA_BOUNDED_REPLAY", "0")


def _llm(path, **kwargs) -> LLM:
    return LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False, **{"max_num_seqs": 4, **kwargs})


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 2000, (n,), generator=g).tolist() for n in (40, 23, 9, 3)]


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)


def _chosen(out) -> list[float]:
    c = out.outputs[0]
    return [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]


def _same(a, b) -> None:
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert torch.allclose(torch.tensor(_chosen(x)), torch.tensor(_chosen(y)), atol=ATOL)


@pytest.mark.parametrize("name,quant", [("v41-tiny", "fp8+fp4"), ("v41-sources", "fp8+fp4"), ("v41-tiny", None)])
def test_incremental_decode_equals_the_full_forward(checkpoint, exact, name, quant):
    llm = _llm(checkpoint(name, quant), enable_prefix_caching=False)
    prompts = _prompts()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    whole = [p + o.outputs[0].token_ids[:-1] for p, o in zip(prompts, outs)]
    full = llm.generate(whole, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    for p, o, f in zip(prompts, outs, full):
        toks = o.outputs[0].token_ids
        ref = [d[t] for d, t in zip(f.prompt_logprobs[len(p):], toks[:-1])]
        assert torch.allclose(torch.tensor(_chosen(o)[:-1]), torch.tensor(ref), atol=ATOL)
        assert len(set(toks)) > 1  # not a degenerate model


def test_chunked_prefill_preemption_and_prefix_caching_change_nothing(checkpoint, exact):
    path = checkpoint("v41-tiny")
    prompts = _prompts()
    plain = _llm(path, enable_prefix_caching=False).generate(prompts, GREEDY, use_tqdm=False)
    _same(_llm(path, enable_prefix_caching=False, max_num_batched_tokens=7).generate(prompts, GREEDY, use_tqdm=False), plain)

    cached = _llm(path)
    cached.generate([prompts[0][:35]], GREEDY, use_tqdm=False)  # 32 tokens cached: 2 blocks
    hit = cached.generate(prompts, GREEDY, use_tqdm=False)
    replay = cached.engine.model.replay_tokens()
    assert replay == 8 * 7  # every layer's window exact again
    assert hit[0].num_cached_tokens == 0  # a 32-token hit would be replayed entirely: not taken
    _same(hit, plain)
    longer = [prompts[0] * 3]
    base = _llm(path, enable_prefix_caching=False).generate(longer, GREEDY, use_tqdm=False)
    cached.generate([longer[0][:100]], GREEDY, use_tqdm=False)
    again = cached.generate(longer, GREEDY, use_tqdm=False)
    assert again[0].num_cached_tokens == 96 - replay
    _same(again, base)

    tight = _llm(path, num_kv_blocks=4, max_num_batched_tokens=24, enable_prefix_caching=False)
    outs = tight.generate(prompts, GREEDY, use_tqdm=False)
    assert tight.engine.num_preemptions > 0
    _same(outs, plain)


def _attention_rows(llm) -> list[int]:
    """Query rows of every sparse_attention call of the next forward(s), in order."""
    calls, ops = [], llm.engine.ops
    inner = ops.sparse_attention

    def record(q, *args):
        calls.append(q.shape[0])
        return inner(q, *args)

    ops.sparse_attention = record
    return calls


def test_bounded_replay_runs_the_layers_after_the_last_kv_source_on_the_tail_only(checkpoint):
    path = checkpoint("v41-tiny")
    llm = _llm(path, enable_prefix_caching=False)
    model = llm.engine.model
    assert model.bounded_replay and model.tail_tokens == 8  # sliding_window 8, no speculation
    assert model.replay_tokens() == 8  # a prefix hit recomputes the last window only
    rows = _attention_rows(llm)
    prompt = _prompts()[0]  # 40 tokens
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    # layers 0-4 see all 40 rows; layer 5 (the last KV source) writes all, queries 8; 6 and 7 run on 8
    assert rows[:8] == [40] * 5 + [8] * 3

    # a sequence that wants prompt logprobs keeps every row (its logits are all used)
    rows.clear()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    assert rows[:8] == [40] * 8


def test_bounded_replay_is_exact_for_prompts_within_the_tail_and_close_beyond(checkpoint, monkeypatch):
    path = checkpoint("v41-tiny")
    short = [p for p in _prompts() if len(p) <= 8]
    on = _llm(path, enable_prefix_caching=False).generate(_prompts(), GREEDY, use_tqdm=False)
    monkeypatch.setenv("DEEPINFER_SWA_BOUNDED_REPLAY", "0")
    off = _llm(path, enable_prefix_caching=False).generate(_prompts(), GREEDY, use_tqdm=False)
    _same([o for o, p in zip(on, _prompts()) if len(p) <= 8], [o for o, p in zip(off, _prompts()) if len(p) <= 8])
    assert short
    # longer prompts: the first token's logits come from the tail's last row, whose window is
    # complete in every layer, but deeper layers saw truncated windows below it: close, not equal
    first_on = torch.tensor([_chosen(o)[0] for o in on])
    first_off = torch.tensor([_chosen(o)[0] for o in off])
    assert (first_on - first_off).abs().max() < 1.0


def test_checkpoint_layout_vision_weights_and_image_tokens(checkpoint, caplog):
    path = checkpoint("v41-tiny")
    with caplog.at_level(logging.INFO, logger="deepinfer.loader"):
        llm = _llm(path)
    assert "vision tower" in caplog.text  # vision.* / aligner.* skipped with a note
    groups = {g.name: g for g in llm.engine.cache_groups}
    assert set(groups) == {"window", "c2_kv", "c2_index", "c2_state", "c1_kv", "c1_index"}
    assert groups["c2_kv"].layers == ("model.layers.2.self_attn.compressed",)  # only KV sources own caches
    assert groups["c1_kv"].layers == ("model.layers.5.self_attn.compressed",)
    assert len(groups["window"].layers) == 8
    with pytest.raises(RequestError, match="image"):
        llm.generate([[5, IMAGE_TOKEN, 6]], GREEDY, use_tqdm=False)


def test_engram_reads_the_tokens_before_each_chunk(checkpoint, exact):
    """Chunks split inside an n-gram: the look-back ids the engine passes make them hash as whole."""
    path = checkpoint("v41-tiny")
    prompts = _prompts()[:2]
    whole = _llm(path, enable_prefix_caching=False).generate(prompts, GREEDY, use_tqdm=False)
    for budget in (2, 5):
        _same(_llm(path, enable_prefix_caching=False, max_num_batched_tokens=budget).generate(prompts, GREEDY, use_tqdm=False), whole)
    # and the lookback matters: without it the chunked run differs
    llm = _llm(path, enable_prefix_caching=False, max_num_batched_tokens=5)
    llm.engine.runner.lookback = 0
    llm.engine.model.lookback_tokens = 0
    blind = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert any(torch.tensor(_chosen(a)).sub(torch.tensor(_chosen(b))).abs().max() > 1e-3 for a, b in zip(blind, whole))


def test_indexer_chunks_of_queries_change_nothing(checkpoint, monkeypatch):
    """The indexers build their [queries, entries] candidate index a chunk of queries at a time
    (CANDIDATE_BYTES), on the whole batch and on bounded replay's tail rows alike."""
    import deepinfer_core.models.v41.model as v41

    path = checkpoint("v41-tiny")
    prompts = _prompts()
    whole = _llm(path, enable_prefix_caching=False).generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.setattr(v41, "CANDIDATE_BYTES", 8 * 40 * 3)  # 3 queries a chunk at 40 entries
    _same(_llm(path, enable_prefix_caching=False).generate(prompts, GREEDY, use_tqdm=False), whole)


def test_engram_pads_with_the_pad_tokens_compressed_id(tmp_path, exact):
    """Blocked n-gram slots (before position 0) hash as the pad token's compressed id (§4.5, as
    DeepSeek's and vLLM's token_map[pad_id]), not its token id: two checkpoints whose pad tokens
    are different tokens with one compressed id give the same logprobs; a pad of another
    compressed id does not."""
    runs = {}
    for pad in (579, 1380, 314):  # "Ġse" and "ĠSE" (compressed id 230), "Ġin" (231)
        path = write_checkpoint_v41("v41-tiny", tmp_path / str(pad), engram_pad_token_id=pad)
        llm = _llm(path, enable_prefix_caching=False)
        model = llm.engine.model
        engrams = [layer.engram for layer in model.model.layers if layer.engram is not None]
        assert len(engrams) == 2 and {e.pad_id for e in engrams} == {int(model.compressed_ids[pad])}
        runs[pad] = llm.generate(_prompts()[:2], GREEDY, use_tqdm=False)
    assert engrams[0].pad_id == 231 and int(model.compressed_ids[579]) == int(model.compressed_ids[1380]) == 230
    _same(runs[579], runs[1380])
    assert any(torch.tensor(_chosen(a)).sub(torch.tensor(_chosen(b))).abs().max() > 1e-3 for a, b in zip(runs[579], runs[314]))
