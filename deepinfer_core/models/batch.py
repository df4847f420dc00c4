"""What one model forward needs to know about the batch it runs (built by the engine's runner)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BatchMeta:
    """Flat description of a mixed prefill/decode batch.

    Tokens are packed: first the new tokens of every prefill sequence (chunks of prompts, or of
    prompts plus earlier output after a preemption), sequence after sequence, then exactly one
    token for every decode sequence. All tensors live on the model's device.

    num_prefill_tokens: tokens [0, num_prefill_tokens) belong to prefill sequences.
    slot_mapping: [T] int64, the cache slot each token's latent is written to (-1: padding).

    Prefill sequences (P of them), expanded MLA over their whole context:
    prefill_cu_seqlens_q: [P+1] int32 boundaries of the new tokens.
    prefill_cu_seqlens_k: [P+1] int32 boundaries of the full contexts (cached prefix + new).
    prefill_context_slots: [sum of context lengths] int64, the cache slot of every context token
        of every prefill sequence, sequence after sequence, in position order.

    Decode sequences (D of them), absorbed MLA over the paged cache:
    decode_block_tables: [D, max_blocks] int32.
    decode_seq_lens: [D] int32, context length including the new token.
    """

    num_prefill_tokens: int
    slot_mapping: torch.Tensor
    prefill_cu_seqlens_q: torch.Tensor
    prefill_cu_seqlens_k: torch.Tensor
    prefill_context_slots: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor

    @property
    def num_prefills(self) -> int:
        return self.prefill_cu_seqlens_q.shape[0] - 1

    @property
    def num_decodes(self) -> int:
        return self.decode_seq_lens.shape[0]


@dataclass(frozen=True)
class CacheSpec:
    """One cache a model layer needs, declared by the model, allocated by the engine's KVCache.

    kind "paged_latent": one entry of ``entry_dim`` values per token, stored in the paged block
    pool shared by all layers (tensor [num_blocks, block_size, entry_dim]). Later kinds (V4's
    sliding windows and compressed caches) add their own entries here.
    """

    layer: str
    kind: str
    entry_dim: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        return self.entry_dim * torch.empty((), dtype=self.dtype).element_size()
