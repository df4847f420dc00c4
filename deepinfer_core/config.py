"""Configuration: the model (from HF config.json), the engine, and DEEPINFER_* settings.

Every DEEPINFER_* environment variable is read here, by ``Settings``, and nowhere else.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# The model_type values (config.json) DeepInfer serves: the one list. models/registry.py maps each to
# its class; it lives here because the registry imports this module (and the model code with it).
SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "deepseek_v4", "deepseek_v41")
MLA_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")  # served by ModelConfig; deepseek_v4 by V4ModelConfig, deepseek_v41 by V41ModelConfig
DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"


class ConfigError(ValueError):
    """A model directory or engine setting that cannot be used, with what to do about it."""


class Settings(BaseSettings):
    """DEEPINFER_* environment variables (all optional)."""

    model_config = SettingsConfigDict(env_prefix="DEEPINFER_", extra="ignore")

    hf_model_dir: str | None = Field(None, description="Model used when LLM() / the example get none.")
    accelerator: str | None = Field(None, description="Backend name: cpu, nvidia, ascend or any installed backend; auto when unset.")
    dtype: str | None = Field(None, description="Compute dtype override: auto, float32, bfloat16, float16.")
    log_level: str = Field("INFO", description="Python logging level for the deepinfer logger.")
    swa_bounded_replay: bool = Field(
        True, description="DeepSeek-V4.1's SWA bounded replay (approximate; section 4.4 of the architecture notes): 0 off (exact), 1 on."
    )
    async_scheduling: bool | None = Field(
        None, description="Overlapped scheduling (launch step N+1 while step N runs): 0 off, 1 on; unset: on where the platform supports it."
    )
    batch_invariant: bool = Field(
        False, description="1: batch-invariant inference (bitwise the same logits for a request whatever batch it runs in, "
                           "preempted or not) when LLM() is not given batch_invariant."
    )
    use_nextn_decode: int | None = Field(
        None, ge=0, le=16,
        description="DeepSeek's switch: K > 0 drafts K tokens per step with the model's own drafter (MTP; DSpark on "
                    "V4.1) when LLM() is given no speculative_config (0 or unset: off).",
    )
    enable_mtp_varlen: bool | None = Field(
        None,
        description="DeepSeek's switch: 1 turns on DSpark with adaptive verification (V4.1; drafts "
                    "DEEPINFER_USE_NEXTN_DECODE tokens at most, default 5) when LLM() is given no speculative_config.",
    )
    eplb_interval: int = Field(
        1000, ge=0,
        description="Expert parallelism: re-place the experts for their measured load every N lock-step steps (0: never).",
    )
    cp_min_tokens: int = Field(
        4096, gt=0,
        description="Context parallelism: a prompt whose cacheable prefix has at least this many tokens is prefilled across its CP group.",
    )
    dist_timeout: float = Field(600.0, gt=0, description="Seconds a data-parallel collective or a rank's start-up may take.")
    external_kernels: bool = Field(
        True, description="0: a backend uses only its own kernels even where peer libraries it can use are installed "
                          "(NVIDIA: FlashMLA, cuBLAS's block-scaled FP8 GEMM); 1: it uses them where they fit.",
    )


def settings() -> Settings:
    return Settings()


def validation_problems(error: ValidationError, names: dict[str, str] | None = None) -> str:
    """A pydantic error as one line, "field: what is wrong; ..."; ``names`` renames fields (CLI flags)."""
    def where(loc: tuple) -> str:
        field = ".".join(map(str, loc))
        return f"{(names or {}).get(field, field)}: " if field else ""

    return "; ".join(where(err["loc"]) + err["msg"].removeprefix("Value error, ") for err in error.errors())


class ModelConfig(BaseModel):
    """The fields of an HF DeepSeek V2/V3 config.json that the engine uses, validated."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    model_type: Literal[MLA_MODEL_TYPES]  # type: ignore[valid-type]  # Literal[("a", "b")] is Literal["a", "b"]
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
    def _check(self) -> ModelConfig:
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
        return _as_ids(self.eos_token_id)

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def context_bytes_per_token(self, itemsize: int, chunk_tokens: int) -> int:
        """Activation bytes a prefill chunk needs per token of context (K and V of one layer expanded)."""
        return (self.latent_dim + self.num_attention_heads * (self.qk_nope_head_dim + self.v_head_dim + self.qk_head_dim)) * itemsize

    @classmethod
    def from_dir(cls, model_dir: str | Path):
        """Read and validate ``model_dir/config.json`` through transformers' config classes
        (a ``V4ModelConfig`` for model_type deepseek_v4; deepseek_v41, which transformers lacks,
        through ``config_v41.V41ModelConfig``)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path} not found: a model directory must hold an HF config.json")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} holds a JSON {type(raw).__name__}, not an object: an HF config.json is one object of settings")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{path}: model_type {model_type!r} is not supported; supported model types: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == "deepseek_v41":  # transformers has no V4.1: read here
            from deepinfer_core.config_v41 import V41ModelConfig

            try:
                return V41ModelConfig.from_raw(raw)
            except ConfigError as e:
                raise ConfigError(f"{path}: {e}") from e
        if model_type == "deepseek_v4":
            _check_v4_layer_kinds(raw, path)
        from transformers import AutoConfig

        try:
            hf = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
        except Exception as e:  # transformers raises many types for a bad config
            raise ConfigError(f"{path}: transformers could not read it: {e}") from e
        try:
            return V4ModelConfig.from_hf(hf, raw) if model_type == "deepseek_v4" else ModelConfig.from_hf(hf, raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e

    @classmethod
    def from_hf(cls, hf: Any, raw: dict | None = None) -> ModelConfig:
        raw = raw if raw is not None else hf.to_dict()
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        fp8_block = _fp8_block(raw)
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


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """config.json's ``eos_token_id``: none, one id or a list."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _check_v4_layer_kinds(raw: dict, path: Path) -> None:
    """A V4 config.json names each layer's kind: DeepSeek's ``compress_ratios`` (0, 4 or 128 per
    layer, what transformers maps) or transformers' ``layer_types`` (with ``compress_rates``)."""
    ratios = raw.get("compress_ratios")
    if "layer_types" in raw:
        return
    if ratios is None:
        raise ConfigError(
            f"{path}: a deepseek_v4 config.json needs compress_ratios (DeepSeek's) or layer_types (transformers'): "
            "transformers' default layer pattern does not match DeepSeek's checkpoints"
        )
    bad = sorted({r for r in ratios if r not in (0, 4, 128)} if isinstance(ratios, list) else {str(ratios)})
    if bad:
        raise ConfigError(
            f"{path}: compress_ratios holds {bad}; transformers reads only 0, 4 and 128 there. For other rates give "
            "layer_types (sliding_attention / compressed_sparse_attention / heavily_compressed_attention) and compress_rates"
        )


