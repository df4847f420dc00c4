"""Prefill/decode disaggregation over NIXL (engine/kv_transfer.py), on the CPU: NIXL's UCX backend
between two engines of this process, and between processes on loopback.

A prefill engine computes every prompt token but the last and parks the blocks; a decode engine
reads every cache group's blocks (V3's MLA latents; V4's window ring, compressor states and
compressed entries) bit for bit, computes only the last prompt token and the outputs, and gives
the float32 greedy tokens of one engine (logprobs within the summation order of another batch).
Then: a cancelled receive frees its blocks once the READ is over; blocks nobody reads are freed
after the timeout; wrong kv_transfer_params are refused naming what is wrong; and through the
servers, vllm-router drives a prefill/decode pair to one engine's answer, and a killed prefill
instance costs only the request whose blocks it held (a 502), not the decode instance.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.kv_tiers import block_spans, block_views
from deepinfer_core.engine.kv_transfer import rows_per_block
from deepinfer_core.engine.output import to_output
from deepinfer_core.engine.requests import RequestError
from tests.hf_checkpoints import write_checkpoint
from tests.hf_checkpoints_v4 import random_prompt, write_checkpoint_v4

# NIXL comes with the project's install (./build.sh installs the pd extra): no skip here, so a
# broken NIXL install fails these tests (with kv_transfer's message naming the fix) instead of
# hiding them, as an importorskip of the meta-package `nixl` (not installed) once did
pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (2, 5, 37, 130, 200)  # one token to READ, a partial block, several blocks, beyond V4's window
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=2)


def _checkpoint(kind: str, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(kind)
    if kind == "v3":
        write_checkpoint("v3_grouped", path)
    elif kind == "v4_fp8":  # FlashMLA's 584-byte records need V4's real head dims (448 + 64)
        write_checkpoint_v4("v4_flash_like", path, head_dim=512, qk_rope_head_dim=64, index_head_dim=64)
    else:
        write_checkpoint_v4("v4_flash_like", path)
    return path


@pytest.fixture(scope="module", params=["v3", "v4", "v4_fp8"])
def trio(request, tmp_path_factory, one_thread):
    """(one engine, a prefill engine, a decode engine) of one tiny model, float32 (v4_fp8: V4's
    window and compressed caches as FP8 records, whose rows straddle pages)."""
    path = _checkpoint(request.param, tmp_path_factory)
    kw = dict(model=str(path), accelerator="cpu", dtype="float32", progress=False, max_num_seqs=8,  # V4: a parked
              kv_cache_dtype="fp8" if request.param == "v4_fp8" else "auto")  # sequence keeps its ring slots
    llms = LLM(**kw), LLM(**kw, kv_role="prefill"), LLM(**kw, kv_role="decode")
    yield llms
    for llm in llms:
        llm.close()


def _run(engine, requests: list[tuple[str, list[int], SamplingParams]], timeout: float = 120) -> dict:
    for rid, ids, params in requests:
        engine.add_request({"prompt_token_ids": ids}, params, request_id=rid)
    done, t0 = {}, time.time()
    while engine.has_unfinished():
        assert time.time() - t0 < timeout, "the engine did not finish"
        for req in engine.step():
            done[req.request_id] = to_output(req, False)
    return done


def _prefill(prefill, prompts: list[list[int]], params=GREEDY) -> dict[str, dict]:
    asked = params.model_copy(update={"kv_transfer_params": {"do_remote_decode": True}})
    out = _run(prefill.engine, [(str(i), p, asked) for i, p in enumerate(prompts)])
    return {rid: o.kv_transfer_params for rid, o in out.items()}


def _tokens_computed(engine) -> list[int]:
    """A list that gets, per step of ``engine``, the tokens it computed (its observer)."""
    seen: list[int] = []
    engine.observer = lambda stats: seen.append(stats.num_prefill_tokens + stats.num_decode_tokens)
    return seen


def test_the_decode_engine_continues_the_prefill_engines_cache_with_one_engines_tokens(trio):
    one, prefill, decode = trio
    prompts = [random_prompt(n, seed=n) for n in LENGTHS]
    want = one.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    params = _prefill(prefill, prompts)
    assert [params[str(i)]["remote_num_tokens"] for i in range(len(prompts))] == [n - 1 for n in LENGTHS]
    assert len(prefill.engine.scheduler.transfer.parked) == len(prompts)  # held until read
    computed = _tokens_computed(decode.engine)
    try:
        got = _run(decode.engine, [(str(i), p, GREEDY.model_copy(update={"kv_transfer_params": params[str(i)]}))
                                   for i, p in enumerate(prompts)])
    finally:
        decode.engine.observer = None
    for i, w in enumerate(want):
        g = got[str(i)]
        assert g.error is None and g.outputs[0].token_ids == w.outputs[0].token_ids, i
        for a, b, t in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, w.outputs[0].token_ids):
            assert abs(a[t] - b[t]) < 1e-4
    # the decode engine computed each prompt's last token and the outputs after the first, nothing more
    assert sum(computed) == len(prompts) * GREEDY.max_tokens
    deadline = time.time() + 10
    while prefill.engine.scheduler.transfer.parked and time.time() < deadline:  # NIXL's notifications: the READs are over
        prefill.engine.poll_transfers()
        time.sleep(0.01)
    assert not prefill.engine.scheduler.transfer.parked
    assert prefill.engine.kv.num_free == prefill.engine.kv.num_blocks
    assert decode.engine.kv.num_free == decode.engine.kv.num_blocks


def test_every_cache_group_arrives_bit_for_bit(trio):
    _, prefill, decode = trio
    prompt = random_prompt(150, seed=7)
    params = _prefill(prefill, [prompt])["0"]
    engine = decode.engine
    engine.add_request({"prompt_token_ids": prompt}, GREEDY.model_copy(update={"kv_transfer_params": params}), request_id="bits")
    assert engine.step() == []  # admitted: blocks taken, the READ started (nothing to compute yet)
    (seq,) = engine.scheduler.receiving
    deadline = time.time() + 10
    while seq in engine.scheduler.receiving and time.time() < deadline:
        engine.poll_transfers()
    assert seq in engine.scheduler.running and seq.num_computed_tokens == len(prompt) - 1
    for g in engine.cache_groups:
        theirs = params["remote_block_ids"][g.name]
        assert len(seq.block_tables[g.name]) == len(theirs)
        for layer in g.layers:
            a, b = prefill.engine.kv_cache.tensors[layer], engine.kv_cache.tensors[layer]
            rows = rows_per_block(g, engine.kv.block_size, a)
            for mine, their in zip(seq.block_tables[g.name], theirs):
                for (lo, n), (ro, _) in zip(block_spans(b, rows, mine), block_spans(a, rows, their)):
                    assert torch.equal(b.view(-1).view(torch.uint8)[lo : lo + n], a.view(-1).view(torch.uint8)[ro : ro + n]), (layer, mine)
    engine.abort("bits")
    assert engine.kv.num_free == engine.kv.num_blocks


def test_a_request_cancelled_while_its_blocks_arrive_frees_them_and_the_engine_goes_on(trio):
    one, prefill, decode = trio
    prompts = [random_prompt(90, seed=1), random_prompt(60, seed=2)]
    params = _prefill(prefill, prompts)
    engine = decode.engine
    engine.add_request({"prompt_token_ids": prompts[0]}, GREEDY.model_copy(update={"kv_transfer_params": params["0"]}),
                       request_id="gone")
    engine.step()  # the READ is under way
    aborted = engine.abort("gone")
    assert aborted.seqs[0].finish_reason == "abort"
    after = _run(engine, [("next", prompts[1], GREEDY.model_copy(update={"kv_transfer_params": params["1"]}))])
    want = one.generate([{"prompt_token_ids": prompts[1]}], GREEDY, use_tqdm=False)[0]
    assert after["next"].outputs[0].token_ids == want.outputs[0].token_ids
    deadline = time.time() + 10
    while engine.scheduler.transfer.busy and time.time() < deadline:
        engine.poll_transfers()
    assert not engine.scheduler.transfer.busy and engine.kv.num_free == engine.kv.num_blocks


def test_blocks_nobody_reads_are_freed_after_the_timeout(trio):
    _, prefill, _ = trio
    transfer = prefill.engine.scheduler.transfer
    before, transfer.timeout_s = transfer.timeout_s, 0.05
    try:
        _prefill(prefill, [random_prompt(70, seed=3)])
        assert transfer.parked and prefill.engine.kv.num_free < prefill.engine.kv.num_blocks
        time.sleep(0.1)
        prefill.engine.poll_transfers()
        assert not transfer.parked and prefill.engine.kv.num_free == prefill.engine.kv.num_blocks
    finally:
        transfer.timeout_s = before


def test_wrong_kv_transfer_params_are_refused_with_what_to_do(trio):
    one, prefill, decode = trio
    prompt = random_prompt(40, seed=4)
    params = _prefill(prefill, [prompt])["0"]

    def refused(llm, kv, ids=prompt, match=""):
        with pytest.raises(RequestError, match=match):
            llm.engine.add_request({"prompt_token_ids": ids}, GREEDY.model_copy(update={"kv_transfer_params": kv}))

    refused(one, {"do_remote_decode": True}, match="without a role; send it to an instance started with --role prefill")
    refused(decode, {"do_remote_decode": True}, match="runs as decode")
    refused(prefill, params, match="runs as prefill; send them to an instance started with --role decode")
    refused(prefill, {"do_remote_decode": True}, ids=prompt[:1], match="one-token prompt")
    refused(decode, {"neither": 1}, match="neither do_remote_decode")
    refused(decode, {"do_remote_prefill": True}, match="not a DeepInfer prefill instance's")
    refused(decode, params, ids=random_prompt(40, seed=5), match="computed other tokens than this prompt's")
    refused(decode, {**params, "remote_layout": "0" * 64}, match="another model or KV cache layout")
    refused(decode, {**params, "deepinfer_protocol": 99}, match="run the same DeepInfer version")
    with pytest.raises(RequestError, match="prompt_logprobs .* send this request to one instance"):
        prefill.engine.add_request({"prompt_token_ids": prompt}, GREEDY.model_copy(
            update={"prompt_logprobs": 1, "kv_transfer_params": {"do_remote_decode": True}}))
    assert not decode.engine.requests and not one.engine.requests
    _run(decode.engine, [("ok", prompt, GREEDY.model_copy(update={"kv_transfer_params": params}))])  # the right ones still run


def test_a_role_needs_one_engine_without_speculation(tmp_path):
    from deepinfer_core.config import ConfigError

    with pytest.raises(ConfigError, match="speculative decoding"):
        LLM(accelerator="cpu", progress=False, kv_role="decode", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="kv_role"):
        LLM(accelerator="cpu", progress=False, kv_role="sideways")


# ---- two servers and vllm-router, in processes --------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"{url} exited: {proc.stdout.read() if proc.stdout else ''}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} did not become healthy")


def _serve(model: Path, role: str, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "deepinfer_core.cli", "serve", str(model), "--accelerator", "cpu",
                             "--dtype", "float32", "--port", str(port), "--role", role, "--max-num-seqs", "4"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, one_thread):
    """A prefill and a decode server (``deepinfer serve --role``) of the tiny V3 model, and one engine."""
    path = _checkpoint("v3", tmp_path_factory)
    logs = tmp_path_factory.mktemp("logs")
    ports = _free_port(), _free_port()
    procs = [_serve(path, role, port, logs / f"{role}.log") for role, port in zip(("prefill", "decode"), ports)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url, proc in zip(urls, procs):
            _wait_healthy(url, proc)
        yield logs, urls, procs, LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _completion(url: str, prompt: list[int], **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}, timeout=60)


def test_vllm_router_drives_a_prefill_decode_pair_to_one_engines_answer(pair, tmp_path):
    router = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    assert Path(router).exists(), "vllm-router is missing: ./build.sh installs it with the pd extra"
    logs, (prefill_url, decode_url), _, one = pair
    port = _free_port()
    proc = subprocess.Popen([router, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
                             "--prefill", prefill_url, "--decode", decode_url, "--kv-connector", "nixl",
                             "--worker-startup-timeout-secs", "60", "--prometheus-port", str(_free_port())],
                            stdout=open(tmp_path / "router.log", "w"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        prompts = [random_prompt(n, seed=n) for n in (3, 33, 100)]
        want = one.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        for p, w in zip(prompts, want):
            while True:
                try:
                    r = _completion(url, p)
                    break
                except httpx.HTTPError:
                    assert time.time() < deadline, (tmp_path / "router.log").read_text()
                    time.sleep(0.5)
            assert r.status_code == 200, (r.text, (tmp_path / "router.log").read_text())
            assert r.json()["choices"][0]["text"] == w.outputs[0].text
            assert "kv_transfer_params" not in r.json()  # the decode instance's answer
        for role in ("prefill", "decode"):  # both hops were taken, once per request
            assert (logs / f"{role}.log").read_text().count('"POST /v1/completions HTTP/1.1" 200') == len(prompts), role
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_prefill_instance_costs_its_request_not_the_decode_instance(pair, tmp_path):
    _, (prefill_url, decode_url), procs, one = pair
    prompt, other = random_prompt(50, seed=11), random_prompt(20, seed=12)
    first = _completion(prefill_url, prompt, kv_transfer_params={"do_remote_decode": True})
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_num_tokens"] == len(prompt) - 1
    assert "deepinfer_kv_transfers_parked 1.0" in httpx.get(f"{prefill_url}/metrics").text  # held for the decode side
    procs[0].send_signal(signal.SIGKILL)  # the prefill instance dies holding the blocks
    procs[0].wait()
    r = _completion(decode_url, prompt, kv_transfer_params=params)
    assert r.status_code == 502, r.text
    assert "did not arrive from the prefill instance" in r.json()["error"]["message"]
    assert httpx.get(f"{decode_url}/health").status_code == 200
    r = _completion(decode_url, other)  # the decode instance serves on
    want = one.generate([{"prompt_token_ids": other}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.outputs[0].text
    r = _completion(decode_url, other, kv_transfer_params={"do_remote_decode": True})
    assert r.status_code == 400 and "--role prefill" in r.json()["error"]["message"]


def test_a_decode_engine_reads_only_the_blocks_its_own_cache_lacks(trio):
    """A follow-up turn: the decode engine's pool caches the conversation's first blocks, so the
    READ brings only the rest (and the rings and states whole); the tokens are one engine's."""
    one, prefill, decode = trio
    first = random_prompt(70, seed=21)
    follow = first + random_prompt(40, seed=22)
    engine = decode.engine
    for rid, prompt in (("turn1", first), ("turn2", follow)):
        params = _prefill(prefill, [prompt])["0"]
        got = _run(engine, [(rid, prompt, GREEDY.model_copy(update={"kv_transfer_params": params}))])[rid]
        want = one.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, rid
        assert got.num_cached_tokens + got.num_transferred_tokens == len(prompt) - 1
    bs = engine.kv.block_size
    assert got.num_cached_tokens == (len(first) - 1) // bs * bs > 0  # turn 1's full blocks, from the decode's own pool


