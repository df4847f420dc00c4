"""DeepSeek-V4's config.json (read through transformers), and the fields V4 and V4.1 share."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deepinfer_core.config import ConfigError, as_token_ids, fp8_block_of, transformers_config, validation_problems


class V4FamilyConfig(BaseModel):
    """The config.json fields DeepSeek-V4 and V4.1 share (attention with sinks over a sliding
    window and compressed entries, mHC streams, sqrt-softplus MoE), and their checks."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    q_lora_rank: int = Field(gt=0)
    o_groups: int = Field(gt=0)
    o_lora_rank: int = Field(gt=0)
    index_n_heads: int = Field(gt=0)
    index_head_dim: int = Field(gt=0)
    index_topk: int = Field(gt=0)
    sliding_window: int = Field(gt=1)
    n_routed_experts: int = Field(gt=0)
    n_shared_experts: int = Field(ge=0)
    moe_intermediate_size: int = Field(gt=0)
    num_experts_per_tok: int = Field(gt=0)
    routed_scaling_factor: float = Field(gt=0)
    swiglu_limit: float | None = None
    hc_mult: int = Field(gt=0)
    hc_sinkhorn_iters: int = Field(gt=0)
    hc_eps: float = Field(ge=0)
    rms_norm_eps: float = Field(gt=0)
    rope_theta: float = Field(gt=0)
    compress_rope_theta: float = Field(gt=0)
    compress_rope_parameters: dict[str, Any]
    max_position_embeddings: int = Field(gt=0)
    num_nextn_predict_layers: int = Field(0, ge=0)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None
    fp8_block: tuple[int, int] | None = None
    expert_dtype: Literal["fp4", "fp8", "bf16"] | None = None

    @model_validator(mode="after")
    def _check_shared(self):
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and at most head_dim={self.head_dim}")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not divisible by o_groups={self.o_groups}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts={self.n_routed_experts}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"index_head_dim={self.index_head_dim} is smaller than qk_rope_head_dim={self.qk_rope_head_dim}")
        return self

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return as_token_ids(self.eos_token_id)


