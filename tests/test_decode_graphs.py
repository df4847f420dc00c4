"""DecodeGraphs' bookkeeping, on the CPU.

Graph capture needs a GPU (tests/test_gpu.py replays real CUDA graphs); here the platform's
GraphBackend is a stand-in whose "replay" recomputes the forward into the captured outputs.
Everything else runs for real against eager engine steps: static buffers, padding rows and
padded verification rows, full-width block tables, and the incremental block tables across
preemption and batch changes.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer_core.engine.startup import warm_up
from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.graphs import BlockTableBuffer, DecodeGraphs, max_blocks_per_group
from deepinfer_core.models.batch import BatchMeta
from deepinfer_core.ops import REFERENCE_OPS
from tests.hf_checkpoints import write_checkpoint

# Three prompts: decode batches of 3 are padded to the bucket of 4.
PROMPTS = [[5, 17, 42, 99, 3, 64, 7], [11, 12], [150, 2, 2, 8, 33, 41, 90, 100, 120, 7, 6, 5, 4]]


class RecomputeGraphs:
    """A GraphBackend stand-in: "replay" recomputes the captured function into its outputs."""

    def __init__(self):
        self.captured: list[object] = []

    def capture(self, fn):
        out = fn()
        self.captured.append(out)
        return (fn, out), out

    def replay(self, graph):
        fn, out = graph
        new = fn()
        for a, b in zip(out, new) if isinstance(out, tuple) else ((out, new),):
            a.copy_(b)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("graphs") / "ckpt"
    write_checkpoint("v3_grouped", path)
    return path


def with_graphs(engine, sizes=(1, 2, 4), buckets=()):
    """Give a CPU engine decode graphs captured the way a graph platform's engine does at start-up
    (``buckets``: context buckets, in tokens, for a ``graphs_by_context`` model)."""
    lookahead = engine.kv.lookahead
    query_lens = (1, 1 + lookahead) if lookahead else (1,)
    widths = max_blocks_per_group(engine.cache_groups, engine.max_model_len, engine.kv.block_size, max(query_lens), engine.kv.rings)
    graphs = DecodeGraphs(engine.model, engine.kv_cache.tensors, engine.cache_groups, widths, sizes, query_lens,
                          engine.device, RecomputeGraphs(), keep_streams=engine.runner.keep_hidden and engine.model.mtp_reads_streams,
                          context_buckets=buckets, block_size=engine.kv.block_size)
    graphs.capture_all(progress=False)
    engine.runner.graphs = graphs
    return graphs


def _generate(checkpoint, graphs: bool, **engine_args):
    llm = LLM(model=str(checkpoint), accelerator="cpu", dtype="float32", block_size=4, progress=False, **engine_args)
    engine = llm.engine
    replays = []
    if graphs:
        g = with_graphs(engine)
        warm_up(engine, g.sizes, progress=False)  # as a graph platform's engine starts: rows reused afterwards
        real = g.replay
        g.replay = lambda hb, q_len, fill: replays.append((len(hb.seq_lens), q_len)) or real(hb, q_len, fill)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2)
    return llm.generate(PROMPTS, params, use_tqdm=False), engine, replays


@pytest.mark.parametrize("num_kv_blocks", [None, 12], ids=["roomy", "preempting"])
def test_graph_steps_match_eager_steps(checkpoint, num_kv_blocks):
    expected, eager, _ = _generate(checkpoint, False, num_kv_blocks=num_kv_blocks)
    got, engine, replays = _generate(checkpoint, True, num_kv_blocks=num_kv_blocks)
    assert replays and any(n == 3 for n, _ in replays), "the padded bucket (3 rows in a graph of 4) was never used"
    assert len(engine.runner.graphs.graphs) == 3  # every bucket captured at start-up
    assert engine.num_preemptions == eager.num_preemptions
    if num_kv_blocks:
        assert engine.num_preemptions > 0, "the small cache was meant to force a preemption"
    for a, b in zip(expected, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and all(abs(la[t] - lb[t]) < 1e-5 for t in la)


def test_verification_rows_replay_padded_graphs(checkpoint):
    """With n-gram speculation, decode rows of 1 + k tokens replay the (batch, 1 + k) graphs, rows
    with fewer drafts padded: the tokens are plain greedy decoding's."""
    expected, _, _ = _generate(checkpoint, False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    got, engine, replays = _generate(checkpoint, True, speculative_config=spec)
    assert {q for _, q in replays} == {1, 4} and engine.num_draft_tokens > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_block_table_buffer_matches_rebuilding_every_step():
    """Rows shift, sequences grow, leave, return, and get new blocks after a preemption."""
    rng = random.Random(0)
    buffer = BlockTableBuffer(max_batch=6, max_blocks=10)
    seqs = {i: ([rng.randrange(100) for _ in range(rng.randint(1, 4))], 0) for i in range(8)}
    for _ in range(300):
        order = rng.sample(sorted(seqs), rng.randint(1, 6))
        for sid in order:
            blocks, preemptions = seqs[sid]
            roll = rng.random()
            if roll < 0.1:  # preempted: new blocks, new key
                seqs[sid] = ([rng.randrange(100) for _ in range(rng.randint(1, 3))], preemptions + 1)
            elif roll < 0.5 and len(blocks) < 10:
                blocks.append(rng.randrange(100))
        tables = [seqs[sid][0] for sid in order]
        out = buffer.fill([(sid, seqs[sid][1]) for sid in order], tables)
        assert out.shape == (len(order), 10) and out.dtype == np.int32
        for row, table in zip(out, tables):
            assert row[: len(table)].tolist() == table


# Six prompts, each generating two tokens more than the one before: decode batches shrink 6, 5, 4,
# 3, 2, 1 through the buckets (1, 2, 4, 8), the earliest rows finishing first so the later ones
# shift down. Every padded step (6 or 5 rows in 8, 3 in 4) follows a larger one (or the warm-up's
# full buckets) that left a live sequence's ids, slots, lengths and block table in its padding rows.
SIX = [[5, 17, 42, 99, 3, 64, 7], [11, 12], [150, 2, 2, 8, 33], [9, 8, 7, 6, 5, 4, 3, 2, 1], [60, 61], [100, 7, 100, 7, 100]]
SIX_PARAMS = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True, logprobs=2) for i in range(len(SIX))]