def test_a_prompt_the_decode_engine_caches_whole_needs_no_read_of_its_blocks(trio):
    """The same prompt twice, its tokens but the last filling whole blocks: the second time the
    decode engine's pool has every paged block (V3: nothing to READ; V4: the rings and states
    only), the prefill engine is told to free its parked blocks all the same."""
    one, prefill, decode = trio
    bs = decode.engine.kv.block_size
    prompt = random_prompt(4 * bs + 1, seed=31)
    want = one.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for rid in ("again1", "again2"):
        params = _prefill(prefill, [prompt])["0"]
        got = _run(decode.engine, [(rid, prompt, GREEDY.model_copy(update={"kv_transfer_params": params}))])[rid]
        assert got.outputs[0].token_ids == want
    assert got.num_cached_tokens == 4 * bs and got.num_transferred_tokens == 0
    deadline = time.time() + 10
    while prefill.engine.scheduler.transfer.parked and time.time() < deadline:
        prefill.engine.poll_transfers()
        time.sleep(0.01)
    assert not prefill.engine.scheduler.transfer.parked


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["v3", "v4"])
def test_on_the_gpu_a_pair_gives_one_engines_tokens(kind, tmp_path_factory):
    """The same pair on the NVIDIA backend: the caches registered as NIXL's VRAM, the READ
    posted once the device is past the steps queued before it (not run on a GPU yet: needs
    nixl-cu13 there)."""
    path = _checkpoint(kind, tmp_path_factory)
    kw = dict(model=str(path), accelerator="nvidia", dtype="float32", progress=False, max_num_seqs=8, gpu_memory_utilization=0.2)
    one, prefill, decode = LLM(**kw), LLM(**kw, kv_role="prefill"), LLM(**kw, kv_role="decode")
    assert decode.engine.scheduler.transfer.memory == "VRAM"
    prompts = [random_prompt(n, seed=n) for n in LENGTHS]
    want = one.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    params = _prefill(prefill, prompts)
    got = _run(decode.engine, [(str(i), p, GREEDY.model_copy(update={"kv_transfer_params": params[str(i)]}))
                               for i, p in enumerate(prompts)])
    for i, w in enumerate(want):
        assert got[str(i)].error is None and got[str(i)].outputs[0].token_ids == w.outputs[0].token_ids, i


