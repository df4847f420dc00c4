"""The engine core through the public API: prefix caching, n-gram speculative decoding with
rollback, overlapped scheduling, and bounded replay of ring groups. Each feature's outputs are
compared with plain decoding (fp32 on the CPU: greedy tokens equal, seeded sampling equal)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.kv_cache import KVCacheManager
from deepinfer_core.engine.runner import ModelRunner
from deepinfer_core.engine.scheduler import Scheduler
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.models.batch import CacheGroup
from tests.hf_checkpoints import write_checkpoint

SHARED = list(range(40, 80))  # a 40-token prefix shared by every prompt below
PROMPTS = [SHARED + [5, 17, 42], SHARED + [11, 12, 13, 14, 15, 16, 17, 18, 19], SHARED + [150]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True, seed=7, n=3)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("core") / "ckpt"
    write_checkpoint("v3_grouped", path)
    return path


def make_llm(path, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    return LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False, **kw)


def tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def close_logprobs(a, b, tol=1e-4) -> bool:
    for oa, ob in zip(a, b):
        for ca, cb in zip(oa.outputs, ob.outputs):
            for la, lb in zip(ca.logprobs or [], cb.logprobs or []):
                if la.keys() != lb.keys() or any(abs(la[t] - lb[t]) > tol for t in la):
                    return False
    return True


class Steps:
    """Collects the StepStats the engine would pass to observers."""

    def __init__(self, llm: LLM):
        self.stats = []
        llm.engine.observer = self.stats.append

    def total(self, name: str) -> int:
        return sum(getattr(s, name) for s in self.stats)


# ---- prefix caching ----------------------------------------------------------------------------
@pytest.mark.parametrize("num_kv_blocks", [None, 24], ids=["roomy", "preempting"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefix_caching_changes_no_output(ckpt, params, num_kv_blocks):
    off = make_llm(ckpt, enable_prefix_caching=False, num_kv_blocks=num_kv_blocks, max_model_len=64)
    on = make_llm(ckpt, num_kv_blocks=num_kv_blocks, max_model_len=64)
    expected = off.generate(PROMPTS, params, use_tqdm=False)
    first = on.generate(PROMPTS, params, use_tqdm=False)
    again = on.generate(PROMPTS, params, use_tqdm=False)  # every prompt's prefix is cached now
    assert tokens(first) == tokens(expected) == tokens(again)
    assert close_logprobs(expected, again)
    assert all(o.num_cached_tokens is None or o.num_cached_tokens == 0 for o in expected)
    if num_kv_blocks is None:
        # all admitted in one step, so nothing was cached yet; then each prompt's full blocks but its last token
        assert [o.num_cached_tokens for o in first] == [0, 0, 0]
        assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 4 * 4 for p in PROMPTS] == [40, 48, 40]
    else:
        assert on.engine.num_preemptions > 0 or off.engine.num_preemptions > 0
    assert on.engine.prefix_hit_rate > 0


def test_samples_of_a_request_share_the_prompt(ckpt):
    """n samples: the first computes the prompt, the others start from its blocks."""
    llm = make_llm(ckpt)
    steps = Steps(llm)
    prompt = SHARED + [1, 2]  # 42 tokens: 10 full blocks
    out = llm.generate([prompt], SamplingParams(temperature=0.8, seed=1, n=4, max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    # 42 for the first sample, then 2 tokens (the partial block) for each of the other three
    assert steps.total("num_prefill_tokens") == 42 + 3 * 2
    assert steps.total("num_cached_tokens") == 3 * 40
    off = make_llm(ckpt, enable_prefix_caching=False)
    same = off.generate([prompt], SamplingParams(temperature=0.8, seed=1, n=4, max_tokens=3), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in same.outputs]


def test_prompt_logprobs_compute_every_prompt_token(ckpt):
    llm = make_llm(ckpt)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    out = llm.generate(PROMPTS[1:2], params, use_tqdm=False)[0]
    ref = make_llm(ckpt, enable_prefix_caching=False).generate(PROMPTS[1:2], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(PROMPTS[1])
    for a, b in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)


def test_a_long_prompt_in_small_chunks_computes_what_one_chunk_does(ckpt):
    """A 49-token prompt through a 7-token step budget: seven chunks, each at its own positions in
    the sequence (the forward passes see them start at 0, 7, 14, ...). Prompt logprobs, tokens
    and logprobs are those of the prompt computed in one chunk."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    prompt = PROMPTS[1]
    whole = make_llm(ckpt).generate([prompt], params, use_tqdm=False)[0]
    llm = make_llm(ckpt, max_num_batched_tokens=7)
    model, starts = llm.engine.model, []
    forward = model.forward

    def spy(ids, positions, meta, caches):
        if meta.num_prefill_tokens:
            starts.append(positions[0].item())
        return forward(ids, positions, meta, caches)

    model.forward = spy
    chunked = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(prompt) == 49 and starts == [0, 7, 14, 21, 28, 35, 42]
    assert chunked.outputs[0].token_ids == whole.outputs[0].token_ids
    assert len(chunked.prompt_logprobs) == len(prompt) and chunked.prompt_logprobs[0] is None
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert close_logprobs([whole], [chunked])