def _padding_state(g, n: int, size: int, q_len: int) -> dict[str, list]:
    """What the padding rows [n, size) of the static buffers hold now."""
    t, total = n * q_len, size * q_len
    state = {"ids": g.input_ids[t:total].tolist(), "positions": g.positions[t:total].tolist(),
             "seq_lens": g.seq_lens[n:size].tolist()}
    for name in g.slots:
        state[f"slots.{name}"] = g.slots[name][t:total].tolist()
        state[f"tables.{name}"] = g.tables[name][n:size].tolist()
    for name in g.valid_from:
        state[f"valid_from.{name}"] = g.valid_from[name][n:size].tolist()
    return state


def test_padding_rows_are_reset_after_a_larger_step(checkpoint):
    """Padding rows repeat row 0 with nothing written (graphs.py's contract), whatever a previous,
    larger step left in them: ids and positions of row 0, slots -1, row 0's length and block
    table. A stale slot would write a padding token into a live sequence's cache; the tokens and
    logprobs are the eager run's."""
    expected = LLM(model=str(checkpoint), accelerator="cpu", dtype="float32", block_size=4,
                   progress=False).generate(SIX, SIX_PARAMS, use_tqdm=False)
    llm = LLM(model=str(checkpoint), accelerator="cpu", dtype="float32", block_size=4, progress=False)
    g = with_graphs(llm.engine, sizes=(1, 2, 4, 8))
    warm_up(llm.engine, g.sizes, progress=False)
    real, padded, stale, wrong = g.replay, [], set(), []

    def replay(hb, q_len, fill):
        n = len(hb.seq_lens)
        size = next(s for s in g.sizes if s >= n)
        before = _padding_state(g, n, size, q_len)
        hidden = real(hb, q_len, fill)
        if size == n:
            return hidden
        pad = size - n
        want = {"ids": hb.ids[:q_len] * pad, "positions": hb.positions[:q_len] * pad, "seq_lens": [hb.seq_lens[0]] * pad}
        for name in g.slots:
            want[f"slots.{name}"] = [-1] * (pad * q_len)
            want[f"tables.{name}"] = g.tables[name][:1].expand(pad, -1).tolist()  # row 0's, at full width
        for name in g.valid_from:
            want[f"valid_from.{name}"] = [hb.valid_from[name][0]] * pad
        now = _padding_state(g, n, size, q_len)
        wrong.extend((n, size, k, now[k], want[k]) for k in want if now[k] != want[k])
        padded.append((n, size))
        stale.update(k for k in want if before[k] != want[k])
        return hidden

    g.replay = replay
    got = llm.generate(SIX, SIX_PARAMS, use_tqdm=False)
    assert not wrong, f"padding rows not reset (rows, bucket, buffer, found, expected): {wrong[:3]}"
    assert {(6, 8), (5, 8), (3, 4)} <= set(padded)
    # the padding rows did hold another row's data before those steps: the resets were needed
    assert {"ids", "positions", "seq_lens", "slots.mla", "tables.mla"} <= stale
    for a, b in zip(expected, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and all(abs(la[t] - lb[t]) < 1e-5 for t in la)


def _generate_v4(path, graphs: bool, buckets=(), **engine_args):
    """A V4 checkpoint's greedy tokens; with ``graphs``, its decode steps replayed from graphs
    captured over full-width block tables (the index tensors' shapes must not follow the batch),
    and over narrower ones per context bucket (``buckets``)."""
    llm = LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False, **engine_args)
    engine = llm.engine
    replays = []
    if graphs:
        g = with_graphs(engine, buckets=buckets)
        warm_up(engine, g.sizes, progress=False)
        real = g.replay
        g.replay = lambda hb, q_len, fill: replays.append((len(hb.seq_lens), q_len, max(hb.seq_lens))) or real(hb, q_len, fill)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompts = [[(7 * i + 3) % 150 + 2 for i in range(n)] for n in (70, 9, 33)]
    return llm.generate(prompts, params, use_tqdm=False), engine, replays