def test_a_request_that_waited_past_the_prefills_keep_time_ends_with_an_error_not_a_stale_read(trio):
    """The prefill instance frees parked blocks after its timeout: a decode instance that could
    not start the READ within half of it ends the request, naming the setting, and serves on."""
    one, prefill, decode = trio
    prompt = random_prompt(50, seed=41)
    params = {**_prefill(prefill, [prompt])["0"], "timeout_s": 1e-6}  # as if it had waited that long
    engine = decode.engine
    out = _run(engine, [("late", prompt, GREEDY.model_copy(update={"kv_transfer_params": params}))])["late"]
    assert out.outputs[0].finish_reason == "abort" and "--kv-transfer-timeout" in out.error
    assert engine.kv.num_free == engine.kv.num_blocks and not engine.scheduler.transfer.busy
    again = _run(engine, [("fresh", prompt, GREEDY)])["fresh"]  # no role needed for a plain request
    assert again.outputs[0].token_ids == one.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_seeded_samples_of_a_request_are_one_engines_through_the_pair(trio):
    """n=2 sampled with a seed: the prefill computes the prompt once, the decode's first sample reads
    it and the second starts from the first's blocks; both draw what one engine draws (the decode
    samples the first token itself)."""
    one, prefill, decode = trio
    prompt = random_prompt(45, seed=51)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=8)
    want = one.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    kv = _prefill(prefill, [prompt], params)["0"]
    got = _run(decode.engine, [("n2", prompt, params.model_copy(update={"kv_transfer_params": kv}))])["n2"]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert got.outputs[0].token_ids != got.outputs[1].token_ids  # two samples, not one copied