def test_a_request_that_finishes_in_its_prefill_still_caches_its_prompt(ckpt):
    llm = make_llm(ckpt)
    one = SamplingParams(temperature=0, max_tokens=1)
    assert llm.generate([SHARED + [1, 2]], one, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate([SHARED + [1, 2]], one, use_tqdm=False)[0].num_cached_tokens == 40
    steps = Steps(llm)
    out = llm.generate([SHARED + [3, 4]], SamplingParams(temperature=0.8, seed=1, n=4, max_tokens=1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 40 and steps.total("num_prefill_tokens") == 4 * 2


def test_eviction_keeps_outputs_and_frees_everything(ckpt):
    """Distinct prompts through a small cache: cached blocks are evicted LRU, nothing leaks."""
    llm = make_llm(ckpt, num_kv_blocks=30, max_model_len=64)
    prompts = [[i] * 3 + SHARED[: 20 + i] for i in range(8)]
    expected = tokens(make_llm(ckpt, enable_prefix_caching=False).generate(prompts, GREEDY, use_tqdm=False))
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert tokens(llm.generate(prompts[::-1], GREEDY, use_tqdm=False)) == expected[::-1]
    (pool,) = llm.engine.kv.pools.values()
    assert pool.num_evicted > 0 and pool.num_free == 30 and not any(pool.refs)


# ---- n-gram speculative decoding --------------------------------------------------------------
CODE = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n", "for i in range(10):\n    print(i)\nfor j in range(10):\n"]


@pytest.fixture(scope="module")
def default_llms():
    """The embedded default model (its text repeats, so n-gram drafts get accepted)."""
    plain = LLM(accelerator="cpu", dtype="float32", progress=False, enable_prefix_caching=False)
    spec = LLM(accelerator="cpu", dtype="float32", progress=False, speculative_config=NGRAM)
    return plain, spec


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, logprobs=1),
    SamplingParams(temperature=0.7, max_tokens=24, seed=5, n=2),
    SamplingParams(temperature=0, max_tokens=17, stop=["\n\n"], repetition_penalty=1.1),
], ids=["greedy", "seeded", "stop-and-penalty"])
def test_ngram_speculation_emits_what_plain_decoding_does(default_llms, params):
    plain, spec = default_llms
    steps = Steps(spec)
    expected = plain.generate(CODE, params, use_tqdm=False)
    got = spec.generate(CODE, params, use_tqdm=False)
    assert tokens(got) == tokens(expected)
    assert [[c.text for c in o.outputs] for o in got] == [[c.text for c in o.outputs] for o in expected]
    assert close_logprobs(expected, got, tol=1e-4)
    drafts, accepted = steps.total("num_draft_tokens"), steps.total("num_accepted_tokens")
    assert drafts > 0 and 0 <= accepted <= drafts  # measured, not assumed
    # per request and by draft position: the same counts, as the steps reported them
    per_request = [o.metrics.speculative for o in got]
    assert sum(m.num_draft_tokens for m in per_request) == drafts and sum(m.num_accepted_tokens for m in per_request) == accepted
    by_position = [sum(col) for col in zip(*[s.drafts_by_position + [0] * (3 - len(s.drafts_by_position)) for s in steps.stats])]
    assert [sum(m.proposed[i] if i < len(m.proposed) else 0 for m in per_request) for i in range(3)] == by_position
    for m in per_request:  # verification accepts a prefix: position i + 1 is accepted only after position i
        assert all(a <= p for a, p in zip(m.accepted, m.proposed))
        assert all(m.accepted[i + 1] <= m.accepted[i] for i in range(len(m.accepted) - 1))
    assert all(o.metrics.speculative is None for o in expected)  # no speculation, no counts
    if params.repetition_penalty == 1.0:  # a penalty steers away from the repeats drafts copy
        assert accepted > 0
    emitted = sum(len(c.token_ids) for o in got for c in o.outputs)
    assert sum(1 for s in steps.stats if s.num_decode_tokens) < emitted  # fewer decode steps than tokens


