"""Expert parallelism for one MoE layer: each rank holds some physical expert slots (an EPLB
``Placement`` says which), and a token's routed pairs travel to the ranks holding their experts
and back.

``ExpertShard`` is one rank's share of a layer: its slots' weights and the layer's placement.
``moe_expert_parallel`` runs the routed experts of this rank's tokens across the EP group:

1. **Dispatch.** Each (token, expert) pair picks one copy of its expert (by the token's rank
   and position, so copies share the load) and goes, as the token's hidden row, its routing
   weight and the slot's local index, to the rank holding that copy (``all_to_all``). After
   the counts are exchanged, the rows travel while ``meanwhile`` (the layer's shared expert)
   computes: the exchange is started, not waited for (``communicator.start_all_to_all``).
2. **Compute.** Each rank runs the backend's ``moe_experts`` op over the rows it received,
   one expert slot per row.
3. **Combine.** The weighted outputs go back (``all_to_all``), and each token adds its pairs
   in ascending expert id, the reference's order.

A rank with no tokens still takes part (it sends nothing and computes what it receives). The
communicator is ``parallel.communicator``'s (torch.distributed, or the backend's own). Where it
offers a fused dispatch-combine (``moe_dispatch`` / ``moe_combine``, ``communicator.Dispatched``)
and takes the call, steps 1 and 3 are its own (the shared expert then runs after the dispatch
returns) and step 2 is unchanged; where it declines, or has none, they run as above.

``ExpertParallel`` does this for a whole model built with only this rank's slots
(``initial_slots``: the model allocates and the loader reads just those experts, so no rank ever
holds them all): it counts each expert's load (the tokens routed to it), runs the idle pass of a
rank without work (every MoE layer's exchange with no rows, so the others are not left waiting),
and rebalances: the loads summed over the group, a new EPLB placement computed identically on
every rank, and the expert weights moved to their new slots through the communicator.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.parallel.communicator import Dispatched, start_all_to_all
from deepinfer_core.parallel.eplb import Placement, num_physical_experts, rebalance

log = logging.getLogger("deepinfer")
WEIGHTS = ("w13", "w2", "w13_scale", "w2_scale")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class ExpertShard:
    """One rank's slots of one MoE layer: ``w13`` [S, 2I, D] and ``w2`` [S, D, I] for its S =
    slots_per_gpu physical slots (FP8 scales alongside when blocked; packed MXFP4 experts: uint8
    [S, 2I, D/2], [S, D, I/2] and their UE8M0 scales, block None), and the layer's placement
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
        mine = placement.slots_of(rank, layer)

        def take(t):
            return None if t is None else t[mine].contiguous()

        return cls(take(w13), take(w2), placement, layer, take(w13_scale), take(w2_scale), block)


def moe_expert_parallel(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, shard: ExpertShard, comm,
                        experts_op, meanwhile: Callable[[], Any] | None = None) -> tuple[torch.Tensor, Any]:
    """([T, D], what ``meanwhile()`` returned): the routed experts' weighted sum for this rank's
    tokens ``x`` [T, D], their experts ``topk_ids`` [T, k] (logical ids) and weights [T, k],
    computed across ``comm``'s ranks with ``experts_op`` (an OpTable's ``moe_experts``);
    ``meanwhile`` runs while the dispatched rows are in flight.

    A communicator with ``moe_dispatch`` / ``moe_combine`` (a fused dispatch-combine, see
    ``communicator.Dispatched``) moves the rows where it takes the call; where it declines (None,
    on every rank alike) or has none, the rows go through ``all_to_all`` here."""
    placement = shard.placement
    slots = physical_slots(topk_ids, placement, shard.layer, comm.rank)
    fused = getattr(comm, "moe_dispatch", None)
    got = fused(x, topk_weights, topk_ids, slots, placement.phy2log.shape[1]) if fused is not None else None
    in_flight = None if got is not None else dispatch_all_to_all(comm, x, topk_weights, topk_ids, slots, placement.slots_per_gpu)
    # An error in the shared expert or the experts is raised only after the combine: the other
    # ranks are waiting for this rank's rows, and must get them (zeros) to stay in step.
    during, error = None, None
    try:
        during = meanwhile() if meanwhile is not None else None
    except Exception as e:  # noqa: BLE001 - raised below, after the exchange
        error = e
    dispatched = got if in_flight is None else in_flight.wait()
    rows = dispatched.rows
    y = rows.new_zeros((rows.shape[0], x.shape[1]))
    if rows.shape[0] and error is None:
        try:
            y = experts_op(rows, shard.w13, shard.w2, dispatched.weights, dispatched.local, shard.w13_scale, shard.w2_scale,
                           shard.block)
        except Exception as e:  # noqa: BLE001 - raised below, after the exchange
            error = e
    out = comm.moe_combine(y, dispatched) if in_flight is None else combine_all_to_all(comm, y, dispatched)
    if error is not None:
        raise error
    return out, during


