"""The ops of the ``vendor_example`` backend: same contracts as ``deepinfer_core.ops``, other algorithms.

Each op follows the docstring of the reference op of the same name (shapes, dtypes, in-place
behaviour, empty inputs) and matches it within the tolerances of ``specs/ops.toml``; none is a
call into the reference. Each callable carries an ``impl`` string that ``deepinfer backends``
prints next to it.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The sum of squares as one dot product per row, then the weight applied in float32 and a
    # single rounding at the end (the reference rounds the normalised row, then the product).
    x32 = x.float()
    inv_rms = torch.rsqrt(torch.linalg.vecdot(x32, x32) / x.shape[-1] + eps)
    return (x32 * inv_rms.unsqueeze(-1) * weight.float()).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = torch.add(x, residual)  # in x's dtype: the contract wants exactly the reference's sum
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # silu(g) = g * sigmoid(g), written out and multiplied by `up` in float32, rounded once.
    half = x.shape[-1] // 2
    gate, up = x[..., :half].float(), x[..., half:].float()
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)


def moe_route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Selection by ranking: one stable descending sort per token (of groups, then of experts)
    # instead of topk + masked_fill; excluded experts sort last.
    logits = x.float() @ gate_weight.float().T
    num_tokens, num_experts = logits.shape
    group_size = num_experts // n_group  # explicit: a view with -1 is ambiguous for 0 tokens
    if scoring_func == "sigmoid":
        scores = torch.sigmoid(logits)
    elif scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        raise ValueError(f"scoring_func {scoring_func!r} is not supported by vendor_example")

    if topk_method == "noaux_tc":
        choice = scores if correction_bias is None else scores + correction_bias.float()
        per_group = choice.view(num_tokens, n_group, group_size).sort(dim=-1, descending=True).values
        in_kept_group = _kept_groups(per_group[..., :2].sum(dim=-1), topk_group, group_size)
        ranked = torch.where(in_kept_group, choice, float("-inf")).argsort(dim=-1, descending=True, stable=True)
        ids = ranked[:, :top_k]
        weights = scores.gather(1, ids)
        if norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    elif topk_method == "greedy":
        ids = scores.argsort(dim=-1, descending=True, stable=True)[:, :top_k]
        weights = scores.gather(1, ids)
    elif topk_method == "group_limited_greedy":
        in_kept_group = _kept_groups(scores.view(num_tokens, n_group, group_size).amax(dim=-1), topk_group, group_size)
        kept = torch.where(in_kept_group, scores, 0.0)
        ids = kept.argsort(dim=-1, descending=True, stable=True)[:, :top_k]
        weights = kept.gather(1, ids)
    else:
        raise ValueError(f"topk_method {topk_method!r} is not supported by vendor_example")
    return weights * routed_scaling_factor, ids


def _kept_groups(group_scores: torch.Tensor, topk_group: int, group_size: int) -> torch.Tensor:
    """[T, E] bool: the experts of each token's topk_group best groups (by rank of group_scores)."""
    rank = group_scores.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    return (rank < topk_group).repeat_interleave(group_size, dim=-1)


def write_latent_cache(kv_cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # (block, row) index pairs written straight into the 3-D cache, latent and k_pe separately:
    # no concatenated temporary, and the cache need not be contiguous.
    keep = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping.index_select(0, keep)
    blocks, rows = slots // kv_cache.shape[1], slots % kv_cache.shape[1]
    d_c = latent.shape[-1]
    kv_cache[blocks, rows, :d_c] = latent.index_select(0, keep).to(kv_cache.dtype)
    kv_cache[blocks, rows, d_c:] = k_pe.index_select(0, keep).to(kv_cache.dtype)


def gather_latent_cache(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return kv_cache.flatten(0, 1).index_select(0, slots)


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return padded_decode_attention(q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale)


def padded_decode_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA decode for every query row at once. Each row's sequence and causal length
    come from tensor ops (no loop): the row's sequence by searchsorted over query_start_loc, its
    length seq_len - q_len + 1 + i = seq_len - query_start_loc[b + 1] + 1 + row. Every row's
    entries are gathered into one [T, max_len, d_c + d_r] tensor, scores are one dot product of
    [q_latent | q_pe] with whole [c | k_pe] entries, and positions at or past a row's length are
    masked. (The reference loops over sequences and rows.) Rows of length <= 0 give zeros, as the
    reference does."""
    rows, _, d_c = q_latent.shape
    if rows == 0:
        return q_latent.new_empty(q_latent.shape)
    block_size = kv_cache.shape[1]
    starts = query_start_loc.long()
    row = torch.arange(rows, device=q_latent.device)
    seq = torch.searchsorted(starts[1:], row, right=True)  # [T]: the sequence whose rows include it
    lengths = seq_lens.long()[seq] - starts[seq + 1] + 1 + row  # [T]: entries the row attends to
    max_len = int(lengths.max().clamp(min=0))
    pos = torch.arange(max_len, device=kv_cache.device)
    valid = pos[None, :] < lengths[:, None]  # [T, max_len]
    blocks = block_tables.long()[seq].gather(1, (pos // block_size).expand(rows, max_len))
    blocks = torch.where(valid, blocks, 0)  # table entries past a sequence's end may be stale
    entries = kv_cache[blocks, pos % block_size].float()  # [T, max_len, d_c + d_r]
    q = torch.cat([q_latent, q_pe], dim=-1).float()  # [T, H, d_c + d_r]
    scores = torch.einsum("thd,tld->thl", q, entries) * scale
    masked = ~valid[:, None, :]
    probs = scores.masked_fill(masked, float("-inf")).softmax(dim=-1).masked_fill(masked, 0.0)
    return torch.einsum("thl,tlc->thc", probs, entries[..., :d_c]).to(q_latent.dtype)


rms_norm.impl = "torch (vendor example): row dot product for the sum of squares, weight in float32, one rounding"
add_rms_norm.impl = "torch (vendor example): add in the input dtype, then this backend's rms_norm"
silu_and_mul.impl = "torch (vendor example): gate * sigmoid(gate) * up in float32, one rounding"
moe_route.impl = "torch (vendor example): stable descending sorts rank groups, then experts (no topk)"
write_latent_cache.impl = "torch (vendor example): index_put by (block, row), latent and k_pe written separately"
gather_latent_cache.impl = "torch (vendor example): index_select on the flattened cache"
mla_decode_attention.impl = "torch (vendor example): every query row at once, padded to the longest row, masked, one einsum"

OPS = {
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "silu_and_mul": silu_and_mul,
    "moe_route": moe_route,
    "write_latent_cache": write_latent_cache,
    "gather_latent_cache": gather_latent_cache,
    "mla_decode_attention": mla_decode_attention,
}
