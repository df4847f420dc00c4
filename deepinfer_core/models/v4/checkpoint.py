"""DeepSeek-V4 checkpoint keys: the three namings V4 weights come in, mapped to the model's
parameter names (transformers' ``DeepseekV4ForCausalLM`` state_dict names, plus ``mtp.layers.i.*``
for the MTP block), and the checkpoint format ``V4Checkpoint`` the loader uses for V4 models.

Namings, recognised key by key (a checkpoint may mix them):

* ``original``: DeepSeek's release (no ``model.`` prefix): ``embed.weight``, ``head.weight``,
  ``norm.weight``, ``hc_head_fn``, ``layers.L.attn.wq_a.{weight,scale}``,
  ``layers.L.ffn.experts.E.{w1,w2,w3}.{weight,scale}``, ``mtp.0.*`` ...
* ``hf_save``: what transformers' ``save_pretrained`` writes for V4: ``model.`` prefix, the
  original inner names (the attention ``kv_norm`` written back as ``attn.norm``),
  ``model.embed_tokens.weight``, ``head.weight``, ``model.norm.weight``, ``model.hc_head.hc_fn``;
  no MTP.
* ``hf``: transformers' module names (``model.layers.L.self_attn.q_a_proj.weight``, fused
  ``mlp.experts.gate_up_proj`` / ``down_proj``, ``lm_head.weight``), FP8 scales
  ``X.weight_scale_inv``; MTP under ``mtp.layers.i.``.

Scales: ``X.scale`` and ``X.weight_scale_inv`` are accepted in every naming and belong to the
parameter ``X.weight_scale_inv`` (of a fused expert tensor ``P``: ``P_scale_inv``). Routed experts
per expert go into the fused tensors: ``w1`` the first half of ``gate_up_proj[E]``'s rows, ``w3``
the second, ``w2`` ``down_proj[E]``.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer_core.loader import CheckpointError, LoadPlan, Slot, expert_slots, first_slots

logger = logging.getLogger("deepinfer.loader")

NAMINGS = ("original", "hf_save", "hf")

# (parameter name, original name) inside one decoder layer (model.layers.L. / layers.L.) or MTP
# block. Tensors are mapped whole; linears by module (leaf weight, and scale / weight_scale_inv).
LAYER_TENSORS = (
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("attn_hc.fn", "hc_attn_fn"),
    ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"),
    ("ffn_hc.base", "hc_ffn_base"),
    ("ffn_hc.scale", "hc_ffn_scale"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
)
LAYER_LINEARS = (
    ("self_attn.q_a_proj", "attn.wq_a"),
    ("self_attn.q_b_proj", "attn.wq_b"),
    ("self_attn.kv_proj", "attn.wkv"),
    ("self_attn.o_a_proj", "attn.wo_a"),
    ("self_attn.o_b_proj", "attn.wo_b"),
    ("self_attn.compressor.kv_proj", "attn.compressor.wkv"),
    ("self_attn.compressor.gate_proj", "attn.compressor.wgate"),
    ("self_attn.compressor.indexer.kv_proj", "attn.indexer.compressor.wkv"),
    ("self_attn.compressor.indexer.gate_proj", "attn.indexer.compressor.wgate"),
    ("self_attn.compressor.indexer.q_b_proj", "attn.indexer.wq_b"),
    ("self_attn.compressor.indexer.scorer.weights_proj", "attn.indexer.weights_proj"),
    ("mlp.shared_experts.gate_proj", "ffn.shared_experts.w1"),
    ("mlp.shared_experts.up_proj", "ffn.shared_experts.w3"),
    ("mlp.shared_experts.down_proj", "ffn.shared_experts.w2"),
)
# What only the MTP block has, besides a decoder layer's tensors.
MTP_TENSORS = (
    ("enorm.weight", "enorm.weight"),
    ("hnorm.weight", "hnorm.weight"),
    ("norm.weight", "norm.weight"),
    ("hc_head.hc_fn", "hc_head_fn"),
    ("hc_head.hc_base", "hc_head_base"),
    ("hc_head.hc_scale", "hc_head_scale"),
)
MTP_LINEARS = (("e_proj", "e_proj"), ("h_proj", "h_proj"))
# Whole keys outside the layers: parameter name -> (original, hf_save) name.
TOP = {
    "model.embed_tokens.weight": ("embed.weight", "model.embed_tokens.weight"),
    "lm_head.weight": ("head.weight", "head.weight"),
    "model.norm.weight": ("norm.weight", "model.norm.weight"),
    "model.hc_head.hc_fn": ("hc_head_fn", "model.hc_head.hc_fn"),
    "model.hc_head.hc_base": ("hc_head_base", "model.hc_head.hc_base"),
    "model.hc_head.hc_scale": ("hc_head_scale", "model.hc_head.hc_scale"),
}
# save_pretrained's lossy spelling of the attention kv_norm (its reverse rename of ".norm.").
HF_SAVE_KV_NORM = "attn.norm.weight"

FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_EXPERT_W = {"w1": ("mlp.experts.gate_up_proj", 0), "w3": ("mlp.experts.gate_up_proj", 1), "w2": ("mlp.experts.down_proj", None)}
_LAYER_KEY = re.compile(r"(model\.)?layers\.(\d+)\.(.+)")
_MTP_KEY = re.compile(r"mtp\.(layers\.)?(\d+)\.(.+)")
_LAYER_PARAM = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MTP_PARAM = re.compile(r"mtp\.layers\.(\d+)\.(.+)")
_ORIGINAL_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.(weight|scale|weight_scale_inv)")
_HF_EXPERT = re.compile(r"(mlp\.experts\.(?:gate_up_proj|down_proj))(_scale_inv)?")
_LINEAR_LEAVES = ("weight", "scale", "weight_scale_inv")
SCALE_SUFFIX = "_scale_inv"


def _tables(mtp: bool):
    tensors = LAYER_TENSORS + (MTP_TENSORS if mtp else ())
    linears = LAYER_LINEARS + (MTP_LINEARS if mtp else ())
    return (
        {p: o for p, o in tensors},
        {o: p for p, o in tensors} | {HF_SAVE_KV_NORM: "self_attn.kv_norm.weight"},
        {p: o for p, o in linears},
        {o: p for p, o in linears},
    )


_INNER = {mtp: _tables(mtp) for mtp in (False, True)}
_TOP_BY_NAME = {name: param for param, names in TOP.items() for name in (param, *names)}


@dataclass(frozen=True)
class V4Key:
    """A checkpoint key, normalised. ``target`` is the parameter it fills (for a scale: the
    weight's parameter, ``X.weight`` or a fused expert tensor); ``expert`` / ``half`` pick the part
    of a fused expert tensor (half 0: w1 / gate rows, 1: w3 / up rows, None: down_proj or all);
    ``naming`` is one of NAMINGS, or None where the key reads the same in several; ``mtp`` is the
    MTP block's index for its keys."""

    target: str
    expert: int | None = None
    half: int | None = None
    scale: bool = False
    naming: str | None = None
    mtp: int | None = None

    @property
    def param(self) -> str:
        """The model parameter this key fills when the model holds it (scales: ``*_scale_inv``)."""
        return self.target + SCALE_SUFFIX if self.scale else self.target


def _inner(rest: str, mtp: bool) -> tuple[str, int | None, int | None, bool, bool | None] | None:
    """A key inside one layer -> (parameter suffix, expert, half, scale, original naming?)."""
    tensors, tensors_o, linears, linears_o = _INNER[mtp]
    if rest in tensors or rest in tensors_o:
        both = rest in tensors and rest in tensors_o
        return (rest if rest in tensors else tensors_o[rest]), None, None, False, None if both else rest in tensors_o
    if m := _ORIGINAL_EXPERT.fullmatch(rest):
        target, half = _EXPERT_W[m[2]]
        return target, int(m[1]), half, m[3] != "weight", True
    if m := _HF_EXPERT.fullmatch(rest):
        return m[1], None, None, bool(m[2]), False
    module, _, leaf = rest.rpartition(".")
    if leaf not in _LINEAR_LEAVES or not (module in linears or module in linears_o):
        return None
    both = module in linears and module in linears_o
    original = None if both else module in linears_o
    return (module if module in linears else linears_o[module]) + ".weight", None, None, leaf != "weight", original


def normalize_v4_key(key: str) -> V4Key | None:
    """What a V4 checkpoint key (any naming) holds, or None for a key that is no V4 tensor."""
    if key in _TOP_BY_NAME:
        param = _TOP_BY_NAME[key]
        namings = [n for n, name in zip(NAMINGS, (*TOP[param], param)) if name == key]
        return V4Key(param, naming=namings[0] if len(namings) == 1 else None)
    if m := _LAYER_KEY.fullmatch(key):
        inner = _inner(m[3], mtp=False)
        if inner is None:
            return None
        rest, expert, half, scale, original = inner
        naming = None if original is None else ("hf" if not original else "hf_save" if m[1] else "original")
        return V4Key(f"model.layers.{m[2]}.{rest}", expert, half, scale, naming)
    if m := _MTP_KEY.fullmatch(key):
        inner = _inner(m[3], mtp=True)
        if inner is None:
            return None
        rest, expert, half, scale, _ = inner
        return V4Key(f"mtp.layers.{m[2]}.{rest}", expert, half, scale, "hf" if m[1] else "original", int(m[2]))
    return None


def v4_checkpoint_key(
    target: str, naming: str = "original", expert: int | None = None, half: int | None = None, scale: bool = False
) -> str | None:
    """The checkpoint key of parameter ``target`` (a scale's: its weight's target and scale=True;
    a part of a fused expert tensor: ``expert`` and ``half``) in ``naming``; None for a name
    that is no V4 parameter. The inverse of ``normalize_v4_key``."""
    if naming not in NAMINGS:
        raise ValueError(f"naming {naming!r} is not one of {NAMINGS}")
    if target in TOP:
        return target if naming == "hf" else TOP[target][0 if naming == "original" else 1]
    if m := _LAYER_PARAM.fullmatch(target):
        prefix, mtp = (f"layers.{m[1]}." if naming == "original" else f"model.layers.{m[1]}."), False
    elif m := _MTP_PARAM.fullmatch(target):
        prefix, mtp = (f"mtp.layers.{m[1]}." if naming == "hf" else f"mtp.{m[1]}."), True
    else:
        return None
    rest = m[2]
    tensors, _, linears, _ = _INNER[mtp]
    if naming == "hf":
        known = rest in tensors or rest in FUSED_EXPERTS or rest.removesuffix(".weight") in linears
        if not known or (expert is not None and rest in FUSED_EXPERTS):
            return None  # transformers' names hold fused experts only
        return prefix + rest + (SCALE_SUFFIX if scale else "")
    leaf = "scale" if scale else "weight"
    if rest in FUSED_EXPERTS:
        if expert is None:
            return None  # the original naming holds experts one by one
        w = "w2" if rest.endswith("down_proj") else ("w1", "w3")[half]
        return f"{prefix}ffn.experts.{expert}.{w}.{leaf}"
    if rest in tensors and not scale:
        if naming == "hf_save" and rest == "self_attn.kv_norm.weight":
            return prefix + HF_SAVE_KV_NORM
        return prefix + tensors[rest]
    module = rest.removesuffix(".weight")
    if module in linears:
        return f"{prefix}{linears[module]}.{leaf}"
    return None


def rename_v4_state(state: dict[str, torch.Tensor], naming: str = "original", checkpoint_key=v4_checkpoint_key,
                    family: str = "DeepSeek-V4") -> dict[str, torch.Tensor]:
    """A state dict in parameter names (fused experts, ``*_scale_inv`` scales) -> checkpoint keys
    in ``naming`` (original / hf_save: experts one by one, scales ``.scale``), for writing test
    checkpoints; ``checkpoint_key``: the family's key mapping (models/v41/checkpoint.py passes V4.1's).
    Raises ValueError for a name that is no parameter of ``family``."""
    out = {}
    for name, tensor in state.items():
        scale = name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in state
        target = name[: -len(SCALE_SUFFIX)] if scale else name
        parts = [(None, None, tensor)]
        if target.endswith(FUSED_EXPERTS) and naming != "hf":
            halves = (0, 1) if target.endswith("gate_up_proj") else (None,)
            rows = tensor.shape[1] // len(halves)
            parts = [(e, h, tensor[e, (h or 0) * rows : ((h or 0) + 1) * rows]) for e in range(tensor.shape[0]) for h in halves]
        for expert, half, part in parts:
            key = checkpoint_key(target, naming, expert, half, scale)
            if key is None:
                raise ValueError(f"{name} is not a {family} parameter name")
            out[key] = part.clone().contiguous()
    return out


class V4Checkpoint:
    """The checkpoint format of DeepSeek-V4 models (see the module docstring). ``normalize`` /
    ``checkpoint_key``: the key mapping (models/v41/checkpoint.py's V41Checkpoint brings V4.1's)."""

    normalize = staticmethod(normalize_v4_key)
    checkpoint_key = staticmethod(v4_checkpoint_key)

    def scale_keys(self, key: str) -> tuple[str, ...]:
        """Names the scale of quantised weight ``key`` may have; () for a key that is no weight."""
        parsed = self.normalize(key)
        if parsed is None or parsed.scale:
            return ()
        if key.endswith(".weight"):
            return (key[: -len(".weight")] + ".scale", key + SCALE_SUFFIX)
        return (key + SCALE_SUFFIX,)  # fused experts, transformers' naming

    def resolve_mtp(self, model, config, key_file: dict[str, Path]) -> None:
        k = getattr(model, "num_mtp_layers", 0)
        layers = {p.mtp for p in map(self.normalize, key_file) if p is not None and p.mtp is not None}
        extra = sorted(i for i in layers if i >= k)
        if extra:
            logger.warning(
                "the checkpoint holds MTP block(s) mtp.%s.* that the model does not have (it has %d): ignored",
                extra, k,
            )
        if not k:
            return
        present = [i in layers for i in range(k)]
        if not any(present):
            logger.warning(
                "config.json announces %d MTP layer(s) (num_nextn_predict_layers) but the checkpoint has no "
                "mtp.0.* keys: loading without MTP (speculative decoding with MTP is unavailable)",
                k,
            )
            model.drop_mtp_layers()
        elif not all(present):
            missing = [i for i, p in enumerate(present) if not p]
            raise CheckpointError(
                f"the checkpoint holds only some of the {k} MTP layers: no keys for mtp.{missing}.*; "
                "use a complete checkpoint or set num_nextn_predict_layers in config.json to the layers it has"
            )

    def plan(self, model, config, key_file: dict[str, Path]) -> LoadPlan:
        params = model.state_dict(keep_vars=True)
        k = getattr(model, "num_mtp_layers", 0)
        slots = getattr(model, "expert_slots", None)  # expert parallelism: only this rank's experts (not the MTP block's)
        found: dict[tuple, str] = {}  # (target, expert, half, scale) -> checkpoint key
        parsed: dict[str, V4Key] = {}
        ignored: set[str] = set()
        namings: Counter[str] = Counter()
        for key, path in key_file.items():
            p = self.normalize(key)
            if p is None:
                continue  # reported as unexpected
            if p.mtp is not None and p.mtp >= k:
                ignored.add(key)  # an MTP block the model does not have (resolve_mtp warned)
                continue
            if slots is not None and p.mtp is None and p.expert is not None and p.expert not in slots:
                ignored.add(key)  # another rank's expert
                continue
            ident = (p.target, p.expert, p.half, p.scale)
            if ident in found:
                other = found[ident]
                raise CheckpointError(
                    f"{path}: {key} and {other} ({key_file[other].name}) are the same tensor "
                    f"({p.param}) under two names: the checkpoint holds it twice; remove one of them"
                )
            found[ident], parsed[key] = key, p
            if p.naming:
                namings[p.naming] += 1
        naming = namings.most_common(1)[0][0] if namings else "original"  # names the missing keys

        expected: dict[str, Slot] = {}
        for name, tensor in params.items():
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            scale = name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in params
            target = name[: -len(SCALE_SUFFIX)] if scale else name
            whole = (target, None, None, scale)
            param_slots = expert_slots(model, name)
            if target.endswith(FUSED_EXPERTS) and whole not in found:
                halves = (0, 1) if target.endswith("gate_up_proj") else (None,)
                first = first_slots(tensor.shape[0], param_slots)
                parts = [(e, h) for e in first for h in halves]
                if naming != "hf" or any((target, e, h, scale) in found for e, h in parts):
                    rows = tensor.shape[1] // len(halves)
                    for e, h in parts:
                        key = found.get((target, e, h, scale)) or self.checkpoint_key(target, naming, e, h, scale)
                        expected[key] = Slot(name, first[e], None if h is None else slice(h * rows, (h + 1) * rows))
                    continue
            key = found.get(whole) or self.checkpoint_key(target, naming, scale=scale) or name
            sharded = param_slots is not None and target.endswith(FUSED_EXPERTS)  # fused: this rank's rows
            expected[key] = Slot(name, source=tuple(param_slots)) if sharded else Slot(name)

        companions = {}
        for key, p in parsed.items():
            if p.scale and key not in expected:
                weight = found.get((p.target, p.expert, p.half, False))
                if weight in expected:
                    companions[weight] = key  # dequantised together with its weight
        return LoadPlan(expected, companions, ignored)