@pytest.mark.parametrize("name", ["v4_flash_like", "v4_swa_nohash", "v4_flash_like+fp8kv"])
def test_v4_graph_steps_match_eager_steps(tmp_path, name):
    """DeepSeek-V4's decode steps replayed from graphs (sliding window rings, compressed entries
    read in place through full-width tables, every decode token pooling a window) give the eager
    steps' tokens and logprobs, through the padded bucket (3 rows in a graph of 4); with FP8 KV
    records too (V4's real key rows; the window rows written before the attention)."""
    from tests.hf_checkpoints_v4 import write_checkpoint_v4

    name, _, variant = name.partition("+")
    path = tmp_path / name
    fp8 = variant == "fp8kv"
    write_checkpoint_v4(name, path, **(dict(head_dim=512, qk_rope_head_dim=64, index_head_dim=64) if fp8 else {}))
    kv = {"kv_cache_dtype": "fp8"} if fp8 else {}
    expected, _, _ = _generate_v4(path, False, **kv)
    got, engine, replays = _generate_v4(path, True, **kv)
    assert engine.model.supports_graphs and replays and any(n == 3 for n, _, _ in replays)
    # FP8 records: a graph's padded batch rounds some float32 sums differently (~1e-7), and where
    # a value sits at an e4m3 rounding boundary its record moves by a whole e4m3 step (2^-4):
    # measured worst logprob difference 0.0086 over the 10 steps (float32 KV: 2e-6)
    bound = 0.05 if fp8 else 1e-5
    for a, b in zip(expected, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and all(abs(la[t] - lb[t]) < bound for t in la)


class SyncWatch(TorchDispatchMode):
    """Records the aten ops that make the host wait for the device (a value read back, or an
    output whose shape depends on values): none may run in a forward a graph captures. Paused
    inside the op table's calls: each backend's ops answer for themselves (their kernels are
    captured on the GPU; the reference's are not meant to be)."""

    SYNCING = {"aten.nonzero.default", "aten._local_scalar_dense.default", "aten.masked_select.default",
               "aten._unique2.default", "aten.unique_consecutive.default", "aten.unique_dim.default"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if not self.paused:
            boolean_index = name.startswith(("aten.index.", "aten.index_put")) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) if i is not None)
            unsized_repeat = name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None
            if name in self.SYNCING or boolean_index or unsized_repeat:
                self.seen.append(name)
        return func(*args, **kwargs)