def test_ngram_rollback_under_preemption(ckpt):
    """A tiny cache: verification rows are preempted and rolled back; the tokens are plain greedy."""
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8], [3, 4, 3, 4, 3, 4], [5, 6, 5, 6, 5]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = tokens(make_llm(ckpt).generate(prompts, params, use_tqdm=False))
    llm = make_llm(ckpt, num_kv_blocks=14, max_model_len=40, speculative_config=NGRAM)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert llm.engine.num_draft_tokens > 0 and llm.engine.kv.num_free == 14


def test_drafts_that_do_not_fit_are_dropped_not_paid_for_with_a_preemption():
    """A sequence whose newest token fits its blocks but whose drafts would need another block,
    with none free: it decodes without drafts this step; nobody is preempted."""
    kv = KVCacheManager([CacheGroup("mla", "paged", ("l0",), 8, torch.float32)], num_blocks=4, block_size=4,
                        max_num_seqs=4, lookahead=3)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a = Sequence(0, "a", 0, [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=20), 0)
    b = Sequence(1, "b", 0, [9] * 7, SamplingParams(max_tokens=20), 0)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    scheduler.update(out, {0: [8], 1: [9]}, lambda seq, toks: seq.output_token_ids.extend(toks) or False)
    assert kv.num_free == 0
    b.draft_token_ids = [9, 9, 9]  # position 7 fits b's second block, the drafts would need a third
    out = scheduler.schedule()
    assert not out.preempted and [(s.seq.seq_id, s.num_tokens, s.num_drafts) for s in out.decodes] == [(0, 1, 0), (1, 1, 0)]


def test_speculative_config_is_checked(ckpt):
    with pytest.raises(ValueError, match="method"):
        make_llm(ckpt, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_llm(ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_min 4 exceeds prompt_lookup_max 2"):
        make_llm(ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2})
    engine = make_llm(ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}).engine
    assert (engine.proposer.lookup_min, engine.proposer.lookup_max) == (2, 2)  # vLLM: a missing bound equals the other


# ---- overlapped scheduling ----------------------------------------------------------------------
@pytest.mark.parametrize("params", [
    GREEDY,
    SEEDED,
    SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[64], min_tokens=2, presence_penalty=0.5),
    SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1),
], ids=["greedy", "seeded", "stops-and-penalty", "prompt-logprobs"])
@pytest.mark.parametrize("num_kv_blocks", [None, 24], ids=["roomy", "preempting"])
def test_overlapped_scheduling_emits_what_synchronous_does(ckpt, monkeypatch, params, num_kv_blocks):
    sync = make_llm(ckpt, num_kv_blocks=num_kv_blocks, max_model_len=64, enable_prefix_caching=False)
    assert not sync.engine.async_scheduling  # the reference platform does not overlap by default
    monkeypatch.setenv("DEEPINFER_ASYNC_SCHEDULING", "1")
    overlapped = make_llm(ckpt, num_kv_blocks=num_kv_blocks, max_model_len=64, enable_prefix_caching=False)
    assert overlapped.engine.async_scheduling
    steps = Steps(overlapped)
    expected = sync.generate(PROMPTS, params, use_tqdm=False)
    got = overlapped.generate(PROMPTS, params, use_tqdm=False)
    assert tokens(got) == tokens(expected)
    assert [[c.finish_reason for c in o.outputs] for o in got] == [[c.finish_reason for c in o.outputs] for o in expected]
    assert close_logprobs(expected, got)
    assert [o.prompt_logprobs is None for o in got] == [o.prompt_logprobs is None for o in expected]
    assert not overlapped.engine.has_unfinished() and overlapped.engine.in_flight is None
    assert steps.stats and overlapped.engine.kv.num_free == overlapped.engine.kv.num_blocks


