"""Data parallelism with expert-parallel MoE layers, end to end through ``LLM.generate`` on CPU
(gloo, 2 and 4 processes on this 2-core machine, tiny V3 and V4 checkpoints, float32): greedy
tokens and logprobs equal the single-process run, with prompt chunks mixed with decode rows,
with preemption, with EPLB re-placing the experts mid-run, and with long prompts prefilled by
context parallelism (V3, V4 and V4.1); requests go to the least-loaded rank, or to the rank
given their prefix (prefix affinity, within its slack); an engine error on one rank
loses no finished output and leaves the group usable; a killed rank is a clear error, not a
hang; the launch under torchrun gives every rank the same outputs."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError
from deepinfer_core.parallel.data_parallel import Router, Work, assign
from deepinfer_core.parallel.launch import RankFailure
from deepinfer_core.engine.engine import RequestError
from tests.hf_checkpoints import write_checkpoint
from tests.hf_checkpoints_v4 import write_checkpoint_v4

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
# prompts of 3..48 tokens: with 16 tokens a step, the long ones are prefilled in chunks beside decode rows
PROMPTS = [[(5 * i + 3 * j) % 150 + 1 for j in range(3 + 9 * i)] for i in range(6)]
SMALL_STEPS = {"max_num_batched_tokens": 16, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    v3 = tmp_path_factory.mktemp("v3_grouped")
    write_checkpoint("v3_grouped", v3)  # 16 experts, 4 per token, 4 groups
    v4 = tmp_path_factory.mktemp("v4")
    write_checkpoint_v4("v4_flash_like", v4)
    return {"v3": v3, "v4": v4}


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    """A rank out of step fails these tests in a minute instead of hanging CI for the default ten."""
    monkeypatch.setenv("DEEPINFER_DIST_TIMEOUT", "60")


def _llm(path, **kwargs) -> LLM:
    return LLM(str(path), accelerator="cpu", dtype="float32", progress=False, **kwargs)


@pytest.fixture(scope="module")
def reference(checkpoints):
    """The single-process outputs (the same step budget; a roomy KV cache)."""
    out = {}
    for name, path in checkpoints.items():
        llm = _llm(path, **SMALL_STEPS)
        out[name] = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return out


def _assert_same(got, want, same_ids: bool = True, tol: float = 1e-5):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.prompt_token_ids == w.prompt_token_ids and (g.request_id == w.request_id or not same_ids), i
        gc, wc = g.outputs[0], w.outputs[0]
        assert gc.token_ids == wc.token_ids, f"prompt {i}: {gc.token_ids} != {wc.token_ids}"
        for step, (gl, wl, t) in enumerate(zip(gc.logprobs, wc.logprobs, wc.token_ids)):
            assert abs(gl[t].logprob - wl[t].logprob) <= tol, (i, step, gl[t].logprob, wl[t].logprob)


def test_assign_spreads_work_by_load():
    assert assign([10, 10, 10, 10], [0, 0]) == [0, 1, 0, 1]
    assert assign([100, 30, 30, 30], [0, 0]) == [0, 1, 1, 1]  # the heavy one alone
    assert assign([5, 5], [50, 0, 7]) == [1, 1]  # the busy rank gets nothing; 1 stays lightest (ties: lowest rank)
    assert assign([], [0, 0]) == []
    assert assign([5], [0, 0], free_blocks=[3, 9]) == [1]  # equal load: the rank with more free KV blocks


A, B, C, D = (bytes([i]) * 16 for i in range(1, 5))  # block hashes


def test_affinity_wins_within_the_slack_and_load_beyond_it():
    holders = {A: 0, B: 0}
    assert assign([10], [0, 0], hashes=[[A, B]], holders=holders) == [0]
    assert assign([10], [10, 0], hashes=[[A, B]], holders=holders) == [0]  # 10 more queued: within one cost
    assert assign([10], [11, 0], hashes=[[A, B]], holders=holders) == [1]  # beyond it: the least load
    assert assign([10], [25, 0], hashes=[[A, B]], holders=holders, slack=3) == [0]
    assert assign([10], [1, 0], hashes=[[A, B]], holders=holders, slack=0) == [1]  # slack 0: no busier at all
    assert assign([10], [0, 0, 0], free_blocks=[1, 1, 9], hashes=[[C]], holders=holders) == [2]  # unknown: least load
    assert holders == {A: 0, B: 0}  # pure


def test_affinity_follows_the_longest_remembered_prefix():
    holders = {A: 0, B: 1}  # rank 1 was given the longer prefix A+B
    assert assign([10], [0, 0], hashes=[[A, B, C]], holders=holders) == [1]
    assert assign([10], [0, 0], hashes=[[A, D]], holders=holders) == [0]  # only A is shared: rank 0 had it


def test_a_held_prefix_counts_as_work_saved():
    """A k-block prefix on its rank saves k * block_size tokens there: the slack is measured
    after the saving, and the rank's load grows by the cost less it."""
    holders = {C: 0}
    assert assign([100], [140, 0], hashes=[[A, B, C]], holders=holders) == [1]  # 140 > 0 + 100
    assert assign([100], [140, 0], hashes=[[A, B, C]], holders=holders, block_size=16) == [0]  # 140 - 48 <= 100
    assert assign([100], [150, 0], hashes=[[A, B, C]], holders=holders, block_size=16) == [1]
    assert assign([100, 60, 50], [0, 0], hashes=[[A, B, C], [], []], holders=holders, block_size=16) == [0, 1, 0]  # rank 0: 52
    assert assign([100, 60, 50], [0, 0], hashes=[[A, B, C], [], []], holders=holders) == [0, 1, 1]  # rank 0: 100