@pytest.mark.parametrize("rows", [16, 48, 64, 100])
def test_the_read_spans_of_blocks_beyond_this_tensor_are_where_a_larger_pool_keeps_them(rows):
    """A decode instance computes the prefill's spans from its own tensor (``block_spans``), and
    the prefill's block numbers may lie beyond it: the spans of those blocks are the bytes a
    larger pool of the same layout holds them in (FP8 records whose rows straddle pages too; the
    layout itself is checked against ops/kv_record's in test_kv_tiers.py)."""
    from deepinfer_core.ops.kv_record import RECORD_BYTES, record_rows

    small, large = 2, 7
    records = [torch.zeros(record_rows(n * rows), RECORD_BYTES, dtype=torch.uint8) for n in (small, large)]
    plain = [torch.zeros(n, rows, 24, dtype=torch.bfloat16) for n in (small, large)]
    for mine, theirs in (records, plain):
        for block in range(large):
            want = [(v.data_ptr() - theirs.data_ptr(), v.numel()) for v in block_views(theirs, rows, block)]
            assert block_spans(mine, rows, block) == want, (mine.dtype, block)


def test_a_prefill_engine_reset_with_parked_blocks_fails_their_reads_not_serves_other_bytes(trio):
    """An engine reset (a failed step's abort_all) frees the parked blocks for reuse: the prefill
    engine restarts its NIXL agent, so a decode engine still holding the old kv_transfer_params
    gets a failed READ (the request ends with an error), and the new agent serves the next pair."""
    one, prefill, decode = trio
    prompt = random_prompt(60, seed=61)
    stale = _prefill(prefill, [prompt])["0"]
    before = prefill.engine.scheduler.transfer.name
    prefill.engine.abort_all()
    assert prefill.engine.scheduler.transfer.name != before and not prefill.engine.scheduler.transfer.parked
    _prefill(prefill, [random_prompt(60, seed=62)])  # another request's bytes may now sit in those blocks
    out = _run(decode.engine, [("stale", prompt, GREEDY.model_copy(update={"kv_transfer_params": stale}))])["stale"]
    assert out.error is not None and "did not arrive from the prefill instance" in out.error
    fresh = _prefill(prefill, [prompt])["0"]
    got = _run(decode.engine, [("fresh", prompt, GREEDY.model_copy(update={"kv_transfer_params": fresh}))])["fresh"]
    want = one.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert got.error is None and got.outputs[0].token_ids == want.outputs[0].token_ids


def test_a_read_that_does_not_end_before_the_prefills_keep_time_ends_its_request(trio, monkeypatch):
    """A READ still in flight when 90% of the prefill's keep time (from the request's arrival) is
    gone is given up: the request ends naming the setting, its blocks come back, the engine goes on."""
    _, prefill, decode = trio
    prompt = random_prompt(50, seed=71)
    params = {**_prefill(prefill, [prompt])["0"], "timeout_s": 0.4}
    transfer = decode.engine.scheduler.transfer
    monkeypatch.setattr(transfer.agent, "check_xfer_state", lambda handle: "PROC")  # as if the network stalled
    out = _run(decode.engine, [("stalled", prompt, GREEDY.model_copy(update={"kv_transfer_params": params}))])["stalled"]
    assert out.outputs[0].finish_reason == "abort" and "did not end in time" in out.error and "--kv-transfer-timeout" in out.error
    monkeypatch.undo()
    deadline = time.time() + 10
    while transfer.busy and time.time() < deadline:
        decode.engine.poll_transfers()
    assert not transfer.busy and decode.engine.kv.num_free == decode.engine.kv.num_blocks