def physical_slots(topk_ids: torch.Tensor, placement: Placement, layer: int, rank: int) -> torch.Tensor:
    """[T, k] int64: the physical slot each (token, expert) pair goes to, one copy of its expert
    picked by the token's rank and position (so copies share the load). Slot s is local slot
    s % slots_per_gpu of rank s // slots_per_gpu."""
    tokens, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    token_of = torch.arange(tokens, device=topk_ids.device).repeat_interleave(k)
    copies = placement.replicas[layer].to(topk_ids.device)[flat_ids]
    pick = (token_of + rank) % copies  # spread a replicated expert's pairs over its copies
    return placement.log2phy[layer].to(topk_ids.device)[flat_ids, pick].view(tokens, k)


class _AllToAllInFlight:
    """``dispatch_all_to_all``'s rows and (weight, slot) pairs, started; ``wait()`` gives them."""

    def __init__(self, rows, metas, state: dict):
        self.rows, self.metas, self.state = rows, metas, state

    def wait(self) -> Dispatched:
        recv_x, recv_meta = self.rows.wait(), self.metas.wait()
        return Dispatched(recv_x, recv_meta[:, :1].float(), recv_meta[:, 1:].long(), self.state)


def dispatch_all_to_all(comm, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, slots: torch.Tensor,
                        slots_per_rank: int) -> _AllToAllInFlight:
    """The core's dispatch over ``comm.all_to_all``: each pair goes, as its token's row, its
    routing weight and its slot's local index, to the rank holding the slot; the counts are
    exchanged first, then the rows are started, not waited for (``start_all_to_all``)."""
    tokens, k = slots.shape
    token_of = torch.arange(tokens, device=x.device).repeat_interleave(k)
    flat = slots.reshape(-1)
    dest, local = flat // slots_per_rank, flat % slots_per_rank
    order = torch.argsort(dest, stable=True)  # pairs grouped by destination rank
    counts = torch.bincount(dest, minlength=comm.size)
    ones = [1] * comm.size
    received, _ = comm.all_to_all(counts[:, None], ones, ones)  # the counts first, on the device (NCCL needs it)
    both = torch.cat([counts, received[:, 0]]).tolist()  # one host sync for the two
    send_counts, recv_counts = both[:comm.size], both[comm.size:]
    # (weight, local slot) as float64 pairs: both exact in it, one exchange beside the rows
    meta = torch.stack((topk_weights.reshape(-1)[order].double(), local[order].double()), dim=1)
    rows = start_all_to_all(comm, x[token_of[order]], send_counts, recv_counts)
    metas = start_all_to_all(comm, meta, send_counts, recv_counts)
    state = {"order": order, "send_counts": send_counts, "recv_counts": recv_counts, "topk_ids": topk_ids}
    return _AllToAllInFlight(rows, metas, state)