def test_requests_of_one_call_follow_each_other():
    """The heaviest is placed first; later ones sharing its prefix follow it (within the slack)."""
    assert assign([10, 10, 10], [0, 0], hashes=[[A], [A], [C]], holders={}) == [0, 0, 1]
    assert assign([10, 10, 10], [0, 0]) == [0, 1, 0]  # without affinity


def test_affinity_off_is_least_load():
    holders = {A: 1}
    for costs, loads in [([10, 10, 10, 10], [0, 0]), ([100, 30, 30, 30], [0, 0]), ([5, 5], [50, 0, 7])]:
        want = assign(costs, loads)
        work = [_work(i, c) for i, c in enumerate(costs)]
        router = Router(len(loads), lambda ids: [A], 16, policy="least_load")
        router.holders.update(holders)
        router.route(work, loads, [0] * len(loads))
        assert [w.rank for w in work] == want
        assert router.holders == holders  # nothing remembered


def _work(i: int, cost: int, ids=None, **params) -> Work:
    ids = ids if ids is not None else [i] * (cost - 1)
    return Work(str(i), None, ids, SamplingParams(max_tokens=cost - len(ids), **params), i)


def test_the_router_remembers_a_bounded_lru_of_hashes():
    router = Router(2, lambda ids: [bytes([t]) * 16 for t in ids], 1, policy="affinity", slack=1.0, entries=4)
    first = [_work(0, 20, [1, 2, 3]), _work(1, 10, [7, 8])]
    router.route(first, [0, 0], [0, 0])
    assert [w.rank for w in first] == [0, 1] and len(router.holders) == 4
    again = _work(2, 10, [7, 8, 9])
    router.route([again], [5, 0], [0, 0])  # shares [7, 8] with rank 1's request
    assert again.rank == 1 and len(router.holders) == 4
    assert list(router.holders) == [bytes([t]) * 16 for t in (3, 7, 8, 9)]  # 1 and 2 least recently given: forgotten
    back = _work(3, 10, [1, 2])
    router.route([back], [0, 0], [0, 0])
    assert back.rank == 0  # ties to the lowest rank: the forgotten prefix no longer pulls it anywhere
    logprobs = _work(4, 10, [7, 8], prompt_logprobs=1)  # never reuses a cached prefix: no affinity
    router.route([logprobs], [0, 0], [0, 0])
    assert logprobs.rank == 0


def test_round_robin_goes_in_turn_across_calls():
    router = Router(3, lambda ids: [A], 16, policy="round_robin")
    work = [_work(i, 10) for i in range(4)]
    router.route(work[:2], [0, 0, 0], [0, 0, 0])
    router.route(work[2:], [0, 99, 0], [0, 0, 0])
    assert [w.rank for w in work] == [0, 1, 2, 0] and not router.holders


