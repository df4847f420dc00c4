"""Context parallelism's pieces (deepinfer_core/parallel/context_parallel.py): zig-zag chunks give every
CP rank the same causal attention work; partial attention results merged by log-sum-exp equal
the attention over all keys; and the whole exchange across 2 and 4 gloo processes (each rank
holding the KV of its own chunks) gives each rank its queries' exact attention."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core.parallel.communicator import TorchCommunicator
from deepinfer_core.parallel.context_parallel import causal_work, merge_partials, partial_attention, zigzag_chunks

HEADS, D_K, D_V, SCALE = 4, 24, 16, 0.2


@pytest.mark.parametrize("length, cp", [(64, 2), (1000, 4), (4096, 8), (7, 4)])
def test_zigzag_chunks_cover_the_prompt_once_and_balance_the_work(length, cp):
    ranks = zigzag_chunks(length, cp)
    covered = sorted(i for chunks in ranks for s, e in chunks for i in range(s, e))
    assert covered == list(range(length))
    work = [causal_work(chunks) for chunks in ranks]
    assert sum(work) == length * (length + 1) // 2
    if length % (2 * cp) == 0:
        assert len(set(work)) == 1  # exactly equal
    elif length >= 100 * cp:
        assert max(work) / min(work) < 1.01
    contiguous = [causal_work([(length * r // cp, length * (r + 1) // cp)]) for r in range(cp)]
    if length >= 64:
        assert max(contiguous) / min(contiguous) > 2  # what zig-zag avoids


def _qkv(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, HEADS, D_K, generator=g), torch.randn(tokens, D_K, generator=g),
            torch.randn(tokens, D_V, generator=g))


def test_partials_merged_by_lse_are_the_full_attention():
    q, k, v = _qkv(40)
    pos = torch.arange(40)
    full, full_lse = partial_attention(q, k, v, pos, pos, SCALE)
    # the keys in 3 uneven parts; early queries see no key of the later parts (lse -inf there)
    parts = [(0, 7), (7, 30), (30, 40)]
    outs, lses = zip(*(partial_attention(q, k[s:e], v[s:e], pos, pos[s:e], SCALE) for s, e in parts))
    assert torch.isinf(lses[2][:30]).all()
    out, lse = merge_partials(list(outs), list(lses))
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, full_lse, rtol=1e-6, atol=1e-6)
    ref = torch.softmax((torch.einsum("qhd,kd->qhk", q, k) * SCALE).masked_fill(pos[None, None, :] > pos[:, None, None], float("-inf")), -1)
    torch.testing.assert_close(full, torch.einsum("qhk,kd->qhd", ref, v), rtol=1e-5, atol=1e-6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, length: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        comm = TorchCommunicator()
        q, k, v = _qkv(length, seed=7)  # every rank can make the prompt; each keeps only its own KV
        owner = torch.empty(length, dtype=torch.int64)
        for r, chunks in enumerate(zigzag_chunks(length, world)):
            for s, e in chunks:
                owner[s:e] = r
        pos = torch.arange(length)
        mine = (owner == rank).nonzero().flatten()
        # queries go to every rank (all-gather), each attends to the keys it holds
        all_q = torch.cat(comm.all_gather(torch.cat([q[mine], torch.zeros(length - len(mine), HEADS, D_K)])), 0)
        all_pos = torch.cat(comm.all_gather(torch.cat([mine, torch.full((length - len(mine),), -1)])), 0)
        keep = all_pos >= 0
        all_q, all_pos = all_q[keep], all_pos[keep]
        out, lse = partial_attention(all_q, k[mine], v[mine], all_pos, pos[mine], SCALE)
        # each query's partials go to its owner, which merges them in rank order
        order = torch.argsort(owner[all_pos], stable=True)
        counts = torch.bincount(owner[all_pos], minlength=world).tolist()
        packed = torch.cat([out[order].flatten(1), lse[order]], dim=1)
        recv, recv_counts = comm.all_to_all(packed, counts)
        per_rank = torch.split(recv, recv_counts)
        outs = [p[:, : HEADS * D_V].view(-1, HEADS, D_V) for p in per_rank]
        lses = [p[:, HEADS * D_V:] for p in per_rank]
        merged, _ = merge_partials(outs, lses)
        full, _ = partial_attention(q, k, v, pos, pos, SCALE)
        # every source rank sent this rank's queries in the same order: the gathered order of `mine`
        torch.testing.assert_close(merged, full[mine], rtol=1e-5, atol=1e-6)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, length", [(2, 37), (4, 64)])
def test_context_parallel_attention_across_processes_is_exact(world, length):
    mp.spawn(_worker, args=(world, _free_port(), length), nprocs=world, join=True)
