"""The Ascend communicator's fused MoE dispatch-combine (``HcclCommunicator.moe_dispatch`` /
``moe_combine`` over torch_npu's ``npu_moe_distribute_dispatch_v2`` / ``combine_v2``), on the CPU.

These test OUR GLUE, NOT THE CHIP, NOR HCCL: ``torch_npu`` is ``tests/ascend/fake_torch_npu.py``, a
test-only model of the two operators' documented semantics and limits (its docstrings name the
documents), and a 2-process gloo group stands in for the HCCL communicator (the name the glue
asks torch_npu for is mapped to it). A pass shows that the arguments the communicator builds are
the ones the documents ask for, on every rank alike, that the expert-parallel layer around it
gives each rank the single-process ``moe_experts`` result (within the bf16 tolerance of
specs/ops.toml: the fused combine adds a token's experts in its own order, in float32), and that
calls outside the operators' limits go, on every rank, through the all_to_all path instead.
The chip's own behaviour is for the ``npu``-marked test in test_hardware.py.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_ascend_950 import hccl
from deepinfer_core.ops.moe import moe_experts
from deepinfer_core.parallel.eplb import Placement, num_physical_experts, rebalance
from deepinfer_core.parallel.expert_parallel import ExpertShard, moe_expert_parallel

from . import fake_torch_npu as fake

EXPERTS, TOP_K, HIDDEN, INTER = 8, 3, 1024, 32  # H = 1024: the smallest the operators take
TOL = 3e-2  # specs/ops.toml, moe_experts in bfloat16
NAME = "hccl-ep-stand-in"

# (what, placement, tokens on rank 0 and rank 1, dtype, communicator's token cap, HCCL_BUFFSIZE, fused?)
CASES = [
    ("plain placement", "plain", (5, 8), torch.bfloat16, None, None, True),
    ("EPLB copies, rank 1 without tokens", "eplb", (6, 0), torch.bfloat16, None, None, True),
    ("float16", "plain", (3, 4), torch.float16, None, None, True),
    ("rank 0 above the token cap, rank 1 below", "plain", (5, 3), torch.bfloat16, 4, None, False),
    ("float32 rows", "plain", (5, 8), torch.float32, None, None, False),
    ("HCCL_BUFFSIZE too small", "plain", (5, 8), torch.bfloat16, None, "1", False),
]


def _layer(dtype):
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5
    return w13.to(dtype), w2.to(dtype)


def _tokens(rank: int, count: int, dtype):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(count, HIDDEN, generator=g).to(dtype)
    popularity = torch.tensor([8.0, 6.0] + [1.0] * (EXPERTS - 2))
    ids = (torch.stack([torch.multinomial(popularity, TOP_K, generator=g) for _ in range(count)]) if count
           else torch.zeros(0, TOP_K, dtype=torch.int64))
    return x, torch.rand(count, TOP_K, generator=g), ids


def _placement(kind: str, world: int) -> Placement:
    if kind == "plain":
        return Placement.contiguous(1, EXPERTS, world)
    load = torch.tensor([[40.0, 30.0] + [5.0] * (EXPERTS - 2)])
    placement = rebalance(load, num_physical_experts(EXPERTS, world, extra=world), world)
    assert int(placement.replicas[0, 0]) > 1, "the hot expert should have copies"
    return placement


def _communicator(cap):
    """An HcclCommunicator on the gloo group (its backend check answered 'hccl' while it is built)."""
    real = dist.get_backend
    dist.get_backend = lambda group=None: "hccl"
    try:
        return hccl.HcclCommunicator(moe_max_tokens=cap)
    finally:
        dist.get_backend = real


def _cases(rank: int, world: int) -> None:
    fake.GROUPS[NAME] = dist.group.WORLD
    asked = []
    hccl.hccl_comm_name = lambda group, r: asked.append((group, r)) or NAME
    for what, kind, counts, dtype, cap, buffsize, fused in CASES:
        if buffsize is None:
            os.environ.pop("HCCL_BUFFSIZE", None)
        else:
            os.environ["HCCL_BUFFSIZE"] = buffsize
        fake.CALLS.clear()
        comm = _communicator(cap)
        w13, w2 = _layer(dtype)
        shard = ExpertShard.from_full(w13, w2, _placement(kind, world), rank)
        x, weights, ids = _tokens(rank, counts[rank], dtype)
        got, during = moe_expert_parallel(x, weights, ids, shard, comm, moe_experts, lambda x=x: x * 2)
        want = moe_experts(x, w13, w2, weights, ids)  # one process, every expert
        assert got.dtype == dtype and got.shape == x.shape, what
        tol = TOL if dtype == torch.bfloat16 else 5e-3 if dtype == torch.float16 else 1e-5
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m, what=what: f"{what}: {m}")
        assert torch.equal(during, x * 2), what
        calls = 1 if fused else 0
        assert fake.CALLS["npu_moe_distribute_dispatch_v2"] == fake.CALLS["npu_moe_distribute_combine_v2"] == calls, \
            (what, dict(fake.CALLS))
    assert asked and all(a == (None, rank) for a in asked)  # the default group's name, asked with this rank


def _rank(rank: int, world: int, store: str) -> None:
    # a file store: no TCP port picked beforehand that another process could take meanwhile
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        sys.modules["torch_npu"] = fake  # this process is one rank of the test, nothing else runs in it
        _cases(rank, world)  # its communicators and tensors are gone when it returns
        dist.barrier()
    finally:
        # no reference to the gloo group may outlive destroy_process_group: a group freed later, at the
        # interpreter's exit, can abort the process ("terminate called without an active exception",
        # seen once in CI under load)
        fake.GROUPS.clear()
        dist.destroy_process_group()


def test_the_expert_parallel_moe_through_the_modelled_operators_matches_one_process(tmp_path):
    mp.spawn(_rank, args=(2, str(tmp_path / "store")), nprocs=2, join=True)


def test_a_group_of_one_rank_never_dispatches(monkeypatch, tmp_path):
    """ep_world_size is at least 2 (both documents): one rank's group declines before any collective."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        comm = _communicator(None)
        monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("no collective for a group of one"))
        x, weights, ids = _tokens(0, 4, torch.bfloat16)
        assert comm.moe_dispatch(x, weights, ids, ids, EXPERTS) is None
    finally:
        dist.destroy_process_group()


def test_the_buffer_formula_and_the_token_cap():
    # the document's A3 formula, by hand for DeepSeek-V3's layer on 16 ranks (256 experts, H 7168, K 8, 512 tokens)
    row = ((2 * 7168 + 31) // 32 * 32 + 64 + 511) // 512 * 512  # Align512(Align32(2H) + 64) = 14848
    assert hccl.mc2_buffer_bytes(16, 16, 512, 7168, 8) == 2 * (16 * 512 * 16 * row + 9 * 512 * 14336)
    assert hccl.mc2_buffer_bytes(16, 16, 64, 7168, 8) * 8 == hccl.mc2_buffer_bytes(16, 16, 512, 7168, 8)