def test_a_request_sharing_a_prefix_lands_where_it_is_cached(checkpoints):
    """Two ranks, full experts each: the second turn of a conversation goes to the rank that
    served the first (its prompt's four 16-token blocks come from the cache); round robin (and
    least load, both ranks idle: the lowest rank) send it to the other rank, which computes it all."""
    llm = _llm(checkpoints["v3"], data_parallel_size=2, block_size=16, **SMALL_STEPS)
    try:
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        history = [(7 * j) % 150 + 1 for j in range(64)]
        filler = [(11 * j) % 150 + 1 for j in range(80)]
        first = llm.generate([filler, history + [3]], params, use_tqdm=False)  # the heavier filler: rank 0
        assert [o.num_cached_tokens for o in first] == [0, 0]
        router = llm.parallel.router
        assert router.policy == "affinity" and router.holders[llm.engine.kv.prompt_hashes(history + [3])[-1]] == 1
        second = llm.generate([history + [5, 9, 4]], params, use_tqdm=False)[0]
        assert second.num_cached_tokens == 64  # on rank 1, where the history is
        router.policy, router.next_rank = "round_robin", 0  # where round robin's turn would be
        third = llm.generate([history + [6, 2]], params, use_tqdm=False)[0]
        assert third.num_cached_tokens == 0  # rank 0: prefilled again
    finally:
        llm.close()


@pytest.mark.parametrize("model, world, eplb", [("v3", 2, 0), ("v4", 2, 0), ("v3", 4, 2)])
def test_data_and_expert_parallel_match_one_process(checkpoints, reference, monkeypatch, model, world, eplb):
    monkeypatch.setenv("DEEPINFER_EPLB_INTERVAL", str(eplb))  # 2: the experts move every second step
    llm = _llm(checkpoints[model], data_parallel_size=world, expert_parallel=True, **SMALL_STEPS)
    try:
        ep = llm.parallel.ep
        start = ep.placement.phy2log.clone()
        seen = []
        llm.engine.observer = seen.append  # rank 0's StepStats
        assert ep.num_slots % world == 0 and ep.layers and all(m.ep is not None for m in ep.layers)
        assert ep.layers[0].ep.shard.w13.shape[0] == ep.num_slots // world  # this rank holds its slots only
        _assert_same(llm.generate(PROMPTS, GREEDY, use_tqdm=False), reference[model])
        if eplb:
            assert llm.parallel.steps >= 2 * eplb
            assert not ep.placement.phy2log.equal(start), "EPLB should have moved experts for the measured load"
            moves = [s.extra["eplb"] for s in seen if "eplb" in s.extra]
            assert moves and all(m["imbalance_after"] <= m["imbalance_before"] for m in moves)
            assert any(m["slots_moved"] > 0 for m in moves)
        _assert_same(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False), reference[model][:2], same_ids=False)  # a second call
    finally:
        llm.close()


def test_random_weights_are_the_same_model_at_any_ep_size(checkpoints):
    """load_format="dummy" (the benchmarks' random weights) under expert parallelism: each rank
    draws every expert in turn and keeps its own, so the group computes the single process's model."""
    one = _llm(checkpoints["v3"], load_format="dummy", **SMALL_STEPS)
    want = one.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = _llm(checkpoints["v3"], load_format="dummy", data_parallel_size=2, expert_parallel=True, **SMALL_STEPS)
    try:
        _assert_same(llm.generate(PROMPTS, GREEDY, use_tqdm=False), want)
    finally:
        llm.close()


def test_a_closed_group_frees_rank_zeros_engine(checkpoints):
    """After close() nothing but the caller holds a data-parallel LLM (no exit hook): dropping it
    frees rank 0's engine, so a process can build one group after another (benchmarks.scale_out)."""
    llm = _llm(checkpoints["v3"], data_parallel_size=2, expert_parallel=True, **SMALL_STEPS)
    engine = weakref.ref(llm.engine)
    llm.close()
    del llm
    gc.collect()
    assert engine() is None


LONG_PROMPTS = [[(5 * i + 3 * j) % 150 + 1 for j in range(20 + 37 * i)] for i in range(5)]  # 20..168 tokens


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    from tests.v41_checkpoints import write_checkpoint_v41

    return write_checkpoint_v41("v41-tiny", tmp_path_factory.mktemp("v41"))  # KV sources of ratios 2 and 1, Engram


