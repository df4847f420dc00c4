"""Engram n-gram memory ops (DeepSeek-V4.1, deepseek_architectures.md §4.5): the multiplicative
XOR hash of each token's preceding n-grams into per-(size, head) prime-sized table segments,
and the per-stream sigmoid gate that adds the projected memory to the residual streams.

The static tables (primes, offsets, multipliers, compressed token ids) come from
``deepinfer_core.models.v41.engram_tables``; the row lookup and the ``W_ekv`` projection between the
two ops are ordinary embedding / linear ops.
"""

from __future__ import annotations

import torch


def engram_hash_ids(
    ngram_ids: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor, pad_id: int
) -> torch.Tensor:
    """Engram table row ids of every token's n-grams (sizes 2..n, every head).

    ngram_ids [T, n] int64: column s is the compressed id of the token at position p - s
    (s = 0..n-1), or -1 where that lookback is blocked (before position 0, or at/after a dead
    token; callers guarantee that once a column is -1 all later columns are -1).
    multipliers [n] int64 (odd, ``engram_multipliers``); primes [n-1, H] int64; offsets
    [(n-1)*H] int64 (running sums of the layer's primes, ``engram_offsets``); pad_id: the
    compressed id used for blocked lookbacks.

    With v_s = ngram_ids[:, s] (pad_id where -1), in int64:
    roll_0 = v_0 * mult[0]; roll_s = roll_{s-1} XOR (v_s * mult[s]);
    out[:, (s-1)*H + h] = roll_s mod primes[s-1, h] + offsets[(s-1)*H + h] for s >= 1.

    Precondition: 0 <= every id (and pad_id) < the compressed vocabulary size the multipliers
    were drawn for, so every product is in [0, 2^63) and every roll is non-negative.
    Returns [T, (n-1)*H] int64, each column inside [offset, offset + prime).
    """
    n = ngram_ids.shape[1]
    v = torch.where(ngram_ids < 0, torch.full_like(ngram_ids, pad_id), ngram_ids)
    prods = v * multipliers.to(v.device, torch.int64)
    rolls = [prods[:, 0]]
    for s in range(1, n):
        rolls.append(rolls[-1] ^ prods[:, s])
    roll = torch.stack(rolls[1:], dim=1)  # [T, n-1]
    p = primes.to(v.device, torch.int64)
    ids = torch.remainder(roll[:, :, None], p[None]) + offsets.to(v.device, torch.int64).view(1, *p.shape)
    return ids.flatten(1)


def engram_gate(x: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Add the projected n-gram memory to each residual stream through its own gate.

    x [T, hc, D] streams (model dtype); kv [T, (hc+1)*D] = W_ekv · concat(rows): key_k =
    kv[:, k*D:(k+1)*D] for stream k < hc, value = kv[:, hc*D:]; q_weight, k_weight [hc, D].
    All math in float32:

        dot_k = sum_d x_k[d] q_weight[k,d] k_weight[k,d] key_k[d]
                * rsqrt(mean_d(x_k^2) + eps) * rsqrt(mean_d(key_k^2) + eps) * D^-0.5
        g_k   = sigmoid(sign(dot_k) * sqrt(max(|dot_k|, 1e-6)))
        out_k = x_k + g_k * value          (the same value for every stream)

    Returns [T, hc, D] in x's dtype (one rounding at the end). Tokens that must get a zero gate
    (image tokens) are the caller's business: pass them around this op.
    """
    t, hc, d = x.shape
    x32 = x.float()
    kv32 = kv.float()
    key = kv32[:, : hc * d].view(t, hc, d)
    value = kv32[:, hc * d :].view(t, 1, d)
    dot = (x32 * q_weight.float() * k_weight.float() * key).sum(-1)
    dot = dot * torch.rsqrt(x32.pow(2).mean(-1) + eps) * torch.rsqrt(key.pow(2).mean(-1) + eps) * d**-0.5
    gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp_min(1e-6).sqrt())
    return (x32 + gate[..., None] * value).to(x.dtype)
