"""DeepSeek-V2 / V3's checkpoint format: HF / DeepSeek key names, routed experts per expert or
fused, MTP layer i under ``model.layers.{num_hidden_layers + i}`` (its ``embed_tokens`` and
``shared_head.head`` ignored: tied to the main model). The shared reading (files, FP8, errors) is
``deepinfer_core.loader``'s."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from deepinfer_core.loader import CheckpointError, LoadPlan, Slot, expert_slots, first_slots

logger = logging.getLogger("deepinfer.loader")

MTP_TIED_KEYS = ("embed_tokens.weight", "shared_head.head.weight")
EXPERT_KEY = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_scale_inv)?")
PER_EXPERT_KEY = re.compile(r".*\.mlp\.experts\.(\d+)\.(?:gate|up|down)_proj\.weight(?:_scale_inv)?")


class V3Checkpoint:
    """The checkpoint format of DeepSeek V2/V3 (module docstring): HF / DeepSeek names, MTP layer
    i under ``model.layers.{num_hidden_layers + i}``. A checkpoint format provides these three
    methods (``models/v4/checkpoint.py``'s ``V4Checkpoint`` is another)."""

    def scale_keys(self, key: str) -> tuple[str, ...]:
        """The names the scale of quantised weight ``key`` may have (any one present will do)."""
        return (_scale_key(key),)

    def resolve_mtp(self, model, config, key_file: dict[str, Path]) -> None:
        """Drop the model's MTP layers when the checkpoint has none (warning); error when some lack."""
        _resolve_mtp(model, config, key_file)

    def plan(self, model, config, key_file: dict[str, Path]) -> LoadPlan:
        expected = _expected_keys(model, config, set(key_file))
        mtp_first = config.num_hidden_layers
        ignored, companions = set(), {}
        slots = getattr(model, "expert_slots", None)
        for key in key_file:
            if key in expected:
                continue
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.*)", key)
            e = PER_EXPERT_KEY.fullmatch(key)
            if m and mtp_first <= int(m[1]) < mtp_first + model.num_mtp_layers and m[2] in MTP_TIED_KEYS:
                ignored.add(key)
            elif slots is not None and e and int(e[1]) not in slots and m and int(m[1]) < mtp_first:
                ignored.add(key)  # another rank's expert (the MTP layers keep every expert)
            elif key.endswith("_scale_inv") and key[: -len("_scale_inv")] in expected:
                companions[key[: -len("_scale_inv")]] = key  # dequantised together with its weight
        return LoadPlan(expected, companions, ignored)


def _checkpoint_name(param: str, num_hidden_layers: int) -> str:
    m = re.fullmatch(r"mtp\.layers\.(\d+)\.(.*)", param)
    return f"model.layers.{num_hidden_layers + int(m[1])}.{m[2]}" if m else param


def _scale_key(weight_key: str) -> str:
    return weight_key + "_scale_inv"


def _expected_keys(model: torch.nn.Module, config, present: set[str]) -> dict[str, Slot]:
    """Checkpoint key -> where it goes, for every tensor the model needs."""
    expected: dict[str, Slot] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        key = _checkpoint_name(name, config.num_hidden_layers)
        slots = expert_slots(model, name)
        if key in present:
            sharded = slots is not None and EXPERT_KEY.fullmatch(key)
            expected[key] = Slot(name, source=tuple(slots)) if sharded else Slot(name)
            continue
        split = split_expert_key(key, tensor.shape, name, slots)
        expected.update({key: Slot(name)} if split is None else split)
    return expected


def split_expert_key(key: str, shape: tuple[int, ...], param: str | None = None,
                     slots: tuple[int, ...] | None = None) -> dict[str, Slot] | None:
    """A fused routed-expert key (``EXPERT_KEY``) of tensor ``shape`` -> DeepSeek's per-expert
    keys, each with its part of the fused tensor (of ``param``, default ``key``); None for any
    other key. ``slots`` (expert parallelism): the logical expert of each of the tensor's slots;
    only those experts' keys, each into its first slot."""
    m = EXPERT_KEY.fullmatch(key)
    if m is None:
        return None
    experts, proj, suffix, param = m[1], m[2], "weight_scale_inv" if m[3] else "weight", param or key
    first = first_slots(shape[0], slots)
    if proj == "down_proj":
        return {f"{experts}.{e}.down_proj.{suffix}": Slot(param, s) for e, s in first.items()}
    half = shape[1] // 2
    split = {}
    for e, s in first.items():
        split[f"{experts}.{e}.gate_proj.{suffix}"] = Slot(param, s, slice(0, half))
        split[f"{experts}.{e}.up_proj.{suffix}"] = Slot(param, s, slice(half, 2 * half))
    return split


def _resolve_mtp(model, config, key_file: dict[str, Path]) -> None:
    n, k = config.num_hidden_layers, model.num_mtp_layers
    if not k:
        return
    present = [any(key.startswith(f"model.layers.{n + i}.") for key in key_file) for i in range(k)]
    if not any(present):
        logger.warning(
            "config.json announces %d MTP layer(s) (num_nextn_predict_layers) but the checkpoint has no "
            "model.layers.%d.* keys: loading without MTP (speculative decoding with MTP is unavailable)",
            k,
            n,
        )
        model.drop_mtp_layers()
    elif not all(present):
        missing = [n + i for i, p in enumerate(present) if not p]
        raise CheckpointError(
            f"the checkpoint holds only some of the {k} MTP layers: no keys for model.layers.{missing}.*; "
            "use a complete checkpoint or set num_nextn_predict_layers in config.json to the layers it has"
        )