def combine_all_to_all(comm, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
    """``dispatch_all_to_all``'s way back: the weighted outputs ``y`` return to their tokens'
    ranks, and each token adds its pairs in ascending expert id, the reference's order."""
    state = dispatched.state
    back, _ = comm.all_to_all(y, state["recv_counts"], state["send_counts"])
    topk_ids = state["topk_ids"]
    tokens, k = topk_ids.shape
    hidden = y.shape[1]
    pair_out = torch.empty_like(back)
    pair_out[state["order"]] = back  # back in (token, slot) order
    pair_out = pair_out.view(tokens, k, hidden)
    out = back.new_zeros((tokens, hidden))
    ascending = torch.argsort(topk_ids, dim=1)
    for j in range(k):  # each token's experts added in ascending id, as the reference does
        out += pair_out[torch.arange(tokens, device=y.device), ascending[:, j]]
    return out


def initial_placement(num_experts: int, ep_size: int, num_groups: int = 1, extra: int | None = None,
                      layers: int = 1) -> Placement:
    """The placement every MoE layer starts with, before any load is measured: EPLB's for an even
    load over ``num_physical_experts`` slots (the extra copies go to the lowest expert ids), the
    same in every layer. Computed identically by every rank, and by each rank's loader."""
    num_slots = num_physical_experts(num_experts, ep_size, extra)
    row = rebalance(torch.ones(1, num_experts), num_slots, ep_size, num_groups).phy2log
    return Placement.from_phy2log(row.expand(layers, -1).contiguous(), num_experts, ep_size)


def initial_slots(num_experts: int, rank: int, ep_size: int, num_groups: int = 1, extra: int | None = None) -> tuple[int, ...]:
    """The logical expert of each slot ``rank`` holds at start-up (``initial_placement``): what
    its model allocates and its loader reads (``expert_slots`` of the model constructors)."""
    return tuple(initial_placement(num_experts, ep_size, num_groups, extra).slots_of(rank).tolist())


class ExpertParallel:
    """A model's MoE layers sharded over the ranks of ``comm`` (attention stays with each rank's
    own requests). The model was built and loaded with this rank's slots of ``initial_placement``
    (``model.expert_slots``, from ``initial_slots``). ``moe_layers(model)`` gives the MoE modules
    in forward order; each has ``experts`` (gate_up_proj, down_proj and their scales, ``block``)
    and ``experts_op`` (its local routed-expert op, ``moe_experts``' signature). An expert with
    two slots on this rank was loaded into the first: the others are copied from it here."""

    def __init__(self, model, comm, num_experts: int, extra: int | None = None, num_groups: int = 1):
        self.comm = comm
        self.dtype = model.dtype  # what the exchanged rows are in (experts may be kept in FP8)
        self.layers = moe_layers(model)
        self.num_experts, self.num_groups = num_experts, num_groups
        self.num_slots = num_physical_experts(num_experts, comm.size, extra)
        self.placement = initial_placement(num_experts, comm.size, num_groups, extra, len(self.layers))
        mine = tuple(self.placement.slots_of(comm.rank).tolist())  # initial_slots' answer, without a second placement
        built = model.expert_slots
        if built is None or tuple(built) != mine:
            raise ValueError(
                f"rank {comm.rank}'s model holds expert slots {built}, not the {mine} of the initial placement over "
                f"{comm.size} ranks: build it with expert_slots=initial_slots(...) (Engine(expert_parallel=(rank, size)))"
            )
        first = {e: mine.index(e) for e in mine}
        device = self.layers[0].experts.gate_up_proj.device if self.layers else torch.device("cpu")
        self.load = torch.zeros((len(self.layers), num_experts), dtype=torch.int64, device=device)
        self.exchanges = 0  # MoE layer exchanges run (real or empty): every rank runs len(layers) a step
        for index, moe in enumerate(self.layers):
            ex = moe.experts
            shard = ExpertShard(ex.gate_up_proj.data, ex.down_proj.data, self.placement, index, _data(ex.gate_up_proj_scale_inv),
                                _data(ex.down_proj_scale_inv), ex.block)
            for slot, expert in enumerate(mine):
                if first[expert] != slot:  # a second copy on this rank: the loader filled the first
                    for name in WEIGHTS:
                        tensor = getattr(shard, name)
                        if tensor is not None:
                            tensor[slot] = tensor[first[expert]]
            moe.ep = _Layer(self, index, moe, shard)
            _release(ex)  # the shard holds the tensors; a rebalance replaces them without the module keeping the old ones

    def idle(self, first: int = 0) -> None:
        """The MoE exchanges of one forward pass with no tokens: what a rank without work runs
        while the others step (from layer ``first``: the rest of a pass that stopped there)."""
        for moe in self.layers[first:]:
            w13, hidden = moe.ep.shard.w13, moe.ep.shard.w2.shape[1]  # w2 [S, D, I] (or I/2 packed MXFP4)
            # the model's top-k, as the ranks with tokens have it (a fused dispatch pads an idle rank
            # with one token of k pairs, and its operator may want every rank's k alike)
            k = getattr(getattr(moe, "config", None), "num_experts_per_tok", 1)
            moe.ep.exchange(w13.new_empty((0, hidden), dtype=self.dtype), w13.new_empty((0, k), dtype=torch.float32),
                            torch.zeros((0, k), dtype=torch.int64, device=w13.device))

    def finish_pass(self, exchanged: int) -> None:
        """After a step that ran ``exchanged`` MoE exchanges (a whole pass, none, or part of one
        when its forward raised): run the missing ones empty, so that this rank has taken part
        in exactly one pass's exchanges, as every other rank has."""
        if not self.layers or (exchanged and exchanged % len(self.layers) == 0):
            return
        self.idle(exchanged % len(self.layers))

    def group_load(self) -> torch.Tensor:
        """[layers, experts]: tokens routed to each expert since the last rebalance, summed over
        the group (a collective: every rank calls it)."""
        total = self.load.clone()
        self.comm.all_reduce(total)
        return total

    def rebalance(self) -> dict:
        """Place the experts for the load counted since the last rebalance (summed over the
        group), move the weights, reset the counts. Every rank calls it at the same step.
        Returns the imbalance under the old and the new placement (same load) and how many slots
        received weights from another rank."""
        load = self.group_load().cpu()
        old = self.placement
        if not load.sum():
            return {"imbalance_before": 1.0, "imbalance_after": 1.0, "slots_moved": 0}
        new = rebalance(load, self.num_slots, self.comm.size, self.num_groups)
        moved = 0
        for moe in self.layers:
            moved += moe.ep.move_to(new)
        self.placement = new
        self.load.zero_()
        stats = {"imbalance_before": float(old.imbalance(load).mean()), "imbalance_after": float(new.imbalance(load).mean()),
                 "slots_moved": moved}
        if self.comm.rank == 0:
            log.info("EPLB: imbalance %.3f -> %.3f (busiest rank / mean, mean over %d layers); %d slots got new weights",
                     stats["imbalance_before"], stats["imbalance_after"], len(self.layers), moved)
        return stats


def moe_layers(model) -> list:
    """The MoE modules of ``model``'s decoder stack (``model.model``; MTP modules are not part of
    it), in forward order: every module with an ``experts_op``."""
    return [m for m in model.model.modules() if hasattr(m, "experts_op")]


class _Layer:
    """One MoE layer's expert-parallel state: what ``moe.ep(x, weights, ids)`` runs."""

    def __init__(self, owner: ExpertParallel, index: int, moe, shard: ExpertShard):
        self.owner, self.index, self.moe, self.shard = owner, index, moe, shard

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 meanwhile: Callable[[], Any] | None = None) -> tuple[torch.Tensor, Any]:
        """(the routed experts' output, ``meanwhile()``'s result: the shared expert, computed
        while the dispatched rows travel)."""
        owner = self.owner
        owner.load[self.index] += torch.bincount(topk_ids.reshape(-1), minlength=owner.num_experts)
        return self.exchange(x, topk_weights, topk_ids, meanwhile)

    def exchange(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 meanwhile: Callable[[], Any] | None = None) -> tuple[torch.Tensor, Any]:
        try:
            return moe_expert_parallel(x, topk_weights, topk_ids, self.shard, self.owner.comm, self.moe.experts_op, meanwhile)
        finally:  # an exchange that raised after completing counts as run (moe_expert_parallel completes it)
            self.owner.exchanges += 1

    def move_to(self, new: Placement) -> int:
        """Fill this rank's slots of ``new`` (same layer index): weights already here are copied
        locally, the others come from the rank holding the expert's first copy under the old
        placement, through one all-to-all per weight tensor. Returns the slots (over the whole
        group) that got their weights from another rank."""
        comm, layer, old = self.owner.comm, self.index, self.shard.placement
        per = old.slots_per_gpu
        old_row, new_row = old.phy2log[layer].tolist(), new.phy2log[layer].tolist()
        held = [set(old_row[r * per:(r + 1) * per]) for r in range(comm.size)]
        # (destination rank, its local slot) <- (source rank, the source's local slot), for every slot
        plan = []
        for slot, expert in enumerate(new_row):
            dest = slot // per
            if expert in held[dest]:
                src, src_slot = dest, old_row.index(expert, dest * per, (dest + 1) * per)
            else:
                first = int(old.log2phy[layer, expert, 0])
                src, src_slot = first // per, first
            plan.append((dest, slot % per, src, src_slot % per))
        me = comm.rank
        sends = sorted((d, ds, ss) for d, ds, s, ss in plan if s == me and d != me)  # by destination, then slot
        recvs = sorted((s, ds, ss) for d, ds, s, ss in plan if d == me and s != me)  # by source, then the order it sends
        send_counts = [sum(1 for d, _, _ in sends if d == r) for r in range(comm.size)]
        recv_counts = [sum(1 for s, _, _ in recvs if s == r) for r in range(comm.size)]
        local = [(ds, ss) for d, ds, s, ss in plan if d == me and s == me]
        shard = self.shard
        for name in WEIGHTS:
            tensor = getattr(shard, name)
            if tensor is None:
                continue
            rows = torch.tensor([ss for _, _, ss in sends], dtype=torch.int64, device=tensor.device)
            raw = tensor.view(torch.uint8) if tensor.dtype in FP8 else tensor  # gloo takes no FP8 dtype: the bytes travel
            received, _ = comm.all_to_all(raw.index_select(0, rows), send_counts, recv_counts)
            received = received.view(tensor.dtype)
            out = torch.empty_like(tensor)
            for ds, ss in local:
                out[ds] = tensor[ss]
            for row, (_, ds, _) in enumerate(recvs):
                out[ds] = received[row]
            setattr(shard, name, out)
        shard.placement = new
        return sum(1 for d, _, s, _ in plan if d != s)


def _data(param):
    return None if param is None else param.data


def _release(experts) -> None:
    """Drop the module's references to its expert weights once the layer's shard holds them."""
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv"):
        param = getattr(experts, name, None)
        if param is not None:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
