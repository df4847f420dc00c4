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

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.graphs import BlockTableBuffer, DecodeGraphs, max_blocks_per_group
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
        out.copy_(fn())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("graphs") / "ckpt"
    write_checkpoint("v3_grouped", path)
    return path


def with_graphs(engine, sizes=(1, 2, 4)):
    """Give a CPU engine decode graphs captured the way a graph platform's engine does at start-up."""
    lookahead = engine.kv.lookahead
    query_lens = (1, 1 + lookahead) if lookahead else (1,)
    widths = max_blocks_per_group(engine.cache_groups, engine.max_model_len, engine.kv.block_size, max(query_lens), engine.kv.rings)
    graphs = DecodeGraphs(engine.model, engine.kv_cache.tensors, engine.cache_groups, widths, sizes, query_lens,
                          engine.device, RecomputeGraphs())
    graphs.capture_all(progress=False)
    engine.runner.graphs = graphs
    return graphs


def _generate(checkpoint, graphs: bool, **engine_args):
    llm = LLM(model=str(checkpoint), accelerator="cpu", dtype="float32", block_size=4, progress=False, **engine_args)
    engine = llm.engine
    replays = []
    if graphs:
        g = with_graphs(engine)
        engine._warm_up(g.sizes, progress=False)  # as a graph platform's engine starts: rows reused afterwards
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
