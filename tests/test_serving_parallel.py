"""Serving a data-parallel LLM (2 gloo processes, experts sharded, tiny V3, float32): requests
streamed through ``AsyncLLM`` and the HTTP server give the single-process greedy tokens, are
spread over both ranks, can be aborted mid-stream, and a failed step ends every request in
flight with its output while the server goes on; the metrics add up the ranks."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.api import GenerationError
from deepinfer_core.engine.engine import RequestError
from deepinfer_core.serving.async_llm import AsyncLLM
from tests.hf_checkpoints import write_checkpoint

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn", reason="fastapi and uvicorn are runtime dependencies")

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[(5 * i + 3 * j) % 150 + 1 for j in range(3 + 9 * i)] for i in range(6)]
STEPS = {"max_num_batched_tokens": 16, "max_num_seqs": 4}


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    monkeypatch.setenv("DEEPINFER_DIST_TIMEOUT", "60")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("v3_grouped")
    write_checkpoint("v3_grouped", path)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    llm = LLM(str(checkpoint), accelerator="cpu", dtype="float32", progress=False, **STEPS)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def served(checkpoint):
    llm = LLM(str(checkpoint), accelerator="cpu", dtype="float32", progress=False, data_parallel_size=2,
              expert_parallel=True, **STEPS)
    engine = AsyncLLM(llm)
    try:
        yield llm, engine
    finally:
        engine.shutdown()
        llm.close()


async def _collect(engine: AsyncLLM, prompt, params=GREEDY, request_id=None):
    outs = []
    async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id=request_id):
        outs.append(out)
    return outs


def test_streamed_requests_give_the_single_process_tokens_on_both_ranks(served, reference, monkeypatch):
    llm, engine = served
    add, on_rank0 = llm.engine.add_request, []
    monkeypatch.setattr(llm.engine, "add_request", lambda *a, **k: on_rank0.append(1) or add(*a, **k))

    async def main():
        return await asyncio.gather(*(_collect(engine, p) for p in PROMPTS))

    streams = asyncio.run(main())
    assert 0 < len(on_rank0) < len(PROMPTS)  # the rest ran on rank 1
    for outs, want in zip(streams, reference):
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == want
        counts = [len(o.outputs[0].token_ids) for o in outs]
        assert counts == sorted(counts) and len(outs) > 1  # streamed as the tokens came
    gauges = engine.driver.gauges()
    assert gauges["kv_blocks"] == 2 * llm.engine.kv.num_blocks  # both ranks' caches
    assert gauges["running"] == 0 and gauges["waiting"] == 0
    assert llm.engine.num_preemptions >= 0 and len(llm.engine.requests) == 0


def test_unseeded_samples_get_the_seeds_one_engine_would_give(served, checkpoint):
    """Samples are seeded from their sequence ids: a request added after others went to rank 1
    must not reuse one of their ids (it used to, and then drew the same tokens)."""
    llm, engine = served
    hot = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    one_engine = LLM(str(checkpoint), accelerator="cpu", dtype="float32", progress=False, **STEPS)
    one_engine.engine.next_seq_id = llm.engine.next_seq_id  # the ids the served group hands out next
    want = [o.outputs[0].token_ids for o in one_engine.generate([PROMPTS[0]] * 2, hot, use_tqdm=False)]
    want += [o.outputs[0].token_ids for o in one_engine.generate([PROMPTS[0]], hot, use_tqdm=False)]

    async def main():
        first = await asyncio.gather(*(_collect(engine, PROMPTS[0], hot) for _ in range(2)))  # one on each rank
        return first + [await _collect(engine, PROMPTS[0], hot)]

    got = [outs[-1].outputs[0].token_ids for outs in asyncio.run(main())]
    assert got == want
    assert got[2] != got[1]


def test_abort_mid_stream_and_a_refused_request(served, reference):
    llm, engine = served
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main():
        stream = engine.generate({"prompt_token_ids": PROMPTS[5]}, long)
        got = [await stream.__anext__() for _ in range(2)]
        await stream.aclose()  # the client went away: aborted on its rank at the next step
        with pytest.raises(RequestError, match="outside the vocabulary"):
            await _collect(engine, [1, 2, 10**6])
        rest = await asyncio.gather(*(_collect(engine, p) for p in PROMPTS[:3]))
        return got, rest

    got, rest = asyncio.run(main())
    assert not got[-1].finished
    for outs, want in zip(rest, reference[:3]):
        assert outs[-1].outputs[0].token_ids == want
    assert engine.num_unfinished() == 0


def test_a_failed_step_ends_every_request_with_its_output_and_serving_goes_on(served, reference, monkeypatch):
    llm, engine = served
    step, calls = llm.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return step()

    monkeypatch.setattr(llm.engine, "step", failing_step)

    async def main():
        return await asyncio.gather(*(_collect(engine, p) for p in PROMPTS), return_exceptions=True)

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, GenerationError)]
    assert errors and all("rank 0: RuntimeError: injected failure" in str(e) for e in errors)
    assert all(e.outputs and e.outputs[0].outputs[0].finish_reason == "abort" for e in errors)
    monkeypatch.setattr(llm.engine, "step", step)
    again = asyncio.run(main())
    assert [r[-1].outputs[0].token_ids for r in again] == reference


def test_the_http_server_serves_a_data_parallel_llm(served, reference):
    from deepinfer_core.serving.protocol import Limits
    from deepinfer_core.serving.server import build_app, serve_in_thread

    llm, engine = served
    app = build_app(engine, "dp", None, Limits(max_tokens=64, max_n=2, max_body_bytes=1 << 16))
    with serve_in_thread(app) as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": "dp", "prompt": PROMPTS[2], "max_tokens": 8,
                                                       "temperature": 0, "ignore_eos": True, "logprobs": 1}, timeout=60)
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == 8
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert "deepinfer_kv_cache_usage_ratio 0.0" in metrics


def test_health_turns_503_as_soon_as_a_rank_dies(served):
    """/health reads the group's liveness: a rank killed while the server is idle makes it 503
    at once (it used to stay "ok" until a request failed on the dead rank), new requests are 503s
    naming the rank, and the idle engine thread breaks the group (stopping what is left) so the
    LLM still closes. Last in this module: it kills rank 1 of the module's group."""
    import os
    import signal
    import time

    from deepinfer_core.serving.protocol import Limits
    from deepinfer_core.serving.server import build_app, serve_in_thread

    llm, engine = served
    app = build_app(engine, "dp", None, Limits(max_tokens=64, max_n=2, max_body_bytes=1 << 16))
    with serve_in_thread(app) as url:
        assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
        rank1 = llm.parallel.group.processes[1]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(10)
        r = httpx.get(f"{url}/health", timeout=10)  # no request ran since: the liveness check alone tells
        assert r.status_code == 503 and "rank 1 died (killed by signal 9)" in r.json()["reason"], r.text
        r = httpx.post(f"{url}/v1/completions", json={"model": "dp", "prompt": PROMPTS[0], "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "rank 1 died" in r.json()["error"]["message"], r.text
        deadline = time.time() + 30
        while llm.parallel.group.broken is None:  # the engine thread's watch, within about a second
            assert time.time() < deadline, "the idle engine thread did not break the group"
            time.sleep(0.1)
        assert "rank 1 died" in llm.parallel.group.broken and not llm.parallel.group.processes
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
