"""MTP speculative decoding (engine.spec_decode.mtp): the tokens are those of plain decoding
(greedy, and seeded sampling under coupled acceptance) at every draft length, in mixed batches,
under preemption and prefix caching; the drafts are those an uncached recomputation of the MTP
module gives (so its cache is caught up correctly); rejection sampling draws from the target's
distribution (chi-square), and the cache's prefix hashes cover the token after each block."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError
from deepinfer_core.engine.kv_cache import KVCache, KVCacheManager
from deepinfer_core.engine.runner import ModelRunner
from deepinfer_core.engine.scheduler import ScheduledSeq, SchedulerOutput
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.models.batch import CacheGroup
from deepinfer_core.engine.spec_decode.mtp import MTPProposer
from tests.hf_checkpoints import add_mtp_weights, write_checkpoint

CODE = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n", "for i in range(10):\n    print(i)\nfor j in range(10):\n",
        "class Stack:\n    def __init__(self):", "import os\n"]
MIXED = [SamplingParams(temperature=0, max_tokens=30, logprobs=2),
         SamplingParams(temperature=0.8, top_p=0.95, max_tokens=26, seed=11, n=2, logprobs=1),
         SamplingParams(temperature=0, max_tokens=21, stop=["\n\n"], repetition_penalty=1.1),
         SamplingParams(temperature=0.6, max_tokens=18, seed=4, min_tokens=10, presence_penalty=0.3)]


def mtp(k: int, **kw) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, **kw}


def default_llm(**kw) -> LLM:
    return LLM(accelerator="cpu", dtype="float32", progress=False, **kw)


def tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def record_drafts(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(tokens, drafts) of every sequence each time the engine proposes, filled as it runs."""
    seen = []
    propose = llm.engine.proposer.propose

    def recording(running):
        propose(running)
        seen.extend((seq.token_ids(), list(seq.draft_token_ids)) for seq in running if seq.draft_token_ids)

    llm.engine.proposer.propose = recording
    return seen


