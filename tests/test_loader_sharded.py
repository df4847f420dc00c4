"""Loading one expert-parallel rank's shard: a model built with ``expert_slots`` gets exactly its
experts' weights (each in its first slot), the other ranks' experts are never read, and a
checkpoint that lacks one of this rank's experts is still an error."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer_core import loader
from deepinfer_core.models.registry import read_config
from deepinfer_core.parallel.expert_parallel import initial_slots
from deepinfer_core.loader import CheckpointError, load_model
from deepinfer_core.models.registry import get_model_class
from deepinfer_core.ops import OpTable
from tests.hf_checkpoints import write_checkpoint
from tests.hf_checkpoints_v4 import write_checkpoint_v4


def slots_for(path: Path) -> tuple[int, ...]:
    """Four slots, one expert twice (the loader fills the first, ExpertParallel copies it to the other)."""
    e = read_config(path).n_routed_experts
    return (e - 3, 1, e - 3, e - 2)


SLOTS = (5, 1, 5, 6)  # of the 8 experts of the V3 checkpoints
EXPERT = re.compile(r".*experts\.(\d+)\..*")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name in ("v3_yarn", "v3_fp8"):
        out[name] = tmp_path_factory.mktemp(name) / "ckpt"
        write_checkpoint(name, out[name])
    out["v4"] = tmp_path_factory.mktemp("v4") / "ckpt"
    write_checkpoint_v4("v4_flash_like", out["v4"])
    return out


def build(path: Path, slots=None, keep_fp8: bool = False):
    config = read_config(path)
    cls = get_model_class(config.model_type)
    return config, cls(config, OpTable.reference(), torch.float32, torch.device("cpu"), keep_fp8=keep_fp8, expert_slots=slots)


def experts_of(model) -> list:
    return [m for m in model.modules() if type(m).__name__ == "Experts"]


def load_recording(monkeypatch, path: Path, slots, keep_fp8: bool = False):
    """The model for ``slots`` loaded from ``path``, and every checkpoint key read."""
    read: list[str] = []
    original = loader._read

    def recording(handles, key_file, key, rows=None):
        read.append(key)
        return original(handles, key_file, key, rows)

    monkeypatch.setattr(loader, "_read", recording)
    config, model = build(path, slots, keep_fp8)
    load_model(path, config, model, progress=False)
    return model, read


def assert_shard_matches(full, shard, slots):
    pairs = list(zip(experts_of(full), experts_of(shard), strict=True))
    assert pairs
    for whole, part in pairs:
        assert part.gate_up_proj.shape[0] == len(slots)
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv"):
            w, p = getattr(whole, name), getattr(part, name)
            if w is None:
                continue
            for slot, expert in enumerate(slots):
                if slots.index(expert) == slot:  # the first copy is loaded
                    torch.testing.assert_close(p[slot], w[expert], rtol=0, atol=0)


@pytest.mark.parametrize("name,keep_fp8", [("v3_yarn", False), ("v3_fp8", False), ("v3_fp8", True), ("v4", False)])
def test_a_shard_loads_its_experts_and_reads_no_other(checkpoints, monkeypatch, name, keep_fp8):
    path = checkpoints[name]
    config, full = build(path, keep_fp8=keep_fp8)
    load_model(path, config, full, progress=False)
    slots = slots_for(path)
    shard, read = load_recording(monkeypatch, path, slots, keep_fp8)
    assert_shard_matches(full, shard, slots)
    experts_read = {int(m[1]) for key in read if (m := EXPERT.fullmatch(key))}
    assert experts_read == set(slots)  # every other expert's tensors stay unread


def test_a_fused_checkpoint_is_read_row_by_row(checkpoints, tmp_path, monkeypatch):
    """Experts stored fused (``mlp.experts.gate_up_proj`` [E, 2I, D]): a shard reads its rows."""
    src = checkpoints["v3_yarn"]
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fused, layers = {}, {m[1] for k in tensors if (m := re.fullmatch(r"(.*\.mlp\.experts)\.\d+\..*", k))}
    for prefix in layers:
        n = len({k for k in tensors if k.startswith(prefix + ".") and k.endswith("down_proj.weight")})
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"]]) for e in range(n)])
        fused[f"{prefix}.down_proj"] = torch.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(n)])
    rest = {k: v for k, v in tensors.items() if not EXPERT.fullmatch(k)}
    dst = tmp_path / "fused"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file({**rest, **fused}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config, full = build(src)
    load_model(src, config, full, progress=False)
    shard, _ = load_recording(monkeypatch, dst, SLOTS)
    assert_shard_matches(full, shard, SLOTS)


def test_the_mtp_layer_keeps_every_expert(tmp_path, monkeypatch):
    """The MTP layer drafts on each rank alone: a shard loads all of its experts."""
    from tests.hf_checkpoints import add_mtp_weights

    path = tmp_path / "mtp"
    add_mtp_weights(path, write_checkpoint("v3_yarn", path))
    config, full = build(path)
    load_model(path, config, full, progress=False)
    shard, read = load_recording(monkeypatch, path, SLOTS)
    assert_shard_matches(full.model, shard.model, SLOTS)
    whole, part = experts_of(full.mtp)[0], experts_of(shard.mtp)[0]
    assert part.gate_up_proj.shape[0] == config.n_routed_experts
    torch.testing.assert_close(part.gate_up_proj, whole.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(part.down_proj, whole.down_proj, rtol=0, atol=0)


def test_a_missing_expert_of_this_rank_is_an_error_and_another_ranks_is_not(checkpoints, tmp_path):
    src = checkpoints["v3_yarn"]
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    dst = tmp_path / "holey"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    gone = next(k for k in tensors if ".experts.6.up_proj" in k)
    save_file({k: v for k, v in tensors.items() if k != gone}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config, model = build(dst, (0, 1, 2, 3))
    load_model(dst, config, model, progress=False)  # expert 6 lives on another rank
    config, model = build(dst, SLOTS)
    with pytest.raises(CheckpointError, match=re.escape(gone)):
        load_model(dst, config, model, progress=False)


def test_initial_slots_cover_every_expert_once_over_the_ranks():
    for experts, size, extra in ((8, 2, 0), (16, 4, 32), (256, 8, 32), (5, 2, 1)):
        per_rank = [initial_slots(experts, r, size, extra=extra) for r in range(size)]
        assert len({len(s) for s in per_rank}) == 1
        assert set().union(*per_rank) == set(range(experts))