@pytest.mark.parametrize("model, world, cp, ep", [("v3", 2, 2, False), ("v3", 4, 2, True), ("v4", 2, 2, False),
                                                 ("v4", 4, 2, True), ("v41", 2, 2, False), ("v41", 4, 2, True)])
def test_context_parallel_prefill_matches_one_process(checkpoints, v41, monkeypatch, model, world, cp, ep):
    """Prompts whose whole-block prefix reaches 32 tokens are prefilled across their CP group
    (zig-zag chunks; V3: latent rows gathered per layer; V4: KV and compressor rows gathered, the
    compressed and indexer entries pooled on every rank); the owner finds the prefix in its
    prefix cache and decodes (V4 first replays the tokens its window and compressor rings need).
    With 4 ranks there are two CP groups, and under EP a group with no long prompt left runs the
    MoE exchanges empty while the other prefills."""
    monkeypatch.setenv("DEEPINFER_CP_MIN_TOKENS", "32")
    # V4.1 exactly: with SWA bounded replay a prefix hit is an approximation of its own (the
    # owner's prefix hit would then differ from one process's full prefill)
    monkeypatch.setenv("DEEPINFER_SWA_BOUNDED_REPLAY", "0")
    steps = {"max_num_batched_tokens": 32}
    path = v41 if model == "v41" else checkpoints[model]
    want = _llm(path, **steps).generate(LONG_PROMPTS, GREEDY, use_tqdm=False)
    llm = _llm(path, data_parallel_size=world, context_parallel_size=cp, expert_parallel=ep, **steps)
    try:
        got = llm.generate(LONG_PROMPTS, GREEDY, use_tqdm=False)
        _assert_same(got, want)
        kv = llm.engine.kv
        for g in got:  # the CP group's prefix, found by the owner: whole blocks before the last token (V4: less its replay)
            prefix = (len(g.prompt_token_ids) - 1) // kv.block_size * kv.block_size
            want_cached = kv.replay_start(prefix) if prefix >= 32 else 0
            assert g.num_cached_tokens == want_cached, (len(g.prompt_token_ids), g.num_cached_tokens)
        assert any(g.num_cached_tokens for g in got)  # some prompt's prefix came from its CP group
        assert llm.parallel.num_cp_prefills > 0
    finally:
        llm.close()