def _fp8_block(raw: dict) -> tuple[int, int] | None:
    quant = raw.get("quantization_config") or {}
    if not quant:
        return None
    if quant.get("quant_method") != "fp8" or "weight_block_size" not in quant:
        raise ConfigError(
            f"quantization_config {quant} is not supported; only DeepSeek's block FP8 "
            "(quant_method 'fp8' with weight_block_size) is"
        )
    return tuple(quant["weight_block_size"])


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
        return _as_ids(self.eos_token_id)


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
            "fp8_block": _fp8_block({"quantization_config": quant}),
            "expert_dtype": expert_dtype,
        }
        try:
            return cls(**fields)
        except ValidationError as e:
            raise ConfigError(f"not usable: {validation_problems(e)}") from e


class EngineConfig(BaseModel):
    """Engine settings chosen by the user (``LLM(...)`` arguments)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # None: the model's choice (16 for V2/V3; a multiple of every compression rate for V4)
    block_size: int | None = Field(None, gt=0)
    num_kv_blocks: int | None = Field(None, gt=0)
    max_num_seqs: int = Field(64, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)  # None: the backend's SchedulerLimits, else 2048
    max_model_len: int | None = Field(None, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    seed: int = 0
    # "safetensors": read the checkpoint's weights. "dummy": random weights of the right shapes and
    # dtypes (benchmarks of real architectures without downloading them; outputs are noise).
    load_format: Literal["safetensors", "dummy"] = "safetensors"
    # Run every step eagerly even where the platform can capture decode steps as graphs.
    enforce_eager: bool = False
    # Reuse the KV blocks of prompt prefixes computed before (and across the n samples of a request).
    enable_prefix_caching: bool = True
    speculative_config: SpeculativeConfig | None = None
    # Each request's logits bitwise the same whatever else runs beside it and whether or not it was
    # preempted and recomputed: the backend's batch-invariant op table, every token computed as a
    # decode row (needs a backend whose platform supports it, and an MLA model).
    batch_invariant: bool = False


class ParallelConfig(BaseModel):
    """How many processes run one ``LLM`` (its ``data_parallel_size`` / ``expert_parallel`` /
    ``context_parallel_size`` arguments)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Ranks, each with its own engine and share of the requests (attention data parallelism).
    data_parallel_size: int = Field(1, gt=0)
    # The MoE layers' routed experts sharded over those ranks (EP size = data_parallel_size), with EPLB.
    expert_parallel: bool = False
    # Ranks one long prompt's prefill is split over (zig-zag chunks); divides data_parallel_size
    # (CP groups of consecutive ranks). Prompts of DEEPINFER_CP_MIN_TOKENS or more are split.
    context_parallel_size: int = Field(1, gt=0)


