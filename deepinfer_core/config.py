"""Configuration: the engine, parallelism and speculation settings, DEEPINFER_* settings, and the
helpers every generation's model config (``models/<generation>/config.py``) reads config.json with.

Every DEEPINFER_* environment variable is read here, by ``Settings``, and nowhere else. Which
generation a model directory holds is ``models/registry.py``'s to say (``read_config``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

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
    dp_policy: Literal["affinity", "least_load", "round_robin"] = Field(
        "affinity",
        description="Data parallelism: how rank 0 spreads new requests over the ranks. affinity: the least queued "
                    "work, but a request goes to the rank that was given its longest cached prefix while that rank's "
                    "load is within the slack; least_load: the least queued work alone; round_robin: in turn "
                    "(a baseline for benchmarks).",
    )
    dp_affinity_slack: float = Field(
        1.0, ge=0,
        description="Data parallelism, dp_policy=affinity: a request goes to the rank holding its prefix while that "
                    "rank's queued work, less the prompt tokens the prefix saves, exceeds the least-loaded rank's by at "
                    "most this many times the request's own cost (prompt + max_tokens, times n); 0: no more than it.",
    )
    dp_affinity_entries: int = Field(
        262144, gt=0,
        description="Data parallelism, dp_policy=affinity: how many block hashes rank 0 remembers the rank of "
                    "(least recently used forgotten first; about 150 bytes each).",
    )
    dist_timeout: float = Field(600.0, gt=0, description="Seconds a data-parallel collective or a rank's start-up may take.")
    external_kernels: bool = Field(
        True, description="0: a backend uses only its own kernels even where peer libraries it can use are installed "
                          "(NVIDIA: FlashMLA, cuBLAS's block-scaled FP8 GEMM); 1: it uses them where they fit.",
    )


def configure_logging(level: str) -> None:
    """The "deepinfer" logger at ``level`` (DEEPINFER_LOG_LEVEL), with a handler unless the app configured logging."""
    logger = logging.getLogger("deepinfer")
    try:
        logger.setLevel(level.upper())
    except ValueError as e:
        raise ConfigError(f"DEEPINFER_LOG_LEVEL={level!r} is not a logging level (DEBUG, INFO, WARNING, ERROR)") from e
    if not logger.handlers and not logging.getLogger().handlers:  # leave configured apps alone
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s deepinfer: %(message)s"))
        logger.addHandler(handler)


def settings() -> Settings:
    return Settings()


def validation_problems(error: ValidationError, names: dict[str, str] | None = None) -> str:
    """A pydantic error as one line, "field: what is wrong; ..."; ``names`` renames fields (CLI flags)."""
    def where(loc: tuple) -> str:
        field = ".".join(map(str, loc))
        return f"{(names or {}).get(field, field)}: " if field else ""

    return "; ".join(where(err["loc"]) + err["msg"].removeprefix("Value error, ") for err in error.errors())


def as_token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """config.json's ``eos_token_id``: none, one id or a list."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def fp8_block_of(raw: dict) -> tuple[int, int] | None:
    quant = raw.get("quantization_config") or {}
    if not quant:
        return None
    if quant.get("quant_method") != "fp8" or "weight_block_size" not in quant:
        raise ConfigError(
            f"quantization_config {quant} is not supported; only DeepSeek's block FP8 "
            "(quant_method 'fp8' with weight_block_size) is"
        )
    return tuple(quant["weight_block_size"])

def transformers_config(model_dir: str | Path) -> Any:
    """config.json read by transformers' own config class (no remote code): V2/V3 and V4."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
    except Exception as e:  # transformers raises many types for a bad config
        raise ConfigError(f"transformers could not read it: {e}") from e


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
    # The KV cache's format: "auto" (the compute dtype) or "fp8": DeepSeek-V4's window and compressed
    # KV caches as FP8 records (ops/kv_record.py); checked against the model and the platform at start-up.
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    # Lower tiers of the prefix cache (engine/kv_tiers.py): GiB of host memory that keep full blocks
    # evicted from the device's pool (0: none), and a directory on disk, of at most kv_disk_gb GiB,
    # that keeps what reaches the host tier across restarts (fed from the host tier: needs kv_offload_gb).
    kv_offload_gb: float = Field(0, ge=0)
    kv_disk_dir: str | None = None
    kv_disk_gb: float | None = Field(None, gt=0)
    # Prefill/decode disaggregation (engine/kv_transfer.py): this engine prefills for decode instances
    # ("prefill") or decodes from prefill instances' KV ("decode"), over NIXL; and how long a prefill
    # instance keeps blocks nobody read, and a decode instance waits for a READ (seconds).
    kv_role: Literal["prefill", "decode"] | None = None
    kv_transfer_timeout: float = Field(120.0, gt=0)

    @model_validator(mode="after")
    def _kv_role(self) -> EngineConfig:
        if self.kv_role is not None and self.speculative_config is not None:
            raise ValueError(f"kv_role={self.kv_role!r} does not work with speculative decoding yet (its lookahead changes the "
                             "cache layout, and MTP drafts from state the transfer does not carry); drop speculative_config")
        return self

    @model_validator(mode="after")
    def _kv_tiers(self) -> EngineConfig:
        if self.kv_disk_dir is not None and not self.kv_disk_dir.strip():
            raise ValueError("kv_disk_dir is empty: name a directory, or leave it unset for no disk tier")
        if (self.kv_disk_dir is None) != (self.kv_disk_gb is None):
            given, missing = ("kv_disk_dir", "kv_disk_gb") if self.kv_disk_gb is None else ("kv_disk_gb", "kv_disk_dir")
            raise ValueError(f"{given} needs {missing}: the disk tier is a directory (kv_disk_dir) and how many GiB of it "
                             "the tier may fill (kv_disk_gb); give both, or neither")
        if self.kv_disk_dir is not None and not self.kv_offload_gb:
            raise ValueError("kv_disk_dir needs kv_offload_gb > 0: blocks reach the disk tier through the host tier")
        if self.kv_offload_gb and not self.enable_prefix_caching:
            raise ValueError("kv_offload_gb needs prefix caching: the lower tiers keep cached prefixes; drop "
                             "enable_prefix_caching=False or kv_offload_gb")
        return self


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
    (``engine.spec_decode.rejection``). Greedy requests are the same under all three."""

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
