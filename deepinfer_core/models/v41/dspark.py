"""DeepSeek-V4.1's DSpark draft head (deepseek_architectures.md §4.6): its three stages, loaded
from ``mtp.{0,1,2}.*``, and the forward that drafts a block; scheduling drafts and verifying
them is the speculative-decoding engine's work.

* Taps: the mean over the hc streams of the residual entering each of ``dspark_target_layer_ids``
  (the target forward collects them). ``main_x = main_norm(main_proj([tap_1 | tap_2 | tap_3]))``.
* Context: for every token the target processes, each stage writes
  ``RoPE(kv_norm_s(wkv_s(main_x)), p)`` (main rope: stages are window-only) into its own window
  ring at the token's position (``write_context``).
* Block (``draft``): rows ``[y, noise x (N - 1)]`` at positions P .. P + N - 1 (y: the newest
  token, not yet through the target), streams = its embedding, through the three stages (V4.1
  blocks: delayed mHC, window-only attention, MoE of ``dspark_n_routed_experts`` top
  ``dspark_num_experts_per_tok``); each row attends to its stage's context P - W .. P - 1 and to
  every row of the block (not causal within it). Head: ``x_i = sum_j pre_j X_ij`` with the last
  stage's FFN pre, ``base_i = head(norm(x_i))``; Markov head ``logits_i = base_i + head_M(embed_M[prev_i])``
  (prev_0 = y, then the previous draft), drafted greedily in order; confidence
  ``sigmoid(w_c [x_i | embed_M[prev_i]])``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer_core.models.layers import Alloc, Linear, param
from deepinfer_core.models.v4.model import Norm, apply_rope


@dataclass
class Draft:
    """One block per sequence: ``tokens`` [B, N] (row i predicts position P + 1 + i),
    ``logits`` [B, N, V] float32 (after the Markov bias), ``base_logits`` [B, N, V] float32,
    ``confidence`` [B, N] float32 (estimated acceptance of each row), ``hidden`` [B, N, D] the
    collapsed rows before the final norm."""

    tokens: torch.Tensor
    logits: torch.Tensor
    base_logits: torch.Tensor
    confidence: torch.Tensor
    hidden: torch.Tensor


class Head(nn.Module):
    """A ``weight`` [rows, cols] holder (the Markov head's tables, the confidence projection)."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = param((rows, cols), dtype, device)


def add_stage_extras(stage: nn.Module, index: int, config, ops, alloc: Alloc) -> None:
    """The tensors only some stages carry: stage 0 the tap projection, the last the head."""
    d = config.hidden_size
    if index == 0:
        stage.main_proj = Linear(len(config.dspark_target_layer_ids) * d, d, ops, alloc)
        stage.main_norm = Norm(d, config.rms_norm_eps, alloc)
    if index == config.num_nextn_predict_layers - 1:
        stage.norm = Norm(d, config.rms_norm_eps, alloc)
        stage.markov_head = nn.Module()
        stage.markov_head.embed = Head(config.vocab_size, config.dspark_markov_rank, alloc.dtype, alloc.device)
        stage.markov_head.head = Head(config.vocab_size, config.dspark_markov_rank, alloc.dtype, alloc.device)
        stage.confidence_head = nn.Module()
        stage.confidence_head.proj = Head(1, d + config.dspark_markov_rank, torch.float32, alloc.device)


def stage_name(i: int) -> str:
    return f"mtp.layers.{i}.self_attn"


def write_context(model, taps: torch.Tensor, plan, caches: dict[str, torch.Tensor]) -> None:
    """taps [T, n_taps, D] float32 of ``plan``'s rows -> every stage's window keys at their positions."""
    ops, stages = model.ops, model.mtp.layers
    first = stages[0]
    main_x = first.main_proj(taps.flatten(1).to(model.dtype))
    main_x = ops.rms_norm_f32(main_x, first.main_norm.weight, first.main_norm.eps)
    table = model.tables["main"][0]
    for i, stage in enumerate(stages):
        attn = stage.self_attn
        kv = ops.rms_norm_f32(attn.kv_proj(main_x), attn.kv_norm.weight, attn.kv_norm.eps)
        kv = apply_rope(ops, kv[:, None], plan.positions, table)[:, 0]
        ops.write_cache(caches[f"{stage_name(i)}.window"], kv, plan.slots("window"))


def block_index(plan, window: int, block: int) -> torch.Tensor:
    """[B N, window + block] pool rows each block row attends to: its sequence's context
    positions P - window .. P - 1 (from the stage's ring) and the block's rows (this batch)."""
    seq = plan.seq
    start = plan.start[seq]
    ctx = start[:, None] - window + torch.arange(window, device=seq.device)[None, :]
    rows = plan.pool_rows("window", seq[:, None].expand_as(ctx), ctx)
    own = plan.base[seq][:, None] + torch.arange(block, device=seq.device)[None, :]
    return torch.cat([rows, own], dim=1)


@torch.no_grad()
def draft(model, anchor_ids: torch.Tensor, plan, caches: dict[str, torch.Tensor], choose=None) -> Draft:
    """The block of every sequence of ``plan`` (decode rows of N tokens each: the anchor and
    N - 1 noise tokens at positions P .. P + N - 1; nothing is written to the caches).
    ``choose(i, logits_i)`` picks row i's tokens [B] from its logits [B, V] (after the Markov
    bias); default greedy. The Markov head is sequential: row i + 1's bias reads row i's pick."""
    c, ops = model.config, model.ops
    stages = model.mtp.layers
    n = c.dspark_block_size
    b = anchor_ids.shape[0]
    ids = torch.full((b, n), c.dspark_noise_token_id, dtype=torch.int64, device=anchor_ids.device)
    ids[:, 0] = anchor_ids
    ids = ids.flatten()
    if ids.shape[0] != plan.num_tokens:
        raise ValueError(f"the batch holds {plan.num_tokens} tokens, not {b} blocks of dspark_block_size={n}")
    x = model.model.embed_tokens.weight[ids][:, None, :].expand(-1, c.hc_mult, -1).contiguous()
    pre = torch.zeros((ids.shape[0], c.hc_mult), dtype=torch.float32, device=x.device)
    pre[:, 0] = 1.0
    index = block_index(plan, c.sliding_window, n)
    for i, stage in enumerate(stages):
        x, pre = stage(x, pre, None, plan, caches, stage_name(i), model.tables["main"], None, window_index=index)
    last = stages[-1]
    hidden = ops.mhc_collapse(x, pre)
    base = model.compute_logits(ops.rms_norm_f32(hidden, last.norm.weight, last.norm.eps)).view(b, n, -1)
    m1, m2 = last.markov_head.embed.weight, last.markov_head.head.weight
    prev = anchor_ids
    tokens, logits, embeds = [], [], []
    for i in range(n):
        e = m1[prev]  # [B, R]
        li = base[:, i] + ops.linear(e, m2).float()
        prev = li.argmax(dim=-1) if choose is None else choose(i, li)
        tokens.append(prev)
        logits.append(li)
        embeds.append(e)
    e = torch.stack(embeds, dim=1)  # [B, N, R]
    feats = torch.cat([hidden.view(b, n, -1).float(), e.float()], dim=-1)
    confidence = torch.sigmoid(feats @ last.confidence_head.proj.weight.float()[0])
    return Draft(torch.stack(tokens, dim=1), torch.stack(logits, dim=1), base, confidence, hidden.view(b, n, -1))
