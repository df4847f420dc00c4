"""DSpark speculative decoding for DeepSeek-V4.1 (engine.spec_decode.dspark): the tokens are
plain decoding's (greedy; seeded sampling under coupled acceptance) at every draft length, with
and without adaptive verification, under preemption and prefix caching; the drafts are those a
block draft over a freshly prefilled context gives; adaptive verification admits, per request,
the prefix of its drafts that the global budget maximising expected tokens per second holds."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError
from deepinfer_core.engine.kv_cache import KVCache, KVCacheManager
from deepinfer_core.engine.runner import ModelRunner
from deepinfer_core.engine.scheduler import ScheduledSeq, SchedulerOutput
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.engine.spec_decode import adaptive
from deepinfer_core.engine.spec_decode.dspark import DSparkProposer
from tests.test_spec_mtp import record_drafts
from tests.v41_checkpoints import write_checkpoint_v41

PARAMS = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=1),
          SamplingParams(temperature=0.8, top_p=0.9, seed=2, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, repetition_penalty=1.2, min_tokens=4)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint_v41("v41-dspark", tmp_path_factory.mktemp("dspark") / "ckpt")


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 2000, (n,), generator=g).tolist() for n in (30, 45, 12)]


def make(path, **kw) -> LLM:
    return LLM(str(path), accelerator="cpu", dtype="float32", progress=False, **{"max_num_seqs": 4, **kw})


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def dspark(k: int, **kw) -> dict:
    return {"method": "dspark", "num_speculative_tokens": k, **kw}


def fixed_costs(llm: LLM, per_token: float = 0.02) -> DSparkProposer:
    """Replace the start-up profile (timings of this machine) by fixed cost curves, so what
    adaptive verification admits depends on the confidences alone."""
    proposer = llm.engine.proposer
    assert proposer.verify_cost is not None and len(proposer.verify_cost.points) >= 4  # it was profiled
    proposer.verify_cost = adaptive.CostCurve([(1, 1.0), (101, 1.0 + 100 * per_token)])
    proposer.draft_cost = adaptive.CostCurve([(1, 0.2), (64, 0.4)])
    return proposer


@pytest.fixture(scope="module")
def expected(ckpt):
    return tokens(make(ckpt, enable_prefix_caching=False).generate(prompts(), PARAMS, use_tqdm=False))


@pytest.mark.parametrize("k,adaptive_on", [(1, False), (2, False), (3, False), (3, True)])
def test_dspark_emits_what_plain_decoding_does(ckpt, expected, k, adaptive_on):
    llm = make(ckpt, enable_prefix_caching=False, speculative_config=dspark(k, adaptive=adaptive_on))
    if adaptive_on:
        fixed_costs(llm)
    assert tokens(llm.generate(prompts(), PARAMS, use_tqdm=False)) == expected
    spec = llm.engine.spec_stats
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0 and len(spec.proposed) <= k
    if adaptive_on:
        assert llm.engine.proposer.last_budget is not None


@pytest.mark.parametrize("k", [4, 5])
def test_dspark_blocks_of_five(tmp_path_factory, k):
    """V4.1-Flash's block of 5 (DeepSeek's default of 5 drafts): draft lengths 4 and 5, greedy and
    seeded, in one batch, with and without adaptive verification."""
    path = write_checkpoint_v41("v41-dspark", tmp_path_factory.mktemp("dspark5") / "ckpt", dspark_block_size=5)
    want = tokens(make(path, enable_prefix_caching=False).generate(prompts(), PARAMS, use_tqdm=False))
    for adaptive_on in (False, True):
        llm = make(path, enable_prefix_caching=False, speculative_config=dspark(k, adaptive=adaptive_on))
        if adaptive_on:
            fixed_costs(llm)
        assert tokens(llm.generate(prompts(), PARAMS, use_tqdm=False)) == want
        assert llm.engine.spec_stats.num_draft_tokens > 0 and len(llm.engine.spec_stats.proposed) <= k


def test_dspark_under_preemption_and_exact_prefix_caching(ckpt, monkeypatch):
    """A cache so small that sequences are preempted, and (bounded replay off, so a prefix hit
    recomputes every window exactly, the stages' included) prompts reused: plain decoding's tokens."""
    monkeypatch.setenv("DEEPINFER_SWA_BOUNDED_REPLAY", "0")
    expected = tokens(make(ckpt, enable_prefix_caching=False).generate(prompts(), PARAMS, use_tqdm=False))
    llm = make(ckpt, speculative_config=dspark(3), num_kv_blocks=26, block_size=4, max_model_len=64)
    assert tokens(llm.generate(prompts(), PARAMS, use_tqdm=False)) == expected
    assert llm.engine.num_preemptions > 0
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(3, 2000, (96,), generator=g).tolist()  # beyond the exact replay of 8 layers x 7 tokens
    long = [shared + torch.randint(3, 2000, (n,), generator=g).tolist() for n in (5, 9)]
    want = tokens(make(ckpt, enable_prefix_caching=False).generate(long, PARAMS[:2], use_tqdm=False))
    roomy = make(ckpt, speculative_config=dspark(3))
    assert tokens(roomy.generate(long, PARAMS[:2], use_tqdm=False)) == want
    again = roomy.generate(long, PARAMS[:2], use_tqdm=False)
    assert tokens(again) == want and all(o.num_cached_tokens > 0 for o in again)


def _fresh_block(model, token_ids: list[int]) -> list[int]:
    """Greedy DSpark drafts after ``token_ids`` from scratch: the target prefills all but the
    newest token into a fresh cache (writing the stages' context), then one block draft."""
    groups, cpu = model.cache_groups(with_mtp=True), torch.device("cpu")
    n, bs = model.config.dspark_block_size, 16
    p = len(token_ids) - 1
    blocks = -(-(p + n) // bs) + 2
    cache = KVCache(groups, blocks, bs, 1, n, cpu)
    kv = KVCacheManager(groups, blocks, bs, 1, n, prefix_caching=False)
    seq = Sequence(0, "fresh", 0, token_ids[:p], SamplingParams(max_tokens=1), 0)
    kv.allocate(seq, p + n)
    runner = ModelRunner(model, cache, kv, cpu)
    ids, positions, meta = runner._meta(runner.prepare(SchedulerOutput(prefills=[ScheduledSeq(seq, 0, p, samples=True)])))
    model.forward(ids, positions, meta, cache.tensors)
    seq.num_computed_tokens = p
    seq.draft_token_ids = [token_ids[p]] + [model.config.dspark_noise_token_id] * (n - 1)
    _, positions, meta = runner._meta(runner.prepare(SchedulerOutput(decodes=[ScheduledSeq(seq, p, n, n - 1, is_decode=True)])))
    return model.forward_dspark(torch.tensor([token_ids[p]]), positions, meta, cache.tensors).tokens[0].tolist()


def test_drafts_equal_a_block_over_a_fresh_context(ckpt, monkeypatch):
    """After chunked prefills and verification rows with rejected drafts (their context entries
    written, then never read), each block drafted equals one drafted over the same tokens'
    context computed at once (bounded replay off: the model is exact, so the two contexts are equal)."""
    monkeypatch.setenv("DEEPINFER_SWA_BOUNDED_REPLAY", "0")
    llm = make(ckpt, enable_prefix_caching=False, speculative_config=dspark(3), max_num_batched_tokens=16)
    seen = record_drafts(llm)
    llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    checked = seen[2::4]
    assert len(checked) >= 5
    for token_ids, drafts in checked:
        assert _fresh_block(llm.engine.model, token_ids)[: len(drafts)] == drafts


def test_adaptive_budget_and_admission():
    flat = adaptive.CostCurve([(1, 1.0), (64, 1.0)])  # verifying more tokens is free: every draft is worth it
    steep = adaptive.CostCurve([(1, 1.0), (2, 3.0)])  # one more token triples the step: none is
    surv = adaptive.survivals([[0.9, 0.5, 0.5], [0.2, 0.9], [1.0, 1.0, 1.0]])
    assert surv[0] == pytest.approx([0.9, 0.45, 0.225]) and surv[2] == [1.0, 1.0, 1.0]
    assert adaptive.choose_budget(surv, 3, 0.1, flat) == 8
    assert adaptive.choose_budget(surv, 3, 0.1, steep) == 0
    # a verify cost linear in tokens: the budget stops where a draft's survival no longer pays its time
    linear = adaptive.CostCurve([(1, 1.0), (11, 2.0)])
    budget = adaptive.choose_budget(surv, 3, 0.5, linear)
    rates = [(3 + sum(sorted(sum(surv, []), reverse=True)[:b])) / (0.5 + linear(3 + b)) for b in range(9)]
    assert 0 < budget < 8 and rates[budget] == pytest.approx(max(rates), rel=1e-9)
    counts = adaptive.admit(surv, 5)  # the top 5: 1.0, 1.0, 1.0, 0.9, 0.45
    assert counts == [2, 0, 3]
    assert adaptive.admit(surv, 0) == [0, 0, 0] and adaptive.admit(surv, 99) == [3, 2, 3]
    assert flat(1000) == 1.0 and steep(3) == 5.0 and linear(6) == pytest.approx(1.5) and linear(51) == pytest.approx(6.0)


def test_adaptive_verification_follows_the_confidences(ckpt):
    """Each step every request has exactly the drafts admit() gives it for the confidences of its
    block and the budget chosen from the profiled costs; steep verify costs admit none."""
    llm = make(ckpt, enable_prefix_caching=False, speculative_config=dspark(3, adaptive=True))
    proposer = fixed_costs(llm, per_token=0.3)
    steps = []
    admit, propose = proposer._admit, proposer.propose

    def recording_admit(chosen, confidence, running):
        counts = admit(chosen, confidence, running)
        surv = adaptive.survivals([c[:room] for (_, room), c in zip(chosen, confidence)])
        budget = adaptive.choose_budget(surv, len(chosen), proposer.draft_cost(len(chosen)), proposer.verify_cost)
        assert budget == proposer.last_budget and counts == adaptive.admit(surv, budget)
        steps.append({seq.seq_id: n for (seq, _), n in zip(chosen, counts)})
        return counts

    def recording_propose(running):
        before = len(steps)
        propose(running)
        if len(steps) > before:  # this call admitted drafts
            assert {s.seq_id: len(s.draft_token_ids) for s in running if s.seq_id in steps[-1]} == steps[-1]

    proposer._admit, proposer.propose = recording_admit, recording_propose
    llm.generate(prompts(), PARAMS[0], use_tqdm=False)
    assert len(steps) > 5 and len({n for step in steps for n in step.values()}) > 1  # lengths vary
    proposer.verify_cost = adaptive.CostCurve([(1, 1.0), (2, 100.0)])
    before = llm.engine.spec_stats.num_draft_tokens
    llm.generate(prompts(), PARAMS[0], use_tqdm=False)
    assert llm.engine.spec_stats.num_draft_tokens == before


def test_dspark_config_errors(ckpt, tmp_path, monkeypatch):
    from tests.hf_checkpoints import write_checkpoint

    with pytest.raises(ConfigError, match="exceeds DSpark's block of dspark_block_size=3"):
        make(ckpt, speculative_config=dspark(4))
    with pytest.raises(ConfigError, match="use 'dspark'"):
        make(ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="adaptive verification needs DSpark"):
        make(ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": True})
    v3 = tmp_path / "v3"
    write_checkpoint("v3_grouped", v3)
    with pytest.raises(ConfigError, match="'dspark' drafts for deepseek_v41"):
        LLM(str(v3), accelerator="cpu", dtype="float32", progress=False, speculative_config=dspark(2))
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")  # DeepSeek's switches
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    engine = make(ckpt).engine
    assert isinstance(engine.proposer, DSparkProposer) and engine.proposer.k == 2 and engine.proposer.adaptive


def test_device_block_drafts_what_the_host_block_drafts(ckpt, monkeypatch):
    """Block rows of requests without penalties keep their picks on the device (the Markov head
    reads them there); the drafts equal those of the host path, greedy and seeded."""
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), SamplingParams(temperature=0.9, seed=4, max_tokens=10, ignore_eos=True)]
    runs = []
    for forced_host in (False, True):
        if forced_host:
            monkeypatch.setattr("deepinfer_core.engine.spec_decode.dspark.needs_history", lambda params: True)
        llm = make(ckpt, enable_prefix_caching=False, speculative_config=dspark(3))
        seen = record_drafts(llm)
        runs.append((tokens(llm.generate(prompts(), [params[0], params[1], params[1]], use_tqdm=False)), seen))
    assert runs[0] == runs[1] and len(runs[0][1]) > 10