@pytest.mark.parametrize("where", ["in a layer", "after the last gather"])
def test_a_failed_context_parallel_prefill_falls_back_to_the_owner(checkpoints, monkeypatch, caplog, where):
    """Rank 0's part of its first CP prefill raises, in the first layer's attention (rank 1 is in
    that layer's gather) or after the last layer (rank 1 has finished its part): the group drops
    that prefix at once, runs the pass's MoE exchanges empty, its owner prefills the prompt alone,
    and the tokens are one process's; no collective waits for the timeout."""
    monkeypatch.setenv("DEEPINFER_CP_MIN_TOKENS", "32")
    steps = {"max_num_batched_tokens": 32}
    want = _llm(checkpoints["v3"], **steps).generate(LONG_PROMPTS, GREEDY, use_tqdm=False)
    llm = _llm(checkpoints["v3"], data_parallel_size=2, context_parallel_size=2, expert_parallel=True, **steps)
    try:
        model, calls = llm.engine.model, []
        target, name = (model.model.layers[0].self_attn, "forward_context_parallel") if where == "in a layer" \
            else (model, "prefill_context_parallel")
        original = getattr(target, name)

        def failing(*args, **kwargs):
            calls.append(1)
            if where == "in a layer" and len(calls) == 1:
                raise RuntimeError("injected CP failure")  # before the layer's gather
            out = original(*args, **kwargs)
            if len(calls) == 1:
                raise RuntimeError("injected CP failure")  # after the whole pass: the peer is at its finish
            return out

        setattr(target, name, failing)
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="deepinfer"):
            got = llm.generate(LONG_PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 30  # the test timeout is 60 s
        _assert_same(got, want)
        assert len(calls) > 1  # the later CP prefills ran
        assert "injected CP failure" in caplog.text and "it is prefilled on its own rank" in caplog.text
        assert llm.parallel.num_cp_prefills > 0  # the others still came from the group
        delattr(target, name)
        _assert_same(llm.generate(LONG_PROMPTS[:2], GREEDY, use_tqdm=False), want[:2], same_ids=False)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def v3_with_mtp(tmp_path_factory):
    from tests.hf_checkpoints import add_mtp_weights

    path = tmp_path_factory.mktemp("v3_mtp")
    add_mtp_weights(path, write_checkpoint("v3_grouped", path))
    return path


@pytest.fixture(scope="module")
def v41_dspark(tmp_path_factory):
    from tests.v41_checkpoints import write_checkpoint_v41

    return write_checkpoint_v41("v41-dspark", tmp_path_factory.mktemp("v41_dspark"))


@pytest.mark.parametrize("method", ["mtp", "ngram", "dspark"])
def test_speculative_decoding_under_expert_parallelism(v3_with_mtp, v41_dspark, method, monkeypatch):
    """A step is still one pass of the decoder stack on every rank: n-gram drafts need no pass,
    and the MTP layer (V4.1: the DSpark stages) keeps every expert and drafts on each rank alone.
    Greedy tokens and the drafts' acceptance equal one process's (V4.1 exactly: SWA bounded
    replay makes a prefill depend on how it is chunked, which differs with the batch around it)."""
    monkeypatch.setenv("DEEPINFER_SWA_BOUNDED_REPLAY", "0")
    spec = {"method": method, "num_speculative_tokens": 2}
    if method == "ngram":
        spec |= {"prompt_lookup_max": 2, "prompt_lookup_min": 1}
    path = v41_dspark if method == "dspark" else v3_with_mtp
    repetitive = [[7, 8, 9] * (2 + i) + [5 * i + 1] for i in range(4)] + PROMPTS[:2]
    want = _llm(path, speculative_config=spec, **SMALL_STEPS).generate(repetitive, GREEDY, use_tqdm=False)
    llm = _llm(path, data_parallel_size=2, expert_parallel=True, speculative_config=spec, **SMALL_STEPS)
    try:
        if method != "ngram":
            drafter = llm.engine.model.mtp.layers[0].mlp.experts.gate_up_proj
            assert drafter.shape[0] == (llm.engine.model_config.dspark_n_routed_experts if method == "dspark"
                                        else llm.engine.model_config.n_routed_experts)  # every expert, loaded
        got = llm.generate(repetitive, GREEDY, use_tqdm=False)
        _assert_same(got, want)
        drafted = [(g.metrics.speculative.proposed, g.metrics.speculative.accepted) for g in got]
        if method != "dspark":  # DSpark's draft counts depend on the batch each rank runs (they differ with DP alone too)
            assert drafted == [(w.metrics.speculative.proposed, w.metrics.speculative.accepted) for w in want]
        assert sum(sum(proposed) for proposed, _ in drafted) > 0  # drafts were verified (random weights accept few)
    finally:
        llm.close()


def test_serving_with_context_parallel_prefills(checkpoints, monkeypatch):
    """Long prompts that arrive at a served CP=2 group (``AsyncLLM``) have their prefixes
    prefilled by it, and give the single-process tokens."""
    from deepinfer_core.serving.async_llm import AsyncLLM

    monkeypatch.setenv("DEEPINFER_CP_MIN_TOKENS", "32")
    long = [[(5 * i + 3 * j) % 150 + 1 for j in range(40 + 37 * i)] for i in range(3)]
    want = _llm(checkpoints["v3"], **SMALL_STEPS).generate(long, GREEDY, use_tqdm=False)
    llm = _llm(checkpoints["v3"], data_parallel_size=2, context_parallel_size=2, **SMALL_STEPS)
    engine = AsyncLLM(llm)
    try:
        async def main():
            async def collect(prompt):
                return [out async for out in engine.generate({"prompt_token_ids": prompt}, GREEDY)]

            return await asyncio.gather(*(collect(p) for p in long))

        got = asyncio.run(main())
        assert [g[-1].outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
        assert llm.parallel.num_cp_prefills > 0 and all(g[-1].num_cached_tokens for g in got)
    finally:
        engine.shutdown()
        llm.close()


def test_a_served_group_that_lost_a_rank_answers_503(checkpoints):
    """A served data-parallel LLM whose rank 1 dies: the request in flight and every later one
    get a 503 naming the dead rank, and /health says so; the server itself goes on."""
    import httpx

    from deepinfer_core.serving.async_llm import AsyncLLM
    from deepinfer_core.serving.protocol import Limits
    from deepinfer_core.serving.server import build_app, serve_in_thread

    llm = _llm(checkpoints["v3"], data_parallel_size=2, expert_parallel=True, **SMALL_STEPS)
    engine = AsyncLLM(llm)
    try:
        app = build_app(engine, "dp", None, Limits(max_tokens=64, max_n=2, max_body_bytes=1 << 16))
        with serve_in_thread(app) as url:
            body = {"model": "dp", "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            os.kill(llm.parallel.group.processes[1].pid, signal.SIGKILL)
            for _ in range(2):  # the request that finds rank 1 gone, then one after
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
                assert r.status_code == 503 and "rank 1 died" in r.json()["error"]["message"], r.text
            health = httpx.get(f"{url}/health", timeout=10)
            assert health.status_code == 503 and "rank 1 died" in health.json()["reason"]
    finally:
        engine.shutdown()
        llm.close()


def test_data_parallel_without_expert_parallel_and_preemption_on_one_rank(checkpoints, reference):
    """Full experts on every rank; a KV cache of 6 blocks: rank 0 gets the long n=2 request (two
    63-token samples need 8 blocks) and preempts, rank 1 the two short ones and does not."""
    llm = _llm(checkpoints["v3"], data_parallel_size=2, num_kv_blocks=6, block_size=16, **SMALL_STEPS)
    try:
        assert llm.parallel.ep is None
        long = SamplingParams(temperature=0, max_tokens=60, n=2, logprobs=1, ignore_eos=True)
        got = llm.generate(PROMPTS[:3], [long, GREEDY, GREEDY], use_tqdm=False)
        assert llm.parallel.rank_preemptions[0] > 0 and llm.parallel.rank_preemptions[1] == 0
        _assert_same(got[1:], reference["v3"][1:3])
        one = _llm(checkpoints["v3"], **SMALL_STEPS).generate(PROMPTS[:1], long, use_tqdm=False)[0]
        assert [c.token_ids for c in got[0].outputs] == [c.token_ids for c in one.outputs]
    finally:
        llm.close()


def test_the_cli_summary_counts_every_ranks_prompts(capsys):
    """`deepinfer generate`'s summary line under data parallelism counts the prompt tokens of
    every rank's requests (it counted rank 0's alone: "0 of 6 prompt tokens" for 9)."""
    from deepinfer_core.cli import main
    from deepinfer_core.config import DEFAULT_MODEL_DIR
    from deepinfer_core.engine.startup import load_tokenizer

    prompts = ["def f(x):", "class Stack:", "import os\n"]
    argv = ["generate", "--max-tokens", "2", "--accelerator", "cpu", "--data-parallel-size", "2"]
    for prompt in prompts:
        argv += ["--prompt", prompt]
    assert main(argv) == 0
    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    total = sum(len(tokenizer(p).input_ids) for p in prompts)
    summary = capsys.readouterr().err.splitlines()[-1]
    assert re.fullmatch(rf"prefix cache: \d+ of {total} prompt tokens reused \(\d+%\); preemptions: 0", summary), summary


@pytest.mark.parametrize("where", ["attention after an exchange", "experts inside an exchange"])
def test_an_error_inside_the_forward_pass_is_a_clean_generation_error(checkpoints, reference, where):
    """Rank 0's forward raises after the first MoE layer has exchanged (the last layer's
    attention), or inside an exchange (its experts): rank 1 is waiting in a later exchange. The
    failing rank finishes the pass's exchanges empty, so both ranks report the error at once
    (not after the timeout) and the group still works."""
    llm = _llm(checkpoints["v3"], data_parallel_size=2, expert_parallel=True, **SMALL_STEPS)
    try:
        model, calls = llm.engine.model, []
        target = model.model.layers[-1].self_attn if where.startswith("attention") else model.model.layers[1].mlp
        name = "forward" if where.startswith("attention") else "experts_op"
        original = getattr(target, name)

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 4:
                raise RuntimeError("injected failure in the forward pass")
            return original(*args, **kwargs)

        setattr(target, name, failing)
        started = time.monotonic()
        with pytest.raises(Exception) as info:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 30  # the test timeout is 60 s: no collective waited for it
        assert type(info.value).__name__ == "GenerationError" and "injected failure in the forward pass" in str(info.value)
        assert len(info.value.outputs) == len(PROMPTS)
        delattr(target, name)  # the instance attribute goes; the class's method is back
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for g, w in zip(again, reference["v3"]):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
    finally:
        llm.close()


def test_a_spawned_group_outlives_the_collective_timeout_while_idle(checkpoints, reference, monkeypatch):
    """The spawned ranks wait for rank 0's next command without a timeout: an LLM left unused
    for longer than DEEPINFER_DIST_TIMEOUT still generates (it used to lose its ranks). The timeout
    also bounds the ranks' start-up, which takes 3-4 s on a 2-core CI machine: 8 s, not less."""
    monkeypatch.setenv("DEEPINFER_DIST_TIMEOUT", "8")
    llm = _llm(checkpoints["v3"], data_parallel_size=2, expert_parallel=True, **SMALL_STEPS)
    try:
        first = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        time.sleep(10)  # idle past the timeout
        again = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        for a, b, w in zip(first, again, reference["v3"]):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids == w.outputs[0].token_ids
    finally:
        llm.close()


def test_engine_error_on_one_rank_loses_nothing_and_the_group_goes_on(checkpoints, reference, monkeypatch):
    llm = _llm(checkpoints["v3"], data_parallel_size=2, expert_parallel=True, **SMALL_STEPS)
    try:
        step, calls = llm.engine.step, []

        def failing_step():
            calls.append(1)
            if len(calls) == 11:  # rank 1 has finished its short prompt by then
                raise RuntimeError("injected failure")
            return step()

        monkeypatch.setattr(llm.engine, "step", failing_step)
        with pytest.raises(Exception) as info:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert type(info.value).__name__ == "GenerationError" and "rank 0: RuntimeError: injected failure" in str(info.value)
        outputs = info.value.outputs
        assert [o.request_id for o in outputs] == [w.request_id for w in reference["v3"]]
        finished = [o for o in outputs if o.outputs[0].finish_reason == "length"]
        aborted = [o for o in outputs if o.outputs[0].finish_reason == "abort"]
        assert finished and aborted and len(finished) + len(aborted) == len(outputs)
        monkeypatch.setattr(llm.engine, "step", step)
        with pytest.raises(RequestError, match="outside the vocabulary"):  # refused on rank 0, nothing queued anywhere
            llm.generate([[1, 2, 10**6]], GREEDY, use_tqdm=False)
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for g, w in zip(again, reference["v3"]):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
    finally:
        llm.close()


def test_a_killed_rank_is_a_clear_error_not_a_hang(checkpoints):
    llm = _llm(checkpoints["v3"], data_parallel_size=2, expert_parallel=True, **SMALL_STEPS)
    try:
        os.kill(llm.parallel.group.processes[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=r"rank 1 died \(killed by signal 9\)"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 30
        with pytest.raises(RuntimeError, match="group is gone .rank 1 died"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.close()


def test_parallel_settings_that_cannot_run_are_refused(checkpoints, monkeypatch, tmp_path):
    from tests.v41_checkpoints import write_checkpoint_v41

    path = checkpoints["v3"]
    with pytest.raises(ConfigError, match="must divide data_parallel_size"):
        _llm(path, data_parallel_size=2, context_parallel_size=4)
    write_checkpoint_v41("v41-tiny", tmp_path / "v41")
    with pytest.raises(ConfigError, match="needs prefix caching on"):
        _llm(path, data_parallel_size=2, context_parallel_size=2, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="needs data_parallel_size > 1"):
        _llm(path, expert_parallel=True)
    with pytest.raises(ConfigError, match="data_parallel_size"):
        _llm(path, data_parallel_size=0)
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")  # DeepSeek's switch: DSpark with adaptive verification on V4.1
    with pytest.raises(ConfigError, match="adaptive verification .* with expert_parallel"):
        _llm(tmp_path / "v41", data_parallel_size=2, expert_parallel=True)


def test_torchrun_launch_gives_every_rank_the_same_outputs(checkpoints, reference, tmp_path):
    script = ROOT / "tests" / "dp_torchrun_script.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(checkpoints["v3"]), str(tmp_path), json.dumps(PROMPTS)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = [w.outputs[0].token_ids for w in reference["v3"]]
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == want
