"""DeepSeek-V4.1-Flash, written on the OpTable (deepseek_architectures.md §4).

Deltas from V4 (models/v4/model.py, whose attention-with-sinks, MoE and mHC pieces are reused):
no per-head query norm; delayed mHC (each sublayer collapses its input with the previous
sublayer's ``pre``; layer 0 takes the embedding copy; the final collapse uses the last FFN
sublayer's ``pre``, no learned head); KV sharing (``config_v41``'s topology): only KV sources own
a compressor (ratio 2: non-overlapping pairs, no position bias; ratio 1: every token is an entry)
and index keys (``k_norm(wk(latent))``); index sources score their owner's keys, those after the
candidate source only inside the candidate blocks it keeps; other layers reuse the latest
selection of the same forward; Engram n-gram memory (models/engram.py) in ``engram_layer_ids``.

Caches (``cache_groups``): every layer's window keys in the ring group "window"; each KV source's
compressed entries and index keys in paged groups ``c{r}_kv`` / ``c{r}_index`` (r = its ratio);
ratio-2 sources' projected rows of the open pair in the ring ``c2_state`` (float32). Consumer
layers own nothing but their window.

SWA bounded replay (§4.4, on unless DEEPINFER_SWA_BOUNDED_REPLAY=0): in a prefill the layers from
the last KV source on run only on each sequence's newest ``sliding_window`` tokens
(the last KV source still writes its caches for every token), and after a prefix-cache hit only
the hit's last ``sliding_window`` tokens are recomputed. Both approximate: off, the model is exact
(prefix hits then replay ``layers * (sliding_window - 1)`` tokens).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.config import settings
from deepinfer_core.models.batch import BatchMeta, CacheGroup
from deepinfer_core.models.layers import Alloc, Linear, param
from deepinfer_core.models.v4.batch import V4Batch
from deepinfer_core.models.v4.model import (CANDIDATE_BYTES, RING_BLOCK, HyperConnection, MoE, Norm, PrefixPlan, V4FamilyLM, add_attention_projections, apply_rope, rope_tables, sparse_output)
from deepinfer_core.models.v41 import dspark
from deepinfer_core.models.v41.checkpoint import V41Checkpoint
from deepinfer_core.models.v41.config import FULL, REINDEX, REUSE, WINDOW, V41ModelConfig
from deepinfer_core.models.v41.engram import Engram, ngram_ids
from deepinfer_core.ops import OpTable

WINDOW_GROUP = "window"


def kv_group(ratio: int) -> str:
    return f"c{ratio}_kv"


def index_group(ratio: int) -> str:
    return f"c{ratio}_index"


def state_group(ratio: int) -> str:
    return f"c{ratio}_state"


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn"


class Compressor(nn.Module):
    """A KV source's compressor (§4.3): entry j pools the projected rows of tokens
    [j r, (j + 1) r) with a per-channel softmax over gates (ratio 1: the token's row itself),
    normalised; the attention entry is it rotated at j r, the index key k_norm(wk(it)) rotated."""

    def __init__(self, config: V41ModelConfig, ops: OpTable, alloc: Alloc, ratio: int):
        super().__init__()
        self.ops, self.ratio = ops, ratio
        d, hd = config.hidden_size, config.head_dim
        bf = Alloc(alloc.dtype, alloc.device, None)  # bf16 in DeepSeek's checkpoints
        self.kv_proj = Linear(d, hd, ops, bf)
        self.gate_proj = Linear(d, hd, ops, bf) if ratio > 1 else None
        self.kv_norm = Norm(hd, config.rms_norm_eps, alloc)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2 head_dim] float32 [kv | gate] of every token (the state ring's rows)."""
        return torch.cat([self.kv_proj(x).float(), self.gate_proj(x).float()], dim=-1)

    def latents(self, kv: torch.Tensor, score: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """kv, score [N, S, head_dim] float32 (-inf scores: empty slots) -> normalised latents [N, head_dim]."""
        return self.ops.compress_pool(kv, score, self.kv_norm.weight, self.kv_norm.eps).to(dtype)


class Indexer(nn.Module):
    """An index source's queries and weights; a KV source's also makes the index keys."""

    def __init__(self, config: V41ModelConfig, ops: OpTable, alloc: Alloc, owner: bool):
        super().__init__()
        self.ops = ops
        self.num_heads, self.head_dim, self.top_k = config.index_n_heads, config.index_head_dim, config.index_topk
        bf = Alloc(alloc.dtype, alloc.device, None)
        self.q_b_proj = Linear(config.q_lora_rank, self.num_heads * self.head_dim, ops, alloc)
        self.weights_proj = Linear(config.hidden_size, self.num_heads, ops, bf)
        if owner:
            self.k_proj = Linear(config.head_dim, self.head_dim, ops, bf)
            self.k_norm = Norm(self.head_dim, config.rms_norm_eps, alloc)

    def keys(self, latents: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        k = self.ops.rms_norm_f32(self.k_proj(latents), self.k_norm.weight, self.k_norm.eps)
        return apply_rope(self.ops, k[:, None], positions, table)[:, 0]

    def queries(self, x, qr, positions, table) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, Hi, Di] rotated, weights [T, Hi] float32 with the head-count scale)."""
        q = self.q_b_proj(qr).view(x.shape[0], self.num_heads, self.head_dim)
        return apply_rope(self.ops, q, positions, table), self.weights_proj(x).float() * self.num_heads**-0.5


class ForwardState:
    """What one forward's layers share: each KV owner's gathered entries and index keys, the
    latest index source's selection, the candidate source's kept blocks."""

    def __init__(self):
        self.owned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.selection: torch.Tensor | None = None
        self.blocks: torch.Tensor | None = None  # [Tq, blocks] bool


class Attention(nn.Module):
    def __init__(self, config: V41ModelConfig, ops: OpTable, alloc: Alloc, layer: int | None):
        super().__init__()
        self.ops, self.config, self.layer = ops, config, layer
        self.mode = WINDOW if layer is None else config.mode(layer)
        self.ratio = 0 if layer is None else config.compress_ratios[layer]
        add_attention_projections(self, config, ops, alloc)
        self.compressor = Compressor(config, ops, alloc, self.ratio) if self.mode == FULL else None
        self.indexer = Indexer(config, ops, alloc, owner=self.mode == FULL) if self.mode in (FULL, REINDEX) else None

    def forward(self, x, plan: V4Batch, caches, name: str, tables, state: ForwardState, q_rows: torch.Tensor | None = None,
                window_index: torch.Tensor | None = None):
        """x: [T, D] normed block inputs of ``plan``'s rows; keys (window, compressed entries) are
        written for all of them, queries are ``q_rows`` (None: all). ``window_index``: the pool
        rows each query reads instead of its sliding window, nothing written (DSpark blocks).
        Returns [Tq, D]."""
        ops, c = self.ops, self.config
        table, inverse = tables
        kv = ops.rms_norm_f32(self.kv_proj(x), self.kv_norm.weight, self.kv_norm.eps)
        kv = apply_rope(ops, kv[:, None], plan.positions, table)[:, 0]
        window = caches[f"{name}.window"]
        pool = torch.cat([kv, window.view(-1, self.head_dim).to(kv.dtype)])  # read before this step's writes
        if window_index is None:
            ops.write_cache(window, kv, plan.slots(WINDOW_GROUP))

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t if q_rows is None else t[q_rows]

        xq, positions = rows(x), rows(plan.positions)
        qr = ops.rms_norm_f32(self.q_a_proj(xq), self.q_a_norm.weight, self.q_a_norm.eps)
        q = apply_rope(ops, self.q_b_proj(qr).view(xq.shape[0], self.num_heads, self.head_dim), positions, table)
        index = rows(plan.window(WINDOW_GROUP, c.sliding_window)) if window_index is None else window_index
        if self.mode != WINDOW:
            if self.mode == FULL:
                self._compress(x, plan, caches, name, table)
            entries, chosen = self._select(xq, qr, positions, plan, caches, table, state, q_rows)
            index = torch.cat([index, torch.where(chosen >= 0, chosen + pool.shape[0], chosen)], dim=1)
            pool = torch.cat([pool, entries])
        return sparse_output(self, q, pool, index, positions, inverse)

    def forward_context_parallel(self, x: torch.Tensor, positions: torch.Tensor, cp, tables, state: ForwardState):
        """This rank's tokens of a context-parallel prefill (``parallel.context_parallel.ContextParallel``):
        the prefix's window keys (and, in a KV source, its compressor rows) are gathered; a KV
        source pools every entry and index key of the prefix (on every rank) and leaves them in
        ``state`` for the layers that read them; the queries then select and attend as the
        engine's forward would. Returns (the attention output of this rank's tokens, a KV
        source's entries by cache name: ``compressed``, ``indexer``)."""
        ops, c = self.ops, self.config
        table, inverse = tables
        kv = ops.rms_norm_f32(self.kv_proj(x), self.kv_norm.weight, self.kv_norm.eps)
        full = cp.gather(apply_rope(ops, kv[:, None], positions, table)[:, 0])  # position p is row p
        qr = ops.rms_norm_f32(self.q_a_proj(x), self.q_a_norm.weight, self.q_a_norm.eps)
        q = apply_rope(ops, self.q_b_proj(qr).view(x.shape[0], self.num_heads, self.head_dim), positions, table)
        index, pool, saved = PrefixPlan.window(positions, c.sliding_window), full, {}
        if self.mode != WINDOW:
            if self.mode == FULL:
                saved = self._compress_prefix(x, positions, cp, table)
                state.owned[self.layer] = (saved["compressed"], saved["indexer"])
            ratios = {kv_group(r): r for r in set(c.compress_ratios) if r}
            entries, chosen = self._select(x, qr, positions, PrefixPlan(positions, ratios, cp.length), None, table, state, None)
            index = torch.cat([index, torch.where(chosen >= 0, chosen + pool.shape[0], chosen)], dim=1)
            pool = torch.cat([pool, entries])
        return sparse_output(self, q, pool, index, positions, inverse), saved

    def _compress_prefix(self, x, positions, cp, table) -> dict[str, torch.Tensor]:
        """Every entry (rotated latent) and index key of a context-parallel prefix, from the
        gathered compressor rows: entry j pools tokens [j r, (j + 1) r)."""
        comp, r, hd = self.compressor, self.ratio, self.head_dim
        n = cp.length // r
        if r > 1:
            window = cp.gather(comp.rows(x))[: n * r].view(n, r, 2 * hd)  # oldest first, as the emitters read them
            kv, score = window[..., :hd], window[..., hd:]
        else:
            kv = cp.gather(comp.kv_proj(x).float())[:, None]
            score = torch.zeros_like(kv)
        entry_pos = torch.arange(n, device=x.device) * r
        latents = comp.latents(kv, score, x.dtype)
        return {"compressed": apply_rope(self.ops, latents[:, None], entry_pos, table)[:, 0],
                "indexer": self.indexer.keys(latents, entry_pos, table)}

    def _compress(self, x, plan: V4Batch, caches, name: str, table) -> None:
        """Write the entries (attention latents rotated, index keys) this step completes."""
        comp, r, hd = self.compressor, self.ratio, self.head_dim
        if r > 1:
            rows = comp.rows(x)
            ring = caches[f"{name}.compressor_state"]
            ring_pool = torch.cat([rows, ring.view(-1, ring.shape[-1])])
            self.ops.write_cache(ring, rows, plan.slots(state_group(r)))
            em = plan.emitters(kv_group(r), state_group(r), r)
            if not em.tokens.numel():
                return
            window = ring_pool[em.rows.clamp(min=0)]  # [N, r, 2 hd], oldest first
            valid = (em.rows >= 0)[:, :, None]
            kv = window[..., :hd].masked_fill(~valid, 0.0)
            score = window[..., hd:].masked_fill(~valid, float("-inf"))
            tokens, slots, entry_pos = em.tokens, em.slots, em.entry_positions
        else:
            all_slots = plan.slots(kv_group(r))
            tokens = torch.nonzero(all_slots >= 0).flatten()
            if not tokens.numel():
                return
            kv = comp.kv_proj(x[tokens]).float()[:, None]
            score = torch.zeros_like(kv)
            slots, entry_pos = all_slots[tokens], plan.positions[tokens]
        latents = comp.latents(kv, score, x.dtype)
        entries = apply_rope(self.ops, latents[:, None], entry_pos, table)[:, 0]
        self.ops.write_cache(caches[f"{name}.compressed"], entries, slots)
        self.ops.write_cache(caches[f"{name}.indexer"], self.indexer.keys(latents, entry_pos, table), slots)

    def _select(self, xq, qr, positions, plan: V4Batch, caches, table, state: ForwardState, q_rows):
        """(the KV owner's entries [N, d], the rows of them each query attends to [Tq, K])."""
        c, r = self.config, self.ratio
        owner = c.kv_owner(self.layer)
        if owner not in state.owned:
            slots = plan.entries(kv_group(r))
            gather = self.ops.gather_latent_cache
            state.owned[owner] = (gather(caches[f"{layer_name(owner)}.compressed"], slots).to(xq.dtype),
                                  gather(caches[f"{layer_name(owner)}.indexer"], slots).to(xq.dtype))
        entries, keys = state.owned[owner]
        if self.mode == REUSE:
            return entries, state.selection
        q, weights = self.indexer.queries(xq, qr, positions, table)
        scale = self.indexer.head_dim**-0.5
        candidate_source = self.layer == c.candidate_source_layer_id
        filtered = c.filters_candidates(self.layer) and state.blocks is not None
        t = xq.shape[0]
        step = max(1, CANDIDATE_BYTES // (8 * max(1, keys.shape[0])))  # the [t, C] int64 candidate index
        chosen, blocks = [], []
        for lo in range(0, t, step):
            hi = min(lo + step, t)
            # each chunk's [t, C] index is built when needed, never the whole batch's
            cand = plan.visible(kv_group(r), lo, hi) if q_rows is None else plan.visible(kv_group(r), rows=q_rows[lo:hi])
            if candidate_source:
                blocks.append(self.ops.indexer_block_candidates(q[lo:hi], weights[lo:hi], keys, cand, scale,
                                                                c.candidate_block_size, c.candidate_topk_blocks))
            if filtered:
                keep = state.blocks[lo:hi].repeat_interleave(c.candidate_block_size, dim=1)[:, : cand.shape[1]]
                cand = torch.where(keep, cand, torch.full_like(cand, -1))
            chosen.append(self.ops.indexer_topk(q[lo:hi], weights[lo:hi], keys, cand, self.indexer.top_k, scale))
        if candidate_source:
            state.blocks = torch.cat(blocks) if blocks else torch.zeros((0, 0), dtype=torch.bool, device=xq.device)
        state.selection = torch.cat(chosen) if chosen else torch.zeros((0, 0), dtype=torch.int64, device=xq.device)
        return entries, state.selection


class DecoderLayer(nn.Module):
    def __init__(self, config: V41ModelConfig, ops: OpTable, alloc: Alloc, layer: int | None, moe_config=None):
        super().__init__()
        self.ops, self.config = ops, config
        self.self_attn = Attention(config, ops, alloc, layer)
        self.mlp = MoE(moe_config or config, ops, alloc, hashed=False)
        self.input_layernorm = Norm(config.hidden_size, config.rms_norm_eps, alloc)
        self.post_attention_layernorm = Norm(config.hidden_size, config.rms_norm_eps, alloc)
        self.attn_hc = HyperConnection(config, alloc)
        self.ffn_hc = HyperConnection(config, alloc)
        self.engram = Engram(config, ops, alloc, layer) if layer in config.engram_layer_ids else None

    def _mix(self, hc: HyperConnection, x, pre_in):
        c = self.config
        return self.ops.mhc_pre_delayed(x, pre_in, hc.fn, hc.base, hc.scale, hc_eps=c.hc_eps, rms_eps=c.rms_norm_eps,
                                        sinkhorn_iters=c.hc_sinkhorn_iters)

    def forward(self, x, pre_in, ngram, plan: V4Batch, caches, name: str, tables, state: ForwardState, q_rows=None,
                window_index=None, attend=None):
        """x: [T, hc, D] streams, pre_in: [T, hc] the previous sublayer's pre -> (streams, this
        layer's FFN pre) of the query rows ``q_rows`` (None: all). ``attend``: what runs the
        attention instead of ``self_attn`` (a context-parallel prefill)."""
        ops = self.ops
        if self.engram is not None:
            x = self.engram(x, ngram)
        pre, post, comb, y = self._mix(self.attn_hc, x, pre_in)
        y = ops.rms_norm_f32(y, self.input_layernorm.weight, self.input_layernorm.eps)
        a = self.self_attn(y, plan, caches, name, tables, state, q_rows, window_index) if attend is None else attend(y)
        if q_rows is not None:
            x, pre, post, comb = x[q_rows], pre[q_rows], post[q_rows], comb[q_rows]
        x = ops.mhc_post(a, x, post, comb)
        f_pre, f_post, f_comb, y = self._mix(self.ffn_hc, x, pre)
        y = ops.rms_norm_f32(y, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        return ops.mhc_post(self.mlp(y, None), x, f_post, f_comb), f_pre


class DeepseekV41Backbone(nn.Module):
    def __init__(self, config: V41ModelConfig, ops: OpTable, alloc: Alloc):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = param((config.vocab_size, config.hidden_size), alloc.dtype, alloc.device)
        self.layers = nn.ModuleList(DecoderLayer(config, ops, alloc, i) for i in range(config.num_hidden_layers))
        self.norm = Norm(config.hidden_size, config.rms_norm_eps, alloc)


class DeepseekV41ForCausalLM(V4FamilyLM):
    """DeepSeek-V4.1 causal LM over the cache groups of ``cache_groups`` (the batch contract of
    DeepseekV3ForCausalLM.forward; ``BatchMeta.lookback_ids`` carries the tokens before each
    sequence's new ones for Engram). ``set_tokenizer`` must be called before a forward when the
    model has Engram layers (their hashes read the tokenizer's compressed vocabulary)."""

    supports_context_parallel = True  # prefill_context_parallel / write_context (V4FamilyLM's)
    checkpoint_format = V41Checkpoint()  # how its checkpoints name their tensors (loader.load_model)
    draft_method = "dspark"
    mtp_reads_streams = False  # no MTP layers: DSpark's stages read their taps (forward_dspark)

    def __init__(self, config: V41ModelConfig, ops: OpTable, dtype: torch.dtype, device: torch.device, keep_fp8: bool = False,
                 expert_slots: tuple[int, ...] | None = None, keep_fp4: bool = False):
        super().__init__(config, ops, dtype, device, keep_fp8, expert_slots, keep_fp4)
        alloc = self._alloc()
        self.model = DeepseekV41Backbone(config, ops, alloc)
        self._add_head()
        self.mtp = nn.Module()
        self.mtp.layers = nn.ModuleList()
        if config.num_nextn_predict_layers and config.dspark_target_layer_ids:  # DSpark's stages (models/dspark.py)
            stage_moe = config.model_copy(update={
                "n_routed_experts": config.dspark_n_routed_experts or config.n_routed_experts,
                "num_experts_per_tok": config.dspark_num_experts_per_tok or config.num_experts_per_tok})
            whole = alloc.every_expert()  # the draft stages keep every expert (their own count): they run on each rank alone
            for i in range(config.num_nextn_predict_layers):
                stage = DecoderLayer(config, ops, whole, None, stage_moe)
                dspark.add_stage_extras(stage, i, config, ops, alloc)
                self.mtp.layers.append(stage)
        self.tables = rope_tables(config.qk_rope_head_dim, config.rope_theta, config.compress_rope_theta,
                                  config.compress_rope_parameters, config.max_position_embeddings, self.device, None)
        self.bounded_replay = settings().swa_bounded_replay
        self.lookback_tokens = config.engram_max_ngram_size - 1 if config.engram_layer_ids else 0
        self.register_buffer("compressed_ids", None, persistent=False)  # token id -> Engram's compressed id

    # ---- engine hooks ---------------------------------------------------------------------------
    def set_tokenizer(self, tokenizer) -> None:
        """Build Engram's compressed vocabulary from the tokenizer's decoded tokens (§4.5), and
        its pad value: the pad token's compressed id."""
        c = self.config
        if not c.engram_layer_ids:
            return
        from deepinfer_core.config import ConfigError
        from deepinfer_core.models.v41.engram_tables import compressed_token_ids

        if tokenizer is None:
            raise ConfigError("DeepSeek-V4.1's Engram layers need the model's tokenizer (its compressed vocabulary); none was found")
        try:
            ids, size = compressed_token_ids(tokenizer)
        except TypeError as e:
            raise ConfigError(f"DeepSeek-V4.1's Engram layers: {e}") from None
        if size != c.engram_compressed_vocab_size:
            raise ConfigError(
                f"the tokenizer's compressed vocabulary has {size} entries but config.json's engram_compressed_vocab_size is "
                f"{c.engram_compressed_vocab_size}: the tokenizer does not belong to this checkpoint"
            )
        if c.engram_pad_token_id >= ids.shape[0]:
            raise ConfigError(f"config.json's engram_pad_token_id {c.engram_pad_token_id} is not a token of the tokenizer "
                              f"({ids.shape[0]} tokens)")
        pad = int(ids[c.engram_pad_token_id])
        for layer in self.model.layers:
            if layer.engram is not None:
                layer.engram.pad_id = pad
        # embedding rows beyond the tokenizer (padding) hash as the pad token
        ids = ids[: c.vocab_size]
        self.compressed_ids = torch.cat([ids, ids.new_full((c.vocab_size - ids.shape[0],), pad)]).to(self.device)

    # ---- layout ---------------------------------------------------------------------------------
    @property
    def default_block_size(self) -> int:
        return 16

    @property
    def tail_tokens(self) -> int:
        """Tokens of a prefill the layers from the last KV source on compute (bounded replay): one
        window, with or without speculation (as vLLM's decoder tail). Rolled-back drafts need no
        more rows: the ring already holds window + lookahead positions, and the next query reads
        only accepted ones. A tail that grew with the lookahead would change the approximation,
        so the tokens, whenever speculation is switched on."""
        return self.config.sliding_window

    def replay_tokens(self, with_mtp: bool = False) -> int:
        """Tokens recomputed after a prefix hit: the last window when bounded replay is on, else
        enough for every layer's window to be exact again (each depends on the previous layer's
        over another ``sliding_window - 1`` tokens)."""
        c = self.config
        if self.bounded_replay:
            return c.sliding_window
        return c.num_hidden_layers * (c.sliding_window - 1)

    def cache_groups(self, with_mtp: bool = False) -> list[CacheGroup]:
        c, dt = self.config, self.dtype
        names = [layer_name(i) for i in range(c.num_hidden_layers)]
        replay = self.replay_tokens(with_mtp)
        stages = [dspark.stage_name(i) for i in range(self.num_mtp_layers)] if with_mtp else []
        groups = [CacheGroup(WINDOW_GROUP, "ring", tuple(f"{n}.window" for n in names + stages), c.head_dim, dt,
                             window=c.sliding_window, replay_tokens=replay, ring_block=min(RING_BLOCK, c.sliding_window))]
        for r in sorted({c.compress_ratios[s] for s in c.kv_source_layer_ids}):
            src = [names[s] for s in c.kv_source_layer_ids if c.compress_ratios[s] == r]
            groups += [
                CacheGroup(kv_group(r), "paged", tuple(f"{n}.compressed" for n in src), c.head_dim, dt, tokens_per_entry=r),
                CacheGroup(index_group(r), "paged", tuple(f"{n}.indexer" for n in src), c.index_head_dim, dt, tokens_per_entry=r),
            ]
            if r > 1:
                groups.append(CacheGroup(state_group(r), "ring", tuple(f"{n}.compressor_state" for n in src), 2 * c.head_dim,
                                         torch.float32, window=r, replay_tokens=replay, ring_block=r))
        return groups

    # ---- forward --------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill_context_parallel(self, input_ids: torch.Tensor, positions: torch.Tensor, cp) -> dict[str, torch.Tensor]:
        """This rank's tokens (``input_ids`` at ``positions``, ``cp.positions()``) of a prompt prefix
        prefilled across a CP group; every rank of the group calls it. Every layer runs on this
        rank's tokens (no bounded-replay tail: the KV sources need every token). Returns the KV
        sources' entries and index keys of the whole prefix, by cache tensor name: what
        ``write_context`` stores (the rings are rebuilt by the owner's replay)."""
        c = self.config
        ngram = None
        if c.engram_layer_ids:
            if self.compressed_ids is None:
                raise RuntimeError("DeepSeek-V4.1 Engram layers need set_tokenizer() before a forward")
            ids = cp.gather(input_ids[:, None])[:, 0]  # the whole prefix's tokens: each n-gram reaches back
            pos = positions[:, None] - torch.arange(c.engram_max_ngram_size, device=positions.device)[None, :]
            ngram = torch.where(pos >= 0, self.compressed_ids[ids[pos.clamp(min=0)]], torch.full_like(pos, -1))
        x = self.model.embed_tokens.weight[input_ids][:, None, :].expand(-1, c.hc_mult, -1).contiguous()
        pre = torch.zeros((input_ids.shape[0], c.hc_mult), dtype=torch.float32, device=x.device)
        pre[:, 0] = 1.0  # layer 0 collapses to the embedding copy
        state, entries = ForwardState(), {}
        for i, layer in enumerate(self.model.layers):
            name, tables = layer_name(i), self._layer_tables(i)

            def attend(y, layer=layer, name=name, tables=tables):
                out, saved = layer.self_attn.forward_context_parallel(y, positions, cp, tables, state)
                entries.update({f"{name}.{k}": v for k, v in saved.items()})
                return out

            x, pre = layer(x, pre, ngram, None, None, name, tables, state, attend=attend)
        return entries

    def _tail_plan(self, plan: V4Batch, batch: BatchMeta) -> V4Batch | None:
        """The rows bounded replay keeps after the last KV source, or None when it keeps all."""
        if not self.bounded_replay or self.config.last_kv_source < 0 or not batch.num_prefills:
            return None
        n = plan.end - plan.start
        trimmed = torch.arange(n.shape[0], device=n.device) < batch.num_prefills  # prefills, not decodes
        if batch.exact_prefills:
            trimmed[list(batch.exact_prefills)] = False
        keep = torch.where(trimmed, n.clamp(max=self.tail_tokens), n)
        if bool((keep == n).all()):
            return None
        return plan.tail(keep)

    def _layer_tables(self, layer: int):
        return self.tables["compress" if self.config.compress_ratios[layer] else "main"]

    @torch.no_grad()
    def forward_streams(self, input_ids, positions, batch: BatchMeta, kv_caches):
        """(streams after the last layer [T', hc, D], the last FFN pre [T', hc], the rows T' of the
        batch they belong to: None for all, else the bounded-replay tail's)."""
        c = self.config
        plan = self._plan(positions, batch, kv_caches)
        ngram = None
        if c.engram_layer_ids:
            if self.compressed_ids is None:
                raise RuntimeError("DeepSeek-V4.1 Engram layers need set_tokenizer() before a forward")
            ngram = ngram_ids(self.compressed_ids, input_ids, plan, batch.lookback_ids, c.engram_max_ngram_size)
        t = input_ids.shape[0]
        x = self.model.embed_tokens.weight[input_ids][:, None, :].expand(-1, c.hc_mult, -1).contiguous()
        pre = torch.zeros((t, c.hc_mult), dtype=torch.float32, device=x.device)
        pre[:, 0] = 1.0  # layer 0 collapses to the embedding copy
        tail = self._tail_plan(plan, batch)
        state = ForwardState()
        # DSpark's taps, when its stages' windows are among the caches (cache_groups(with_mtp=True))
        tapping = self.num_mtp_layers and f"{dspark.stage_name(0)}.window" in kv_caches
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if tapping and i in c.dspark_target_layer_ids:
                taps[i] = x.float().mean(dim=1)
            q_rows = tail.rows if tail is not None and i == c.last_kv_source else None
            x, pre = layer(x, pre, ngram, plan, kv_caches, layer_name(i), self._layer_tables(i), state, q_rows)
            if q_rows is not None:
                plan, ngram = tail, None if ngram is None else ngram[q_rows]
                taps = {k: v[q_rows] for k, v in taps.items()}
        if tapping:
            dspark.write_context(self, torch.stack([taps[t] for t in c.dspark_target_layer_ids], dim=1), plan, kv_caches)
        return x, pre, None if tail is None else tail.rows

    @torch.no_grad()
    def forward(self, input_ids, positions, batch: BatchMeta, kv_caches: dict[str, torch.Tensor]) -> torch.Tensor:
        """Hidden states after the final collapse and norm, [T, D] (rows bounded replay skipped: zeros)."""
        x, pre, rows = self.forward_streams(input_ids, positions, batch, kv_caches)
        hidden = self.ops.rms_norm_f32(self.ops.mhc_collapse(x, pre), self.model.norm.weight, self.model.norm.eps)
        if rows is None:
            return hidden
        out = hidden.new_zeros((input_ids.shape[0], hidden.shape[-1]))
        out[rows] = hidden
        return out

    @torch.no_grad()
    def forward_dspark(self, anchor_ids, positions, batch: BatchMeta, kv_caches, choose=None) -> dspark.Draft:
        """DSpark's block draft (models/dspark.py): ``batch`` holds one decode row of
        ``dspark_block_size`` tokens per sequence at positions P .. P + N - 1 (the anchor, the
        newest token, at P); the stages' windows (cache_groups(with_mtp=True)) hold the context
        the target forwards wrote. Nothing is written. ``choose``: see dspark.draft."""
        if not self.num_mtp_layers:
            raise ValueError("DSpark requested but the model has no DSpark stages loaded (mtp.0-2.*)")
        return dspark.draft(self, anchor_ids, self._plan(positions, batch, kv_caches), kv_caches, choose)
