"""FlashMLA (DeepSeek's MLA decode kernels) as the provider of ``mla_decode_attention`` (and,
through ``flashmla_sparse.py``, of ``sparse_attention`` over V4's FP8 records).

Chosen when ``flash_mla`` imports (``pip install "deepinfer-nvidia-sm100[flashmla]"``: the
``sgl-flash-mla`` wheel) and a call's shapes fit its dense decode kernel (``use_legacy=True``):
a bf16 cache of 64-token blocks whose rows are 512 latent + 64 RoPE channels (the V2/V3 layout),
and at least MIN_ROWS_X_HEADS query rows x heads (below that the Triton kernel is faster end to end).
Any other call goes to the Triton kernel (``kernels/mla_decode.py``), as does every call when
``DEEPINFER_EXTERNAL_KERNELS=0`` or the batch-invariant table is asked for (the dense kernel has
no batch-invariant mode). The shape test looks at shapes and dtypes only, so a captured graph
takes the same path as the eager call.

The contract lets every sequence have its own number of query rows (0, 1, or 1 + k when
speculative decoding verifies k drafts), which FlashMLA's [batch, s_q, heads, 576] queries cannot
say. So, as in the Triton kernel, every query row is its own FlashMLA sequence of one query:
row r of sequence b reads b's block table and attends to its first
n_r = seq_lens[b] - q_len_b + 1 + i entries (i: r's index within b). That per-row plan (row ->
sequence, n_r, the [T, W] block table rows: one kernel, ``mla_decode.row_plan``) and FlashMLA's
tile-scheduler metadata are made on the device once per step and shared by every layer's call.
The plan is kept for the step's ``seq_lens`` / ``query_start_loc`` / ``block_tables`` tensors
(the same objects for all layers of a step); in a captured graph the first layer's kernels
remake it at every replay. Rows with n_r <= 0 (graph padding) get zeros, as the contract says:
FlashMLA reads one entry for them and the output is masked.

Cost against the Triton kernel, per layer: one concatenation of q_latent and q_pe (FlashMLA
takes [latent | rope] rows) and the mask; per step: the plan and FlashMLA's metadata (two
launches; the same plan made of ~20 torch ops cost ~40 us a step on an H200).

Not done: with several rows per sequence (speculative decoding), one FlashMLA sequence per row
reads the cache once per row. FlashMLA's s_q (rows sharing the cache tiles) needs the same row
count for every sequence, which a captured graph has (rows are padded to it) but the op cannot
know from shapes. At 4 rows per sequence the provider ran at 0.36-0.83x FlashMLA given s_q = 4
(``benchmarks/kernels.py``, H200, with the plan remade every call).
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("deepinfer")

BLOCK_SIZE = 64  # FlashMLA's dense kernel reads pages of 64 tokens
LATENT_DIM, ROPE_DIM = 512, 64  # its head_dim_v and head_dim - head_dim_v
DTYPES = (torch.bfloat16,)
DEVICE_TYPES = ("cuda",)
# FlashMLA takes calls of at least this many query rows x heads. Measured on an H200 through
# LLM.generate (benchmarks/decode_peers.py, two LLMs side by side, 2026-12-03): with FlashMLA
# for every call the V2-Lite shape (16 heads) decoded 7% slower at B=1 and 3% at B=8, 7% faster
# at B=64 (L=2048); the V3 slice (128 heads; its two LLMs built one after the other, which drifted
# by up to 13%) -8..+13% at B=8..64 and equal at B=1. Its kernel alone is faster from B=8 at both
# head counts (kernels.py), but below that the concatenation, the mask and the per-step plan
# cost more than it saves.
MIN_ROWS_X_HEADS = 1024


@functools.cache
def version() -> str | None:
    """The installed FlashMLA's distribution and version when ``flash_mla`` imports and has the
    dense (legacy) kernels, else None."""
    try:
        import flash_mla
    except Exception as e:  # noqa: BLE001 - a wheel built for another torch fails in many ways
        log.debug("flash_mla does not import: %s", e)
        return None
    if hasattr(flash_mla, "has_legacy") and not flash_mla.has_legacy():
        log.warning("flash_mla imports but has no dense (legacy) decode kernel; the Triton kernel decodes")
        return None
    for dist in ("sgl-flash-mla", "flash-mla", "flash_mla"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"flash_mla {getattr(flash_mla, '__version__', '?')}"


def fits(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether FlashMLA's dense decode takes this call (shapes, dtypes and device only)."""
    return (
        kv_cache.device.type in DEVICE_TYPES
        and q_latent.shape[0] * q_latent.shape[1] >= MIN_ROWS_X_HEADS
        and kv_cache.dtype in DTYPES
        and q_latent.dtype == kv_cache.dtype
        and q_pe.dtype == kv_cache.dtype
        and kv_cache.dim() == 3
        and kv_cache.shape[1] == BLOCK_SIZE
        and kv_cache.shape[2] == LATENT_DIM + ROPE_DIM
        and q_latent.shape[-1] == LATENT_DIM
        and q_pe.shape[-1] == ROPE_DIM
        and kv_cache.stride(2) == 1
        and kv_cache.stride(1) == kv_cache.shape[2]
    )