class V4ModelConfig(V4FamilyConfig):
    """The fields of a DeepSeek-V4 config.json (as transformers' DeepseekV4Config reads it:
    legacy ``compress_ratios`` / ``num_hash_layers`` folded into ``layer_types`` /
    ``mlp_layer_types``), validated. ``compress_ratios`` is per layer: 0 (sliding window only),
    the CSA rate or the HCA rate."""

    model_type: Literal["deepseek_v4"]
    layer_types: tuple[Literal["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"], ...]
    csa_ratio: int = Field(gt=0)
    hca_ratio: int = Field(gt=0)
    norm_topk_prob: bool
    scoring_func: Literal["sqrtsoftplus"]
    num_hash_layers: int = Field(ge=0)

    @model_validator(mode="after")
    def _check(self) -> V4ModelConfig:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        return self

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        rate = {"sliding_attention": 0, "compressed_sparse_attention": self.csa_ratio, "heavily_compressed_attention": self.hca_ratio}
        return tuple(rate[t] for t in self.layer_types)

    def context_bytes_per_token(self, itemsize: int, chunk_tokens: int) -> int:
        """Activation bytes a prefill chunk of ``chunk_tokens`` needs per token of context: one
        layer's gathered compressed entries and indexer keys, and the chunk's int64 index of the
        HCA entries each query sees (the ops' own temporaries are bounded, see ops/sparse.py)."""
        entries = (self.head_dim + self.index_head_dim) * itemsize / self.csa_ratio + self.head_dim * itemsize / self.hca_ratio
        return math.ceil(2 * entries + 8 * chunk_tokens / self.hca_ratio)

    @classmethod
    def from_config_json(cls, raw: dict, model_dir: str | Path) -> V4ModelConfig:
        """From config.json's contents, through transformers' DeepseekV4Config."""
        check_layer_kinds(raw)
        return cls.from_hf(transformers_config(model_dir), raw)

    @classmethod
    def from_hf(cls, hf: Any, raw: dict | None = None) -> V4ModelConfig:
        raw = raw if raw is not None else hf.to_dict()
        rope = getattr(hf, "rope_parameters", None) or {}
        rates = dict(getattr(hf, "compress_rates", None) or {})
        quant = dict(raw.get("quantization_config") or {})
        expert_dtype = raw.get("expert_dtype") or quant.pop("expert_dtype", None)
        mlp_types = list(getattr(hf, "mlp_layer_types", None) or [])
        num_hash = sum(1 for t in mlp_types if t == "hash_moe")
        if mlp_types[:num_hash] != ["hash_moe"] * num_hash:
            raise ConfigError(f"mlp_layer_types {mlp_types}: hash_moe layers must come first")
        layer_types = list(hf.layer_types)  # transformers folds compress_ratios in (and drops the MTP tail)
        fields: dict[str, Any] = {
            "model_type": "deepseek_v4",
            "vocab_size": hf.vocab_size,
            "hidden_size": hf.hidden_size,
            "num_hidden_layers": hf.num_hidden_layers,
            "num_attention_heads": hf.num_attention_heads,
            "head_dim": hf.head_dim,
            "qk_rope_head_dim": int(hf.qk_rope_head_dim),
            "q_lora_rank": hf.q_lora_rank,
            "o_groups": hf.o_groups,
            "o_lora_rank": hf.o_lora_rank,
            "layer_types": tuple(layer_types),
            "csa_ratio": rates.get("compressed_sparse_attention", 4),
            "hca_ratio": rates.get("heavily_compressed_attention", 128),
            "index_n_heads": hf.index_n_heads,
            "index_head_dim": hf.index_head_dim,
            "index_topk": hf.index_topk,
            "sliding_window": hf.sliding_window,
            "n_routed_experts": hf.n_routed_experts,
            "n_shared_experts": hf.n_shared_experts or 0,
            "moe_intermediate_size": hf.moe_intermediate_size,
            "num_experts_per_tok": hf.num_experts_per_tok,
            "norm_topk_prob": bool(hf.norm_topk_prob),
            "routed_scaling_factor": hf.routed_scaling_factor,
            "scoring_func": hf.scoring_func,
            "num_hash_layers": num_hash,
            "swiglu_limit": getattr(hf, "swiglu_limit", None),
            "hc_mult": hf.hc_mult,
            "hc_sinkhorn_iters": hf.hc_sinkhorn_iters,
            "hc_eps": hf.hc_eps,
            "rms_norm_eps": hf.rms_norm_eps,
            "rope_theta": rope.get("main", {}).get("rope_theta", getattr(hf, "rope_theta", 10000.0)),
            "compress_rope_theta": rope.get("compress", {}).get("rope_theta", hf.compress_rope_theta),
            "compress_rope_parameters": dict(rope.get("compress", {"rope_type": "default"})),
            "max_position_embeddings": hf.max_position_embeddings,
            "num_nextn_predict_layers": getattr(hf, "num_nextn_predict_layers", 0) or 0,
            "tie_word_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
            "bos_token_id": hf.bos_token_id,
            "eos_token_id": hf.eos_token_id,
            "torch_dtype": str(raw.get("torch_dtype") or raw.get("dtype") or "") or None,
            "fp8_block": fp8_block_of({"quantization_config": quant}),
            "expert_dtype": expert_dtype,
        }
        try:
            return cls(**fields)
        except ValidationError as e:
            raise ConfigError(f"not usable: {validation_problems(e)}") from e


def check_layer_kinds(raw: dict) -> None:
    """A V4 config.json names each layer's kind: DeepSeek's ``compress_ratios`` (0, 4 or 128 per
    layer, what transformers maps) or transformers' ``layer_types`` (with ``compress_rates``)."""
    ratios = raw.get("compress_ratios")
    if "layer_types" in raw:
        return
    if ratios is None:
        raise ConfigError(
            "a deepseek_v4 config.json needs compress_ratios (DeepSeek's) or layer_types (transformers'): "
            "transformers' default layer pattern does not match DeepSeek's checkpoints"
        )
    bad = sorted({r for r in ratios if r not in (0, 4, 128)} if isinstance(ratios, list) else {str(ratios)})
    if bad:
        raise ConfigError(
            f"compress_ratios holds {bad}; transformers reads only 0, 4 and 128 there. For other rates give "
            "layer_types (sliding_attention / compressed_sparse_attention / heavily_compressed_attention) and compress_rates"
        )