class SpeculativeConfig(BaseModel):
    """Speculative decoding, spelled as vLLM does. ``method`` "ngram": prompt lookup, drafts are
    the tokens that followed the latest earlier occurrence of the sequence's last n tokens, n from
    prompt_lookup_max down to prompt_lookup_min (as vLLM: both 5 when neither is given, and a
    missing one equal to the other). "mtp": the checkpoint's multi-token-prediction module drafts
    (chained: it runs once per draft token). "dspark": V4.1's DSpark head drafts a block of
    dspark_block_size tokens at once (num_speculative_tokens at most that); ``adaptive`` (dspark
    only) verifies per request as many as its confidences and the start-up cost curves make
    worthwhile. The prompt_lookup fields apply to "ngram" only.

    ``acceptance``: how sampled drafts of a draft model are verified (n-gram drafts are always
    "coupled"): "coupled" emits exactly what decoding without speculation emits; "rejection" is
    speculative sampling (the same distribution, more drafts accepted, other tokens for a seed);
    "auto" is coupled for requests with a seed and rejection for the others
    (``sampling.spec_decode.rejection``). Greedy requests are the same under all three."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["ngram", "mtp", "dspark"]
    num_speculative_tokens: int = Field(gt=0, le=16)
    acceptance: Literal["auto", "coupled", "rejection"] = "auto"
    adaptive: bool = False
    prompt_lookup_max: int = Field(gt=0)
    prompt_lookup_min: int = Field(gt=0)

    @model_validator(mode="before")
    @classmethod
    def _lookup_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            lo, hi = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
            data = {**data, "prompt_lookup_min": lo if lo is not None else (hi if hi is not None else 5),
                    "prompt_lookup_max": hi if hi is not None else (lo if lo is not None else 5)}
        return data

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeConfig:
        if self.adaptive and self.method != "dspark":
            raise ValueError(f"adaptive verification needs DSpark's confidences: method 'dspark', not {self.method!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min {self.prompt_lookup_min} exceeds prompt_lookup_max {self.prompt_lookup_max}")
        return self


EngineConfig.model_rebuild()
