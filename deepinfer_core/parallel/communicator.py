"""The core's communicator over torch.distributed, and how a process gets one for a group.

A backend may provide its own through ``deepinfer_communicator`` (hookspecs: DeepEP's kernels,
a vendor collective library); ``communicator_for`` asks the selected backend first and falls
back to ``TorchCommunicator``: torch.distributed on the group's own backend (NCCL on NVIDIA,
HCCL on Ascend, gloo on CPU). Nothing here is a transport of its own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Pending:
    """A collective in flight: ``wait()`` returns its result once it has arrived."""

    def __init__(self, result: torch.Tensor, work: Any = None):
        self.result, self.work = result, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.result


class TorchCommunicator:
    """The collectives the parallel layers use, on ``group`` (None: the default group)."""

    def __init__(self, group: Any = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; returns ``tensor``."""
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on every rank), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor, group=self.group)
        return out

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int] | None = None
                   ) -> tuple[torch.Tensor, list[int]]:
        """Rows of ``send`` [N, ...] in rank order, ``send_counts[r]`` of them to rank r. Returns
        the rows received (in source-rank order) and how many came from each rank (exchanged
        first unless ``recv_counts`` is given)."""
        if recv_counts is None:
            counts = torch.tensor(send_counts, dtype=torch.int64, device=send.device)  # NCCL exchanges device tensors
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.group)
            recv_counts = received.tolist()
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        dist.all_to_all_single(recv, send.contiguous(), recv_counts, list(send_counts), group=self.group)
        return recv, recv_counts

    def all_to_all_start(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> Pending:
        """``all_to_all`` with known ``recv_counts``, started and not waited for: the caller
        computes something else meanwhile (the shared expert), then ``.wait()`` gives the rows
        received. On NCCL the transfer runs on the communicator's stream beside the compute."""
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        work = dist.all_to_all_single(recv, send.contiguous(), recv_counts, list(send_counts), group=self.group, async_op=True)
        return Pending(recv, work)

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def start_all_to_all(comm: Any, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> Pending:
    """``comm.all_to_all_start`` where the communicator has it; else the blocking ``all_to_all``,
    already finished (a backend's communicator need not overlap)."""
    start = getattr(comm, "all_to_all_start", None)
    if start is not None:
        return start(send, send_counts, recv_counts)
    return Pending(comm.all_to_all(send, send_counts, recv_counts)[0])


def communicator_for(plugins: Any, backend_name: str, platform: Any, group: Any = None) -> Any:
    """The selected backend's communicator for ``group`` (its ``deepinfer_communicator``), or the
    core's torch.distributed one when it has none."""
    provided = plugins._call(backend_name, "deepinfer_communicator", platform=platform, group=group) if plugins else None
    return provided if provided is not None else TorchCommunicator(group)
