"""Scale-out over NCCL on NVIDIA GPUs (the multi-GPU issue's tests; ``tools/gpu_session.sh multi``
runs them alone on a lent multi-GPU host):

- the MoE layer's expert exchange (``dist/expert_parallel.py``) over NCCL, rank r on GPU r: world
  size 1 (one GPU is enough: the NCCL path with device-side counts and the non-blocking
  dispatch), 2 and 4, with the plain layout and with EPLB copies, a rank without tokens
  included: every rank's output equals ``moe_experts`` over all experts on the CPU;
- data x expert parallelism end to end through ``LLM.generate`` with the NVIDIA backend
  (float32, tiny V3 and V4 checkpoints, one with FP8 experts; prompt chunks beside decode rows):
  greedy tokens equal one GPU's and logprobs are within 1e-4, with EPLB re-placing the experts
  every second step.

Each test skips unless the host has the GPUs it names. NVLink multicast stays off (it can take
a shared host's GPUs out of service): ``keep_multicast_off()`` below sets its variables before any
process group.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.multiprocessing as mp

from benchmarks.all_to_all import keep_multicast_off
from tests.hf_checkpoints import write_checkpoint
from tests.hf_checkpoints_v4 import write_checkpoint_v4
from tests.test_data_parallel import GREEDY, PROMPTS, SMALL_STEPS, _assert_same
from tests.test_expert_parallel import _free_port, _worker

pytestmark = pytest.mark.gpu
keep_multicast_off()
MEMORY = 0.3  # of each GPU: the reference LLM and rank 0 share GPU 0 in this process (one after the other)


def gpus(n: int):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(count < n, reason=f"needs {n} NVIDIA GPUs on one host (this one has {count})")


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch):
    monkeypatch.setenv("DEEPINFER_DIST_TIMEOUT", "120")


@pytest.mark.parametrize("world, kind, empty_rank", [
    pytest.param(1, "plain", None, marks=gpus(1)),
    pytest.param(2, "plain", None, marks=gpus(2)),
    pytest.param(2, "eplb", 1, marks=gpus(2)),
    pytest.param(4, "eplb", 2, marks=gpus(4)),
])
def test_the_expert_exchange_over_nccl_matches_one_process(world, kind, empty_rank):
    mp.spawn(_worker, args=(world, _free_port(), kind, empty_rank, "nccl"), nprocs=world, join=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    v3 = tmp_path_factory.mktemp("v3_grouped")
    write_checkpoint("v3_grouped", v3)
    v3_fp8 = tmp_path_factory.mktemp("v3_fp8")
    write_checkpoint("v3_fp8", v3_fp8)  # 32 x 32 blocks: the NVIDIA backend keeps the experts in FP8
    v4 = tmp_path_factory.mktemp("v4")
    write_checkpoint_v4("v4_flash_like", v4)
    return {"v3": v3, "v3_fp8": v3_fp8, "v4": v4}


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _llm(path, **kwargs):
    from deepinfer_core import LLM

    return LLM(str(path), accelerator="nvidia", dtype="float32", progress=False, gpu_memory_utilization=MEMORY,
               **SMALL_STEPS, **kwargs)


@pytest.mark.parametrize("model, world, eplb", [
    pytest.param("v3", 2, 0, marks=gpus(2)),
    pytest.param("v4", 2, 2, marks=gpus(2)),
    pytest.param("v3_fp8", 2, 2, marks=gpus(2)),
    pytest.param("v3", 4, 2, marks=gpus(4)),
    pytest.param("v3", 8, 2, marks=gpus(8)),
])
def test_data_and_expert_parallel_over_nccl_match_one_gpu(checkpoints, monkeypatch, model, world, eplb):
    one = _llm(checkpoints[model])
    want = one.generate(PROMPTS, GREEDY, use_tqdm=False)
    del one
    _free()
    monkeypatch.setenv("DEEPINFER_EPLB_INTERVAL", str(eplb))
    llm = _llm(checkpoints[model], data_parallel_size=world, expert_parallel=True)
    try:
        ep = llm.parallel.ep
        start = ep.placement.phy2log.clone()
        seen = []
        llm.engine.observer = seen.append
        assert llm.engine.device == torch.device("cuda", 0) and ep.layers[0].ep.shard.w13.is_cuda
        if model == "v3_fp8":  # FP8 experts and their scales cross the ranks when EPLB moves them
            assert ep.layers[0].ep.shard.w13.dtype == torch.float8_e4m3fn and ep.layers[0].ep.shard.w13_scale is not None
        _assert_same(llm.generate(PROMPTS, GREEDY, use_tqdm=False), want, tol=1e-4)
        if eplb:
            assert not ep.placement.phy2log.equal(start), "EPLB should have moved experts for the measured load"
            moves = [s.extra["eplb"] for s in seen if "eplb" in s.extra]
            assert moves and any(m["slots_moved"] > 0 for m in moves)
        _assert_same(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False), want[:2], same_ids=False, tol=1e-4)
    finally:
        llm.close()
        del llm
        _free()  # rank 0's engine, before the next test's LLMs take GPU 0