@dataclass
class _Plan:
    """One step's per-row inputs, made once and used by every layer."""

    key: tuple  # the step's tensors (held, so their ids cannot be reused) and their versions
    tables: torch.Tensor  # [T, W] int32: each row's sequence's block table
    lens: torch.Tensor  # [T] int32: entries each row attends to, at least 1
    empty: torch.Tensor  # [T, 1, 1] bool: rows with no entries (their output is zeros)
    meta: object  # FlashMLASchedMeta, filled by the first call and reused by the others


class FlashMLADecode:
    """``mla_decode_attention`` through FlashMLA where ``fits``, else through ``fallback``."""

    def __init__(self, fallback):
        self.fallback = fallback
        self.impl = (f"flashmla ({version()}, dense kernel) for bf16 caches of {BLOCK_SIZE}-token blocks and "
                     f"{LATENT_DIM} + {ROPE_DIM} rows, rows x heads >= {MIN_ROWS_X_HEADS}, one FlashMLA sequence per "
                     f"query row; else "
                     f"{getattr(fallback, 'impl', 'the Triton kernel')}")
        self._plan: _Plan | None = None

    def __call__(self, q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale):
        if not fits(q_latent, q_pe, kv_cache):
            return self.fallback(q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale)
        import flash_mla

        rows, heads, d_c = q_latent.shape  # rows x heads >= MIN_ROWS_X_HEADS >= 1: never empty
        plan = self._plan_for(rows, heads, block_tables, seq_lens, query_start_loc)
        q = torch.cat([q_latent, q_pe], dim=-1).unsqueeze(1)  # [T, 1, H, 576]
        out, _ = flash_mla.flash_mla_with_kvcache(
            q, kv_cache.unsqueeze(2), plan.tables, plan.lens, d_c, plan.meta,
            softmax_scale=scale, causal=False, use_legacy=True,
        )
        return out.squeeze(1).masked_fill_(plan.empty, 0)

    def _plan_for(self, rows: int, heads: int, block_tables, seq_lens, query_start_loc) -> _Plan:
        key = (rows, heads, block_tables, _version(block_tables), seq_lens, _version(seq_lens),
               query_start_loc, _version(query_start_loc),
               seq_lens.is_cuda and torch.cuda.is_current_stream_capturing())  # a capture records its own plan
        old = self._plan
        if old is not None and all(a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(old.key, key)):
            return old
        import flash_mla

        from deepinfer_nvidia_sm100.kernels.mla_decode import row_plan

        tables, lens, empty = row_plan(block_tables, seq_lens, query_start_loc, rows)
        meta, _ = flash_mla.get_mla_metadata()
        self._plan = _Plan(key=key, tables=tables, lens=lens, empty=empty.view(rows, 1, 1), meta=meta)
        return self._plan


def _version(t: torch.Tensor) -> int | None:
    """A tensor's in-place write counter; None for inference tensors, which keep none (the engine
    makes new batch tensors every eager step and never writes them in place during one)."""
    try:
        return t._version
    except RuntimeError:
        return None


def block_size_for(model_config) -> int | None:
    """The KV block size FlashMLA needs for this model when it is installed and the model is a
    V2/V3 one of its row widths (512 latent + 64 RoPE channels); else None (no wish)."""
    from deepinfer_core.models.v3.config import MODEL_TYPES

    fitting = (getattr(model_config, "model_type", None) in MODEL_TYPES
               and (model_config.kv_lora_rank, model_config.qk_rope_head_dim) == (LATENT_DIM, ROPE_DIM))
    return BLOCK_SIZE if fitting and version() is not None else None


def provide(ops: dict) -> dict:
    """``ops`` with FlashMLA providing ``mla_decode_attention`` and, over V4's FP8 records,
    ``sparse_attention`` (``flashmla_sparse.py``; the ops there become their fallbacks) when
    FlashMLA is installed; unchanged otherwise."""
    from deepinfer_nvidia_sm100 import flashmla_sparse

    if version() is None:
        return ops
    if "mla_decode_attention" in ops:
        ops = {**ops, "mla_decode_attention": FlashMLADecode(ops["mla_decode_attention"])}
    return flashmla_sparse.provide(ops, version())
