"""DecodeGraphs' bookkeeping, on the CPU.

CUDA-graph capture needs a GPU (tests/test_gpu.py replays real graphs); here the capture is
replaced by a stand-in whose "replay" recomputes the forward into the captured output tensor.
Everything else runs for real against eager engine steps: static buffers, padding rows, width
buckets, and the incremental block tables across preemption and batch changes.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.graphs import BlockTableBuffer, DecodeGraphs
from tests.hf_checkpoints import write_checkpoint

# Three prompts: decode batches of 3 are padded to the bucket of 4.
PROMPTS = [[5, 17, 42, 99, 3, 64, 7], [11, 12], [150, 2, 2, 8, 33, 41, 90, 100, 120, 7, 6, 5, 4]]


class ReplayByRecompute:
    def __init__(self, forward, out):
        self.forward, self.out = forward, out

    def replay(self):
        self.out.copy_(self.forward())


def _record(self, size, width):
    hidden = self._forward(size, width)
    return ReplayByRecompute(lambda: self._forward(size, width), hidden), hidden


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("graphs") / "ckpt"
    write_checkpoint("v3_grouped", path)
    return path


def _generate(checkpoint, graphs: bool, monkeypatch, **engine_args):
    llm = LLM(model=str(checkpoint), accelerator="cpu", dtype="float32", block_size=4, progress=False, **engine_args)
    engine = llm.engine
    if graphs:
        monkeypatch.setattr(DecodeGraphs, "_record", _record)
        max_blocks = math.ceil(engine.max_model_len / engine.block_manager.block_size)
        engine.runner.graphs = DecodeGraphs(engine.model, engine.kv_cache.tensors, (1, 2, 4), max_blocks, engine.device)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2)
    return llm.generate(PROMPTS, params, use_tqdm=False), engine


@pytest.mark.parametrize("num_kv_blocks", [None, 12], ids=["roomy", "preempting"])
def test_graph_steps_match_eager_steps(checkpoint, monkeypatch, num_kv_blocks):
    expected, eager = _generate(checkpoint, False, monkeypatch, num_kv_blocks=num_kv_blocks)
    got, engine = _generate(checkpoint, True, monkeypatch, num_kv_blocks=num_kv_blocks)
    graphs = engine.runner.graphs
    assert {size for size, _ in graphs.graphs} >= {4}, "the padded bucket was never used"
    assert len({width for _, width in graphs.graphs}) > 1, "contexts grew through one width bucket only"
    assert engine.num_preemptions == eager.num_preemptions
    if num_kv_blocks:
        assert engine.num_preemptions > 0, "the small cache was meant to force a preemption"
    for a, b in zip(expected, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and all(abs(la[t] - lb[t]) < 1e-5 for t in la)


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
