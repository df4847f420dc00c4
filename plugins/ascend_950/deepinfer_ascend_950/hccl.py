"""The Ascend backend's communicator: the core's torch.distributed collectives on an HCCL process
group (``import torch_npu`` registers the ``hccl`` backend; ``parallel.launch`` picks it for npu
devices), with what HCCL needs that NCCL and gloo do not.

torch_npu's ProcessGroupHCCL takes only the dtypes of its ``kScalarTypeToHcclDataType`` table
(Ascend/pytorch ``torch_npu/csrc/distributed/ProcessGroupHCCL.cpp``: uint8, int8, int16, int32,
int64, float16, float32, float64, bool, bfloat16; some releases add float8_e4m3fn / float8_e5m2)
and raises "Unsupported data type for HCCL process group" for any other. Collectives that only
move data (all_gather, all_to_all) carry such tensors (FP8, UE8M0 scales, uint16/32/64) as their
bytes, which is exact; a sum (all_reduce) of one is refused with a message instead.

Expert parallelism (EP > 1) goes through torch_npu's fused MoE operators where they take the
call: ``moe_dispatch`` / ``moe_combine`` (the core's optional pair, ``communicator.Dispatched``)
call ``npu_moe_distribute_dispatch_v2`` / ``npu_moe_distribute_combine_v2``, and decline, on every
rank alike, what lies outside their documented limits (``MC2_*`` below), which then travels
through ``all_to_all`` as on any backend.

Never run on Ascend hardware yet (the ``npu`` tests run it over two NPUs).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_core.parallel.communicator import Dispatched, Pending, TorchCommunicator

log = logging.getLogger("deepinfer")

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


# ---- the fused MoE dispatch / combine ("MC2") ----------------------------------------------------
# Followed: OP/npu_moe_distribute_dispatch_v2 and OP/npu_moe_distribute_combine_v2 (Ascend/op-plugin
# docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_distribute_{dispatch,combine}_v2.md, read at 04f7867),
# which list the Atlas A2 and A3 only: their A3 limits are taken for the 950, and where the documents
# say nothing of the 950, vllm-ascend's use on it (VA vllm_ascend/ops/fused_moe/token_dispatcher.py
# TokenDispatcherWithMC2, with its A5 arguments: group_tp = group_ep, tp_world_size 1, expert_scales
# given to the dispatch). Outside these limits the call takes the all_to_all path.
MC2_OPERATORS: tuple[str, ...] = ("npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2")
MC2_DTYPES = (torch.bfloat16, torch.float16)  # x bfloat16 / float16 (quant_mode 0: the rows travel as they are)
MC2_HIDDEN = (1024, 8192)  # H in [1024, 8192] (A3; A2: (0, 7168], a multiple of 32)
MC2_MAX_TOP_K = 16  # 0 < K <= 16 and K <= moe_expert_num
MC2_MAX_EXPERTS = 1024  # moe_expert_num in [1, 1024]
MC2_RANKS = (2, 768)  # ep_world_size in [2, 768] (A3)
MC2_MAX_TOKENS = 512  # BS per rank in (0, 512] (A3, comm_alg "")
MC2_MAX_TOKENS_ENV = "DEEPINFER_ASCEND_MC2_MAX_TOKENS"  # a lower cap (HCCL buffer, memory); 0 turns the fused path off
HCCL_BUFFSIZE_MB = 200  # HCCL_BUFFSIZE's default, in MB (both documents)
SHARED_EXPERT_NUM = 1  # the operators' default, kept as vllm-ascend and the documents' example run them


def hccl_comm_name(group: Any, rank: int) -> str:
    """The HCCL communicator's name of ``group`` that the MC2 operators take as ``group_ep``: torch_npu's
    ``ProcessGroupHCCL.get_hccl_comm_name(rank)`` (the documents' example; vllm-ascend passes the
    rank in the group)."""
    pg = group if group is not None else dist.group.WORLD
    return pg._get_backend(torch.device("npu")).get_hccl_comm_name(rank)


def mc2_buffer_bytes(local_experts: int, ranks: int, max_tokens: int, hidden: int, top_k: int) -> int:
    """The HCCL buffer the dispatch needs (the document's A3 formula, EP domain, comm_alg "" /
    "fullmesh_v1"): 2 * (local_expert_num * max_bs * ep_world_size * Align512(Align32(2H) + 64)
    + (K + shared_expert_num) * max_bs * Align512(2H)) bytes."""
    def align(x, a):
        return (x + a - 1) // a * a

    return 2 * (local_experts * max_tokens * ranks * align(align(2 * hidden, 32) + 64, 512)
                + (top_k + SHARED_EXPERT_NUM) * max_tokens * align(2 * hidden, 512))


def _npu():
    """torch_npu, imported only when an operator runs (never at import: without CANN it breaks torch)."""
    import torch_npu

    return torch_npu


@dataclass
class _Mc2:
    """What the combine needs of a dispatch: the operator's outputs it takes back unchanged, the
    dispatch's inputs and group arguments, and this rank's token count (before any padding)."""

    expand_x: torch.Tensor
    expert_ids: torch.Tensor
    expert_scales: torch.Tensor
    assist_info: torch.Tensor
    ep_recv_counts: torch.Tensor
    tp_recv_counts: torch.Tensor
    expand_scales: torch.Tensor | None
    group_args: dict
    tokens: int


class HcclCommunicator(TorchCommunicator):
    """TorchCommunicator on an HCCL group; tensors of dtypes HCCL lacks travel as bytes; the MoE
    dispatch-combine through torch_npu's MC2 operators where they take it. ``moe_max_tokens``: the
    most tokens a rank may bring to a fused dispatch (global_bs = it x ranks; the HCCL buffer
    grows with it); None reads DEEPINFER_ASCEND_MC2_MAX_TOKENS, else 512, the documented limit."""

    def __init__(self, group=None, moe_max_tokens: int | None = None):
        backend = dist.get_backend(group)
        if backend != "hccl":
            raise RuntimeError(
                f"the Ascend backend's communicator needs an HCCL process group, got {backend!r}: start the ranks "
                f"with the npu device (deepinfer's launcher initialises torch.distributed with 'hccl' for it)")
        super().__init__(group)
        if moe_max_tokens is None:
            moe_max_tokens = int(os.environ.get(MC2_MAX_TOKENS_ENV, MC2_MAX_TOKENS))
        self.moe_max_tokens = max(0, min(int(moe_max_tokens), MC2_MAX_TOKENS))
        self._group_name: str | None = None
        self._declined: set[str] = set()

    # -- the MoE dispatch / combine -------------------------------------------------------------
    def moe_dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, slots: torch.Tensor,
                     num_slots: int) -> Dispatched | None:
        """This rank's pairs to the ranks holding their slots through npu_moe_distribute_dispatch_v2,
        or None (every rank alike) where the call is outside its limits. Every rank first agrees,
        in one small all_reduce read on the host, on the largest token count and on whether each
        rank's call fits; a group of one rank never dispatches."""
        if self.size < MC2_RANKS[0]:
            return None  # the group's size: alike on every rank, no agreement needed
        tokens, k = slots.shape
        why = self._mc2_refusal(x, k, num_slots)
        cap = self.moe_max_tokens
        vote = torch.tensor([tokens, k, -k, cap, -cap, why is not None], dtype=torch.int32, device=x.device)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.group)
        most, k_max, k_min, cap_max, cap_min, refused = vote.tolist()
        if refused or k_max != -k_min or cap_max != -cap_min:
            why = why or "another rank's call is outside the operators' limits, or its top-k or token cap differs"
        elif most > cap:
            self._note(f"a rank has {most} tokens, above the {cap} a fused dispatch takes (HcclCommunicator("
                       f"moe_max_tokens), {MC2_MAX_TOKENS_ENV}; documented limit {MC2_MAX_TOKENS}); logged once", "tokens")
            return None
        elif most == 0:
            return None  # nothing to move on any rank
        if why is not None:
            self._note(why)
            return None

        per = num_slots // self.size
        if tokens == 0:  # BS must be > 0: an idle rank sends one zero token to k distinct slots, its output dropped
            x = x.new_zeros((1, x.shape[1]))
            topk_weights = torch.zeros((1, k), dtype=torch.float32, device=x.device)
            slots = torch.arange(k, device=x.device)[None]
        if self._group_name is None:
            self._group_name = hccl_comm_name(self.group, self.rank)
        # Every rank passes the same group arguments, in every layer (both documents' 约束说明). No
        # shared-expert ranks (shared_expert_rank_num 0): DeepInfer's shared expert runs on every rank
        # beside the exchange and the model adds it, so shared_expert_x stays None. global_bs: the
        # ranks' token counts differ, so it is max_bs x ranks with max_bs this communicator's cap (as
        # vllm-ascend passes its MC2 capacity), and x_active_mask stays None (every token is valid).
        group_args = {"group_ep": self._group_name, "ep_world_size": self.size, "ep_rank_id": self.rank,
                      "moe_expert_num": num_slots, "group_tp": self._group_name, "tp_world_size": 1, "tp_rank_id": 0,
                      "expert_shard_type": 0, "shared_expert_num": SHARED_EXPERT_NUM, "shared_expert_rank_num": 0,
                      "global_bs": cap * self.size}
        expert_ids = slots.to(torch.int32).contiguous()  # physical slots: moe_expert_num = slots, L = slots / ranks
        expert_scales = topk_weights.to(torch.float32).contiguous()
        expand_x, _, assist_info, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales = \
            _npu().npu_moe_distribute_dispatch_v2(x=x, expert_ids=expert_ids, expert_scales=expert_scales, quant_mode=0,
                                                  expert_token_nums_type=1, **group_args)
        # expand_x [A, H]: the received rows grouped by local expert in ascending order, expert_token_nums
        # ([L] int64, counts with type 1) of each; rows past them are the operator's spare room. (The
        # grouping is what vllm-ascend's grouped matmul reads as its group_list.) One host read.
        counts = expert_token_nums.to(torch.int64)
        n = int(counts.sum())
        local = torch.repeat_interleave(torch.arange(per, device=x.device), counts, output_size=n)[:, None]
        ones = torch.ones((n, 1), dtype=torch.float32, device=x.device)  # the combine applies the routing weights
        state = _Mc2(expand_x, expert_ids, expert_scales, assist_info, ep_recv_counts, tp_recv_counts, expand_scales,
                     group_args, tokens)
        return Dispatched(expand_x[:n], ones, local, state)

    def moe_combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """The expert outputs back to their tokens through npu_moe_distribute_combine_v2, which sums
        each token's k rows weighted by its routing weights ([T, D]; a padded idle rank's row dropped)."""
        st: _Mc2 = dispatched.state
        st.expand_x[:y.shape[0]].copy_(y)  # the outputs in the dispatch's rows, the layout the combine reads
        out = _npu().npu_moe_distribute_combine_v2(
            expand_x=st.expand_x, expert_ids=st.expert_ids, assist_info_for_combine=st.assist_info,
            ep_send_counts=st.ep_recv_counts, expert_scales=st.expert_scales, tp_send_counts=st.tp_recv_counts,
            expand_scales=st.expand_scales, **st.group_args)
        return out[:st.tokens]

    def _mc2_refusal(self, x: torch.Tensor, k: int, num_slots: int) -> str | None:
        """Why this rank's call is outside the MC2 operators' documented limits, or None."""
        hidden = x.shape[1]
        if x.dtype not in MC2_DTYPES:
            return f"{x.dtype} rows (the operators take bfloat16 / float16)"
        if not MC2_HIDDEN[0] <= hidden <= MC2_HIDDEN[1]:
            return f"hidden size {hidden} outside [{MC2_HIDDEN[0]}, {MC2_HIDDEN[1]}]"
        if not 0 < k <= min(MC2_MAX_TOP_K, num_slots):
            return f"top-k {k} outside (0, {MC2_MAX_TOP_K}]"
        if not num_slots <= MC2_MAX_EXPERTS or num_slots % self.size:
            return f"{num_slots} expert slots (at most {MC2_MAX_EXPERTS}, split evenly over the ranks)"
        if self.size > MC2_RANKS[1]:
            return f"{self.size} ranks (at most {MC2_RANKS[1]})"
        need = mc2_buffer_bytes(num_slots // self.size, self.size, self.moe_max_tokens, hidden, k)
        have = _hccl_buffsize_mb()
        if need > have * 2**20:
            return (f"HCCL_BUFFSIZE {have} MB is below the {math.ceil(need / 2**20)} MB the dispatch needs for "
                    f"{self.moe_max_tokens} tokens a rank: raise it, or lower {MC2_MAX_TOKENS_ENV}")
        try:
            npu = _npu()
        except ImportError as e:
            return f"torch_npu does not import ({e})"
        missing = [name for name in MC2_OPERATORS if not callable(getattr(npu, name, None))]
        if missing:
            return f"torch_npu {getattr(npu, '__version__', '?')} lacks {missing}"
        return None

    def _note(self, why: str, kind: str | None = None) -> None:
        """Log, once per reason (``kind``: one for reasons that vary call by call), that MoE rows go
        through all_to_all instead."""
        kind = kind or why
        if kind not in self._declined:
            self._declined.add(kind)
            log.info("HCCL communicator: MoE dispatch through all_to_all, not npu_moe_distribute_dispatch_v2: %s", why)

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


def _hccl_buffsize_mb() -> int:
    try:
        return int(os.environ.get("HCCL_BUFFSIZE", HCCL_BUFFSIZE_MB))
    except ValueError:
        return HCCL_BUFFSIZE_MB


class _BytesPending(Pending):
    """A byte-carried all_to_all in flight: ``wait()`` gives its rows in the sent dtype."""

    def __init__(self, inner: Pending, like: torch.Tensor, rows: int):
        super().__init__(None)
        self.inner, self.like, self.rows = inner, like, rows

    def wait(self) -> torch.Tensor:
        return _from_bytes(self.inner.wait(), self.like, self.rows)
