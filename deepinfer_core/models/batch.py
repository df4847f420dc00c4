"""What one model forward needs to know about its batch and its caches (built by the runner).

A model declares its cache layout as ``CacheGroup``s (named groups of layers that share block
tables); the engine allocates one tensor per layer of each group and passes them to
``forward`` by layer name, with one ``GroupMeta`` (slot mapping, block tables, context slots)
per group in ``BatchMeta.groups``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

CACHE_KINDS = ("paged", "ring", "state")


@dataclass(frozen=True)
class CacheGroup:
    """Layers whose caches share block tables, and what one entry of theirs holds.

    kind "paged": one entry of ``entry_dim`` values per ``tokens_per_entry`` tokens (MLA latents:
        1; V4's compressed caches 4 or 128). A layer's tensor is [num_blocks, block_size //
        tokens_per_entry, entry_dim]: every group uses the engine's one logical block size in
        tokens, so block i of every group covers the same tokens (and one hash, for prefix caching).
    kind "ring": the last ``window`` tokens plus the engine's lookahead (tokens a step may write
        beyond them and roll back: speculative drafts) per sequence, one entry per token, in a
        fixed ring of blocks that are reused as the window slides: tensor [num_blocks, rb,
        entry_dim] with rb = ``ring_block`` tokens per ring block (0: the engine's block size;
        rings are private to a sequence, so their blocks need not match the paged ones);
        position p lives in ring block (p // rb) mod ring_blocks, row p % rb.
    kind "state": one fixed-size slot per sequence of ``state_rows`` rows of ``entry_dim``, times
        (1 + lookahead) versions so a rolled-back step can return to an earlier one: tensor
        [num_slots * (1 + lookahead), state_rows, entry_dim].
    replay_tokens (ring, state): after a prefix-cache hit, how many tokens before the first
        uncached one are recomputed to rebuild this group (ring: its window; bounded replay).
    row_multiple: a layer tensor's rows (all dims but the last, flattened) come in multiples of
        this: extra blocks that no table names pad it (V4's FP8 record caches are pages of 64
        rows, ``ops/kv_record.py``).
    """

    name: str
    kind: str
    layers: tuple[str, ...]
    entry_dim: int
    dtype: torch.dtype
    tokens_per_entry: int = 1
    window: int = 0
    state_rows: int = 1
    replay_tokens: int = 0
    ring_block: int = 0
    row_multiple: int = 1

    def __post_init__(self) -> None:
        if self.kind not in CACHE_KINDS:
            raise ValueError(f"cache group {self.name!r}: kind {self.kind!r} is not one of {CACHE_KINDS}")
        if not self.layers:
            raise ValueError(f"cache group {self.name!r} has no layers")
        if self.kind == "ring" and self.window <= 0:
            raise ValueError(f"ring cache group {self.name!r} needs a positive window")

    @property
    def entry_bytes(self) -> int:
        return self.entry_dim * self.dtype.itemsize

    def bytes_per_token(self) -> float:
        """Paged groups: bytes all its layers add per token."""
        return len(self.layers) * self.entry_bytes / self.tokens_per_entry


@dataclass
class GroupMeta:
    """One cache group's addressing for this batch.

    slot_mapping: [T] int64, where each token's entry is written (-1: not written: padding, a
        token that is not the last of its compressed entry, a replayed token whose paged entry is
        already cached, or a ring token the same step overwrites). Paged groups with
        tokens_per_entry m: the slot of entry p // m, written by the token at p with p % m == m - 1.
        State groups: the row version the state after this token is written to.
    block_tables: [D, W] int32, the blocks of each decode sequence (state groups: [D, 1], the
        sequence's slot). Ring groups: [D + P, W], in ring order, of the decode sequences and
        then of the prefill sequences (a prefill chunk's window reaches into its ring too).
    context_slots: [sum of context lengths] int64, for each prefill sequence in order the slots of
        the entries its context reads, in position order (paged: all entries before the chunk's
        end; ring: the cached window before the chunk, read before the chunk is written).
    valid_from: [D + P] int64 or None, per sequence (decodes, then prefills) the first position
        whose entry this group holds (ring groups after a bounded replay; None: 0 for all).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_slots: torch.Tensor
    valid_from: torch.Tensor | None = None


@dataclass
class BatchMeta:
    """Flat description of a mixed prefill/decode batch.

    Tokens are packed: first the new tokens of every prefill sequence (chunks of prompts, or of
    prompts plus earlier output after a preemption, or a bounded replay), sequence after
    sequence, then the rows of every decode sequence: 1 + k tokens each (its newest token and k
    draft tokens to verify), causal within the row. All tensors live on the model's device. In
    batch-invariant inference (``ModelRunner.prefills_as_rows``) there are no prefill tokens:
    every sequence is a row, a prompt chunk a row as long as the chunk.

    num_prefill_tokens: tokens [0, num_prefill_tokens) belong to prefill sequences.
    prefill_cu_seqlens_q: [P+1] int32 boundaries of the prefill sequences' new tokens.
    prefill_cu_seqlens_k: [P+1] int32 boundaries of their full contexts (cached prefix + new).
    decode_seq_lens: [D] int32, each decode sequence's context length including its row.
    decode_query_start_loc: [D+1] int32, boundaries of the decode rows among the decode tokens
        (row b is tokens num_prefill_tokens + [start[b], start[b+1])).
    groups: {cache group name: GroupMeta}.
    lookback_ids: [P + D, n] int64 or None (models with ``lookback_tokens = n > 0``): per
        sequence (prefills, then decodes) the ids of the n tokens before its first new one,
        oldest first, -1 before position 0.
    exact_prefills: indices of the prefill sequences whose every row's output is used (prompt
        logprobs): approximations that skip rows (V4.1's bounded replay) must not skip theirs.
    """

    num_prefill_tokens: int
    prefill_cu_seqlens_q: torch.Tensor
    prefill_cu_seqlens_k: torch.Tensor
    decode_seq_lens: torch.Tensor
    decode_query_start_loc: torch.Tensor
    groups: dict[str, GroupMeta] = field(default_factory=dict)
    lookback_ids: torch.Tensor | None = None
    exact_prefills: tuple[int, ...] = ()

    @property
    def num_prefills(self) -> int:
        return self.prefill_cu_seqlens_q.shape[0] - 1

    @property
    def num_decodes(self) -> int:
        return self.decode_seq_lens.shape[0]
