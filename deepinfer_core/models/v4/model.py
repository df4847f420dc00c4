"""DeepSeek-V4 (V4-Flash, V4-Pro), written on the OpTable (deepseek_architectures.md §3).

Per layer: manifold-constrained hyper-connections around attention and MoE (``hc_mult``
residual streams); shared-KV multi-query attention with per-head sinks over a sliding window of
``sliding_window`` keys, plus compressed entries: HCA layers (ratio ``hca_ratio``) see every
complete entry, CSA layers (ratio ``csa_ratio``, overlapping windows) the ``index_topk`` a
lightning indexer picks; sqrt-softplus MoE (hash-routed in the first ``num_hash_layers``
layers) with clamped SwiGLU. Parameter names equal transformers' ``DeepseekV4ForCausalLM``
state_dict; the MTP block (``mtp.0.*`` in DeepSeek's checkpoints, §3.8) lives at ``mtp.layers.0``.

Caches (``cache_groups``): every layer's window keys in the ring group "window"; CSA layers'
compressed entries and indexer keys in paged groups "csa_kv" / "csa_index" (one entry per
``csa_ratio`` tokens), HCA layers' in "hca_kv"; each compressor's projected rows of its open
window(s) in a small ring ("csa_state" / "hca_state", float32). Prefix caching reuses the
paged groups; after a hit the rings are rebuilt by recomputing ``replay_tokens()`` tokens, enough
for every layer's window to be exact again (``layers * (sliding_window - 1)`` for real configs).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deepinfer_core.models.batch import BatchMeta, CacheGroup
from deepinfer_core.models.layers import MLP, Alloc, Experts, Linear, param
from deepinfer_core.models.v4.batch import V4Batch, plan_for
from deepinfer_core.models.v4.checkpoint import V4Checkpoint
from deepinfer_core.models.v4.config import V4ModelConfig
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.rope import rope_cos_sin_table
from deepinfer_core.ops.kv_record import NOPE_DIM, PAGE_ROWS, RECORD_BYTES, ROW_DIM, record_rows
from deepinfer_core.ops.sparse import KeyPools

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
WINDOW, CSA_KV, CSA_INDEX, CSA_STATE, HCA_KV, HCA_STATE = "window", "csa_kv", "csa_index", "csa_state", "hca_kv", "hca_state"
RING_BLOCK = 16  # tokens per block of the window and HCA-state rings
CANDIDATE_BYTES = 128 * 2**20  # the indexer's candidate index is built in chunks of queries this large


class Norm(nn.Module):
    """RMSNorm weight kept in float32 (transformers keeps every V4 norm in float32)."""

    def __init__(self, dim: int, eps: float, alloc: Alloc):
        super().__init__()
        self.weight = param((dim,), torch.float32, alloc.device)
        self.eps = eps


class HyperConnection(nn.Module):
    def __init__(self, config: V4ModelConfig, alloc: Alloc):
        super().__init__()
        hc, d = config.hc_mult, config.hidden_size
        self.fn = param(((2 + hc) * hc, hc * d), torch.float32, alloc.device)
        self.base = param(((2 + hc) * hc,), torch.float32, alloc.device)
        self.scale = param((3,), torch.float32, alloc.device)


class HyperHead(nn.Module):
    def __init__(self, config: V4ModelConfig, alloc: Alloc):
        super().__init__()
        hc, d = config.hc_mult, config.hidden_size
        self.hc_fn = param((hc, hc * d), torch.float32, alloc.device)
        self.hc_base = param((hc,), torch.float32, alloc.device)
        self.hc_scale = param((1,), torch.float32, alloc.device)

    def forward(self, ops: OpTable, config: V4ModelConfig, x: torch.Tensor) -> torch.Tensor:
        return ops.mhc_head(x, self.hc_fn, self.hc_base, self.hc_scale, hc_eps=config.hc_eps, rms_eps=config.rms_norm_eps)


def apply_rope(ops: OpTable, x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing rope dims of x [T, H, d] (interleaved pairs) at ``positions``."""
    r = table.shape[-1]
    rotated = ops.rotary_embedding(x[..., -r:], x[:, 0, -r:], positions, table, True)[0]
    return torch.cat([x[..., :-r], rotated], dim=-1)


