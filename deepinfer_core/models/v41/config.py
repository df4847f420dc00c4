"""DeepSeek-V4.1-Flash's config.json (deepseek_architectures.md §4.9) and its attention topology (§4.3).

transformers has no V4.1, so config.json is read here: the model's fields live in its nested
``text_config`` (or at the top level of a flattened config), ``quantization_config`` and
``image_token_id`` at the top level; the ``vision_config`` is ignored (image input is not supported).

Topology: a layer with ``compress_ratios[l] > 0`` reads the compressed cache of its KV owner (the
largest ``kv_source_layer_ids`` entry <= l, of the same ratio) and the top-k selection of its index
owner (the largest ``index_source_layer_ids`` entry <= l). Modes: FULL (a KV source: compressor and
indexer), REINDEX (an index source that owns no KV: its own indexer queries over the owner's index
keys), REUSE (the owner's entries and the latest index source's selection of the same forward),
WINDOW (ratio 0: the sliding window only). Index sources after ``candidate_source_layer_id`` score
only the entries of the candidate blocks that layer keeps.
"""

from __future__ import annotations

import logging
import math
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from deepinfer_core.config import ConfigError, fp8_block_of, validation_problems
from deepinfer_core.models.v4.config import V4FamilyConfig

FULL, REINDEX, REUSE, WINDOW = "full", "reindex", "reuse", "window"
MODEL_TYPE = "deepseek_v41"


