"""The core's communicator over torch.distributed, and how a process gets one for a group.

A backend may provide its own through ``deepinfer_communicator`` (hookspecs: DeepEP's kernels,
a vendor collective library); ``communicator_for`` asks the selected backend first and falls
back to ``TorchCommunicator``: torch.distributed on the group's own backend (NCCL on NVIDIA,
HCCL on Ascend, gloo on CPU). Nothing here is a transport of its own.

A communicator may also offer a fused MoE dispatch-combine, ``moe_dispatch`` / ``moe_combine``
(optional, like ``all_to_all_start``; ``TorchCommunicator`` has none): the expert-parallel layer
uses it where present and where it takes the call, and its own ``all_to_all`` exchange otherwise.
The pair's contract is ``Dispatched``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass
class Dispatched:
    """What a communicator's optional ``moe_dispatch`` returns: the rows this rank's experts compute.

    ``moe_dispatch(x, topk_weights, topk_ids, slots, num_slots)``, called by every rank of the
    group for each MoE layer (a rank without tokens too, with T = 0): ``x`` [T, D] this rank's
    tokens, ``topk_weights`` [T, k] float32 and ``topk_ids`` [T, k] int64 (logical experts) their
    routing, ``slots`` [T, k] int64 the physical slot each pair goes to, of ``num_slots``, split
    evenly and in order over the ranks (slot s is local slot s % (num_slots / size) of rank
    s // (num_slots / size); each row's slots are distinct). It returns ``None`` to decline the
    call, and must then decline it on every rank of the group (decide on what every rank shares,
    or agree through a collective): the core then moves the rows through ``all_to_all``.
    Otherwise a ``Dispatched``:

    * ``rows`` [N, D]: the rows sent to this rank, one per (token, expert) pair, in x's dtype;
    * ``weights`` [N, 1] float32 and ``local`` [N, 1] int64: what the expert op gets as its
      weights and expert ids (``experts_op(rows, w13, w2, weights, local, ...)``, local slots);
    * ``state``: the communicator's own, for the combine.

    ``moe_combine(y, dispatched)`` with the expert op's output ``y`` [N, D] returns [T, D] in x's
    dtype: for each token, the sum over its k pairs of weight * expert output. Each routing
    weight is applied once: through ``weights`` (the expert op multiplies), or in the combine
    (``weights`` then ones). The pairs may be added in any order: a fused combine may round
    differently from the core's, which adds them in ascending expert id as the reference does.
    An error in the shared expert or the experts still reaches ``moe_combine`` (``y`` zeros), so
    the group stays in step; the core raises it after.
    """

    rows: torch.Tensor
    weights: torch.Tensor
    local: torch.Tensor
    state: Any = None


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
