"""The Ascend backend's communicator: the core's torch.distributed collectives on an HCCL process
group (``import torch_npu`` registers the ``hccl`` backend; ``parallel.launch`` picks it for npu
devices), with what HCCL needs that NCCL and gloo do not.

torch_npu's ProcessGroupHCCL takes only the dtypes of its ``kScalarTypeToHcclDataType`` table
(Ascend/pytorch ``torch_npu/csrc/distributed/ProcessGroupHCCL.cpp``: uint8, int8, int16, int32,
int64, float16, float32, float64, bool, bfloat16; some releases add float8_e4m3fn / float8_e5m2)
and raises "Unsupported data type for HCCL process group" for any other. Collectives that only
move data (all_gather, all_to_all) carry such tensors (FP8, UE8M0 scales, uint16/32/64) as their
bytes, which is exact; a sum (all_reduce) of one is refused with a message instead.
Never run on Ascend hardware yet (the ``npu`` tests run it over two NPUs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepinfer_core.parallel.communicator import Pending, TorchCommunicator

# The dtypes every torch_npu release's HCCL process group takes (see above).
HCCL_DTYPES: frozenset[torch.dtype] = frozenset({
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64,
    torch.bool, torch.bfloat16,
})


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` [N, ...] as uint8 rows [N, bytes per row] (no copy for a contiguous tensor)."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1) if t.dim() else t.reshape(1).view(torch.uint8)


def _from_bytes(raw: torch.Tensor, like: torch.Tensor, rows: int) -> torch.Tensor:
    """uint8 rows back to ``rows`` rows of ``like``'s dtype and trailing shape."""
    return raw.reshape(-1).view(like.dtype).reshape(rows, *like.shape[1:]) if like.dim() else raw.view(like.dtype).reshape(())


class HcclCommunicator(TorchCommunicator):
    """TorchCommunicator on an HCCL group; tensors of dtypes HCCL lacks travel as bytes."""

    def __init__(self, group=None):
        backend = dist.get_backend(group)
        if backend != "hccl":
            raise RuntimeError(
                f"the Ascend backend's communicator needs an HCCL process group, got {backend!r}: start the ranks "
                f"with the npu device (deepinfer's launcher initialises torch.distributed with 'hccl' for it)")
        super().__init__(group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype not in HCCL_DTYPES:
            raise TypeError(f"HCCL cannot sum {tensor.dtype} tensors (it takes {sorted(map(str, HCCL_DTYPES))}): "
                            f"reduce in float32 or bfloat16")
        return super().all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if tensor.dtype in HCCL_DTYPES:
            return super().all_gather(tensor)
        rows = tensor.shape[0] if tensor.dim() else 1
        return [_from_bytes(part, tensor, rows) for part in super().all_gather(_as_bytes(tensor))]

    def all_to_all(self, send, send_counts, recv_counts=None):
        if send.dtype in HCCL_DTYPES:
            return super().all_to_all(send, send_counts, recv_counts)
        raw, counts = super().all_to_all(_as_bytes(send), send_counts, recv_counts)
        return _from_bytes(raw, send, sum(counts)), counts

    def all_to_all_start(self, send, send_counts, recv_counts) -> Pending:
        if send.dtype in HCCL_DTYPES:
            return super().all_to_all_start(send, send_counts, recv_counts)
        pending = super().all_to_all_start(_as_bytes(send), send_counts, recv_counts)
        return _BytesPending(pending, send, sum(recv_counts))


class _BytesPending(Pending):
    """A byte-carried all_to_all in flight: ``wait()`` gives its rows in the sent dtype."""

    def __init__(self, inner: Pending, like: torch.Tensor, rows: int):
        super().__init__(None)
        self.inner, self.like, self.rows = inner, like, rows

    def wait(self) -> torch.Tensor:
        return _from_bytes(self.inner.wait(), self.like, self.rows)