class V41ModelConfig(V4FamilyConfig):
    """The fields of a DeepSeek-V4.1 config.json the engine uses, validated (names as in the
    official ``text_config``; ``num_nextn_predict_layers`` counts the DSpark stages)."""

    model_type: Literal["deepseek_v41"]
    compress_ratios: tuple[int, ...]  # per layer: 0 (window only), 1 or 2; the DSpark tail is dropped
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int | None = None
    candidate_block_size: int = Field(8, gt=0)
    candidate_topk_blocks: int = Field(2048, gt=0)
    norm_topk_prob: bool = True
    scoring_func: Literal["sqrtsoftplus"] = "sqrtsoftplus"
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = Field(4, gt=1)
    engram_n_heads: int = Field(8, gt=0)
    engram_head_dim: int = Field(256, gt=0)
    engram_vocab_size: int = Field(16000000, gt=1)
    engram_compressed_vocab_size: int = Field(0, ge=0)
    engram_pad_token_id: int = Field(2, ge=0)
    dspark_block_size: int = Field(5, gt=0)
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = Field(256, gt=0)
    dspark_n_routed_experts: int | None = None
    dspark_num_experts_per_tok: int | None = None
    image_token_id: int | None = None

    @model_validator(mode="after")
    def _check(self) -> V41ModelConfig:
        n = self.num_hidden_layers
        if len(self.compress_ratios) != n:
            raise ValueError(f"compress_ratios has {len(self.compress_ratios)} entries for {n} layers (after the DSpark tail)")
        if bad := sorted({r for r in self.compress_ratios if r not in (0, 1, 2)}):
            raise ValueError(f"compress_ratios holds {bad}; V4.1 layers have ratio 0, 1 or 2")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            ids = getattr(self, name)
            if list(ids) != sorted(set(ids)) or any(not 0 <= i < n for i in ids):
                raise ValueError(f"{name}={list(ids)} must be increasing layer ids below num_hidden_layers={n}")
        ratios = self.compress_ratios
        for src in self.kv_source_layer_ids + self.index_source_layer_ids:
            if ratios[src] == 0:
                raise ValueError(f"layer {src} is a KV / index source but its compress ratio is 0")
        for layer, r in enumerate(ratios):
            if not r:
                continue
            owner = self.kv_owner(layer)
            if owner is None or ratios[owner] != r:
                raise ValueError(
                    f"layer {layer} (ratio {r}) has no KV source of the same ratio at or before it "
                    f"(kv_source_layer_ids={list(self.kv_source_layer_ids)})"
                )
            index = self.index_owner(layer)
            if index is None or index < owner:
                raise ValueError(f"layer {layer} has no index source at or after its KV source {owner} (index_source_layer_ids)")
        cand = self.candidate_source_layer_id
        if cand is not None and cand not in self.index_source_layer_ids:
            raise ValueError(f"candidate_source_layer_id={cand} is not an index source")
        if len(self.engram_num_embeddings) not in (0, len(self.engram_layer_ids)):
            raise ValueError(f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries for engram_layer_ids={list(self.engram_layer_ids)}")
        if self.engram_layer_ids and not self.engram_compressed_vocab_size:
            raise ValueError("engram_layer_ids is set but engram_compressed_vocab_size is not")
        if bad := [t for t in self.dspark_target_layer_ids if not 0 <= t < n]:
            raise ValueError(f"dspark_target_layer_ids {bad} are not layers below num_hidden_layers={n}")
        return self

    # ---- topology (§4.3) --------------------------------------------------------------------
    def kv_owner(self, layer: int) -> int | None:
        """The KV source whose compressed cache ``layer`` reads (None: a window-only layer)."""
        if not self.compress_ratios[layer]:
            return None
        return max((s for s in self.kv_source_layer_ids if s <= layer), default=None)

    def index_owner(self, layer: int) -> int | None:
        """The index source whose selection ``layer`` attends with (None: a window-only layer)."""
        if not self.compress_ratios[layer]:
            return None
        return max((s for s in self.index_source_layer_ids if s <= layer), default=None)

    def mode(self, layer: int) -> str:
        if not self.compress_ratios[layer]:
            return WINDOW
        if layer in self.kv_source_layer_ids:
            return FULL
        return REINDEX if layer in self.index_source_layer_ids else REUSE

    def filters_candidates(self, layer: int) -> bool:
        """An index source after the candidate source: scores only entries of its candidate blocks."""
        cand = self.candidate_source_layer_id
        return cand is not None and layer in self.index_source_layer_ids and layer > cand

    @property
    def last_kv_source(self) -> int:
        return max(self.kv_source_layer_ids, default=-1)

    def context_bytes_per_token(self, itemsize: int, chunk_tokens: int) -> int:
        """Activation bytes a prefill chunk needs per token of context: one owner's gathered
        entries and index keys (ratio 1, the densest), and the chunk's int64 candidate index."""
        return math.ceil(2 * (self.head_dim + self.index_head_dim) * itemsize + 8 * chunk_tokens)

    # ---- reading config.json ----------------------------------------------------------------
    @classmethod
    def from_config_json(cls, raw: dict, model_dir=None) -> V41ModelConfig:
        """From config.json's contents (transformers has no V4.1: read here, ``from_raw``)."""
        return cls.from_raw(raw)

    @classmethod
    def from_raw(cls, raw: dict) -> V41ModelConfig:
        """From config.json's contents: ``text_config`` (or the top level) for the model, the top
        level for ``quantization_config`` / ``image_token_id``."""
        text = dict(raw.get("text_config") or raw)
        for key in ("text_config", "vision_config", "architectures", "auto_map", "transformers_version"):
            text.pop(key, None)
        quant = dict(raw.get("quantization_config") or text.pop("quantization_config", None) or {})
        expert_dtype = text.pop("expert_dtype", None) or quant.pop("expert_dtype", None)
        for key in ("scale_fmt", "activation_scheme", "fmt"):
            quant.pop(key, None)
        rope = dict(text.pop("rope_scaling", None) or text.pop("rope_parameters", None) or {"rope_type": "default"})
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        if rope.get("rope_type") == "yarn":
            rope["attention_factor"] = 1.0  # the compress rope applies no YaRN mscale (§6 item 4)
        if text.get("gate_temp", 1.0) != 1.0:
            raise ConfigError(f"gate_temp={text['gate_temp']} is not supported (router logits are not divided by a temperature)")
        n = text.get("num_hidden_layers", 0)
        ratios = list(text.pop("compress_ratios", None) or [0] * n)
        fields = {k: v for k, v in text.items() if k in cls.model_fields}
        unused = sorted(set(text) - set(fields) - _IGNORED_KEYS)
        fields.update(
            model_type=MODEL_TYPE,
            compress_ratios=tuple(ratios[:n]),  # the tail describes the DSpark stages
            compress_rope_parameters=rope,
            torch_dtype=str(text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype") or "") or None,
            fp8_block=fp8_block_of({"quantization_config": quant}),
            expert_dtype=expert_dtype,
            image_token_id=raw.get("image_token_id", text.get("image_token_id")),
        )
        fields.setdefault("n_shared_experts", 0)
        try:
            config = cls(**fields)
        except ValidationError as e:
            raise ConfigError(f"not usable: {validation_problems(e)}") from e
        if unused:
            logging.getLogger("deepinfer").debug("config.json keys not used by DeepSeek-V4.1: %s", unused)
        return config


# text_config keys that describe what the engine does not need (or derives itself).
_IGNORED_KEYS = {
    "model_type", "num_key_value_heads", "hidden_act", "topk_method", "n_group", "topk_group",
    "num_hash_layers", "dtype", "use_cache", "initializer_range", "attention_bias", "attention_dropout",
    "dspark_draft_topk", "gate_temp", "bias_vl",
}
