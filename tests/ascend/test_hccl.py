"""The Ascend communicator's glue on the CPU: a one-rank gloo group stands in for HCCL. gloo, like
torch_npu's HCCL process group, refuses FP8, UE8M0 and uint16 tensors (checked first), so these
tests pass only through the byte transport. They test the glue, not HCCL (the ``npu`` tests run
it over two NPUs)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deepinfer_ascend_950 import backend, hccl
from deepinfer_core.parallel.communicator import TorchCommunicator, start_all_to_all

MISSING = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.uint16)


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def comm(gloo, monkeypatch):
    monkeypatch.setattr(hccl.dist, "get_backend", lambda group=None: "hccl")  # the group stands in for HCCL
    return backend.deepinfer_communicator(platform=None, group=None)


def _rows(dtype, shape=(5, 3)):
    return (torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) / 7 - 1).abs().to(dtype)


def test_a_group_that_is_not_hccl_is_refused(gloo):
    with pytest.raises(RuntimeError, match="needs an HCCL process group, got 'gloo'"):
        hccl.HcclCommunicator()


@pytest.mark.parametrize("dtype", MISSING, ids=str)
def test_dtypes_hccl_lacks_travel_as_bytes(comm, dtype):
    x = _rows(dtype)
    with pytest.raises(RuntimeError):  # the stand-in refuses them, as HCCL does
        TorchCommunicator().all_to_all(x, [5], [5])
    got, counts = comm.all_to_all(x, [5])
    assert counts == [5] and got.dtype == dtype and torch.equal(got.view(torch.uint8), x.view(torch.uint8))
    started = start_all_to_all(comm, x[1:], [4], [4]).wait()
    assert started.shape == (4, 3) and torch.equal(started.view(torch.uint8), x[1:].view(torch.uint8))
    (gathered,) = comm.all_gather(x[:, 0])  # a 1-D tensor: its rows are its elements
    assert gathered.shape == (5,) and torch.equal(gathered.view(torch.uint8), x[:, 0].contiguous().view(torch.uint8))
    with pytest.raises(TypeError, match=f"HCCL cannot sum {dtype}"):
        comm.all_reduce(x)


def test_dtypes_hccl_takes_go_as_they_are(comm, monkeypatch):
    seen = []
    real = dist.all_to_all_single
    monkeypatch.setattr(dist, "all_to_all_single", lambda out, inp, *a, **k: seen.append(inp.dtype) or real(out, inp, *a, **k))
    x = _rows(torch.bfloat16)
    got, _ = comm.all_to_all(x, [5], [5])
    assert torch.equal(got, x) and seen == [torch.bfloat16]
    assert torch.equal(comm.all_reduce(x.float().clone()), x.float())
