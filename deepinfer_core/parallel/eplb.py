"""Expert-parallel load balancing (EPLB): which routed experts get extra copies, and where every
copy lives, from the experts' measured loads.

DeepSeek's scheme (published with DeepSeek-V3's inference system), written here from its
description:

* **Slots.** An EP group of G GPUs holds P physical expert slots per MoE layer: the E logical
  experts plus redundant copies (``DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS``, default 32), the
  total rounded up to a multiple of G (``num_physical_experts``). GPU g holds slots
  [g * P/G, (g + 1) * P/G).
* **Replicate.** Every expert has one copy; each remaining slot goes to the expert whose load per
  copy is the highest then (its tokens are shared evenly by its copies).
* **Pack.** Copies go to GPUs heaviest first, each to the least-loaded GPU that still has a free
  slot, so every GPU gets exactly P/G copies (``balanced_packing``).
* **Hierarchical** (``num_nodes`` > 1 and the expert groups divide evenly over the nodes):
  expert groups are packed onto nodes first, so that group-limited routing (V3: a token's
  experts come from 4 of 8 groups) reaches few nodes; replication and packing then happen inside
  each node. Otherwise the global form treats all GPUs as one node.

Everything works per layer on [layers, experts] loads (token counts or any non-negative weight);
nothing here touches a device or a process group.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass

import torch

DEFAULT_EXTRA_EXPERTS = 32


def num_physical_experts(num_experts: int, ep_size: int, extra: int | None = None) -> int:
    """Slots per layer: ``num_experts`` + ``extra`` (``DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS``,
    default 32) rounded up to a multiple of ``ep_size``."""
    if extra is None:
        raw = os.environ.get("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", str(DEFAULT_EXTRA_EXPERTS))
        try:
            extra = int(raw)
        except ValueError:
            raise ValueError(f"DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS={raw!r} is not an integer") from None
    if extra < 0 or ep_size < 1 or num_experts < 1:
        raise ValueError(f"need experts >= 1, ep_size >= 1, extra >= 0; got {num_experts}, {ep_size}, {extra}")
    total = num_experts + extra
    return -(-total // ep_size) * ep_size


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Items [n, items] (weights) into ``num_packs`` packs of items/num_packs each, per row:
    heaviest first, each into the lightest pack with room. Returns (pack of each item, its
    position in the pack), both [n, items] int64."""
    rows, items = weight.shape
    if items % num_packs:
        raise ValueError(f"{items} items do not split evenly into {num_packs} packs")
    per_pack = items // num_packs
    pack = torch.empty((rows, items), dtype=torch.int64)
    rank = torch.empty((rows, items), dtype=torch.int64)
    w = weight.double().cpu()
    for r in range(rows):
        values = w[r].tolist()
        open_packs = [(0.0, p, 0) for p in range(num_packs)]  # (load, pack, items): a heap, lightest first
        for i in torch.argsort(w[r], descending=True, stable=True).tolist():
            total, p, count = heapq.heappop(open_packs)
            pack[r, i], rank[r, i] = p, count
            if count + 1 < per_pack:
                heapq.heappush(open_packs, (total + values[i], p, count + 1))
    return pack, rank


