"""Multi-head latent attention (MLA) ops and the paged latent cache.

The cache of one MLA layer is a tensor [num_blocks, block_size, kv_lora_rank + rope_dim]: per
token the normalised latent c (kv_lora_rank values) followed by the rotated shared rope key
k_pe. Slot s is row s % block_size of block s // block_size.
"""

from __future__ import annotations

import torch

from deepinfer_core.ops.norm import rms_norm
from deepinfer_core.ops.rope import rotary_embedding


def write_latent_cache(kv_cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store [latent | k_pe] of token t at slot slot_mapping[t] (in place).

    kv_cache: [num_blocks, block_size, d_c + d_r]; latent: [T, d_c]; k_pe: [T, d_r];
    slot_mapping: [T] int64; a negative slot means "do not store" (padding).
    """
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    keep = slot_mapping >= 0
    entries = torch.cat([latent, k_pe], dim=-1).to(kv_cache.dtype)
    flat[slot_mapping[keep]] = entries[keep]


def norm_rope_write_latent(
    kv_cache: torch.Tensor,
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    q_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    interleaved: bool,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """A layer's new cache rows and rotated queries in one op: the results of
    ``rms_norm(kv[:, :d_c], norm_weight, eps)``, then ``rotary_embedding(q_pe, kv[:, d_c:], positions,
    cos_sin, interleaved)``, then ``write_latent_cache(kv_cache, latent, k_pe, slot_mapping)``.
    Returns the rotated q_pe [T, H, r] (a new tensor in q_pe's dtype); kv_cache is written in place.

    kv: [T, d_c + r] (the kv_a projection's rows: the latent, then the rope key; strided views
    allowed, as q_pe), norm_weight: [d_c]. An optional fusion: the V2/V3 model calls it where
    the backend provides it and calls the three ops otherwise (a backend that has those three
    loses nothing by leaving this one to the reference).
    """
    d_c = norm_weight.shape[0]
    latent = rms_norm(kv[:, :d_c], norm_weight, eps)
    q_rot, k_pe = rotary_embedding(q_pe, kv[:, d_c:], positions, cos_sin, interleaved)
    write_latent_cache(kv_cache, latent, k_pe, slot_mapping)
    return q_rot


def gather_latent_cache(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of the cache at ``slots`` [S] int64 -> [S, d_c + d_r] (a new tensor)."""
    return kv_cache.view(-1, kv_cache.shape[-1])[slots]


def mla_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention over variable-length sequences in the expanded (per-head) MLA form.

    q: [Tq, H, d_qk]; k: [Tk, H, d_qk]; v: [Tk, H, d_v], sequences packed back to back with
    boundaries cu_seqlens_q / cu_seqlens_k ([B+1] int32, starting at 0). Sequence b has
    lq = len_q(b) new tokens that are the last lq of its lk = len_k(b) keys (the rest is cached
    prefix), so query i attends to keys 0 .. lk - lq + i. Softmax in float32. Returns
    [Tq, H, d_v] in q's dtype.
    """
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qs, ks = q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]]
        vs = v[ck[b] : ck[b + 1]]
        lq, lk = qs.shape[0], ks.shape[0]
        if lq == 0:
            continue
        scores = torch.einsum("qhd,khd->hqk", qs.float(), ks.float()) * scale
        allowed = torch.arange(lk, device=q.device)[None, :] <= (torch.arange(lq, device=q.device)[:, None] + lk - lq)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[cq[b] : cq[b + 1]] = torch.einsum("hqk,khd->qhd", probs, vs.float()).to(q.dtype)
    return out


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed-form MLA decode over the paged latent cache: each sequence's newest query tokens
    (one in plain decode, 1 + k when speculative decoding verifies k drafted tokens), causal.

    q_latent: [T, H, d_c] (q_nope already multiplied by W_UK); q_pe: [T, H, d_r] rotated (either
    may be a strided view); kv_cache: [num_blocks, block_size, d_c + d_r]; block_tables:
    [B, max_blocks] int32; seq_lens: [B] int32; query_start_loc: [B + 1] int32, starting at 0,
    non-decreasing, query_start_loc[B] == T.
    Sequence b owns the query rows query_start_loc[b] .. query_start_loc[b + 1] - 1: its newest
    q_len_b = query_start_loc[b + 1] - query_start_loc[b] tokens (0 is allowed), whose entries are
    already in the cache; seq_lens[b] counts all its cached entries, those rows' included. Row i
    (0-based within sequence b) attends to the first n_i = seq_lens[b] - q_len_b + 1 + i entries
    (itself and everything before it). s_j = (q_latent . c_j + q_pe . k_pe_j) * scale; a row
    returns sum_j softmax(s)_j c_j over j < n_i (the caller applies W_UV), zeros when n_i <= 0
    (graph padding: seq_lens 0). Softmax in float32. Returns [T, H, d_c] in q_latent's dtype.
    With one row per sequence (query_start_loc = 0, 1, .., B) this is plain decode: row b attends
    to seq_lens[b] entries.
    """
    d_c = q_latent.shape[-1]
    block_size = kv_cache.shape[1]
    out = q_latent.new_empty(q_latent.shape)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, n in enumerate(lens):
        first, last = starts[b], starts[b + 1]
        if first == last:
            continue
        pos = torch.arange(max(n, 0), device=kv_cache.device)
        blocks = block_tables[b, pos // block_size].long()
        entries = kv_cache[blocks, pos % block_size].float()
        for row in range(first, last):
            allowed = max(0, n - (last - first) + 1 + (row - first))
            c, k_pe = entries[:allowed, :d_c], entries[:allowed, d_c:]
            scores = (q_latent[row].float() @ c.T + q_pe[row].float() @ k_pe.T) * scale
            out[row] = (scores.softmax(dim=-1) @ c).to(q_latent.dtype)
    return out
