"""The paged KV cache: per-layer cache tensors and the block manager that hands out blocks.

A model declares its caches (``CacheSpec``); every ``paged_latent`` cache is a tensor
[num_blocks, block_size, entry_dim] and all of them share one block table per sequence, so a
block id addresses the same token rows in every layer.
"""

from __future__ import annotations

import torch

from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.models.batch import CacheSpec

SUPPORTED_KINDS = ("paged_latent",)


class KVCache:
    def __init__(self, specs: list[CacheSpec], num_blocks: int, block_size: int, device: torch.device):
        unsupported = sorted({s.kind for s in specs} - set(SUPPORTED_KINDS))
        if unsupported:
            raise ValueError(f"cache kinds {unsupported} are not supported by this engine yet (supported: {SUPPORTED_KINDS})")
        self.specs = specs
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tensors = [torch.zeros(num_blocks, block_size, s.entry_dim, dtype=s.dtype, device=device) for s in specs]

    @staticmethod
    def bytes_per_block(specs: list[CacheSpec], block_size: int) -> int:
        return block_size * sum(s.bytes_per_token() for s in specs)


class BlockManager:
    """Free-list allocator of cache blocks; a sequence owns the blocks in its block table."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.reset()

    def reset(self) -> None:
        """Every block free (the sequences that held blocks must be gone)."""
        self.free_blocks: list[int] = list(range(self.num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold its first ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.num_free:
            raise RuntimeError(f"out of KV blocks: need {needed}, {self.num_free} free")
        for _ in range(needed):
            seq.block_table.append(self.free_blocks.pop())

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(reversed(seq.block_table))
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
