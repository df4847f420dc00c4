"""Context parallelism for long prefill: which tokens of a prompt each CP rank owns, and how the
partial attention results of several ranks merge into the exact one.

* ``zigzag_chunks``: a prompt of L tokens in 2C equal chunks; rank r owns chunks r and
  2C-1-r. Under a causal mask the work of a query grows with its position, so pairing an early
  chunk with a late one gives every rank the same attention work (within one chunk's rounding).
* ``merge_partials``: attention over a key set split in parts is each part's softmax-weighted
  output together with its log-sum-exp; the exact result weighs each part by exp(lse_i - lse)
  with lse = log sum_i exp(lse_i). A part with no visible key has lse = -inf and weight 0.
* ``partial_attention``: the reference computation of one part (a query block against a key
  block, causal by absolute positions), returning the output and its log-sum-exp: what a
  backend's attention op returns when it runs one part.

* ``ContextParallel``: what the engine runs (``DataParallel``'s CP prefill). For MLA the
  per-token cache row is one small latent ([c | k_pe], 576 values on V3, against 128 heads x 128
  values of a partial output plus its log-sum-exp), so every rank gathers the latent rows of the
  whole prefix, layer by layer, and attends its own zig-zag chunks over them: the attention work
  is balanced by the chunks, no partial output crosses ranks, and every rank ends up with the
  prefix's cache rows, which the request's owner writes into its KV cache. V4's attention is
  sparse over one shared KV row per token (its window) plus compressed entries, so the same
  holds there: every rank gathers the KV and compressor rows, pools the prefix's entries, and
  the owner stores the entries. ``partial_attention`` / ``merge_partials`` stay the pieces for
  attention whose keys are too big to gather.

  A rank whose part of the prefill raises tells its group so (``fail``): every gather, and the
  ``finish`` after the model's pass, first exchanges each rank's status, so the other ranks
  raise ``PeerFailed`` at their next one instead of waiting in a gather until the timeout.
"""

from __future__ import annotations

import torch


def zigzag_chunks(length: int, cp_size: int) -> list[list[tuple[int, int]]]:
    """Per CP rank, its [start, end) token ranges: chunks r and 2C-1-r of 2C near-equal chunks."""
    if cp_size < 1 or length < 0:
        raise ValueError(f"need cp_size >= 1 and length >= 0, got {cp_size}, {length}")
    pieces = 2 * cp_size
    bounds = [length * i // pieces for i in range(pieces + 1)]
    chunks = [(bounds[i], bounds[i + 1]) for i in range(pieces)]
    return [[chunks[r], chunks[pieces - 1 - r]] for r in range(cp_size)]


def causal_work(ranges: list[tuple[int, int]]) -> int:
    """(query, key) pairs a causal prompt's queries in ``ranges`` attend to: sum of (position + 1)."""
    return sum((end * (end + 1) - start * (start + 1)) // 2 for start, end in ranges)


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries [Tq, H, Dk] at ``q_pos`` over keys [Tk, Dk] / values [Tk, Dv]
    (shared by the heads, MLA's latent form) at ``k_pos``, in float32: (out [Tq, H, Dv], lse [Tq, H]);
    a query that sees none of these keys gets out 0 and lse -inf."""
    scores = torch.einsum("qhd,kd->qhk", q.float(), k.float()) * scale
    visible = (k_pos[None, :] <= q_pos[:, None])[:, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("qhk,kd->qhd", weights, v.float()), lse


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of the parts' keys, from each part's (out [T, H, D], lse [T, H])."""
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    finite = torch.where(torch.isinf(lse), 0.0, lse)
    out = torch.zeros_like(outs[0], dtype=torch.float32)
    for o, part in zip(outs, lses):  # in part order: a fixed summation order
        out += torch.exp(part - finite)[..., None] * o.float()
    return out, lse


class PeerFailed(RuntimeError):
    """Another rank of this CP group failed its part of the prefill (raised at this rank's next
    gather or ``finish``, on every rank of the group but the failed one)."""


class ContextParallel:
    """One prompt prefix of ``length`` tokens prefilled across ``comm``'s ranks (a CP group):
    this rank computes the tokens of its zig-zag chunks (``positions``) and ``gather`` brings
    every rank's rows of a layer together in position order. Every rank ends the prefill with
    ``finish()`` or, when its part raised, ``fail()``. ``device``: where the status flags travel
    (the group's device: NCCL exchanges device tensors)."""

    def __init__(self, comm, length: int, device: torch.device = torch.device("cpu")):
        if length < 2 * comm.size:
            raise ValueError(f"a {length}-token prefix cannot be cut into {2 * comm.size} chunks")
        self.comm, self.length, self.device = comm, length, device
        self.ranges = zigzag_chunks(length, comm.size)
        self.mine = self.ranges[comm.rank]
        self.width = max(sum(e - s for s, e in r) for r in self.ranges)  # rows per rank, padded to the widest

    def positions(self, device: torch.device) -> torch.Tensor:
        """This rank's token positions, chunk by chunk."""
        return torch.cat([torch.arange(s, e, device=device) for s, e in self.mine])

    def _status(self, failed: bool) -> None:
        """Exchange every rank's status (one small all-gather); raise PeerFailed where another
        rank reports a failure. Every rank makes the same number of these calls: one per gather
        it reached, then one in ``finish`` or ``fail``."""
        flags = self.comm.all_gather(torch.tensor([int(failed)], dtype=torch.int64, device=self.device))
        failed_ranks = [r for r, flag in enumerate(torch.cat(flags).tolist()) if flag and r != self.comm.rank]
        if failed_ranks and not failed:
            raise PeerFailed(f"CP rank(s) {failed_ranks} of this group failed during the prefill")

    def finish(self) -> None:
        """This rank's part is done: raises PeerFailed if another rank failed after the last gather."""
        self._status(False)

    def fail(self) -> None:
        """This rank's part raised (not PeerFailed): tell the others, who raise PeerFailed."""
        self._status(True)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """[length, D]: every rank's ``rows`` ([its tokens, D], in ``positions`` order) in position order."""
        self._status(False)
        padded = rows.new_zeros((self.width, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        out = rows.new_empty((self.length, *rows.shape[1:]))
        for ranges, part in zip(self.ranges, self.comm.all_gather(padded)):
            offset = 0
            for s, e in ranges:
                out[s:e] = part[offset: offset + e - s]
                offset += e - s
        return out

    def attention_inputs(self) -> tuple[list[int], list[int]]:
        """cu_seqlens (q, k) for attending this rank's chunks, each a sequence whose keys are the
        prefix up to the chunk's end (its queries the last ones): what ``mla_prefill_attention`` takes."""
        cu_q, cu_k = [0], [0]
        for s, e in self.mine:
            cu_q.append(cu_q[-1] + e - s)
            cu_k.append(cu_k[-1] + e)
        return cu_q, cu_k
