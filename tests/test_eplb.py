"""EPLB placement (deepinfer_core/parallel/eplb.py): slots, packing, replication and the placement's
invariants, and the balance it reaches on skewed synthetic loads (the bound stated here)."""

from __future__ import annotations

import itertools

import pytest
import torch

from deepinfer_core.parallel.eplb import Placement, balanced_packing, num_physical_experts, rebalance, replicate


def zipf_loads(layers: int, experts: int, skew: float = 1.0, tokens: float = 1e5, seed: int = 0) -> torch.Tensor:
    """[layers, experts]: expert popularity ~ 1 / rank^skew, the ranks shuffled per layer."""
    g = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** skew
    return torch.stack([base[torch.randperm(experts, generator=g)] for _ in range(layers)]) / base.sum() * tokens


def test_slots_are_experts_plus_extras_rounded_to_the_ep_size(monkeypatch):
    assert num_physical_experts(256, 8) == 288 and num_physical_experts(256, 64) == 320 and num_physical_experts(384, 48) == 432
    assert num_physical_experts(256, 8, extra=0) == 256
    monkeypatch.setenv("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "8")
    assert num_physical_experts(256, 16) == 272
    monkeypatch.setenv("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "many")
    with pytest.raises(ValueError, match="DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS='many'"):
        num_physical_experts(256, 16)


def test_balanced_packing_fills_every_pack_equally_and_evenly():
    weight = zipf_loads(4, 96, skew=1.2)
    pack, rank = balanced_packing(weight, 8)
    for r in range(4):
        assert torch.bincount(pack[r], minlength=8).tolist() == [12] * 8
        for p in range(8):  # positions 0..11 inside each pack
            assert sorted(rank[r][pack[r] == p].tolist()) == list(range(12))
        totals = torch.zeros(8, dtype=torch.float64).index_add_(0, pack[r], weight[r])
        assert totals.max() - totals.min() <= weight[r].max() + 1e-9  # greedy's bound: one item
    with pytest.raises(ValueError, match="do not split evenly"):
        balanced_packing(weight, 7)


def test_replication_minimises_the_largest_load_per_copy():
    """Greedy replication is optimal for the largest load per copy: checked against every way of
    handing out the extra slots on small cases."""
    g = torch.Generator().manual_seed(3)
    for experts, slots in ((3, 6), (4, 7), (5, 9)):
        load = torch.rand(1, experts, generator=g, dtype=torch.float64) * 10
        slot_expert, slot_rank, count = replicate(load, slots)
        assert count.sum() == slots and (count >= 1).all()
        assert torch.bincount(slot_expert[0], minlength=experts).tolist() == count[0].tolist()
        for e in range(experts):  # copy indices 0..count-1
            assert sorted(slot_rank[0][slot_expert[0] == e].tolist()) == list(range(int(count[0, e])))
        best = min(max(float(load[0, e]) / (1 + extra[e]) for e in range(experts))
                   for extra in itertools.product(range(slots - experts + 1), repeat=experts) if sum(extra) == slots - experts)
        assert float((load / count).max()) == pytest.approx(best)


def _check_placement(p: Placement, experts: int, slots: int, gpus: int) -> None:
    layers = p.phy2log.shape[0]
    assert p.phy2log.shape == (layers, slots) and p.slots_per_gpu == slots // gpus
    for l in range(layers):
        assert torch.bincount(p.phy2log[l], minlength=experts).tolist() == p.replicas[l].tolist()
        for e in range(experts):
            copies = p.log2phy[l, e][: p.replicas[l, e]]
            assert (p.phy2log[l, copies] == e).all() and (p.log2phy[l, e][p.replicas[l, e]:] == -1).all()


@pytest.mark.parametrize("experts, gpus", [(256, 8), (256, 32), (256, 64), (384, 48)])
def test_eplb_balances_skewed_loads_within_the_stated_bound(experts, gpus):
    """Zipf(1) popularity over 256 or 384 experts, 32 extra slots: without EPLB the busiest GPU
    gets 1.7-12x the mean; with it, within 5% (the bound this project states for the global form
    at these sizes)."""
    load = zipf_loads(6, experts)
    slots = num_physical_experts(experts, gpus)
    placement = rebalance(load, slots, gpus)
    _check_placement(placement, experts, slots, gpus)
    assert torch.allclose(placement.gpu_loads(load).sum(-1), load.sum(-1))  # every token is somewhere
    assert placement.imbalance(load).max() < 1.05
    assert Placement.contiguous(6, experts, gpus).imbalance(load).min() > 1.5


def test_hierarchical_placement_keeps_each_group_on_one_node():
    load = zipf_loads(3, 256, skew=0.8)
    gpus, nodes, groups = 16, 2, 8
    placement = rebalance(load, num_physical_experts(256, gpus), gpus, num_groups=groups, num_nodes=nodes)
    _check_placement(placement, 256, 288, gpus)
    per_node = placement.phy2log.shape[1] // nodes
    for l in range(3):
        for node in range(nodes):
            node_groups = set((placement.phy2log[l, node * per_node:(node + 1) * per_node] // 32).tolist())
            assert len(node_groups) == groups // nodes  # 4 whole groups, replicated inside the node only
    assert placement.imbalance(load).max() < 1.2  # balanced inside each node, groups packed over nodes


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="cannot hold"):
        replicate(torch.ones(1, 8), 4)
    with pytest.raises(ValueError, match="slots must split over GPUs"):
        rebalance(torch.ones(1, 8), 9, 2)
    with pytest.raises(ValueError, match="do not split evenly"):
        Placement.contiguous(1, 10, 4)


def test_the_simulation_benchmark_runs_and_labels_its_projection(tmp_path):
    import json

    from benchmarks import eplb

    eplb.main(["--layers", "2", "--tokens", "256", "--history", "2", "--ep", "8,16", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "eplb.json").read_text())
    kinds = {(r["model"], r["ep"], r["placement"]) for r in report["rows"]}
    assert {("v3", 16, "eplb_hier"), ("v41-flash", 8, "eplb"), ("v41-flash", 16, "static")} <= kinds
    for r in report["rows"]:
        if r["placement"] == "eplb":  # judged on fresh steps, not the history it was computed from
            static = next(s for s in report["rows"] if (s["model"], s["ep"], s["placement"]) == (r["model"], r["ep"], "static"))
            assert r["imbalance_mean"] < static["imbalance_mean"]
        assert 1 <= r["pairs_sent_per_token"] <= report["shapes"][r["model"]]["top_k"]
    assert "PROJECTION" in report["projection"]["label"] and len(report["projection"]["rows"]) == 2