def grouped_o_a(ops: OpTable, proj: Linear, x: torch.Tensor) -> torch.Tensor:
    """Group g of heads through rows [g R, (g + 1) R) of ``proj``; [T, G, H d / G] -> [T, G R]."""
    groups = x.shape[1]
    rows = proj.weight.shape[0] // groups
    outs = []
    for g in range(groups):
        w = proj.weight[g * rows : (g + 1) * rows]
        if proj.weight_scale_inv is None:
            outs.append(ops.linear(x[:, g], w))
        else:
            bn = proj.block[0]
            s = proj.weight_scale_inv[g * rows // bn : (g + 1) * rows // bn]
            outs.append(ops.fp8_block_linear(x[:, g], w, s, proj.block))
    return torch.cat(outs, dim=-1)


def rope_tables(r: int, main_theta: float, compress_theta: float, compress_parameters: dict, max_positions: int,
                device: torch.device, round_to: torch.dtype | None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{"main", "compress"} -> (cos/sin table, its inverse with -sin) on ``device``; ``round_to``:
    the dtype cos/sin are first rounded to (transformers rounds them to the model dtype)."""
    main = rope_cos_sin_table(r, main_theta, {"rope_type": "default"}, max_positions)
    compress = rope_cos_sin_table(r, compress_theta, compress_parameters, max_positions)
    tables = {}
    for kind, t in (("main", main), ("compress", compress)):
        t = (t if round_to is None else t.to(round_to).float()).to(device)
        tables[kind] = (t, torch.cat([t[:, : r // 2], -t[:, r // 2 :]], dim=-1))
    return tables


class Compressor(nn.Module):
    """Pools the projected rows of every window of ``ratio`` tokens (two overlapping series when
    ``overlap``: CSA) into one normalised, rotated entry of ``dim`` values (§3.5)."""

    def __init__(self, config: V4ModelConfig, ops: OpTable, alloc: Alloc, ratio: int, dim: int, overlap: bool):
        super().__init__()
        self.ops, self.ratio, self.dim, self.overlap = ops, ratio, dim, overlap
        width = 2 * dim if overlap else dim
        d = config.hidden_size
        bf = Alloc(alloc.dtype, alloc.device, None)  # bf16 in DeepSeek's FP8 checkpoints
        self.kv_proj = Linear(d, width, ops, bf)
        self.gate_proj = Linear(d, width, ops, bf)
        self.position_bias = param((ratio, width), torch.float32, alloc.device)
        self.kv_norm = Norm(dim, config.rms_norm_eps, alloc)

    @property
    def row_dim(self) -> int:
        """Values per token in the state ring: projected kv and gate logits (+ position bias)."""
        return 2 * self.kv_proj.weight.shape[0]

    def rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T, row_dim] float32: [kv | gate + position_bias[p % ratio]] of every token."""
        kv = self.kv_proj(x)
        score = self.gate_proj(x).float() + self.position_bias[positions % self.ratio]
        return torch.cat([kv.float(), score], dim=-1)

    def entries(self, rows: torch.Tensor, state: torch.Tensor, windows: torch.Tensor, positions: torch.Tensor,
                table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Entries [N, dim] in ``dtype`` rotated at ``positions`` [N], pooled from the windows
        ``windows`` [N, S] (S = ratio, or 2 * ratio oldest first when overlapping; -1: an empty
        slot) name in the concatenation of ``rows`` [T, row_dim] and ``state`` [S', row_dim]
        (``ops.compress_entries``: gathered, pooled, normalised and rotated in one op)."""
        return self.ops.compress_entries(rows, state, windows, positions, self.kv_norm.weight, self.kv_norm.eps, table,
                                         self.overlap, dtype)


class Indexer(Compressor):
    """The lightning indexer of a CSA layer (§3.6): its own overlapping compressor of
    ``index_head_dim`` keys, and per-query scores that pick the top ``index_topk`` entries."""

    def __init__(self, config: V4ModelConfig, ops: OpTable, alloc: Alloc):
        super().__init__(config, ops, alloc, config.csa_ratio, config.index_head_dim, overlap=True)
        self.num_heads, self.head_dim, self.top_k = config.index_n_heads, config.index_head_dim, config.index_topk
        self.q_b_proj = Linear(config.q_lora_rank, self.num_heads * self.head_dim, ops, alloc)
        self.scorer = nn.Module()
        self.scorer.weights_proj = Linear(config.hidden_size, self.num_heads, ops, Alloc(alloc.dtype, alloc.device, None))

    def select(self, x, qr, plan: V4Batch, table, keys) -> torch.Tensor:
        """[T, min(index_topk, C)] rows of ``keys`` (the indexer cache viewed as rows, or a
        prefix's keys) each query attends to, -1: none; its candidates are ``plan.entry_slots``."""
        t = x.shape[0]
        q = self.q_b_proj(qr).view(t, self.num_heads, self.head_dim)
        q = apply_rope(self.ops, q, plan.positions, table)
        weights = self.scorer.weights_proj(x).float() * self.num_heads**-0.5
        # the candidates index is [T, C] int64: built per chunk of queries, at most CANDIDATE_BYTES
        step = max(1, CANDIDATE_BYTES // (8 * max(1, plan.entry_width(CSA_KV))))
        chosen = [self.ops.indexer_topk(q[lo : lo + step], weights[lo : lo + step], keys, plan.entry_slots(CSA_KV, lo, lo + step),
                                        self.top_k, self.head_dim**-0.5) for lo in range(0, t, step)]
        return torch.cat(chosen) if chosen else q.new_zeros((0, 0), dtype=torch.int64)


def new_key_rows(ops: OpTable, kv: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """This step's key rows [T, d] as the attention pool holds them beside ``cache``: themselves,
    or, for an FP8 record cache (kv_cache_dtype="fp8"), their records written by ``write_cache``
    (so a key reads the same from this step's pool as from the cache on later steps), in a
    record cache of whole pages: rows past T are padding that no index names."""
    if cache.dtype != torch.uint8:
        return kv
    records = torch.zeros(record_rows(kv.shape[0]), cache.shape[-1], dtype=torch.uint8, device=kv.device)  # whole pages
    ops.write_cache(records, kv, torch.arange(kv.shape[0], device=kv.device))
    return records


def sparse_output(attn: nn.Module, q: torch.Tensor, pool: KeyPools, index: torch.Tensor, positions: torch.Tensor,
                  inverse: torch.Tensor) -> torch.Tensor:
    """V4 / V4.1 attention's end: ``q`` [T, H, d] over the ``index`` rows of ``pool`` (with the
    sinks), the values' rotation undone at the query positions, the grouped output projections.
    ``pool``: one [N, d] tensor or a tuple of 1-3 pools (new rows, cache views) indexed as their
    concatenation, as ``ops.sparse_attention`` takes it."""
    ops = attn.ops
    out = ops.sparse_attention(q, pool, index, attn.sinks, attn.head_dim**-0.5)
    out = apply_rope(ops, out, positions, inverse)  # undo the values' rotation at the query position
    return attn.o_b_proj(grouped_o_a(ops, attn.o_a_proj, out.view(q.shape[0], attn.config.o_groups, -1)))


def add_attention_projections(attn: nn.Module, config, ops: OpTable, alloc: Alloc) -> None:
    """The query/KV projections and norms, the grouped output projection and the sinks that V4's
    and V4.1's attention share (named as the checkpoint's keys), plus num_heads / head_dim."""
    h, d, hidden = config.num_attention_heads, config.head_dim, config.hidden_size
    attn.num_heads, attn.head_dim = h, d
    attn.q_a_proj = Linear(hidden, config.q_lora_rank, ops, alloc)
    attn.q_a_norm = Norm(config.q_lora_rank, config.rms_norm_eps, alloc)
    attn.q_b_proj = Linear(config.q_lora_rank, h * d, ops, alloc)
    attn.kv_proj = Linear(hidden, d, ops, alloc)
    attn.kv_norm = Norm(d, config.rms_norm_eps, alloc)
    # grouped: each group's rows must hold whole FP8 blocks to stay FP8 (else dequantised at load)
    whole = alloc.fp8_block is None or config.o_lora_rank % alloc.fp8_block[0] == 0
    attn.o_a_proj = Linear(h * d // config.o_groups, config.o_groups * config.o_lora_rank, ops, alloc, fp8=whole)
    attn.o_b_proj = Linear(config.o_groups * config.o_lora_rank, hidden, ops, alloc)
    attn.sinks = param((h,), torch.float32, alloc.device)


class Attention(nn.Module):
    def __init__(self, config: V4ModelConfig, ops: OpTable, alloc: Alloc, layer_type: str):
        super().__init__()
        self.ops, self.config, self.layer_type = ops, config, layer_type
        d = config.head_dim
        add_attention_projections(self, config, ops, alloc)
        self.compressor = None
        if layer_type == CSA:
            self.compressor = Compressor(config, ops, alloc, config.csa_ratio, d, overlap=True)
            self.compressor.indexer = Indexer(config, ops, alloc)
        elif layer_type == HCA:
            self.compressor = Compressor(config, ops, alloc, config.hca_ratio, d, overlap=False)

    def _project(self, x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor):
        """(q_a's normed rows qr, the rotated queries [T, H, d], the rotated KV rows [T, d])."""
        ops, c = self.ops, self.config
        t = x.shape[0]
        qr = ops.rms_norm_f32(self.q_a_proj(x), self.q_a_norm.weight, self.q_a_norm.eps)
        q = ops.rms_normalize(self.q_b_proj(qr).view(t, self.num_heads, self.head_dim), c.rms_norm_eps)
        kv = ops.rms_norm_f32(self.kv_proj(x), self.kv_norm.weight, self.kv_norm.eps)
        r = table.shape[-1]
        q_pe, k_pe = ops.rotary_embedding(q[..., -r:], kv[:, -r:], positions, table, True)
        return qr, torch.cat([q[..., :-r], q_pe], dim=-1), torch.cat([kv[:, :-r], k_pe], dim=-1)

    def forward(self, x: torch.Tensor, plan: V4Batch, caches: dict[str, torch.Tensor], name: str, tables) -> torch.Tensor:
        ops, c = self.ops, self.config
        positions = plan.positions
        table, inverse = tables
        qr, q, kv = self._project(x, positions, table)

        window = caches[f"{name}.window"]
        ring = window.view(-1, window.shape[-1])  # the caches addressed in place, not copied
        # FP8 records in a decode-only step: this step's rows go to the ring first and the pools
        # are the caches alone (ring, compressed entries), as FlashMLA's sparse decode takes them.
        # A decode step's few rows per sequence cannot wrap the ring over a row its queries read
        # (the ring holds window + lookahead tokens and a block more); a prefill chunk's can.
        written_first = window.dtype == torch.uint8 and plan.decode_only
        if written_first:
            ops.write_cache(window, kv, plan.slots(WINDOW))
            pools = [ring]
            index = plan.window(WINDOW, c.sliding_window, in_ring=True)
        else:
            new = new_key_rows(ops, kv, window)
            pools = [new, ring]
            index = plan.window(WINDOW, c.sliding_window)
            if new.shape[0] != kv.shape[0]:  # FP8 records: the ring's rows start after pool 0's padding rows
                index = torch.where(index >= kv.shape[0], index + (new.shape[0] - kv.shape[0]), index)
        if self.compressor is not None:
            entries, chosen = self._compressed(x, qr, plan, caches, name, table)
            before = sum(p.shape[0] for p in pools)
            index = torch.cat([index, torch.where(chosen >= 0, chosen + before, chosen)], dim=1)
            pools.append(entries)
        out = sparse_output(self, q, tuple(pools), index, positions, inverse)
        if not written_first:  # after the attention: a long prefill chunk's writes wrap the ring over rows its first queries read
            ops.write_cache(window, kv, plan.slots(WINDOW))
        return out

    def forward_context_parallel(self, x: torch.Tensor, positions: torch.Tensor, cp, tables):
        """This rank's tokens of a context-parallel prefill (``parallel.context_parallel.ContextParallel``):
        the KV rows and compressor rows of the whole prefix are gathered, every compressed entry
        of the prefix is pooled (on every rank), and this rank's queries attend as the engine's
        forward would. Returns (the attention output of this rank's tokens, the prefix's entries
        by cache name: ``compressed`` and, on CSA layers, ``indexer``; none on SWA layers)."""
        c = self.config
        table, inverse = tables
        qr, q, kv = self._project(x, positions, table)
        full = cp.gather(kv)  # position p is row p
        index = PrefixPlan.window(positions, c.sliding_window)
        saved: dict[str, torch.Tensor] = {}
        if self.compressor is None:
            return sparse_output(self, q, full, index, positions, inverse), saved
        comp = self.compressor
        csa = self.layer_type == CSA
        parts = [comp] + ([comp.indexer] if csa else [])
        rows = cp.gather(torch.cat([part.rows(x, positions) for part in parts], dim=-1))
        m, span = comp.ratio, 2 * comp.ratio if comp.overlap else comp.ratio
        ends = torch.arange(cp.length // m, device=x.device) * m + m - 1  # the tokens that close a window
        rows_pos = ends[:, None] - span + 1 + torch.arange(span, device=x.device)[None, :]
        windows, offset = torch.where(rows_pos >= 0, rows_pos, torch.full_like(rows_pos, -1)), 0  # row p: position p
        for part, cache_name in zip(parts, ("compressed", "indexer")):
            part_rows = rows[:, offset:offset + part.row_dim]
            saved[cache_name] = part.entries(part_rows, part_rows[:0], windows, ends - (m - 1), table, x.dtype)
            offset += part.row_dim
        plan = PrefixPlan(positions, {CSA_KV: m, HCA_KV: m}, cp.length)
        chosen = comp.indexer.select(x, qr, plan, table, saved["indexer"]) if csa else plan.visible(HCA_KV)
        index = torch.cat([index, torch.where(chosen >= 0, chosen + full.shape[0], chosen)], dim=1)
        return sparse_output(self, q, torch.cat([full, saved["compressed"]]), index, positions, inverse), saved

    def _compressed(self, x, qr, plan: V4Batch, caches, name: str, table) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's compressed entries; return (the compressed cache viewed as rows
        [slots, d], the rows of it each query attends to [T, K] (-1: none))."""
        comp = self.compressor
        csa = self.layer_type == CSA
        kv_group, state_group = (CSA_KV, CSA_STATE) if csa else (HCA_KV, HCA_STATE)
        parts = [comp] + ([comp.indexer] if csa else [])
        rows = torch.cat([p.rows(x, plan.positions) for p in parts], dim=-1)
        state = caches[f"{name}.compressor_state"]
        span = 2 * comp.ratio if comp.overlap else comp.ratio
        em = plan.emitters(kv_group, state_group, span)
        if em.tokens.numel():
            ring = state.view(-1, state.shape[-1])  # read in place, before this step's writes
            offset = 0
            for part, cache_name in zip(parts, ("compressed", "indexer")):
                cols = slice(offset, offset + part.row_dim)  # this part's columns of the rows and the ring
                offset += part.row_dim
                entries = part.entries(rows[:, cols], ring[:, cols], em.rows, em.entry_positions, table, x.dtype)
                self.ops.write_cache(caches[f"{name}.{cache_name}"], entries, em.slots)
        self.ops.write_cache(state, rows, plan.slots(state_group))
        compressed = caches[f"{name}.compressed"]
        entries = compressed.view(-1, compressed.shape[-1])  # indexed by flat cache slot (entry_slots)
        if not csa:
            return entries, plan.entry_slots(kv_group)
        keys = caches[f"{name}.indexer"]
        return entries, comp.indexer.select(x, qr, plan, table, keys.view(-1, keys.shape[-1]))


class PrefixPlan:
    """What the indexers read of a plan (``positions``, ``visible``), for this rank's queries of
    a context-parallel prefix of ``length`` tokens: query p sees the entries w < (p + 1) // m of
    a paged group with ``ratios[group]`` = m tokens an entry, all of the prefix's entries."""

    def __init__(self, positions: torch.Tensor, ratios: dict[str, int], length: int):
        self.positions, self.ratios, self.length = positions, ratios, length

    @staticmethod
    def window(positions: torch.Tensor, window: int) -> torch.Tensor:
        """[T, window] rows of a gathered prefix (row p: position p) each query's sliding window
        reads, newest first as ``V4Batch.window`` orders them (-1 before position 0)."""
        keys = positions[:, None] - torch.arange(window, device=positions.device)[None, :]
        return torch.where(keys >= 0, keys, torch.full_like(keys, -1))

    def visible(self, group: str, lo: int = 0, hi: int | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        m = self.ratios[group]
        pos = self.positions[lo:hi] if rows is None else self.positions[rows]
        w = torch.arange(self.length // m, device=pos.device)[None, :]
        return torch.where(w < ((pos + 1) // m)[:, None], w, torch.full_like(w, -1))

    def entry_slots(self, group: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """As ``visible``: the prefix's entries are rows of the prefix's own tensors."""
        return self.visible(group, lo, hi)

    def entry_width(self, group: str) -> int:
        return self.length // self.ratios[group]


class ClampedMLP(MLP):
    """The shared expert: SwiGLU with DeepSeek-V4's clamp (``swiglu_limit``; transformers clamps it)."""

    def __init__(self, hidden: int, intermediate: int, ops: OpTable, alloc: Alloc, limit: float | None):
        super().__init__(hidden, intermediate, ops, alloc)
        self.limit = limit

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(gate_up) if self.limit is None else self.ops.silu_and_mul_clamped(gate_up, self.limit)


class MoE(nn.Module):
    def __init__(self, config: V4ModelConfig, ops: OpTable, alloc: Alloc, hashed: bool):
        super().__init__()
        self.ops, self.config = ops, config
        self.gate = nn.Module()
        self.gate.weight = param((config.n_routed_experts, config.hidden_size), alloc.dtype, alloc.device)
        if hashed:  # token id -> its k experts
            self.gate.tid2eid = param((config.vocab_size, config.num_experts_per_tok), torch.int64, alloc.device)
        else:
            self.gate.e_score_correction_bias = param((config.n_routed_experts,), torch.float32, alloc.device)
        self.hashed = hashed
        # routed experts: kept packed MXFP4 where the model keeps FP4 experts, else dequantised at load
        # (FP8 experts always are)
        self.experts = Experts(config, Alloc(alloc.dtype, alloc.device, None, alloc.expert_slots, alloc.fp4_experts))
        inter = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = ClampedMLP(config.hidden_size, inter, ops, alloc, config.swiglu_limit) if inter else None
        self.ep = None  # set by parallel.expert_parallel.ExpertParallel: the routed experts run across ranks

    def experts_op(self, x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, block=None) -> torch.Tensor:
        """The routed experts (V4's clamped SwiGLU where the config has a limit) over the given
        expert weights (all of them, or one rank's slots): dequantised (no scales), or packed
        MXFP4 (uint8 weights, their UE8M0 scales, block None: moe_experts' MXFP4 convention)."""
        limit = self.config.swiglu_limit
        if limit is None:
            return self.ops.moe_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block)
        return self.ops.moe_experts_clamped(x, w13, w2, topk_weights, topk_ids, limit, w13_scale, w2_scale, block)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        c, ops = self.config, self.ops
        fixed = self.gate.tid2eid[input_ids] if self.hashed else None
        bias = None if self.hashed else self.gate.e_score_correction_bias
        weights, ids = ops.moe_route_sqrtsoftplus(
            x, self.gate.weight, bias, fixed, top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor,
        )
        ex = self.experts
        shared = self.shared_experts
        if self.ep is not None:  # the shared expert computes while the routed rows travel to their ranks
            out, shared_out = self.ep(x, weights, ids, None if shared is None else lambda: shared(x))
        else:
            out = self.experts_op(x, ex.gate_up_proj, ex.down_proj, weights, ids, ex.gate_up_proj_scale_inv, ex.down_proj_scale_inv)
            shared_out = None if shared is None else shared(x)
        return out if shared_out is None else out + shared_out


class DecoderLayer(nn.Module):
    def __init__(self, config: V4ModelConfig, ops: OpTable, alloc: Alloc, layer_type: str, hashed: bool):
        super().__init__()
        self.ops, self.config = ops, config
        self.self_attn = Attention(config, ops, alloc, layer_type)
        self.mlp = MoE(config, ops, alloc, hashed)
        self.input_layernorm = Norm(config.hidden_size, config.rms_norm_eps, alloc)
        self.post_attention_layernorm = Norm(config.hidden_size, config.rms_norm_eps, alloc)
        self.attn_hc = HyperConnection(config, alloc)
        self.ffn_hc = HyperConnection(config, alloc)

    def _pre(self, hc: HyperConnection, x: torch.Tensor):
        c = self.config
        return self.ops.mhc_pre(x, hc.fn, hc.base, hc.scale, hc_eps=c.hc_eps, rms_eps=c.rms_norm_eps, sinkhorn_iters=c.hc_sinkhorn_iters)

    def forward(self, x, input_ids, plan: V4Batch, caches, name: str, tables, attend=None) -> torch.Tensor:
        """x: [T, hc, D] streams -> the streams after attention and MoE. ``attend``: what runs
        the attention instead of ``self_attn(y, plan, caches, name, tables)`` (a context-parallel
        prefill)."""
        ops = self.ops
        post, comb, y = self._pre(self.attn_hc, x)
        y = ops.rms_norm_f32(y, self.input_layernorm.weight, self.input_layernorm.eps)
        a = self.self_attn(y, plan, caches, name, tables) if attend is None else attend(y)
        x = ops.mhc_post(a, x, post, comb)
        post, comb, y = self._pre(self.ffn_hc, x)
        y = ops.rms_norm_f32(y, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        return ops.mhc_post(self.mlp(y, input_ids), x, post, comb)


class MTPBlock(DecoderLayer):
    """The V4 MTP block (§3.8): a sliding-window, non-hash decoder layer fed with
    e_proj(enorm(embed(t_{p+1}))) + h_proj(hnorm(streams)), with its own head collapse and norm."""

    def __init__(self, config: V4ModelConfig, ops: OpTable, alloc: Alloc):
        super().__init__(config, ops, alloc, SWA, hashed=False)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = Norm(d, eps, alloc)
        self.hnorm = Norm(d, eps, alloc)
        self.e_proj = Linear(d, d, ops, alloc)
        self.h_proj = Linear(d, d, ops, alloc)
        self.norm = Norm(d, eps, alloc)
        self.hc_head = HyperHead(config, alloc)


class DeepseekV4Backbone(nn.Module):
    def __init__(self, config: V4ModelConfig, ops: OpTable, alloc: Alloc):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = param((config.vocab_size, config.hidden_size), alloc.dtype, alloc.device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, ops, alloc, t, hashed=i < config.num_hash_layers) for i, t in enumerate(config.layer_types)
        )
        self.norm = Norm(config.hidden_size, config.rms_norm_eps, alloc)
        self.hc_head = HyperHead(config, alloc)


class V4FamilyLM(nn.Module):
    """What the DeepSeek-V4 and V4.1 causal LMs share: FP8 allocation, the LM head, the draft
    layers under ``mtp.layers``, the per-forward V4Batch, and post-load fusing. Subclasses build
    ``self.model`` (embed_tokens, layers, norm), then call ``_add_head`` and set ``self.mtp``.
    Decode steps are captured as graphs where the subclass says so (V4; not V4.1 yet: its index
    tensors' sizes still depend on each batch's context lengths)."""

    supports_graphs = False
    graphs_by_context = True  # decode-only forwards score every entry the block tables could name
    supports_batch_invariance = False  # prompt and decode tokens read their attention context along different paths
    mtp_reads_streams = True  # the draft layers read the last layer's hyper-connection streams (forward_streams)
    supports_fp8_kv_cache = False  # V4 overrides; V4.1's caches have no FP8 record format here yet
    lookback_tokens = 0  # a forward reads no token before a sequence's new ones (V4.1's Engram does)

    def __init__(self, config, ops: OpTable, dtype: torch.dtype, device: torch.device, keep_fp8: bool,
                 expert_slots: tuple[int, ...] | None = None, keep_fp4: bool = False, fp8_kv_cache: bool = False):
        super().__init__()
        if fp8_kv_cache and not self.supports_fp8_kv_cache:
            raise ValueError(f"{type(self).__name__} keeps no FP8 KV cache (supports_fp8_kv_cache is False): build it "
                             "without fp8_kv_cache (kv_cache_dtype='auto')")
        if fp8_kv_cache and (config.head_dim, config.qk_rope_head_dim) != (ROW_DIM, ROW_DIM - NOPE_DIM):
            raise ValueError(f"the FP8 KV cache (kv_cache_dtype='fp8') holds DeepSeek-V4's {ROW_DIM}-wide key rows with "
                             f"{ROW_DIM - NOPE_DIM} RoPE dims; this config has head_dim {config.head_dim}, qk_rope_head_dim "
                             f"{config.qk_rope_head_dim}: run it with kv_cache_dtype='auto'")
        # window and compressed KV caches as V4 FP8 records (kv_cache_dtype="fp8", ops/kv_record.py)
        self.fp8_kv_cache = fp8_kv_cache
        self.config, self.ops, self.dtype = config, ops, dtype
        self.device = torch.device(device)
        self.keep_fp8 = keep_fp8 and config.fp8_block is not None
        # routed experts kept packed MXFP4 (what the checkpoint stores) where it has them (expert_dtype fp4)
        self.keep_fp4 = keep_fp4 and getattr(config, "expert_dtype", None) == "fp4"
        self.expert_slots = expert_slots  # expert parallelism: see deepseek_v3.Alloc
        self._all_groups: dict[str, CacheGroup] | None = None

    def _alloc(self) -> Alloc:
        """Where and in which dtypes the layers' parameters go (block FP8 kept when keep_fp8, MXFP4
        routed experts when keep_fp4)."""
        return Alloc(self.dtype, self.device, tuple(self.config.fp8_block) if self.keep_fp8 else None, self.expert_slots,
                     self.keep_fp4)

    def _add_head(self) -> None:
        c = self.config
        self.lm_head = Linear(c.hidden_size, c.vocab_size, self.ops, Alloc(self.dtype, self.device, None))
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp.layers)

    def set_tokenizer(self, tokenizer) -> None:
        """Nothing to read from it (V4.1 overrides: its Engram hashes read the tokenizer)."""

    def drop_mtp_layers(self) -> None:
        self.mtp.layers = nn.ModuleList()
        self._all_groups = None

    @torch.no_grad()
    def post_load(self) -> None:
        for module in self.modules():
            if isinstance(module, MLP):
                module.fuse()

    def _refuse_context_parallel_fp8(self) -> None:
        if getattr(self, "fp8_kv_cache", False):
            raise ValueError("context parallelism does not run with the FP8 KV cache (its prefill attends over unquantised "
                             "rows): run with context_parallel_size=1 or kv_cache_dtype='auto'")

    def _plan(self, positions: torch.Tensor, batch: BatchMeta, kv_caches: dict[str, torch.Tensor]) -> V4Batch:
        if self._all_groups is None:  # every group, the draft layers' windows included (what any forward may address)
            self._all_groups = {g.name: g for g in self.cache_groups(with_mtp=True)}
        return plan_for(self._all_groups, positions, batch, kv_caches)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def write_context(self, kv_caches: dict[str, torch.Tensor], entries: dict[str, torch.Tensor], blocks: dict[str, list[int]],
                      block_size: int) -> None:
        """Store ``prefill_context_parallel``'s entries of a prefix into the paged cache blocks
        ``blocks`` (per group; the prefix fills them exactly)."""
        self._refuse_context_parallel_fp8()
        groups = {layer: g for g in self.cache_groups() if g.kind == "paged" for layer in g.layers}
        for name, rows in entries.items():
            g = groups[name]
            per = block_size // g.tokens_per_entry
            table = torch.tensor(blocks[g.name], dtype=torch.int64, device=self.device)
            slots = (table[:, None] * per + torch.arange(per, device=self.device)).flatten()
            self.ops.write_cache(kv_caches[name], rows, slots[: rows.shape[0]])


class DeepseekV4ForCausalLM(V4FamilyLM):
    """DeepSeek-V4 causal LM over the cache groups of ``cache_groups`` (``forward`` has the same
    batch contract as DeepseekV3ForCausalLM's)."""

    # decode-only forwards index the caches in place with widths from shapes alone (V4Batch.decode_only,
    # entry_slots): no host synchronisation, one graph per batch size
    supports_graphs = True
    supports_context_parallel = True  # prefill_context_parallel / write_context (not with the FP8 KV cache)
    supports_fp8_kv_cache = True  # window / csa_kv / hca_kv as FP8 records (the indexer keys and states stay)
    draft_method = "mtp"
    checkpoint_format = V4Checkpoint()  # how its checkpoints name their tensors (loader.load_model)

    def __init__(self, config: V4ModelConfig, ops: OpTable, dtype: torch.dtype, device: torch.device, keep_fp8: bool = False,
                 expert_slots: tuple[int, ...] | None = None, keep_fp4: bool = False, fp8_kv_cache: bool = False):
        super().__init__(config, ops, dtype, device, keep_fp8, expert_slots, keep_fp4, fp8_kv_cache)
        alloc = self._alloc()
        self.model = DeepseekV4Backbone(config, ops, alloc)
        self._add_head()
        self.mtp = nn.Module()
        whole = alloc.every_expert()  # the MTP block keeps every expert: it drafts on each rank alone
        self.mtp.layers = nn.ModuleList(MTPBlock(config, ops, whole) for _ in range(min(1, config.num_nextn_predict_layers)))
        # transformers rounds cos/sin to the model dtype before rotating
        self.tables = rope_tables(config.qk_rope_head_dim, config.rope_theta, config.compress_rope_theta,
                                  config.compress_rope_parameters, config.max_position_embeddings, self.device, dtype)

    # ---- layout ---------------------------------------------------------------------------------
    @property
    def default_block_size(self) -> int:
        """A multiple of 16 and of every compression rate (paged entries never straddle blocks)."""
        return math.lcm(16, self.config.csa_ratio, self.config.hca_ratio)

    def replay_tokens(self, with_mtp: bool = False) -> int:
        """Tokens recomputed before the first uncached one after a prefix hit so that every ring
        is exact again: each layer's window depends on the previous layer's over another
        ``sliding_window - 1`` tokens, and the last CSA layer's compressor pools the ``csa_ratio``
        rows before the hit (the MTP block, when it runs, is one more window)."""
        c = self.config
        layers = len(self.model.layers) + (self.num_mtp_layers if with_mtp else 0)
        last = (c.sliding_window - 1, c.csa_ratio if CSA in c.layer_types else 0)
        return (layers - 1) * (c.sliding_window - 1) + max(last)

    def cache_groups(self, with_mtp: bool = False) -> list[CacheGroup]:
        c, dt = self.config, self.dtype
        # the attention keys (window rows, compressed entries): FP8 records of RECORD_BYTES, or rows in the model dtype
        kv_dim, kv_dt = (RECORD_BYTES, torch.uint8) if self.fp8_kv_cache else (c.head_dim, dt)
        pages = PAGE_ROWS if self.fp8_kv_cache else 1  # record caches come in pages of PAGE_ROWS rows
        names = [f"model.layers.{i}.self_attn" for i in range(len(self.model.layers))]
        if with_mtp:
            names += [f"mtp.layers.{i}.self_attn" for i in range(self.num_mtp_layers)]
        kinds = list(c.layer_types) + [SWA] * (len(names) - len(c.layer_types))
        csa = [n for n, k in zip(names, kinds) if k == CSA]
        hca = [n for n, k in zip(names, kinds) if k == HCA]
        replay = self.replay_tokens(with_mtp)
        groups = [CacheGroup(WINDOW, "ring", tuple(f"{n}.window" for n in names), kv_dim, kv_dt, window=c.sliding_window,
                             replay_tokens=replay, ring_block=min(RING_BLOCK, c.sliding_window), row_multiple=pages)]
        if csa:
            comp = self.get_submodule(csa[0]).compressor  # every CSA layer has the same row widths
            row = comp.row_dim + comp.indexer.row_dim
            groups += [
                CacheGroup(CSA_KV, "paged", tuple(f"{n}.compressed" for n in csa), kv_dim, kv_dt, tokens_per_entry=c.csa_ratio,
                           row_multiple=pages),
                CacheGroup(CSA_INDEX, "paged", tuple(f"{n}.indexer" for n in csa), c.index_head_dim, dt, tokens_per_entry=c.csa_ratio),
                CacheGroup(CSA_STATE, "ring", tuple(f"{n}.compressor_state" for n in csa), row, torch.float32,
                           window=2 * c.csa_ratio, replay_tokens=replay, ring_block=c.csa_ratio),
            ]
        if hca:
            groups += [
                CacheGroup(HCA_KV, "paged", tuple(f"{n}.compressed" for n in hca), kv_dim, kv_dt, tokens_per_entry=c.hca_ratio,
                           row_multiple=pages),
                CacheGroup(HCA_STATE, "ring", tuple(f"{n}.compressor_state" for n in hca), 2 * c.head_dim, torch.float32,
                           window=c.hca_ratio, replay_tokens=replay, ring_block=min(RING_BLOCK, c.hca_ratio)),
            ]
        return groups

    # ---- forward --------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens.weight[input_ids]

    def _layer_tables(self, layer_type: str):
        return self.tables["main" if layer_type == SWA else "compress"]

    @torch.no_grad()
    def forward_streams(self, input_ids, positions, batch: BatchMeta, kv_caches: dict[str, torch.Tensor]) -> torch.Tensor:
        """The residual streams after the last layer, [T, hc, D] (the MTP block's input)."""
        plan = self._plan(positions, batch, kv_caches)
        e = self.embed(input_ids)
        x = e[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.model.layers):
            x = layer(x, input_ids, plan, kv_caches, f"model.layers.{i}.self_attn", self._layer_tables(self.config.layer_types[i]))
        return x

    @torch.no_grad()
    def prefill_context_parallel(self, input_ids: torch.Tensor, positions: torch.Tensor, cp) -> dict[str, torch.Tensor]:
        """This rank's tokens (``input_ids`` at ``positions``, ``cp.positions()``) of a prompt prefix
        prefilled across a CP group; every rank of the group calls it. Returns the compressed
        and indexer entries of the whole prefix, by cache tensor name: what ``write_context``
        stores (the window and compressor rings are rebuilt by the owner's bounded replay)."""
        self._refuse_context_parallel_fp8()
        e = self.embed(input_ids)
        x = e[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()
        entries: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            name, tables = f"model.layers.{i}.self_attn", self._layer_tables(self.config.layer_types[i])

            def attend(y, layer=layer, name=name, tables=tables):
                out, saved = layer.self_attn.forward_context_parallel(y, positions, cp, tables)
                entries.update({f"{name}.{k}": v for k, v in saved.items()})
                return out

            x = layer(x, input_ids, None, None, name, tables, attend)
        return entries

    def head_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """Final collapse and norm: [T, hc, D] -> [T, D]."""
        x = self.model.hc_head(self.ops, self.config, streams)
        return self.ops.rms_norm_f32(x, self.model.norm.weight, self.model.norm.eps)

    @torch.no_grad()
    def forward(self, input_ids, positions, batch: BatchMeta, kv_caches: dict[str, torch.Tensor]) -> torch.Tensor:
        """input_ids, positions: [T] int64 packed as BatchMeta describes; kv_caches: the tensor of
        every layer of cache_groups(), by layer name. Returns the hidden states after the final
        collapse and norm, [T, D]."""
        return self.head_hidden(self.forward_streams(input_ids, positions, batch, kv_caches))

    @torch.no_grad()
    def forward_mtp(self, depth, input_ids, positions, prev_streams, batch: BatchMeta, kv_caches) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP block (reused for every depth): input_ids are the tokens shifted by one
        (position p carries t_{p+1}), prev_streams the previous stage's streams [T, hc, D]
        (depth 0: forward_streams()). Uses kv_caches["mtp.layers.0.self_attn.window"]
        (cache_groups(with_mtp=True)). Returns (hidden after the block's head collapse and norm
        [T, D], its streams for the next depth)."""
        if not self.num_mtp_layers:
            raise ValueError("MTP requested but the model has no MTP block loaded")
        block: MTPBlock = self.mtp.layers[0]
        ops = self.ops
        e = ops.rms_norm_f32(self.embed(input_ids), block.enorm.weight, block.enorm.eps)
        h = ops.rms_norm_f32(prev_streams, block.hnorm.weight, block.hnorm.eps)
        x = block.e_proj(e)[:, None, :] + block.h_proj(h)
        x = block(x, input_ids, self._plan(positions, batch, kv_caches), kv_caches, "mtp.layers.0.self_attn", self.tables["main"])
        hidden = ops.rms_norm_f32(block.hc_head(ops, self.config, x), block.norm.weight, block.norm.eps)
        return hidden, x
