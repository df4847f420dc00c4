"""What the draft-model proposers (``mtp``, ``dspark``) share: sampling a draft row the way its
verification will judge it, and taking the KV blocks a draft forward addresses."""

from __future__ import annotations

import torch

from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.sampling.sampler import SampleRow, launch, probabilities
from deepinfer_core.engine.spec_decode.rejection import draw, uses_rejection


def draft_room(seq: Sequence, k: int, max_model_len: int) -> int:
    """Drafts ``seq`` may have this step: at most k, never beyond its max_tokens or the model
    length (the token sampled after the drafts counts too)."""
    return min(k, seq.params.max_tokens - len(seq.output_token_ids) - 1, max_model_len - seq.num_tokens - 1)


def sample_drafts(ops, logits: torch.Tensor, rows: list[SampleRow], eos_ids: tuple[int, ...], copy_to_host,
                  acceptance: str) -> list[int]:
    """One draft per row of ``logits`` [N, V]: coupled rows by the backend's sampling op (the
    noise the target's sample at that output position uses; greedy: the argmax), rejection rows
    from their distribution q, which is appended to ``seq.draft_probs`` for the verification."""
    tokens = [t for t, _, _ in launch(ops, logits, rows, eos_ids, copy_to_host).resolve()]
    rejecting = [i for i, r in enumerate(rows) if uses_rejection(r.params, acceptance)]
    if rejecting:
        index = torch.tensor(rejecting, dtype=torch.int64).to(logits.device)
        q = probabilities(logits.index_select(0, index), [rows[i] for i in rejecting], eos_ids)
        for i, probs in zip(rejecting, q):
            row = rows[i]
            tokens[i] = draw(probs, row.seq.seed, row.num_outputs)
            row.seq.draft_probs.append(probs)
    return tokens


class BlockReserve:
    """KV blocks draft forwards may take this step: at most what leaves one block free per
    running sequence, so drafting never costs a sequence its next token (a preemption)."""

    def __init__(self, kv, running: list[Sequence]):
        self.kv = kv
        self.spare = kv.num_free - len(running)

    def blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        bs = self.kv.block_size
        return max((max(0, -(-num_tokens // bs) - len(seq.block_tables.get(g, ()))) for g in self.kv.paged), default=0)

    def take(self, seq: Sequence, num_tokens: int) -> bool:
        """Make ``seq`` hold its first ``num_tokens`` tokens if the reserve allows; whether it does."""
        need = self.blocks_for(seq, num_tokens)
        if need > self.spare or not self.kv.can_allocate(seq, num_tokens):
            return False
        self.kv.allocate(seq, num_tokens)
        self.spare -= need
        return True