@pytest.fixture(scope="module")
def plain():
    return default_llm(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def plain_outputs(plain):
    return plain.generate(CODE, MIXED, use_tqdm=False)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_mtp_emits_what_plain_decoding_does(plain_outputs, k):
    """The embedded default model (trained with its MTP module), a batch mixing greedy, seeded,
    stop-string, penalty and min_tokens requests: the same tokens, text and logprobs."""
    llm = default_llm(speculative_config=mtp(k))
    got = llm.generate(CODE, MIXED, use_tqdm=False)
    assert tokens(got) == tokens(plain_outputs)
    assert [[c.text for c in o.outputs] for o in got] == [[c.text for c in o.outputs] for o in plain_outputs]
    for oa, ob in zip(plain_outputs, got):
        for ca, cb in zip(oa.outputs, ob.outputs):
            for la, lb in zip(ca.logprobs or [], cb.logprobs or []):
                assert la.keys() == lb.keys() and all(abs(la[t] - lb[t]) < 1e-4 for t in la)
    spec = llm.engine.spec_stats
    assert len(spec.proposed) == k and spec.num_draft_tokens > 0
    # the module was trained to guess the token after next (53% agreement on held-out text):
    # a broken catch-up or chain (a hidden state off by one row) accepts about 0.2 here
    assert spec.acceptance_by_position[0] > 0.3, spec
    assert llm.engine.kv.num_free == llm.engine.kv.num_blocks


def reference_drafts(model, prompt: list[int], k: int) -> list[int]:
    """Greedy MTP drafts after ``prompt`` computed from scratch, one sequence in a fresh cache:
    the target over the whole prompt, then per draft the module over every position again (fed
    the target's draft state, then its own for the chained positions)."""
    groups, bs, cpu = model.cache_groups(with_mtp=True), 16, torch.device("cpu")
    blocks = -(-(len(prompt) + k) // bs) + 1
    cache = KVCache(groups, blocks, bs, 1, 0, cpu)
    kv = KVCacheManager(groups, blocks, bs, 1, prefix_caching=False)
    seq = Sequence(0, "reference", 0, list(prompt), SamplingParams(max_tokens=1), 0)
    kv.allocate(seq, len(prompt) + k)
    runner = ModelRunner(model, cache, kv, cpu)

    def batch(length: int):
        _, positions, meta = runner._meta(runner.prepare(SchedulerOutput(prefills=[ScheduledSeq(seq, 0, length)])))
        return positions, meta

    n = len(prompt)
    with torch.no_grad():
        state = getattr(model, "forward_streams", model.forward)(torch.tensor(prompt), *batch(n), cache.tensors)
        drafts, chained = [], []
        for _ in range(k):
            seq.output_token_ids = list(drafts)  # the chained positions' tokens, so the batch covers them
            ids = prompt[1:] + drafts
            prev = torch.cat([state[: n - 1], *chained])
            positions, meta = batch(len(ids))
            out = model.forward_mtp(0, torch.tensor(ids), positions, prev, meta, cache.tensors)
            hidden, next_state = out if isinstance(out, tuple) else (out, out)
            chained.append(next_state[-1:])
            drafts.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return drafts


def test_drafts_equal_an_uncached_recomputation():
    """Every draft the engine proposes (prefill in chunks, verification rows partly rejected,
    prefix-cache hits) is the module's greedy guess recomputed from scratch."""
    llm = default_llm(speculative_config=mtp(3), max_num_batched_tokens=24, block_size=4)
    engine = llm.engine
    seen = record_drafts(llm)
    params = SamplingParams(temperature=0, max_tokens=12)
    llm.generate(CODE[:3], params, use_tqdm=False)
    llm.generate([CODE[0] + "    return a - b\n"], params, use_tqdm=False)  # a prefix-cache hit
    assert engine.prefix_hit_rate and len(seen) > 20
    checked = seen[::3]
    for token_ids, drafts in checked:
        assert reference_drafts(engine.model, token_ids, len(drafts)) == drafts, token_ids


@pytest.fixture(scope="module")
def random_v3(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp_engine") / "ckpt"
    add_mtp_weights(path, write_checkpoint("v3_grouped", path))
    return path


def random_llm(path, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    return LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False, **kw)


def test_random_v3_under_preemption_and_prefix_caching(random_v3):
    """A random V3 whose MTP module is random too (most drafts rejected: rollback every step), a
    cache so small that verification rows are preempted, and prompts sharing prefixes."""
    shared = list(range(40, 72))
    prompts = [shared + [5, 17, 42], shared + [11, 12, 13], [7, 8, 9, 7, 8, 9, 7, 8], shared + [150]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = tokens(random_llm(random_v3, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False))
    for k in (1, 4):
        llm = random_llm(random_v3, num_kv_blocks=40, max_model_len=64, speculative_config=mtp(k))
        assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
        engine = llm.engine
        assert engine.num_preemptions > 0 and engine.num_draft_tokens > 0 and engine.kv.num_free == 40
        assert tokens(llm.generate(prompts[::-1], params, use_tqdm=False)) == expected[::-1]
        assert engine.prefix_hit_rate


def _recorded_drafts(llm: LLM) -> dict[tuple[int, ...], torch.Tensor]:
    """{the tokens a draft follows: the MTP hidden state it was sampled from}, filled as the engine runs."""
    seen = {}
    proposer = llm.engine.proposer
    sample = proposer._sample

    def recording(hidden, rows):
        for h, row in zip(hidden, rows):
            seen[tuple(row.token_ids())] = h.clone()
        return sample(hidden, rows)

    proposer._sample = recording
    return seen


def test_prefix_hits_keep_the_drafts_of_a_fresh_run():
    """A prompt sharing a block-aligned prefix with an earlier one, whose next token differs:
    the MTP states its drafts come from equal those of a run without the earlier prompt. Were
    the cached block's MTP entry at its last position (computed from the other prompt's next
    token) reused, they would differ."""
    tok = default_llm().engine.tokenizer
    shared = tok("def f(x):\n    return x + 1\n\n\ndef g(y):\n    return").input_ids
    assert len(shared) % 4 == 0
    first, second = shared + tok(" y * 2\n").input_ids[1:], shared + tok(" [y]\n").input_ids[1:]
    assert first[len(shared)] != second[len(shared)]
    params = SamplingParams(temperature=0, max_tokens=16)
    fresh = default_llm(speculative_config=mtp(3), block_size=4)
    want = _recorded_drafts(fresh)
    alone = fresh.generate([second], params, use_tqdm=False)[0]
    llm = default_llm(speculative_config=mtp(3), block_size=4)
    llm.generate([first], params, use_tqdm=False)
    got = _recorded_drafts(llm)
    hit = llm.generate([second], params, use_tqdm=False)[0]
    assert hit.num_cached_tokens == len(shared) - 4  # the last shared block is followed by another token
    assert hit.outputs[0].token_ids == alone.outputs[0].token_ids and got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0)


def test_blocks_hash_the_next_token():
    group = CacheGroup("mla", "paged", ("l0",), 8, torch.float32)
    for next_token, hit in ((False, 8), (True, 4)):
        kv = KVCacheManager([group], num_blocks=8, block_size=4, max_num_seqs=2, hash_next_token=next_token)
        a = Sequence(0, "a", 0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], SamplingParams(), 0)
        kv.allocate(a, 10)
        kv.cache(a, 10)
        b = Sequence(1, "b", 0, [1, 2, 3, 4, 5, 6, 7, 8, 50, 51], SamplingParams(), 0)
        assert kv.find_cached(b)[0] == hit  # block [5..8] is followed by 9 in a, by 50 in b


def test_seeded_requests_are_batch_invariant_and_exact(plain):
    """A seeded request gives plain decoding's tokens alone and in any batch, under "coupled"
    and "auto"; under "rejection" its tokens are its own but the same alone and in a batch."""
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=21)
    others = SamplingParams(temperature=0.9, max_tokens=16)
    want = plain.generate([CODE[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    for mode in ("auto", "coupled", "rejection"):
        llm = default_llm(speculative_config=mtp(3, acceptance=mode))
        alone = llm.generate([CODE[1]], params, use_tqdm=False)[0].outputs[0].token_ids
        batch = llm.generate(CODE[:3], [others, params, others], use_tqdm=False)[1].outputs[0].token_ids
        assert alone == batch, mode
        if mode != "rejection":
            assert alone == want, mode


def _two_sample_pvalue(a: list[int], b: list[int]) -> float:
    """Chi-square test that two samples come from one distribution (cells under 5 expected pooled)."""
    cats = sorted(set(a) | set(b))
    counts = torch.tensor([[a.count(c) for c in cats], [b.count(c) for c in cats]], dtype=torch.float64)
    total = counts.sum(0)
    big = total >= 10
    counts = torch.cat([counts[:, big], counts[:, ~big].sum(1, keepdim=True)], 1)
    counts = counts[:, counts.sum(0) > 0]
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = counts.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_rejection_sampling_draws_from_the_target_distribution(plain):
    """Unseeded requests under "auto" are verified by rejection sampling: the second and third
    tokens (the first ones that can be drafts) over 600 samples are distributed as without
    speculation (two-sample chi-square), while drafts are both accepted and rejected."""
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=3, n=600, ignore_eos=True)
    llm = default_llm(speculative_config=mtp(2), seed=1)
    on = llm.generate([CODE[2]], params, use_tqdm=False)[0]
    off = plain.generate([CODE[2]], params, use_tqdm=False)[0]
    spec = on.metrics.speculative
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    for position in (1, 2):
        p = _two_sample_pvalue([c.token_ids[position] for c in on.outputs], [c.token_ids[position] for c in off.outputs])
        assert p > 1e-3, (position, p)


def test_mtp_config_errors(tmp_path, monkeypatch):
    path = tmp_path / "no_mtp"
    write_checkpoint("v3_grouped", path)
    with pytest.raises(ConfigError, match="needs the checkpoint's draft layers"):
        random_llm(path, speculative_config=mtp(2))
    with pytest.raises(ValueError, match="acceptance"):
        default_llm(speculative_config=mtp(2, acceptance="always"))
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")  # DeepSeek's switch
    engine = default_llm().engine
    assert isinstance(engine.proposer, MTPProposer) and engine.proposer.k == 2


@pytest.fixture(scope="module")
def random_v4(tmp_path_factory):
    from tests.hf_checkpoints_v4 import write_checkpoint_v4

    path = tmp_path_factory.mktemp("mtp_v4") / "ckpt"
    write_checkpoint_v4("v4_flash_like", path, with_mtp=True)
    return path


def test_v4_mtp_block_drafts_and_changes_nothing(random_v4):
    """V4's MTP block (sliding-window cache in the ring, fed the residual streams): greedy tokens
    equal plain decoding's at k = 1 and 3 with prefix hits (bounded replay rebuilds the block's
    ring too); and the drafts, proposed after incremental catch-ups through verification rows and
    chained on the block's own streams, are those of a recomputation from scratch."""
    from tests.hf_checkpoints_v4 import random_prompt

    shared = random_prompt(40, seed=3)
    prompts = [shared + random_prompt(6, seed=4), shared + random_prompt(9, seed=5), random_prompt(20, seed=6)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    kw = dict(model=str(random_v4), accelerator="cpu", dtype="float32", progress=False, max_num_seqs=4)
    expected = tokens(LLM(enable_prefix_caching=False, **kw).generate(prompts, params, use_tqdm=False))
    for k in (1, 3):
        llm = LLM(speculative_config=mtp(k), **kw)
        seen = record_drafts(llm)
        assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
        assert tokens(llm.generate(prompts[::-1], params, use_tqdm=False)) == expected[::-1]
        assert llm.engine.prefix_hit_rate and llm.engine.num_draft_tokens > 0
    checked = seen[1::4]
    assert len(checked) > 5
    for token_ids, drafts in checked:
        assert reference_drafts(llm.engine.model, token_ids, len(drafts)) == drafts, token_ids


def test_mtp_through_draft_graphs(plain_outputs):
    """The MTP module's decode rows replayed as graphs (catch-up rows of 1 + accepted tokens
    padded to 1 + k, chained rows of 1; batches of 3 padded to 4), on the CPU through a stand-in
    graph backend that recomputes the captured function from its static buffers: the drafts and
    tokens are those of the eager engine."""
    from deepinfer_core.engine.graphs import DecodeGraphs, max_blocks_per_group
    from tests.test_decode_graphs import RecomputeGraphs, with_graphs

    runs = {}
    for graphs in (False, True):
        llm = default_llm(speculative_config=mtp(3), enable_prefix_caching=False)
        engine = llm.engine
        seen = record_drafts(llm)
        if graphs:
            with_graphs(engine)
            widths = max_blocks_per_group(engine.cache_groups, engine.max_model_len, engine.kv.block_size, 4, engine.kv.rings)
            draft = DecodeGraphs(engine.model, engine.kv_cache.tensors, engine.cache_groups, widths, (1, 2, 4), (1, 4),
                                 engine.device, RecomputeGraphs(), draft_dim=engine.model_config.hidden_size)
            draft.capture_all(progress=False)
            engine.proposer.graphs = draft
            replays = []
            inner = draft.replay
            draft.replay = lambda *a, **kw: replays.append(a[1]) or inner(*a, **kw)
        out = llm.generate(CODE[:3], MIXED[:3], use_tqdm=False)
        runs[graphs] = (tokens(out), seen)
    assert runs[True][0] == runs[False][0] == tokens(plain_outputs)[:3]
    assert runs[True][1] == runs[False][1] and {1, 4} <= set(replays)


def test_v4_mtp_through_graphs(random_v4):
    """V4's verification rows and its MTP block's decode rows replayed as graphs (the block fed
    the target's hyper-connection streams [hc, D] through the draft graphs' static input), on
    the CPU stand-in backend: the drafts and tokens are the eager engine's."""
    from deepinfer_core.engine.graphs import DecodeGraphs, max_blocks_per_group
    from tests.hf_checkpoints_v4 import random_prompt
    from tests.test_decode_graphs import RecomputeGraphs, with_graphs

    prompts = [random_prompt(40, seed=3), random_prompt(9, seed=5), random_prompt(20, seed=6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs, replays = {}, []
    for graphs in (False, True):
        llm = LLM(model=str(random_v4), accelerator="cpu", dtype="float32", progress=False, max_num_seqs=4,
                  speculative_config=mtp(2), enable_prefix_caching=False)
        engine = llm.engine
        seen = record_drafts(llm)
        if graphs:
            with_graphs(engine)
            c = engine.model_config
            widths = max_blocks_per_group(engine.cache_groups, engine.max_model_len, engine.kv.block_size, 3, engine.kv.rings)
            draft = DecodeGraphs(engine.model, engine.kv_cache.tensors, engine.cache_groups, widths, (1, 2, 4), (1, 3),
                                 engine.device, RecomputeGraphs(), draft_dim=(c.hc_mult, c.hidden_size))
            draft.capture_all(progress=False)
            engine.proposer.graphs = draft
            inner = draft.replay
            draft.replay = lambda *a, **kw: replays.append(a[1]) or inner(*a, **kw)
        runs[graphs] = (tokens(llm.generate(prompts, params, use_tqdm=False)), seen)
    assert runs[True] == runs[False] and {1, 3} <= set(replays)


def test_device_chain_drafts_what_the_host_chain_drafts(monkeypatch):
    """Chained drafts of requests without penalties stay on the device until the chain ends; they
    are the drafts the host-side chain (one round trip per draft) proposes, greedy and seeded,
    with sequences leaving the chain at different lengths (max_tokens)."""
    params = [SamplingParams(temperature=0, max_tokens=20), SamplingParams(temperature=0.9, seed=3, max_tokens=9),
              SamplingParams(temperature=0.7, seed=8, max_tokens=14, n=2)]
    runs = []
    for on_device in (True, False):
        llm = default_llm(speculative_config=mtp(4), enable_prefix_caching=False)
        used = []
        if on_device:  # the chain samples with launch() only when its drafts stay on the device
            import deepinfer_core.engine.spec_decode.mtp as mtp_module

            inner = mtp_module.launch
            monkeypatch.setattr(mtp_module, "launch", lambda *a, **kw: used.append(1) or inner(*a, **kw))
        else:
            monkeypatch.setattr("deepinfer_core.engine.spec_decode.mtp.needs_history", lambda params: True)
        seen = record_drafts(llm)
        out = llm.generate(CODE[:3], params, use_tqdm=False)
        monkeypatch.undo()
        runs.append((tokens(out), seen, bool(used)))
    assert runs[0][2] and not runs[1][2]
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]
