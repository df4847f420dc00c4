"""The Ascend backend on an Ascend 950 (marked ``npu``: skipped unless the backend's probe finds
torch_npu, a sourced CANN and an NPU; tests/conftest.py): the platform, each mapped op against the
reference through the conformance kit, an NPU graph replay, HCCL collectives and the fused MoE
dispatch-combine (npu_moe_distribute_dispatch_v2 / combine_v2) over two NPUs, and the default
model end to end. None of these has run yet: there was no Ascend machine where they
were written.

Run them, the op-level conformance suite and the end-to-end baseline recording with one command:
``bash tools/ascend_session.sh`` (plugins/ascend_950/README.md).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from deepinfer_ascend_950 import backend, hccl, npu_ops
from deepinfer_core.conformance.ops_suite import run_op
from deepinfer_core.conformance.spec import dtype_name

pytestmark = pytest.mark.npu

FP32_MAPPED = ("rms_norm", "add_rms_norm", "silu_and_mul", "moe_route", "moe_experts", "rms_norm_f32", "rms_normalize",
               "moe_experts_clamped")
KIT_RUNS = [(op, torch.bfloat16) for op in npu_ops.OPS] + [(op, torch.float32) for op in FP32_MAPPED]


@pytest.fixture(scope="module")
def loaded():
    """(platform, op table) as the engine gets them on this machine."""
    from deepinfer_core.plugins import load_backend

    _, chosen, platform, ops, _ = load_backend("ascend")
    assert chosen.name == "ascend"
    return platform, ops


def test_the_platform_is_an_ascend_950(loaded):
    platform, ops = loaded
    assert platform.name == "ascend-950" and platform.device.startswith("npu:")
    assert "950" in platform.extra["device_name"], platform.extra["device_name"]
    assert {name for name, who in ops.providers.items() if who == "ascend"} == set(backend.deepinfer_op_plan().provides)
    assert set(npu_ops.OPS) <= {name for name, who in ops.providers.items() if who == "ascend"}


def test_this_torch_npu_has_every_operator_the_glue_calls(loaded):
    import torch_npu

    missing = [name for name in (*npu_ops.OPERATORS, *hccl.MC2_OPERATORS) if not callable(getattr(torch_npu, name, None))]
    assert not missing, f"torch_npu {torch_npu.__version__} lacks {missing}"


@pytest.mark.parametrize("op, dtype", KIT_RUNS, ids=[f"{op}-{dtype_name(d)}" for op, d in KIT_RUNS])
def test_each_mapped_op_passes_the_kit_on_the_npu(loaded, op, dtype):
    platform, _ = loaded
    report = run_op(op, npu_ops.OPS[op], dtype, platform.device, examples=4)
    assert report.result == "PASS", f"{op} ({report.dtype}): {report.detail()}"


def test_a_captured_npu_graph_replays_the_eager_result(loaded):
    platform, _ = loaded
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 1024, generator=g).to(platform.device, torch.bfloat16)
    w = torch.rand(1024, generator=g).to(platform.device, torch.bfloat16)
    gate_up = torch.randn(8, 2048, generator=g).to(platform.device, torch.bfloat16)

    def step():
        return npu_ops.rms_norm(x, w, 1e-6) * npu_ops.silu_and_mul(gate_up)

    graphs = platform.graphs()
    graph, out = graphs.capture(step)
    for _ in range(2):  # new inputs in the captured tensors, then a replay
        x.copy_(torch.randn(8, 1024, generator=g).to(platform.device, torch.bfloat16))
        gate_up.copy_(torch.randn(8, 2048, generator=g).to(platform.device, torch.bfloat16))
        graphs.replay(graph)
        platform.synchronize()
        assert torch.equal(out, step())


def _hccl_rank(rank: int, port: int, results) -> None:
    import torch_npu  # noqa: F401
    import torch.distributed as dist

    from deepinfer_ascend_950.hccl import HcclCommunicator

    torch.npu.set_device(rank)
    dist.init_process_group("hccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        comm = HcclCommunicator()
        dev = f"npu:{rank}"
        total = comm.all_reduce(torch.full((4,), float(rank + 1), device=dev))
        rows = torch.arange(6 * 4, dtype=torch.float32, device=dev).reshape(6, 4) + 100 * rank
        sent_fp8 = rows.to(torch.float8_e4m3fn)
        got_bf16, counts = comm.all_to_all(rows.bfloat16(), [2, 4])  # 2 rows to rank 0, 4 to rank 1
        got_fp8, _ = comm.all_to_all(sent_fp8, [2, 4], counts)
        results[rank] = (total.cpu(), counts, got_bf16.float().cpu(), got_fp8.float().cpu(), sent_fp8.float().cpu())
    finally:
        dist.destroy_process_group()


def _on_two_npus(rank_fn, port_base: int):
    """What ``rank_fn(rank, port, results)`` put in ``results`` on each of two spawned ranks (one
    NPU each); the test is skipped without two NPUs."""
    devices, why_not = backend._visible_devices()
    if why_not is not None or len(devices) < 2:
        pytest.skip("needs two NPUs")
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(rank_fn, args=(port_base + os.getpid() % 1000, results), nprocs=2)
    return results


def test_hccl_collectives_over_two_npus():
    results = _on_two_npus(_hccl_rank, 29611)
    for rank in (0, 1):
        total, counts, got_bf16, got_fp8, _ = results[rank]
        assert torch.equal(total, torch.full((4,), 3.0))
        assert counts == ([2, 2] if rank == 0 else [4, 4])
        mine = slice(0, 2) if rank == 0 else slice(2, 6)
        expected = torch.cat([(torch.arange(24.0).reshape(6, 4) + 100 * src)[mine] for src in (0, 1)])
        assert torch.equal(got_bf16, expected.bfloat16().float())
        assert torch.equal(got_fp8, torch.cat([results[src][4][mine] for src in (0, 1)]))  # FP8 bytes, exact


def _moe_rank(rank: int, port: int, results) -> None:
    """One rank of an EP group of two: a bf16 MoE layer through HcclCommunicator's fused dispatch-
    combine, a call with tokens on both ranks and one where rank 1 has none."""
    import torch_npu  # noqa: F401
    import torch.distributed as dist

    from deepinfer_ascend_950.hccl import HcclCommunicator
    from deepinfer_core.ops.moe import moe_experts
    from deepinfer_core.parallel.eplb import Placement
    from deepinfer_core.parallel.expert_parallel import ExpertShard, moe_expert_parallel

    torch.npu.set_device(rank)
    dist.init_process_group("hccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        experts, top_k, hidden, inter = 16, 4, 2048, 64
        g = torch.Generator().manual_seed(0)
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).bfloat16()
        w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).bfloat16()
        dev = f"npu:{rank}"
        shard = ExpertShard.from_full(w13.to(dev), w2.to(dev), Placement.contiguous(1, experts, 2), rank)
        comm = HcclCommunicator()
        fused = []
        combine = comm.moe_combine
        comm.moe_combine = lambda y, d: fused.append(y.shape[0]) or combine(y, d)
        gen = torch.Generator().manual_seed(100 + rank)
        outs = []
        for count in ((9, 5)[rank], (7, 0)[rank]):
            x = torch.randn(count, hidden, generator=gen).bfloat16()
            ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(count)]) if count \
                else torch.zeros(0, top_k, dtype=torch.int64)
            w = torch.rand(count, top_k, generator=gen)
            got, _ = moe_expert_parallel(x.to(dev), w.to(dev), ids.to(dev), shard, comm, moe_experts)
            outs.append((got.float().cpu(), moe_experts(x.float(), w13.float(), w2.float(), w, ids)))
        results[rank] = (outs, len(fused))
    finally:
        dist.destroy_process_group()


def test_moe_dispatch_and_combine_over_two_npus():
    """Each rank's expert-parallel MoE output through npu_moe_distribute_dispatch_v2 / combine_v2
    equals the one-process reference in float32 within the bf16 tolerance of specs/ops.toml."""
    results = _on_two_npus(_moe_rank, 29711)
    for rank in (0, 1):
        outs, fused = results[rank]
        assert fused == 2, f"rank {rank}: {fused} of 2 calls took the fused operators (see the log for why not)"
        for got, want in outs:
            torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_the_default_model_generates_on_the_npu():
    from deepinfer_core import LLM, SamplingParams

    llm = LLM(accelerator="ascend", dtype="bfloat16")
    try:
        out = llm.generate(["def fibonacci(n):", "class Stack:"], SamplingParams(max_tokens=16, temperature=0.0, logprobs=1))
    finally:
        llm.close()
    for o in out:
        assert len(o.outputs[0].token_ids) == 16
        assert math.isfinite(o.outputs[0].cumulative_logprob), o.outputs[0]
