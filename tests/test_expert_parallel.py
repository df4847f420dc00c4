"""Expert parallelism for one MoE layer (deepinfer_core/parallel/expert_parallel.py) across 2 and 4
CPU processes on gloo: every rank's tokens get the same routed-expert output as the reference
``moe_experts`` over all experts in one process, with the plain layout and with an EPLB
placement holding copies of the hot experts, including a rank that has no tokens. A communicator
offering the optional fused ``moe_dispatch`` / ``moe_combine`` is used through them, and one that
declines falls back to the all_to_all exchange, with the same outputs. And the communicator
comes from the backend's ``deepinfer_communicator`` when it has one."""

from __future__ import annotations

import os
import socket
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core.parallel.communicator import TorchCommunicator, communicator_for
from deepinfer_core.parallel.eplb import Placement, num_physical_experts, rebalance
from deepinfer_core.parallel.expert_parallel import (ExpertShard, _Layer, combine_all_to_all, dispatch_all_to_all,
                                                     moe_expert_parallel)
from deepinfer_core.ops.moe import moe_experts

EXPERTS, TOP_K, HIDDEN, INTER = 8, 3, 16, 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layer(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5
    return w13, w2


def _tokens(rank: int, world: int, empty_rank: int | None):
    """This rank's tokens, skewed towards experts 0 and 1 (so EPLB has hot experts to copy)."""
    g = torch.Generator().manual_seed(100 + rank)
    count = 0 if rank == empty_rank else 5 + 3 * rank
    x = torch.randn(count, HIDDEN, generator=g)
    popularity = torch.tensor([8.0, 6.0] + [1.0] * (EXPERTS - 2))
    ids = torch.stack([torch.multinomial(popularity, TOP_K, generator=g) for _ in range(count)]) if count else torch.zeros(0, TOP_K, dtype=torch.int64)
    weights = torch.rand(count, TOP_K, generator=g)
    return x, weights, ids


def _placement(kind: str, world: int) -> Placement:
    if kind == "plain":
        return Placement.contiguous(1, EXPERTS, world)
    load = torch.tensor([[40.0, 30.0] + [5.0] * (EXPERTS - 2)])
    return rebalance(load, num_physical_experts(EXPERTS, world, extra=world), world)


class _FusedByAllToAll(TorchCommunicator):
    """A communicator with the optional fused pair (``moe_dispatch`` / ``moe_combine``) made of the
    core's own all_to_all dispatch and combine, blocking: through it the layer must give exactly
    what it gives without it. ``mode`` "weights in combine": the dispatch hands the expert op
    weights of one and the combine applies the routing weights (the other way the contract
    allows; exact too, a product by 1.0 being exact). "declining": every call is declined."""

    def __init__(self, mode: str = "plain"):
        super().__init__()
        self.mode, self.calls = mode, Counter()

    def moe_dispatch(self, x, topk_weights, topk_ids, slots, num_slots):
        self.calls["dispatch"] += 1
        assert slots.shape == topk_ids.shape == topk_weights.shape and slots.dtype == torch.int64
        assert num_slots % self.size == 0 and bool((slots >= 0).all()) and bool((slots < num_slots).all())
        if self.mode == "declining":
            return None
        got = dispatch_all_to_all(self, x, topk_weights, topk_ids, slots, num_slots // self.size).wait()
        if self.mode == "weights in combine":
            got.state["weights"], got.weights = got.weights, torch.ones_like(got.weights)
        return got

    def moe_combine(self, y, dispatched):
        self.calls["combine"] += 1
        if self.mode == "weights in combine":
            y = y * dispatched.state["weights"].to(y.dtype)
        return combine_all_to_all(self, y, dispatched)


def _worker(rank: int, world: int, port: int, kind: str, empty_rank: int | None, backend: str = "gloo") -> None:
    """One rank: its tokens' routed experts across the group against ``moe_experts`` over all
    experts; then the same through communicators offering the fused pair (``_FusedByAllToAll``),
    bit for bit. ``backend`` "nccl" (tests/nvidia/test_multi_gpu.py): rank r computes on GPU r and
    the exchange runs over NCCL; the reference stays on the CPU."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world, **({"device_id": device} if device.type == "cuda" else {}))
    try:
        torch.set_num_threads(1)
        w13, w2 = _layer()
        placement = _placement(kind, world)
        if kind == "eplb":
            assert int(placement.replicas[0, 0]) > 1, "the hot expert should have copies"
        shard = ExpertShard.from_full(w13.to(device), w2.to(device), placement, rank)
        x, weights, ids = _tokens(rank, world, empty_rank)
        on = [t.to(device) for t in (x, weights, ids)]
        got, during = moe_expert_parallel(*on, shard, TorchCommunicator(), moe_experts, lambda: on[0] * 2)
        want = moe_experts(x, w13, w2, weights, ids)
        assert got.device == device
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5 if device.type == "cuda" else 1e-6)
        assert torch.equal(during, on[0] * 2)
        for mode in ("plain", "weights in combine", "declining"):
            comm = _FusedByAllToAll(mode)
            fused, during = moe_expert_parallel(*on, shard, comm, moe_experts, lambda: on[0] * 3)
            assert torch.equal(fused, got), mode
            assert torch.equal(during, on[0] * 3)
            assert comm.calls == Counter(dispatch=1, combine=0 if mode == "declining" else 1), (mode, comm.calls)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, kind, empty_rank", [(2, "plain", None), (2, "eplb", 1), (4, "plain", 0), (4, "eplb", 2)])
def test_expert_parallel_matches_one_process(world, kind, empty_rank):
    mp.spawn(_worker, args=(world, _free_port(), kind, empty_rank), nprocs=world, join=True)


def _move_worker(rank: int, world: int, port: int) -> None:
    """EPLB's weight move (``_Layer.move_to``) of FP8 experts with their block scales: after it,
    every rank's slots hold, bit for bit, the experts the new placement gives them."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        w13, w2 = (w.to(torch.float8_e4m3fn) for w in _layer())
        g = torch.Generator().manual_seed(7)
        s13, s2 = torch.rand(EXPERTS, 3, 1, generator=g), torch.rand(EXPERTS, 1, 2, generator=g)
        slots = num_physical_experts(EXPERTS, world, extra=world)
        old = rebalance(torch.ones(1, EXPERTS), slots, world)
        new = rebalance(torch.tensor([[40.0, 30.0] + [5.0] * (EXPERTS - 2)]), slots, world)
        assert not torch.equal(old.phy2log, new.phy2log)
        shard = ExpertShard.from_full(w13, w2, old, rank, w13_scale=s13, w2_scale=s2, block=(128, 128))
        moved = _Layer(SimpleNamespace(comm=TorchCommunicator()), 0, None, shard).move_to(new)
        want = ExpertShard.from_full(w13, w2, new, rank, w13_scale=s13, w2_scale=s2, block=(128, 128))
        assert moved > 0 and shard.placement is new
        for name in ("w13", "w2", "w13_scale", "w2_scale"):
            got, expected = getattr(shard, name), getattr(want, name)
            assert got.dtype == expected.dtype and torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), name
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_eplb_moves_fp8_experts_and_their_scales_bit_for_bit():
    mp.spawn(_move_worker, args=(2, _free_port()), nprocs=2, join=True)


class _OneRank:
    """A one-rank communicator recording when exchanges start and finish."""

    rank, size = 0, 1

    def __init__(self, events: list[str], overlapping: bool):
        self.events = events
        if not overlapping:
            self.all_to_all_start = None  # a backend communicator without the non-blocking exchange

    def all_to_all(self, send, send_counts, recv_counts=None):
        self.events.append("exchange")
        return send.clone(), list(send_counts)

    def all_to_all_start(self, send, send_counts, recv_counts):
        self.events.append("start")
        events = self.events

        class Pending:
            def wait(self):
                events.append("wait")
                return send.clone()

        return Pending()


@pytest.mark.parametrize("overlapping", [True, False])
def test_the_shared_expert_runs_while_the_dispatch_is_in_flight(overlapping):
    w13, w2 = _layer()
    placement = _placement("plain", 1)
    x, weights, ids = _tokens(0, 1, None)
    events: list[str] = []
    got, during = moe_expert_parallel(x, weights, ids, ExpertShard.from_full(w13, w2, placement, 0), _OneRank(events, overlapping),
                                      moe_experts, lambda: events.append("shared") or "shared out")
    torch.testing.assert_close(got, moe_experts(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-6)
    assert during == "shared out"
    if overlapping:  # counts, then rows and (weight, slot) started, the shared expert, then both waited for, then the combine
        assert events == ["exchange", "start", "start", "shared", "wait", "wait", "exchange"]
    else:
        assert events == ["exchange", "exchange", "exchange", "shared", "exchange"]


def test_a_shard_holds_its_slots_weights():
    w13, w2 = _layer()
    placement = _placement("eplb", 4)
    per = placement.slots_per_gpu
    for rank in range(4):
        shard = ExpertShard.from_full(w13, w2, placement, rank)
        for s, e in enumerate(placement.phy2log[0, rank * per:(rank + 1) * per].tolist()):
            assert torch.equal(shard.w13[s], w13[e]) and torch.equal(shard.w2[s], w2[e])


def _backend(name: str, communicator):
    from deepinfer_core.hookspecs import SPEC_VERSION, BackendInfo, ProbeResult, hookimpl

    return SimpleNamespace(
        deepinfer_backend=hookimpl(lambda: BackendInfo(name=name, priority=-10, min_spec_version=SPEC_VERSION,
                                                       max_spec_version=SPEC_VERSION)),
        deepinfer_probe=hookimpl(lambda: ProbeResult(True)),
        deepinfer_communicator=hookimpl(lambda platform, group: communicator),
    )


def test_the_backends_communicator_is_used_when_it_has_one():
    from deepinfer_core.plugins import PluginManager

    provided = object()
    manager = PluginManager()
    manager.add("commchip", _backend("commchip", provided))
    manager.add("plainchip", _backend("plainchip", None))
    assert not manager.backends["commchip"].error and not manager.backends["plainchip"].error
    assert communicator_for(manager, "commchip", platform=None, group="g") is provided
    with pytest.raises(ValueError, match="process group has not been initialized"):  # the core's torch.distributed one
        communicator_for(manager, "plainchip", platform=None)
