"""DeepSeek-V4.1 checkpoint keys (deepseek_architectures.md §5.4): DeepSeek's original naming
mapped to the model's parameter names (models/v41/model.py: V4's transformers-style names
where V4.1 reuses a V4 module), and the checkpoint format ``V41Checkpoint``.

Beyond V4's original keys (``models/v4/checkpoint.py``): the stand-alone indexer of index sources
(``layers.L.attn.indexer.{wq_b,weights_proj}``; KV sources also ``wk`` and ``k_norm``), Engram
(``layers.L.engram.{embed,wkv}.{weight,scale}``, ``engram.{q_weight,k_weight}``) and the DSpark
stages ``mtp.{0,1,2}.*`` (``mtp.layers.i.*`` in the model). The vision tower (``vision.*``, ``aligner.*``, ``image_*``) is skipped
with a logged note: image input is not supported.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from deepinfer_core.models.v4.checkpoint import V4Checkpoint, V4Key, normalize_v4_key, rename_v4_state, v4_checkpoint_key
from deepinfer_core.loader import LoadPlan

logger = logging.getLogger("deepinfer.loader")

# (parameter suffix inside a layer, original suffix): tensors whole, linears by module.
V41_TENSORS = (
    ("self_attn.indexer.k_norm.weight", "attn.indexer.k_norm.weight"),
    ("engram.q_weight", "engram.q_weight"),
    ("engram.k_weight", "engram.k_weight"),
)
V41_LINEARS = (
    ("self_attn.indexer.q_b_proj", "attn.indexer.wq_b"),
    ("self_attn.indexer.weights_proj", "attn.indexer.weights_proj"),
    ("self_attn.indexer.k_proj", "attn.indexer.wk"),
    ("engram.kv_proj", "engram.wkv"),
    ("engram.embed", "engram.embed"),
)
VISION_PREFIXES = ("vision.", "aligner.", "image_")
_TENSOR_BY_ORIGINAL = {o: p for p, o in V41_TENSORS}
_TENSOR_BY_PARAM = dict(V41_TENSORS)
_LINEAR_BY_ORIGINAL = {o: p for p, o in V41_LINEARS}
_LINEAR_BY_PARAM = dict(V41_LINEARS)
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
_PARAM = re.compile(r"model\.layers\.(\d+)\.(.+)")
_STAGE_PARAM = re.compile(r"mtp\.layers\.(\d+)\.(.+)")


def normalize_v41_key(key: str) -> V4Key | None:
    """What a V4.1 checkpoint key holds (original naming), or None for a key that is no V4.1 tensor."""
    if m := _LAYER.fullmatch(key):
        rest = m[2]
        if rest in _TENSOR_BY_ORIGINAL:
            return V4Key(f"model.layers.{m[1]}.{_TENSOR_BY_ORIGINAL[rest]}", naming="original")
        module, _, leaf = rest.rpartition(".")
        if module in _LINEAR_BY_ORIGINAL and leaf in ("weight", "scale"):
            return V4Key(f"model.layers.{m[1]}.{_LINEAR_BY_ORIGINAL[module]}.weight", scale=leaf == "scale", naming="original")
    parsed = normalize_v4_key(key)
    if parsed is not None and parsed.naming in (None, "original"):
        return parsed
    if m := _MTP.fullmatch(key):  # a DSpark stage's own tensors: main_proj / main_norm, the heads
        rest, scale = m[2], m[2].endswith(".scale")
        return V4Key(f"mtp.layers.{m[1]}.{rest.removesuffix('.scale') + '.weight' if scale else rest}", scale=scale,
                     naming="original", mtp=int(m[1]))
    return None


def v41_checkpoint_key(target: str, naming: str = "original", expert: int | None = None, half: int | None = None,
                       scale: bool = False) -> str | None:
    """The original checkpoint key of parameter ``target`` (the inverse of ``normalize_v41_key``)."""
    if m := _PARAM.fullmatch(target):
        rest = m[2]
        if rest in _TENSOR_BY_PARAM and not scale:
            return f"layers.{m[1]}.{_TENSOR_BY_PARAM[rest]}"
        module = rest.removesuffix(".weight")
        if module in _LINEAR_BY_PARAM:
            return f"layers.{m[1]}.{_LINEAR_BY_PARAM[module]}.{'scale' if scale else 'weight'}"
    key = v4_checkpoint_key(target, "original", expert, half, scale)
    if key is None and (m := _STAGE_PARAM.fullmatch(target)):  # DSpark's own tensors keep their names
        key = f"mtp.{m[1]}.{m[2].removesuffix('.weight') + '.scale' if scale else m[2]}"
    return key


def rename_v41_state(state: dict) -> dict:
    """A state dict in parameter names -> original checkpoint keys (``rename_v4_state`` with
    V4.1's mapping), for writing test checkpoints."""
    return rename_v4_state(state, "original", v41_checkpoint_key, "DeepSeek-V4.1")


class V41Checkpoint(V4Checkpoint):
    """The checkpoint format of DeepSeek-V4.1 (module docstring)."""

    normalize = staticmethod(normalize_v41_key)
    checkpoint_key = staticmethod(v41_checkpoint_key)

    def plan(self, model, config, key_file: dict[str, Path]) -> LoadPlan:
        plan = super().plan(model, config, key_file)
        vision = {k for k in key_file if k.startswith(VISION_PREFIXES)}
        if vision:
            logger.info("skipping the %d tensors of the vision tower (vision.*, aligner.*, image_*): image input is not supported",
                        len(vision))
            plan.ignored |= vision
        return plan
