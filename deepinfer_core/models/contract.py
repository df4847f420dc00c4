"""The contract between the engine and a model class: what ``models/registry.py``'s records name
and the engine calls, and nothing else. Every generation's causal LM provides all of it (the
engine asks no model whether it has a member); ``check_model_class`` verifies a class at load,
as ``hook_checks`` verifies a backend's hooks.

The batch contract of ``forward`` (flat tokens, ``BatchMeta``, the caches by name) is written
down in ``models/batch.py``; the cache layout a model declares in ``cache_groups`` in DESIGN's
"Caches" section.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import torch

from deepinfer_core.models.batch import BatchMeta, CacheGroup

DRAFT_METHODS = ("mtp", "dspark")  # what a checkpoint's own draft layers are (``draft_method``)


@runtime_checkable
class CausalLM(Protocol):
    """A DeepSeek causal LM as the engine drives it.

    Class attributes (read before a model is built, so they are the class's, not an instance's):

    * ``checkpoint_format``: how its checkpoints name their tensors (``loader.load_model``):
      ``scale_keys(key)``, ``resolve_mtp(model, config, key_file)``, ``plan(model, config, key_file)``.
    * ``supports_graphs``: its decode steps may be captured as CUDA graphs (every decode-only
      forward free of host synchronisation, its tensors' shapes from the batch's shapes alone;
      V4.1's index tensors still follow each batch's context lengths: False).
    * ``graphs_by_context``: its decode work follows the width of the block tables, not each
      sequence's length (V4's indexer scores every entry a table could name), so its graphs are
      captured per context bucket as well (``engine.graphs.context_buckets``).
    * ``supports_batch_invariance``: a row's arithmetic can be made independent of its batch
      (``batch_invariant=True``).
    * ``supports_context_parallel``: ``prefill_context_parallel`` / ``write_context`` work.
    * ``mtp_reads_streams``: its MTP drafter reads the hyper-connection streams of the target's
      last layer (``forward_streams`` / ``head_hidden``) rather than the final hidden state.
    * ``draft_method``: what the checkpoint's draft layers are, ``"mtp"`` or ``"dspark"``.
    * ``supports_fp8_kv_cache``: it can keep its KV caches as FP8 records (``kv_cache_dtype="fp8"``;
      DeepSeek-V4's window and compressed caches, ``ops/kv_record.py``): built with
      ``fp8_kv_cache=True`` then.

    Built as ``cls(config, ops, dtype, device, keep_fp8=..., expert_slots=...)``, plus
    ``keep_fp4=True`` for a checkpoint with MXFP4 experts (config ``expert_dtype`` "fp4") on a
    platform with ``fp4_experts`` (its routed experts then stay packed), plus ``fp8_kv_cache=True``
    for ``kv_cache_dtype="fp8"`` (only where ``supports_fp8_kv_cache``) (parameters
    empty until ``loader.load_model`` or ``dummy_weights.init_dummy_weights`` fills them and
    calls ``post_load``). An instance has ``config``, ``expert_slots`` (None, or the logical
    expert of each routed-expert slot it holds), ``default_block_size`` (the engine's block size
    in tokens unless the user picks one), ``num_mtp_layers`` (final after loading) and
    ``lookback_tokens`` (the tokens before a sequence's new ones a forward reads, passed as
    ``BatchMeta.lookback_ids``; 0: none).
    """

    checkpoint_format: Any
    supports_graphs: bool
    graphs_by_context: bool
    supports_batch_invariance: bool
    supports_context_parallel: bool
    mtp_reads_streams: bool
    supports_fp8_kv_cache: bool
    draft_method: str

    config: Any
    expert_slots: tuple[int, ...] | None
    default_block_size: int
    num_mtp_layers: int
    lookback_tokens: int

    def cache_groups(self, with_mtp: bool = False) -> list[CacheGroup]:
        """The cache layout: named groups of layers sharing block tables (with the drafter's)."""

    def post_load(self) -> None:
        """After the weights are in: fuse what runs fused (stacked projections, shared experts)."""

    def drop_mtp_layers(self) -> None:
        """Forget the draft layers (a checkpoint that has none)."""

    def set_tokenizer(self, tokenizer) -> None:
        """The model's tokenizer, before the first forward (V4.1's Engram hashes read it)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: BatchMeta,
                kv_caches: dict[str, torch.Tensor]) -> torch.Tensor:
        """[T] token ids at [T] positions -> [T, hidden] final hidden states; writes the caches."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""

    def prefill_context_parallel(self, input_ids: torch.Tensor, positions: torch.Tensor, cp) -> Any:
        """This rank's part of a prompt prefix prefilled across a context-parallel group."""

    def write_context(self, kv_caches: dict[str, torch.Tensor], rows: Any, blocks: dict[str, list[int]], block_size: int) -> None:
        """Store ``prefill_context_parallel``'s result into the paged cache blocks ``blocks``."""


# Members a class must define (the Protocol's attributes and methods), with the type of each
# class attribute's value.
CLASS_FLAGS = ("supports_graphs", "graphs_by_context", "supports_batch_invariance", "supports_context_parallel", "mtp_reads_streams",
               "supports_fp8_kv_cache")
METHODS = ("cache_groups", "post_load", "drop_mtp_layers", "set_tokenizer", "forward", "compute_logits",
           "prefill_context_parallel", "write_context")


def check_model_class(cls: type) -> None:
    """TypeError naming what ``cls`` lacks of the contract (``CausalLM``), or returns."""
    problems = []
    for flag in CLASS_FLAGS:
        if not isinstance(inspect.getattr_static(cls, flag, None), bool):
            problems.append(f"{flag} must be a bool class attribute")
    if getattr(cls, "draft_method", None) not in DRAFT_METHODS:
        problems.append(f"draft_method must be one of {DRAFT_METHODS}")
    fmt = getattr(cls, "checkpoint_format", None)
    if fmt is None or not all(callable(getattr(fmt, m, None)) for m in ("scale_keys", "resolve_mtp", "plan")):
        problems.append("checkpoint_format must have scale_keys, resolve_mtp and plan")
    problems += [f"{m}() is missing" for m in METHODS if not callable(getattr(cls, m, None))]
    if getattr(cls, "mtp_reads_streams", False) is True:
        problems += [f"{m}() is missing (mtp_reads_streams)" for m in ("forward_streams", "head_hidden")
                     if not callable(getattr(cls, m, None))]
    if problems:
        raise TypeError(f"model class {cls.__qualname__} breaks the model contract (models/contract.py): {'; '.join(problems)}")


def check_model(model) -> None:
    """TypeError naming what a built ``model`` lacks of the contract's instance members."""
    check_model_class(type(model))
    missing = [name for name in ("config", "expert_slots", "default_block_size", "num_mtp_layers", "lookback_tokens")
               if not hasattr(model, name)]
    if missing:
        raise TypeError(f"model {type(model).__qualname__} breaks the model contract (models/contract.py): "
                        f"it has no {', '.join(missing)}")
