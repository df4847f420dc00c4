"""Expert parallelism for one MoE layer: each rank holds some physical expert slots (an EPLB
``Placement`` says which), and a token's routed pairs travel to the ranks holding their experts
and back.

``ExpertShard`` is one rank's share of a layer: its slots' weights and the layer's placement.
``moe_expert_parallel`` runs the routed experts of this rank's tokens across the EP group:

1. **Dispatch.** Each (token, expert) pair picks one copy of its expert (by the token's rank
   and position, so copies share the load) and goes, as the token's hidden row, its routing
   weight and the slot's local index, to the rank holding that copy (``all_to_all``).
2. **Compute.** Each rank runs the backend's ``moe_experts`` op over the rows it received,
   one expert slot per row.
3. **Combine.** The weighted outputs go back (``all_to_all``), and each token adds its pairs
   in ascending expert id, the reference's order.

A rank with no tokens still takes part (it sends nothing and computes what it receives). The
communicator is ``dist.communicator``'s (torch.distributed, or the backend's own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.dist.eplb import Placement


@dataclass
class ExpertShard:
    """One rank's slots of one MoE layer: ``w13`` [S, 2I, D] and ``w2`` [S, D, I] for its S =
    slots_per_gpu physical slots (FP8 scales alongside when blocked), and the layer's placement
    (``layer`` picks the row of a multi-layer Placement)."""

    w13: torch.Tensor
    w2: torch.Tensor
    placement: Placement
    layer: int = 0
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    block: tuple[int, int] | None = None

    @classmethod
    def from_full(cls, w13: torch.Tensor, w2: torch.Tensor, placement: Placement, rank: int, layer: int = 0,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  block: tuple[int, int] | None = None) -> ExpertShard:
        """Rank ``rank``'s shard, cut from a layer's full [E, ...] expert weights (copies are
        copied: a replicated expert's weights live on every rank holding one of its slots)."""
        per = placement.slots_per_gpu
        mine = placement.phy2log[layer, rank * per:(rank + 1) * per]

        def take(t):
            return None if t is None else t[mine].contiguous()

        return cls(take(w13), take(w2), placement, layer, take(w13_scale), take(w2_scale), block)


def moe_expert_parallel(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, shard: ExpertShard, comm,
                        experts_op) -> torch.Tensor:
    """[T, D]: the routed experts' weighted sum for this rank's tokens ``x`` [T, D], their experts
    ``topk_ids`` [T, k] (logical ids) and weights [T, k], computed across ``comm``'s ranks with
    ``experts_op`` (an OpTable's ``moe_experts``)."""
    placement, layer = shard.placement, shard.layer
    tokens, k = topk_ids.shape
    per = placement.slots_per_gpu
    flat_ids = topk_ids.reshape(-1)
    token_of = torch.arange(tokens, device=x.device).repeat_interleave(k)
    copies = placement.replicas[layer].to(x.device)[flat_ids]
    pick = (token_of + comm.rank) % copies  # spread a replicated expert's pairs over its copies
    slot = placement.log2phy[layer].to(x.device)[flat_ids, pick]
    dest, local = slot // per, slot % per

    order = torch.argsort(dest, stable=True)  # pairs grouped by destination rank
    send_counts = torch.bincount(dest, minlength=comm.size).tolist()
    recv_x, recv_counts = comm.all_to_all(x[token_of[order]], send_counts)
    recv_w, _ = comm.all_to_all(topk_weights.reshape(-1)[order, None].float(), send_counts, recv_counts)
    recv_local, _ = comm.all_to_all(local[order, None], send_counts, recv_counts)
    hidden = x.shape[1]
    if recv_x.shape[0]:
        y = experts_op(recv_x, shard.w13, shard.w2, recv_w, recv_local, shard.w13_scale, shard.w2_scale, shard.block)
    else:
        y = recv_x.new_zeros((0, hidden))
    back, _ = comm.all_to_all(y, recv_counts, send_counts)

    pair_out = torch.empty_like(back)
    pair_out[order] = back  # back in (token, slot) order
    pair_out = pair_out.view(tokens, k, hidden)
    out = torch.zeros_like(x)
    ascending = torch.argsort(topk_ids, dim=1)
    for j in range(k):  # each token's experts added in ascending id, as the reference does
        out += pair_out[torch.arange(tokens, device=x.device), ascending[:, j]]
    return out
