"""MTP drafts: the model's own multi-token-prediction module proposes the next k tokens.

The MTP module at position p reads the target's hidden state h_p (V4: its residual streams) and
the token t_{p+1}, keeps its own cache entry at p (V3: in the target's paged MLA group, so the
same block tables address it; V4: in the sliding-window ring), and its logits predict t_{p+2}. Every step has two parts:

* ``observe`` (after the target's tokens are verified, before the scheduler appends them):
  **catch-up**. For every sequence the step computed, MTP rows for exactly the positions whose
  target entries stay (a prefill chunk: all of it; a verification row: its newest token and the
  accepted drafts), fed (t_{p+1}, h_p): the accepted tokens supply the t_{p+1} the host does not
  hold yet. The last row of a sequence that sampled gives its first draft.
* ``propose`` (after the scheduler's update, for the sequences still decoding): **chaining**.
  Draft j >= 2 runs the module again one position further on, fed draft j - 1 and the module's
  own previous output in place of the target's hidden state (vLLM's and SGLang's scheme). Only
  the first MTP module drafts (DeepSeek's V3/R1 and V4 checkpoints have one; only its cache is
  caught up). These rows write cache entries at positions the
  target has not verified yet: scratch, which the next step's catch-up overwrites before any
  row reads it.

Drafts of coupled rows (see ``rejection``) are sampled by the backend's own ``sample_tokens`` op
with the sequence's seed at the output position the draft stands for, that is with the same
noise the target's verification row uses there: while the draft distribution is close to the
target's, the draft is the very token the target samples (greedy: its argmax), and verification
(``sampler.verify``) accepts it. What is emitted is always the target's own sample, so
speculation never changes the output. Rows verified by rejection sampling draw their draft from
its distribution q, kept in ``Sequence.draft_probs`` for the verification.

Because a paged entry at a block's last position depends on the first token of the next block,
the engine hashes blocks with their next token for prefix caching when the module's cache is
paged (``KVCacheManager.hash_next_token``; V4's ring is rebuilt by bounded replay instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.engine.scheduler import ScheduledSeq, SchedulerOutput
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.sampling.sampler import SampleRow, launch, needs_history
from deepinfer_core.engine.spec_decode.drafting import BlockReserve, draft_room, sample_drafts
from deepinfer_core.engine.spec_decode.rejection import uses_rejection


@dataclass
class _Draft:
    """A sequence's first draft, from the catch-up, and the MTP hidden state that produced it."""

    token: int
    state: torch.Tensor  # [D] (V3) or [hc, D] (V4 streams)