def replicate(weight: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copies of [n, experts] logical experts filling ``num_slots`` slots per row: one each, then
    every extra slot to the expert with the highest load per copy. Returns (logical expert of
    each slot [n, slots], the copy's index among its expert's [n, slots], copies per expert
    [n, experts])."""
    rows, experts = weight.shape
    if num_slots < experts:
        raise ValueError(f"{num_slots} slots cannot hold {experts} experts")
    w = weight.double().cpu()
    slot_expert = torch.empty((rows, num_slots), dtype=torch.int64)
    slot_rank = torch.zeros((rows, num_slots), dtype=torch.int64)
    count = torch.ones((rows, experts), dtype=torch.int64)
    slot_expert[:, :experts] = torch.arange(experts)
    for s in range(experts, num_slots):
        hottest = torch.argmax(w / count, dim=-1)  # ties: the lowest index
        slot_expert[:, s] = hottest
        slot_rank[:, s] = count[torch.arange(rows), hottest]
        count[torch.arange(rows), hottest] += 1
    return slot_expert, slot_rank, count


@dataclass
class Placement:
    """Where each layer's expert copies live. ``phy2log[l, p]``: the logical expert in physical
    slot p (on GPU p // slots_per_gpu); ``log2phy[l, e, j]``: the slot of copy j of expert e
    (-1 past its ``replicas[l, e]`` copies)."""

    phy2log: torch.Tensor  # [layers, slots] int64
    log2phy: torch.Tensor  # [layers, experts, max copies] int64
    replicas: torch.Tensor  # [layers, experts] int64
    num_gpus: int

    @property
    def slots_per_gpu(self) -> int:
        return self.phy2log.shape[1] // self.num_gpus

    def slots_of(self, gpu: int, layer: int = 0) -> torch.Tensor:
        """[slots_per_gpu] int64: the logical expert of each of ``gpu``'s slots in ``layer``."""
        per = self.slots_per_gpu
        return self.phy2log[layer, gpu * per:(gpu + 1) * per]

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor, num_experts: int, num_gpus: int) -> Placement:
        layers, slots = phy2log.shape
        if slots % num_gpus:
            raise ValueError(f"{slots} slots do not split evenly over {num_gpus} GPUs")
        replicas = torch.zeros((layers, num_experts), dtype=torch.int64)
        replicas.scatter_add_(1, phy2log, torch.ones_like(phy2log))
        if (replicas == 0).any():
            raise ValueError("every logical expert needs at least one slot")
        log2phy = torch.full((layers, num_experts, int(replicas.max())), -1, dtype=torch.int64)
        for l in range(layers):
            seen = [0] * num_experts
            for p, e in enumerate(phy2log[l].tolist()):
                log2phy[l, e, seen[e]] = p
                seen[e] += 1
        return cls(phy2log, log2phy, replicas, num_gpus)

    @classmethod
    def contiguous(cls, layers: int, num_experts: int, num_gpus: int) -> Placement:
        """No EPLB: one copy per expert, experts [g * E/G, (g + 1) * E/G) on GPU g."""
        if num_experts % num_gpus:
            raise ValueError(f"{num_experts} experts do not split evenly over {num_gpus} GPUs")
        return cls.from_phy2log(torch.arange(num_experts).repeat(layers, 1), num_experts, num_gpus)

    def gpu_loads(self, load: torch.Tensor) -> torch.Tensor:
        """[layers, GPUs]: each expert's load ([layers, experts]) shared evenly by its copies, summed per GPU."""
        per_copy = load.double() / self.replicas
        slot_load = torch.gather(per_copy, 1, self.phy2log)
        return slot_load.view(slot_load.shape[0], self.num_gpus, -1).sum(-1)

    def imbalance(self, load: torch.Tensor) -> torch.Tensor:
        """[layers]: the busiest GPU's load over the mean GPU load (1.0 = perfectly even)."""
        gpu = self.gpu_loads(load)
        return gpu.max(-1).values / gpu.mean(-1).clamp_min(1e-12)


def rebalance(load: torch.Tensor, num_slots: int, num_gpus: int, num_groups: int = 1, num_nodes: int = 1) -> Placement:
    """The placement of [layers, experts] logical experts in ``num_slots`` slots per layer on
    ``num_gpus`` GPUs for ``load``: hierarchical over ``num_nodes`` nodes when the
    ``num_groups`` expert groups divide evenly over them, else global."""
    layers, experts = load.shape
    if num_slots % num_gpus or num_gpus % num_nodes:
        raise ValueError(f"{num_slots} slots, {num_gpus} GPUs, {num_nodes} nodes: slots must split over GPUs, GPUs over nodes")
    load = load.double().cpu()
    if num_nodes > 1 and num_groups % num_nodes == 0 and experts % num_groups == 0:
        return _hierarchical(load, num_slots, num_gpus, num_groups, num_nodes)
    slot_expert, _, count = replicate(load, num_slots)
    return Placement.from_phy2log(_pack_slots(load, slot_expert, count, num_gpus), experts, num_gpus)


def _pack_slots(load: torch.Tensor, slot_expert: torch.Tensor, count: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """phy2log [layers, slots]: the copies (``slot_expert``) packed onto GPUs by their load per copy."""
    per_copy = torch.gather(load / count, 1, slot_expert)
    gpu, position = balanced_packing(per_copy, num_gpus)
    per_gpu = slot_expert.shape[1] // num_gpus
    phy2log = torch.empty_like(slot_expert)
    phy2log.scatter_(1, gpu * per_gpu + position, slot_expert)
    return phy2log


def _hierarchical(load: torch.Tensor, num_slots: int, num_gpus: int, num_groups: int, num_nodes: int) -> Placement:
    layers, experts = load.shape
    group_size = experts // num_groups
    group_node, _ = balanced_packing(load.view(layers, num_groups, group_size).sum(-1), num_nodes)
    slots_per_node, gpus_per_node = num_slots // num_nodes, num_gpus // num_nodes
    if slots_per_node < experts // num_nodes:
        raise ValueError(f"{num_slots} slots cannot hold {experts} experts on {num_nodes} nodes")
    phy2log = torch.empty((layers, num_slots), dtype=torch.int64)
    for l in range(layers):
        for node in range(num_nodes):
            groups = (group_node[l] == node).nonzero().flatten()
            members = (groups[:, None] * group_size + torch.arange(group_size)).flatten()  # the node's experts
            node_load = load[l, members][None]
            slot_local, _, count = replicate(node_load, slots_per_node)
            packed = _pack_slots(node_load, slot_local, count, gpus_per_node)
            phy2log[l, node * slots_per_node:(node + 1) * slots_per_node] = members[packed[0]]
    return Placement.from_phy2log(phy2log, experts, num_gpus)