def test_async_scheduling_env_turns_it_off(ckpt, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ASYNC_SCHEDULING", "0")
    assert not make_llm(ckpt).engine.async_scheduling


# ---- bounded replay of ring groups --------------------------------------------------------------
def _second_after_a_hit(replay_tokens: int, first_len: int, shared: int):
    """A paged group and a ring group (window 6, block size 4): a first sequence of ``first_len``
    tokens runs a step, then a second sharing its first ``shared`` tokens is scheduled.
    Returns (groups, kv, first, second, the second's step)."""
    groups = [CacheGroup("kv", "paged", ("a",), 8, torch.float32),
              CacheGroup("swa", "ring", ("a.swa",), 8, torch.float32, window=6, replay_tokens=replay_tokens)]
    kv = KVCacheManager(groups, num_blocks=32, block_size=4, max_num_seqs=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    first = Sequence(0, "a", 0, list(range(first_len)), SamplingParams(max_tokens=2), 0)
    scheduler.add(first)
    out = scheduler.schedule()
    scheduler.update(out, {0: [99]}, lambda seq, toks: seq.output_token_ids.extend(toks) or False)
    second = Sequence(1, "b", 0, list(range(shared)) + [7, 7], SamplingParams(max_tokens=2), 0)
    scheduler.add(second)
    return groups, kv, first, second, scheduler.schedule()


def test_prefix_hit_no_longer_than_the_replay_is_not_taken():
    """A hit the bounded replay would recompute entirely spares nothing: it is neither taken
    (no shared blocks, computed from 0) nor counted as cached."""
    _, kv, first, second, out = _second_after_a_hit(replay_tokens=8, first_len=10, shared=8)
    (s,) = out.prefills
    assert out.num_cached_tokens == 0 and second.num_cached_tokens == 0 and s.start == 0
    assert second.paged_write_from == 0 and not set(second.block_tables["kv"]) & set(first.block_tables["kv"])
    assert kv.num_hit_tokens == 0


def test_prefix_hit_replays_the_window_of_ring_groups():
    """A paged group is shared after a hit; a ring group is rebuilt by recomputing the last
    `window` tokens before the first uncached one, which write only the ring."""
    groups, kv, first, second, out = _second_after_a_hit(replay_tokens=6, first_len=20, shared=18)
    (s,) = out.prefills
    # 4 full blocks shared; the 6 replayed tokens are computed again, so 10 were spared
    assert out.num_cached_tokens == 10 and second.num_cached_tokens == 10
    assert s.start == 10 and s.end == 20  # the 6 tokens before 16 replayed, then the 4 new ones
    assert second.block_tables["kv"][:4] == first.block_tables["kv"][:4]
    runner = ModelRunner.__new__(ModelRunner)
    runner.groups, runner.block_size, runner.kv = groups, 4, kv
    runner.max_position = 63
    hb = runner.prepare(out)
    assert hb.slots["kv"][:6] == [-1] * 6 and -1 not in hb.slots["kv"][6:]  # replayed: no write into shared blocks
    assert -1 not in hb.slots["swa"]  # the ring is rebuilt from the replay start
    assert hb.valid_from["swa"] == [0, 10]  # (the first sequence's decode row, then the replay) no ring entry read below
    assert hb.positions[:10] == list(range(10, 20)) and hb.ids[:10] == second.token_slice(10, 20)  # then a decode row