class MTPProposer:
    """``model.forward_mtp`` takes the target's draft state: V3/V2 the hidden state after the final
    norm (and return the next hidden), V4 the residual streams before the head collapse (and
    return (hidden, streams)); the runner keeps whichever the model has (``ModelRunner.keep_hidden``)."""

    def __init__(self, model, runner, num_tokens: int, ops, eos_ids: tuple[int, ...], max_model_len: int, copy_to_host,
                 acceptance: str = "auto"):
        self.model = model
        self.acceptance = acceptance  # how sampled drafts are verified (spec_decode.rejection)
        self.runner = runner
        self.kv = runner.kv
        self.k = num_tokens
        self.ops = ops
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.copy_to_host = copy_to_host
        self.first: dict[int, _Draft] = {}  # seq_id -> its first draft, between observe and propose
        self.graphs = None  # engine.graphs.DecodeGraphs of the module (draft_dim set), where the platform captures

    # ---- catch-up -----------------------------------------------------------------------------
    def observe(self, out: SchedulerOutput, step, accepted: dict[int, list[int]]) -> None:
        """Catch the MTP cache up with the positions ``out`` computed and kept; draft the first
        token of every sequence that sampled. ``accepted``: seq_id -> its tokens of this step."""
        self.first = {}
        rows, ids, hidden_rows = [], [], []
        for s in out.scheduled:
            seq = s.seq
            if seq.is_finished or seq.seq_id not in step.first_rows:
                continue
            new = accepted.get(seq.seq_id, [])
            end = s.start + len(new) if s.num_drafts else s.end  # rejected drafts have no entries
            known = seq.num_tokens
            shifted = seq.token_slice(s.start + 1, min(end + 1, known)) + new[: max(0, end + 1 - max(known, s.start + 1))]
            if len(shifted) != end - s.start:
                raise AssertionError(f"MTP catch-up of sequence {seq.seq_id}: {len(shifted)} ids for {end - s.start} rows")
            # decode rows stay decode rows (the absorbed attention path, not a context expansion)
            rows.append(ScheduledSeq(seq, s.start, end - s.start, is_decode=s.is_decode, samples=bool(new)))
            ids += shifted
            first = step.first_rows[seq.seq_id]
            hidden_rows += range(first, first + end - s.start)
        if not rows:
            return
        index = torch.tensor(hidden_rows, dtype=torch.int64)
        prev = step.hidden.index_select(0, index.to(step.hidden.device))
        batch = SchedulerOutput(prefills=[r for r in rows if not r.is_decode], decodes=[r for r in rows if r.is_decode])
        hidden, state = self._forward(batch, ids, prev)  # out.scheduled is prefills, then decodes: the rows' order
        last, samplers = [], []
        row = 0
        for s in rows:
            row += s.num_tokens
            if s.samples:
                last.append(row - 1)
                samplers.append(SampleRow(s.seq, drafts=accepted[s.seq.seq_id]))
                s.seq.draft_probs = []  # this step's were used by its verification
        if not last:
            return
        index = torch.tensor(last, dtype=torch.int64).to(hidden.device)
        tokens = self._sample(hidden.index_select(0, index), samplers)
        for r, tok, st in zip(samplers, tokens, state.index_select(0, index)):
            self.first[r.seq.seq_id] = _Draft(tok, st)

    # ---- chaining -----------------------------------------------------------------------------
    def propose(self, running: list[Sequence]) -> None:
        """Set ``draft_token_ids`` of every running sequence (empty unless it is decoding)."""
        chains: list[tuple[Sequence, int]] = []  # (sequence, drafts it may have)
        states = []
        reserve = BlockReserve(self.kv, running)
        for seq in running:
            seq.draft_token_ids = []
            first = self.first.get(seq.seq_id)
            if first is None or seq.num_computed_tokens != seq.num_tokens - 1:
                continue
            room = draft_room(seq, self.k, self.max_model_len)
            if room <= 0:
                continue
            seq.draft_token_ids = [first.token]
            # chained rows write positions num_tokens - 1 .. num_tokens + room - 3
            while room > 1 and not reserve.take(seq, seq.num_tokens + room - 2):
                room -= 1
            if room > 1:
                chains.append((seq, room))
                states.append(first.state)
        self.first = {}
        if chains:
            self._chain(chains, torch.stack(states))

    def _chain(self, chains: list[tuple[Sequence, int]], state: torch.Tensor) -> None:
        """Drafts 2.. of every chaining sequence: its j-th row (``_chain_rows``) is fed draft j and
        the module's previous output. When no row's sampling reads its tokens on the host (no
        penalties; coupled or greedy), each draft feeds the next row from the device and the
        host waits once, at the end (their copies started as each was sampled); otherwise each
        draft is brought to the host as it is sampled."""
        on_device = not any(needs_history(seq.params) or uses_rejection(seq.params, self.acceptance) for seq, _ in chains)
        device = state.device
        ids = torch.tensor([seq.draft_token_ids[-1] for seq, _ in chains], dtype=torch.int64).to(device)
        drafts = {seq.seq_id: list(seq.draft_token_ids) for seq, _ in chains}
        counts = {seq.seq_id: len(seq.draft_token_ids) for seq, _ in chains}  # drafts made so far, on the device or not
        everyone = [seq for seq, _ in chains]
        for seq, room in chains:  # placeholders while the chain runs: the rows' ids are passed in ``ids``
            seq.draft_token_ids = drafts[seq.seq_id] + [0] * (room - len(drafts[seq.seq_id]))
        launched: list[tuple[list[Sequence], object]] = []
        j = 1
        while chains:
            hidden, state = self._forward(SchedulerOutput(decodes=_chain_rows(chains, j)), ids, state)
            if on_device:
                # only how many drafts precede each row matters to its sampling here (its seed position, min_tokens)
                rows = [SampleRow(seq, drafts=[0] * counts[seq.seq_id]) for seq, _ in chains]
                with torch.inference_mode():
                    batch = launch(self.ops, self.model.compute_logits(hidden), rows, self.eos_ids, self.copy_to_host)
                launched.append(([seq for seq, _ in chains], batch))
                tokens = batch.tokens
            else:
                picks = self._sample(hidden, [SampleRow(seq, drafts=list(drafts[seq.seq_id])) for seq, _ in chains])
                for (seq, _), token in zip(chains, picks):
                    drafts[seq.seq_id].append(token)
                tokens = torch.tensor(picks, dtype=torch.int64).to(device)
            for seq, _ in chains:
                counts[seq.seq_id] += 1
            keep = [i for i, (seq, room) in enumerate(chains) if counts[seq.seq_id] < room]
            j += 1
            if keep and len(keep) < len(chains):
                index = torch.tensor(keep, dtype=torch.int64).to(device)
                ids, state = tokens.index_select(0, index), state.index_select(0, index)
            else:
                ids = tokens
            chains = [chains[i] for i in keep]
        for seqs, batch in launched:
            for seq, (token, _, _) in zip(seqs, batch.resolve()):
                drafts[seq.seq_id].append(token)
        for seq in everyone:
            seq.draft_token_ids = drafts[seq.seq_id]

    # ---- one MTP forward ------------------------------------------------------------------------
    def _forward(self, out: SchedulerOutput, ids: list[int] | torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states for the logits, draft states for the next chained row) of the module on
        the rows ``out`` describes (positions, slots, tables as the runner builds them for the
        target), fed ``ids`` (t_{p+1} per row) and ``prev`` (the draft state at p). Decode-only
        batches that fit the draft graphs replay them (rows padded as the target's are)."""
        runner, graphs = self.runner, self.graphs
        on_device = isinstance(ids, torch.Tensor)  # single-token rows whose ids the previous draft left on the device
        q_len = graphs.query_len_for(out) if graphs is not None else None
        if q_len is not None:
            pad, real, row = [], [], 0
            for b, s in enumerate(out.decodes):
                pad += list(range(row, row + s.num_tokens)) + [row + s.num_tokens - 1] * (q_len - s.num_tokens)
                real += range(b * q_len, b * q_len + s.num_tokens)
                row += s.num_tokens
            hb = runner.prepare(out, pad_to=q_len)
            index = torch.tensor(pad, dtype=torch.int64).to(prev.device)
            hb.ids = [0] * len(pad) if on_device else [ids[i] for i in pad]

            def fill(buffer: torch.Tensor) -> None:
                if on_device:
                    buffer[: len(pad)].copy_(ids.index_select(0, index))

            with torch.inference_mode():
                result = graphs.replay(hb, q_len, fill, prev.index_select(0, index))
                hidden, state = result if isinstance(result, tuple) else (result, result)  # V4: (hidden, streams)
                keep = torch.tensor(real, dtype=torch.int64).to(hidden.device)
                hidden = hidden.index_select(0, keep)
                state = hidden if state is result else state.index_select(0, keep)
            return hidden, state
        hb = runner.prepare(out)
        hb.ids = [0] * len(hb.positions) if on_device else list(ids)
        input_ids, positions, meta = runner._meta(hb)
        if on_device:
            input_ids = ids
        with torch.inference_mode():
            result = self.model.forward_mtp(0, input_ids, positions, prev, meta, runner.kv_cache.tensors)
        return result if isinstance(result, tuple) else (result, result)

    def _sample(self, hidden: torch.Tensor, rows: list[SampleRow]) -> list[int]:
        with torch.inference_mode():
            return sample_drafts(self.ops, self.model.compute_logits(hidden), rows, self.eos_ids, self.copy_to_host, self.acceptance)


def _chain_rows(chains: list[tuple[Sequence, int]], j: int) -> list[ScheduledSeq]:
    """The j-th chained row of each sequence: one token at position num_tokens - 2 + j (j = 1:
    the newest token's position, fed the first draft)."""
    return [ScheduledSeq(seq, seq.num_tokens - 2 + j, 1, is_decode=True) for seq, _ in chains]