def test_v4_decode_forward_never_waits_for_the_device(tmp_path, monkeypatch):
    """Every decode-only forward of V4 (target and MTP block) runs no synchronising aten op outside
    the op table: the model's glue (V4Batch's index tensors, the pools, the emitters) is capturable."""
    from tests.hf_checkpoints_v4 import write_checkpoint_v4

    path = tmp_path / "v4"
    write_checkpoint_v4("v4_flash_like", path, with_mtp=True)
    llm = LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    model, watch, checked = llm.engine.model, SyncWatch(), []
    for name in list(model.ops.__dict__):
        fn = model.ops.__dict__[name]
        if callable(fn) and name in REFERENCE_OPS:
            def paused(*a, _fn=fn, **k):
                watch.paused += 1
                try:
                    return _fn(*a, **k)
                finally:
                    watch.paused -= 1
            monkeypatch.setitem(model.ops.__dict__, name, paused)

    def watched(original):
        def run(*args, **kwargs):
            batch = next(a for a in args if isinstance(a, BatchMeta))
            if batch.num_prefill_tokens:
                return original(*args, **kwargs)
            checked.append(original.__name__)
            with watch:
                return original(*args, **kwargs)
        return run

    for name in ("forward", "forward_streams", "forward_mtp"):
        monkeypatch.setattr(model, name, watched(getattr(model, name)))
    prompts = [[(7 * i + 3) % 150 + 2 for i in range(n)] for n in (70, 9)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert "forward_streams" in checked and "forward_mtp" in checked
    assert not watch.seen, sorted(set(watch.seen))


def test_v4_graphs_by_context_bucket(tmp_path):
    """A graphs_by_context model's steps replay the graph of the narrowest context bucket holding
    their longest sequence (here 75 tokens, then the full width once a sequence outgrows it): the
    eager steps' tokens either way, and both kinds of graph are used."""
    from deepinfer_core.engine.graphs import context_buckets
    from tests.hf_checkpoints_v4 import write_checkpoint_v4

    assert context_buckets(100_000) == (4096, 16384, 65536) and context_buckets(4096) == ()
    path = tmp_path / "v4"
    write_checkpoint_v4("v4_flash_like", path)
    expected, _, _ = _generate_v4(path, False)
    got, engine, replays = _generate_v4(path, True, buckets=(75,))  # the 70-token prompt grows to 80
    graphs = engine.runner.graphs
    assert engine.model.graphs_by_context and graphs.buckets == [75] and len(graphs.bucket_graphs) == len(graphs.graphs)
    assert any(longest <= 75 for _, _, longest in replays) and any(longest > 75 for _, _, longest in replays)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


@pytest.mark.parametrize("kw, steps, prompts", [
    (dict(max_num_batched_tokens=100, max_model_len=256), [16, 32, 64, 100], [16, 32, 64, 100]),
    (dict(max_num_batched_tokens=100, max_model_len=40, max_num_seqs=8, num_kv_blocks=100), [16, 32, 64, 100],
     [16, 32, 36, 28, 36, 36, 28]),
    (dict(max_num_batched_tokens=100, max_model_len=40, max_num_seqs=2, num_kv_blocks=100), [16, 32, 64, 72],
     [16, 32, 36, 28, 36, 36]),
], ids=["one-prompt-a-step", "prompts-of-max-model-len", "at-most-max-num-seqs"])
def test_the_prefill_warm_up_runs_long_steps_up_to_a_chunk(checkpoint, kw, steps, prompts, monkeypatch):
    """A GPU engine's warm-up also runs prefill steps of (here) 16, 32, 64, ... tokens and of a whole
    chunk, each of prompts of their own (several of max_model_len - 4 tokens where a step is longer,
    at most max_num_seqs of them, added together for the scheduler to pack), every token computed
    (no prefix-cache hit between them), so that a first long request or batch finds its prefill
    kernels compiled; nothing of them stays behind."""
    from deepinfer_core.engine import startup

    monkeypatch.setattr(startup, "WARM_PREFILL_TOKENS", 16)
    llm = LLM(model=str(checkpoint), accelerator="cpu", dtype="float32", block_size=4, progress=False, **kw)
    engine = llm.engine
    computed, added = [], []
    forward, add = engine.model.forward, engine.add_request
    engine.model.forward = lambda ids, positions, meta, caches: computed.append(meta.num_prefill_tokens) or forward(
        ids, positions, meta, caches)
    engine.add_request = lambda prompt, params, *a, **k: added.append(len(prompt)) or add(prompt, params, *a, **k)
    assert startup.warm_up_prefill(engine) == steps
    assert added == prompts
    assert sum(computed) == sum(steps) and max(computed) >= min(steps[-1], 72) and not engine.has_unfinished()
