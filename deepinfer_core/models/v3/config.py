"""DeepSeek-V2 / V3 / R1's config.json: the fields the engine uses, read through transformers."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deepinfer_core.config import ConfigError, as_token_ids, fp8_block_of, transformers_config, validation_problems

MODEL_TYPES = ("deepseek_v3", "deepseek_v2")  # one model class serves both (their differences are config values)


class V3ModelConfig(BaseModel):
    """The fields of an HF DeepSeek V2/V3 config.json that the engine uses, validated."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    model_type: Literal[MODEL_TYPES]  # type: ignore[valid-type]  # Literal[("a", "b")] is Literal["a", "b"]
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    q_lora_rank: int | None
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    n_routed_experts: int = Field(gt=0)
    n_shared_experts: int = Field(ge=0)
    num_experts_per_tok: int = Field(gt=0)
    first_k_dense_replace: int = Field(ge=0)
    moe_layer_freq: int = Field(1, gt=0)
    scoring_func: Literal["sigmoid", "softmax"]
    topk_method: Literal["noaux_tc", "greedy", "group_limited_greedy"]
    n_group: int = Field(gt=0)
    topk_group: int = Field(gt=0)
    norm_topk_prob: bool
    routed_scaling_factor: float = Field(gt=0)
    rms_norm_eps: float = Field(gt=0)
    rope_theta: float = Field(gt=0)
    rope_parameters: dict[str, Any]
    rope_interleave: bool = True
    max_position_embeddings: int = Field(gt=0)
    num_nextn_predict_layers: int = Field(0, ge=0)
    hidden_act: Literal["silu"] = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None
    fp8_block: tuple[int, int] | None = None

    @model_validator(mode="after")
    def _check(self) -> V3ModelConfig:
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts={self.n_routed_experts}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        bad = {k: v for k, v in self.rope_parameters.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isfinite(v)}
        if bad:
            raise ValueError(f"rope_parameters must be finite numbers, got {bad}")
        return self

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the MLA cache: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return as_token_ids(self.eos_token_id)

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def context_bytes_per_token(self, itemsize: int, chunk_tokens: int) -> int:
        """Activation bytes a prefill chunk needs per token of context (K and V of one layer expanded)."""
        return (self.latent_dim + self.num_attention_heads * (self.qk_nope_head_dim + self.v_head_dim + self.qk_head_dim)) * itemsize

    @classmethod
    def from_config_json(cls, raw: dict, model_dir: str | Path) -> V3ModelConfig:
        """From config.json's contents, through transformers' DeepseekV3Config / DeepseekV2Config."""
        return cls.from_hf(transformers_config(model_dir), raw)

    @classmethod
    def from_hf(cls, hf: Any, raw: dict | None = None) -> V3ModelConfig:
        raw = raw if raw is not None else hf.to_dict()
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        fp8_block = fp8_block_of(raw)
        fields: dict[str, Any] = {
            "model_type": hf.model_type,
            "vocab_size": hf.vocab_size,
            "hidden_size": hf.hidden_size,
            "intermediate_size": hf.intermediate_size,
            "moe_intermediate_size": hf.moe_intermediate_size,
            "num_hidden_layers": hf.num_hidden_layers,
            "num_attention_heads": hf.num_attention_heads,
            "q_lora_rank": hf.q_lora_rank,
            "kv_lora_rank": hf.kv_lora_rank,
            "qk_nope_head_dim": hf.qk_nope_head_dim,
            "qk_rope_head_dim": hf.qk_rope_head_dim,
            "v_head_dim": hf.v_head_dim,
            "n_routed_experts": hf.n_routed_experts,
            "n_shared_experts": hf.n_shared_experts or 0,
            "num_experts_per_tok": hf.num_experts_per_tok,
            "first_k_dense_replace": hf.first_k_dense_replace,
            "moe_layer_freq": getattr(hf, "moe_layer_freq", 1) or 1,
            "n_group": getattr(hf, "n_group", None) or 1,
            "topk_group": getattr(hf, "topk_group", None) or 1,
            "routed_scaling_factor": hf.routed_scaling_factor,
            "rms_norm_eps": hf.rms_norm_eps,
            "rope_theta": rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)),
            "rope_parameters": rope,
            "max_position_embeddings": hf.max_position_embeddings,
            "hidden_act": hf.hidden_act,
            "attention_bias": bool(getattr(hf, "attention_bias", False)),
            "tie_word_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
            "bos_token_id": hf.bos_token_id,
            "eos_token_id": hf.eos_token_id,
            "torch_dtype": str(raw.get("torch_dtype") or raw.get("dtype") or "") or None,
            "fp8_block": fp8_block,
        }
        if hf.model_type == "deepseek_v3":
            fields.update(
                scoring_func="sigmoid",
                topk_method="noaux_tc",
                norm_topk_prob=hf.norm_topk_prob,
                rope_interleave=getattr(hf, "rope_interleave", True),
                num_nextn_predict_layers=getattr(hf, "num_nextn_predict_layers", 0) or 0,
            )
        else:
            # transformers' V2 always rotates interleaved pairs in float32 and never renormalises.
            fields.update(
                scoring_func="softmax",
                topk_method=getattr(hf, "topk_method", "greedy"),
                norm_topk_prob=False,
                rope_interleave=True,
                num_nextn_predict_layers=0,
            )
        try:
            return cls(**fields)
        except ValidationError as e:
            raise ConfigError(f"not usable: {validation_problems(e)}") from e
