"""DeepSeek V3 / V2 family (MLA attention, DeepSeek MoE, MTP), written on the OpTable.

One class serves ``model_type`` deepseek_v3 and deepseek_v2: the differences (routing, rope
layout, q_lora) are config values. Parameter names equal the HF checkpoint keys except that
routed experts are fused (``mlp.experts.gate_up_proj`` / ``down_proj``) and MTP layer ``i``
(checkpoint ``model.layers.{num_hidden_layers + i}``) lives at ``mtp.layers.{i}``.

Parameters are allocated with ``torch.empty``: the model is unusable until the loader has
filled every parameter and called ``post_load``.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
from torch import nn

from deepinfer_core.models.batch import BatchMeta, CacheGroup
from deepinfer_core.models.layers import FP8_DTYPE, MLP, Alloc, Experts, Linear, RMSNorm, param
from deepinfer_core.models.v3.checkpoint import V3Checkpoint
from deepinfer_core.models.v3.config import V3ModelConfig
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.rope import rope_cos_sin_table, yarn_mscale

# Every MLA layer's latent cache: one paged group (one block table per sequence for all layers).
CACHE_GROUP = "mla"
# q_a_layernorm and kv_a_layernorm are built without an eps in transformers (its default).
LATENT_NORM_EPS = 1e-6


class Router(nn.Module):
    """The MoE gate; weight and correction bias stay float32 whatever the compute dtype (as HF)."""

    def __init__(self, config: V3ModelConfig, alloc: Alloc):
        super().__init__()
        self.weight = param((config.n_routed_experts, config.hidden_size), torch.float32, alloc.device)
        if config.topk_method == "noaux_tc":
            self.e_score_correction_bias = param((config.n_routed_experts,), torch.float32, alloc.device)
        else:
            self.e_score_correction_bias = None


class SharedInGroupedPass(NamedTuple):
    """A MoE layer's routed experts with its shared experts appended (``MoE.fuse_shared``)."""

    max_tokens: int  # batches up to this many tokens take this path
    w13: torch.Tensor  # [E + n_shared, 2I, D]
    w2: torch.Tensor  # [E + n_shared, D, I]
    w13_scale: torch.Tensor | None  # FP8 scales, as Experts' (None: unquantised)
    w2_scale: torch.Tensor | None
    ids: torch.Tensor  # [max_tokens, n_shared] int64: E.. E + n_shared - 1 on every row, appended to each token's ids
    weights: torch.Tensor  # [max_tokens, n_shared] float32 ones, appended to its weights


class MoE(nn.Module):
    def __init__(self, config: V3ModelConfig, ops: OpTable, alloc: Alloc):
        super().__init__()
        self.config = config
        self.ops = ops
        self.gate = Router(config, alloc)
        # Tokens up to which fuse_shared appends the shared experts to the routed ones (0: never).
        self.shared_max_tokens = self._shared_max_tokens(config, ops, alloc)
        self.experts = Experts(config, alloc, room=config.n_shared_experts if self.shared_max_tokens else 0)
        if config.n_shared_experts:
            self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, ops, alloc)
        else:
            self.shared_experts = None
        self.ep = None  # set by parallel.expert_parallel.ExpertParallel: the routed experts run across ranks
        # Set by fuse_shared: the routed experts with the shared ones appended, for small batches.
        self.with_shared: SharedInGroupedPass | None = None

    @staticmethod
    def _shared_max_tokens(config: V3ModelConfig, ops: OpTable, alloc: Alloc) -> int:
        """What the backend's ``moe_experts`` asks for these experts' weight dtype (its callable's
        ``shared_expert_max_tokens``, see ``deepinfer_core.ops.moe.moe_experts``); 0 in a
        batch-invariant table (a row's arithmetic would follow the batch size), without shared
        experts, under expert parallelism (the routed experts are this rank's slots) and where
        FP8 blocks would straddle the shared chunks."""
        hint = getattr(ops.moe_experts, "shared_expert_max_tokens", {})
        if not isinstance(hint, dict):
            raise TypeError(f"moe_experts.shared_expert_max_tokens must be a dict {{expert weight dtype: max tokens}}, "
                            f"not {hint!r} (see deepinfer_core.ops.moe.moe_experts)")
        appends = getattr(ops.moe_route, "appends_shared_experts", False)
        if appends and "shared_experts" not in inspect.signature(ops.moe_route).parameters:
            raise TypeError("moe_route.appends_shared_experts is set but the callable takes no 'shared_experts' keyword: "
                            "add it or drop the attribute (see deepinfer_core.ops.moe.moe_route)")
        block, inter = alloc.fp8_block, config.moe_intermediate_size
        if ops.batch_invariant or not config.n_shared_experts or alloc.expert_slots is not None:
            return 0
        if block is not None and (inter % block[0] or inter % block[1]):
            return 0
        return int(hint.get(alloc.dtype if block is None else FP8_DTYPE, 0))

    @torch.no_grad()
    def fuse_shared(self) -> None:
        """After loading, where ``shared_max_tokens`` allows: append the shared experts to the
        routed ones as ``n_shared_experts`` more experts, so that a batch of up to that many tokens
        runs them in the routed experts' grouped pass, with weight 1 (one call instead of the
        shared MLP's GEMMs, its SwiGLU and the add). They go into the rows ``Experts`` kept free
        past the routed ones (the routed weights are not copied); the shared MLP keeps its own
        weights for larger batches, a copy of n_shared / n_routed of the expert weights (V2-Lite
        2/64, V3 1/256). The appended shared weights are a copy made here: weights written into
        the parameters after loading would not reach it (nothing does so today)."""
        ex, shared = self.experts, self.shared_experts
        if not self.shared_max_tokens or self.with_shared is not None:
            return
        if shared.gate_up_proj is not None:
            raise RuntimeError("fuse_shared reads the shared MLP's gate_proj / up_proj: call it before MLP.fuse")
        gate, up, down = shared.gate_proj, shared.up_proj, shared.down_proj
        # Shared chunk j is an expert of its own: gate and up rows j*I..(j+1)*I, down columns j*I..(j+1)*I
        # (the same split of the weights' row / column blocks for the FP8 scales).
        n = self.config.n_shared_experts
        w13 = lambda g, u: torch.cat([g.view(n, -1, g.shape[1]), u.view(n, -1, u.shape[1])], dim=1)  # noqa: E731
        w2 = lambda d: d.view(d.shape[0], n, -1).transpose(0, 1)  # noqa: E731
        appended = {"gate_up_proj": w13(gate.weight, up.weight), "down_proj": w2(down.weight)}
        if ex.block is not None:
            appended["gate_up_proj_scale_inv"] = w13(gate.weight_scale_inv, up.weight_scale_inv)
            appended["down_proj_scale_inv"] = w2(down.weight_scale_inv)
        e, whole = ex.gate_up_proj.shape[0], ex.whole
        for name, rows in appended.items():
            if whole[name].data_ptr() != getattr(ex, name).data_ptr():
                raise RuntimeError(f"experts.{name} no longer lies in the rows Experts allocated for it (was the "
                                   "parameter replaced instead of loaded in place?): the shared experts cannot be appended")
            whole[name][e:] = rows
        ex.whole = {}  # now the fused pass's
        device = ex.gate_up_proj.device
        self.with_shared = SharedInGroupedPass(
            self.shared_max_tokens, whole["gate_up_proj"], whole["down_proj"], whole.get("gate_up_proj_scale_inv"),
            whole.get("down_proj_scale_inv"), torch.arange(e, e + n, device=device).repeat(self.shared_max_tokens, 1),
            torch.ones((self.shared_max_tokens, n), dtype=torch.float32, device=device),
        )

    def experts_op(self, x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, block=None) -> torch.Tensor:
        """The routed experts over the given expert weights (all of them, or one rank's slots)."""
        return self.ops.moe_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        f = self.with_shared  # the shared experts in the grouped pass, for this batch?
        if self.ep is not None or f is None or x.shape[0] > f.max_tokens:
            f = None
        # The shared experts' slots from the routing itself where its callable offers it, else appended below.
        in_route = f is not None and getattr(self.ops.moe_route, "appends_shared_experts", False)
        weights, ids = self.ops.moe_route(
            x,
            self.gate.weight,
            self.gate.e_score_correction_bias,
            top_k=c.num_experts_per_tok,
            scoring_func=c.scoring_func,
            topk_method=c.topk_method,
            n_group=c.n_group,
            topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor,
            **({"shared_experts": c.n_shared_experts} if in_route else {}),
        )
        ex, shared = self.experts, self.shared_experts
        if self.ep is not None:  # the shared expert computes while the routed rows travel to their ranks
            out, shared_out = self.ep(x, weights, ids, None if shared is None else lambda: shared(x))
        elif f is not None:
            if not in_route:  # contiguous rows (an expanded [1, n] would cost a copy kernel per cat on a GPU)
                t = x.shape[0]
                weights, ids = torch.cat([weights, f.weights[:t]], dim=1), torch.cat([ids, f.ids[:t]], dim=1)
            out, shared_out = self.experts_op(x, f.w13, f.w2, weights, ids, f.w13_scale, f.w2_scale, ex.block), None
        else:
            out = self.experts_op(x, ex.gate_up_proj, ex.down_proj, weights, ids, ex.gate_up_proj_scale_inv,
                                  ex.down_proj_scale_inv, ex.block)
            shared_out = None if shared is None else shared(x)
        return out if shared_out is None else out + shared_out


def softmax_scale(config: V3ModelConfig) -> float:
    """qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 for YaRN (transformers' yarn_apply_mscale)."""
    scale = config.qk_head_dim**-0.5
    params = config.rope_parameters
    if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale = scale * m * m
    return scale


class Attention(nn.Module):
    """Multi-head latent attention: naive (expanded) form for prefill, absorbed form for decode."""

    stacked_name = "qkv_a_proj"  # the Linear that stacks two of the checkpoint's (see unstacked)

    def __init__(self, config: V3ModelConfig, ops: OpTable, alloc: Alloc):
        super().__init__()
        self.ops = ops
        self.num_heads = h = config.num_attention_heads
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.qk_dim = config.qk_head_dim
        self.interleaved = config.rope_interleave
        self.scale = softmax_scale(config)
        d, bias = config.hidden_size, config.attention_bias
        self.q_lora = config.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = Linear(d, h * self.qk_dim, ops, alloc)
        else:
            self.q_a_proj = Linear(d, config.q_lora_rank, ops, alloc, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS, alloc)
            self.q_b_proj = Linear(config.q_lora_rank, h * self.qk_dim, ops, alloc)
        self.kv_a_proj_with_mqa = Linear(d, self.kv_lora_rank + self.rope_dim, ops, alloc, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, alloc)
        self.kv_b_proj = Linear(self.kv_lora_rank, h * (self.nope_dim + self.v_dim), ops, alloc)
        self.o_proj = Linear(h * self.v_dim, d, ops, alloc, bias=bias)
        # Set by post_load: [q_proj or q_a_proj | kv_a_proj_with_mqa] stacked (one GEMM of the input).
        self.qkv_a_proj: Linear | None = None
        # Derived by post_load from kv_b_proj: W_UK^T [H, d_c, d_n] and W_UV [H, d_v, d_c] (views). Not parameters.
        self.w_uk_t: torch.Tensor | None = None
        self.w_uv: torch.Tensor | None = None

    def post_load(self, dtype: torch.dtype) -> None:
        w = self.kv_b_proj.dequantized_weight(dtype).view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk_t, self.w_uv = w[:, : self.nope_dim].transpose(1, 2), w[:, self.nope_dim :]
        self._fuse_input_projections()

    def _fuse_input_projections(self) -> None:
        """Stack the two projections of the layer input (q_proj or q_a_proj, and kv_a_proj_with_mqa)
        into one GEMM: one launch and one read of x instead of two, and kv_a's narrow GEMM no longer
        runs alone. Kept apart when they carry biases or FP8 blocks would straddle the seam."""
        first = self.q_a_proj if self.q_lora else self.q_proj
        kv = self.kv_a_proj_with_mqa
        if self.qkv_a_proj is not None or first.bias is not None or kv.bias is not None:
            return
        if first.block is not None and first.weight.shape[0] % first.block[0]:
            return
        self.qkv_a_proj = Linear.stacked(first, kv)
        self.qkv_a_split = (first.weight.shape[0], kv.weight.shape[0])
        first.release()
        kv.release()

    def unstacked(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """``qkv_a_proj``'s weight (or a tensor of its rows, e.g. dequantised) split back into the
        checkpoint's projections, by module name."""
        q, kv = weight.split(self.qkv_a_split)
        return {"q_a_proj" if self.q_lora else "q_proj": q, "kv_a_proj_with_mqa": kv}

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope, q_pe before RoPE, the kv_a rows [latent | k_pe] before norm and RoPE) of tokens ``x``."""
        t = x.shape[0]
        if self.qkv_a_proj is not None:
            q, ckv = self.qkv_a_proj(x).split(self.qkv_a_split, dim=1)
        else:
            q, ckv = (self.q_a_proj if self.q_lora else self.q_proj)(x), self.kv_a_proj_with_mqa(x)
        if self.q_lora:
            q = self.q_b_proj(self.ops.rms_norm(q, self.q_a_layernorm.weight, self.q_a_layernorm.eps))
        q = q.view(t, self.num_heads, self.qk_dim)
        return q[..., : self.nope_dim], q[..., self.nope_dim :], ckv

    def _project(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
        """(q_nope, q_pe, latent, k_pe) of tokens ``x`` at ``positions`` (rotary applied)."""
        q_nope, q_pe, ckv = self._inputs(x)
        latent = self.ops.rms_norm(ckv[:, : self.kv_lora_rank], self.kv_a_layernorm.weight, self.kv_a_layernorm.eps)
        q_pe, k_pe = self.ops.rotary_embedding(q_pe, ckv[:, self.kv_lora_rank :], positions, cos_sin, self.interleaved)
        return q_nope, q_pe, latent, k_pe

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, batch: BatchMeta, kv_cache: torch.Tensor, cos_sin: torch.Tensor
    ) -> torch.Tensor:
        ops = self.ops
        t = x.shape[0]
        cache = batch.groups[CACHE_GROUP]
        if ops.backend_provides("norm_rope_write_latent"):  # the backend's one kernel for norm, RoPE and the write
            q_nope, q_pe, ckv = self._inputs(x)
            norm = self.kv_a_layernorm
            q_pe = ops.norm_rope_write_latent(kv_cache, ckv, norm.weight, norm.eps, q_pe, positions, cos_sin,
                                              self.interleaved, cache.slot_mapping)
        else:
            q_nope, q_pe, latent, k_pe = self._project(x, positions, cos_sin)
            ops.write_latent_cache(kv_cache, latent, k_pe, cache.slot_mapping)

        p = batch.num_prefill_tokens
        outs = []
        if p:
            outs.append(self._prefill(q_nope[:p], q_pe[:p], batch, kv_cache).flatten(1))
        if t > p:
            outs.append(self._decode(q_nope[p:], q_pe[p:], batch, kv_cache).flatten(1))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return self.o_proj(out)

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: BatchMeta, kv_cache: torch.Tensor) -> torch.Tensor:
        ctx = self.ops.gather_latent_cache(kv_cache, batch.groups[CACHE_GROUP].context_slots).to(q_nope.dtype)
        return self._expanded_attention(q_nope, q_pe, ctx, batch.prefill_cu_seqlens_q, batch.prefill_cu_seqlens_k)

    def _expanded_attention(self, q_nope, q_pe, ctx: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor) -> torch.Tensor:
        """Attention of the queries over context latent rows ``ctx`` ([c | k_pe] per key, packed
        per sequence as ``cu_k`` says), in the expanded per-head form."""
        s = ctx.shape[0]
        kv = self.kv_b_proj(ctx[:, : self.kv_lora_rank]).view(s, self.num_heads, self.nope_dim + self.v_dim)
        k_pe = ctx[:, None, self.kv_lora_rank :].expand(s, self.num_heads, self.rope_dim)
        k = torch.cat([kv[..., : self.nope_dim], k_pe], dim=-1)
        v = kv[..., self.nope_dim :]
        q = torch.cat([q_nope, q_pe], dim=-1)
        return self.ops.mla_prefill_attention(q, k, v, cu_q, cu_k, self.scale)

    def forward_context_parallel(self, x: torch.Tensor, positions: torch.Tensor, cp, cos_sin: torch.Tensor):
        """This rank's tokens of a context-parallel prefill (``parallel.context_parallel.ContextParallel``):
        every rank's latent rows are gathered, and each of this rank's chunks attends to the prefix
        up to its end. Returns (the attention output of this rank's tokens, the latent rows of
        the whole prefix [length, d_c + d_r])."""
        q_nope, q_pe, latent, k_pe = self._project(x, positions, cos_sin)
        rows = cp.gather(torch.cat([latent, k_pe], dim=-1))
        cu_q, cu_k = cp.attention_inputs()
        ctx = torch.cat([rows[:end] for _, end in cp.mine])
        as_tensor = lambda cu: torch.tensor(cu, dtype=torch.int32, device=x.device)  # noqa: E731
        out = self._expanded_attention(q_nope, q_pe, ctx, as_tensor(cu_q), as_tensor(cu_k))
        return self.o_proj(out.flatten(1)), rows

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: BatchMeta, kv_cache: torch.Tensor) -> torch.Tensor:
        """Decode rows (1 + k tokens per sequence, causal within the row) over the paged cache."""
        q_latent = self.ops.head_linear(q_nope, self.w_uk_t)
        u = self.ops.mla_decode_attention(
            q_latent, q_pe, kv_cache, batch.groups[CACHE_GROUP].block_tables, batch.decode_seq_lens,
            batch.decode_query_start_loc, self.scale,
        )
        return self.ops.head_linear(u, self.w_uv)


class DecoderLayer(nn.Module):
    """Pre-norm block; carries the residual separately so norms fuse with the residual add."""

    def __init__(self, config: V3ModelConfig, ops: OpTable, alloc: Alloc, moe: bool):
        super().__init__()
        self.ops = ops
        self.self_attn = Attention(config, ops, alloc)
        self.mlp = MoE(config, ops, alloc) if moe else MLP(config.hidden_size, config.intermediate_size, ops, alloc)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, alloc)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, alloc)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        batch: BatchMeta,
        kv_cache: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual); the caller adds them (into the next norm)."""
        return self.block(hidden, residual, lambda h: self.self_attn(h, positions, batch, kv_cache, cos_sin))

    def block(self, hidden: torch.Tensor, residual: torch.Tensor | None, attend) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer around ``attend`` (normed hidden -> attention output): norms, residual, MLP."""
        norm = self.input_layernorm
        if residual is None:
            residual, hidden = hidden, self.ops.rms_norm(hidden, norm.weight, norm.eps)
        else:
            hidden, residual = self.ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        hidden = attend(hidden)
        norm = self.post_attention_layernorm
        hidden, residual = self.ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return self.mlp(hidden), residual


class MTPLayer(DecoderLayer):
    """One multi-token-prediction module: a MoE decoder layer plus enorm, hnorm, eh_proj, shared_head.norm."""

    def __init__(self, config: V3ModelConfig, ops: OpTable, alloc: Alloc):
        super().__init__(config, ops, alloc, moe=True)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(d, eps, alloc)
        self.hnorm = RMSNorm(d, eps, alloc)
        # eh_proj is bf16 in DeepSeek's FP8 checkpoints, never quantised.
        self.eh_proj = Linear(2 * d, d, ops, alloc, fp8=False)
        self.shared_head = nn.ModuleDict({"norm": RMSNorm(d, eps, alloc)})


class DeepseekV3Backbone(nn.Module):
    def __init__(self, config: V3ModelConfig, ops: OpTable, alloc: Alloc):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = param((config.vocab_size, config.hidden_size), alloc.dtype, alloc.device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, ops, alloc, moe=config.is_moe_layer(i)) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, alloc)


class DeepseekV3ForCausalLM(nn.Module):
    """DeepSeek V3/V2 causal LM over a paged latent cache (see ``forward`` for the batch contract).

    MTP layers are built for ``config.num_nextn_predict_layers``; a loader that finds none in the
    checkpoint calls ``drop_mtp_layers()`` (so ``num_mtp_layers`` is only final after loading).
    """

    checkpoint_format = V3Checkpoint()  # how its checkpoints name their tensors (loader.load_model)
    default_block_size = 16  # the engine's block size (tokens) unless the user picks one
    # Batch-invariant inference: prompt chunks come as rows (no prefill tokens), so every token
    # takes the absorbed path of _decode, whatever the batch around it.
    supports_batch_invariance = True
    supports_context_parallel = True  # prefill_context_parallel / write_context
    supports_fp8_kv_cache = False  # kv_cache_dtype="fp8": V4 records only (MLA latents would need their own format)
    supports_graphs = True
    graphs_by_context = False  # its decode kernels read no further than each sequence's length
    mtp_reads_streams = False  # its MTP layers read the final hidden state
    draft_method = "mtp"
    lookback_tokens = 0  # a forward reads no token before a sequence's new ones

    def __init__(self, config: V3ModelConfig, ops: OpTable, dtype: torch.dtype, device: torch.device, keep_fp8: bool = False,
                 expert_slots: tuple[int, ...] | None = None):
        super().__init__()
        self.config = config
        self.ops = ops
        self.dtype = dtype
        self.device = torch.device(device)
        self.keep_fp8 = keep_fp8 and config.fp8_block is not None
        self.expert_slots = expert_slots  # expert parallelism: see Alloc; the loader reads only these experts
        alloc = Alloc(dtype, self.device, tuple(config.fp8_block) if self.keep_fp8 else None, expert_slots)
        self.model = DeepseekV3Backbone(config, ops, alloc)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, ops, alloc, fp8=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = nn.Module()
        whole = alloc.every_expert()  # the MTP layers keep every expert: they draft on each rank alone
        self.mtp.layers = nn.ModuleList(MTPLayer(config, ops, whole) for _ in range(config.num_nextn_predict_layers))
        # [max_position_embeddings, rope_dim] float32, shared by all layers; not a parameter.
        self.cos_sin = rope_cos_sin_table(
            config.qk_rope_head_dim, config.rope_theta, config.rope_parameters, config.max_position_embeddings
        ).to(self.device)

    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp.layers)

    def drop_mtp_layers(self) -> None:
        """Forget the MTP layers (the checkpoint has none)."""
        self.mtp.layers = nn.ModuleList()

    def attention_layers(self) -> list[tuple[str, Attention]]:
        names = [f"model.layers.{i}.self_attn" for i in range(len(self.model.layers))]
        names += [f"mtp.layers.{i}.self_attn" for i in range(self.num_mtp_layers)]
        return [(name, self.get_submodule(name)) for name in names]

    def set_tokenizer(self, tokenizer) -> None:
        """Nothing to read from it (the contract's hook for V4.1's Engram)."""

    def cache_groups(self, with_mtp: bool = False) -> list[CacheGroup]:
        """One paged group of every MLA layer's latents ([c | k_pe] per token); the MTP layers'
        caches only when something runs them (``with_mtp``)."""
        layers = [name for name, _ in self.attention_layers() if with_mtp or not name.startswith("mtp.")]
        return [CacheGroup(CACHE_GROUP, "paged", tuple(layers), self.config.latent_dim, self.dtype)]

    @torch.no_grad()
    def post_load(self) -> None:
        """Derive the absorbed-decode matrices W_UK / W_UV from every kv_b_proj (dequantising FP8),
        stack each attention's input projections, append the shared experts to the routed ones
        where the backend asks for it, and fuse every MLP's gate and up projections."""
        for _, attn in self.attention_layers():
            attn.post_load(self.dtype)
        for module in self.modules():
            if isinstance(module, MoE):
                module.fuse_shared()
        for module in self.modules():
            if isinstance(module, MLP):
                module.fuse()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens.weight[input_ids]

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: BatchMeta, kv_caches: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 packed as BatchMeta describes; kv_caches: the cache
        tensor of every layer of cache_groups(), by layer name. Returns the hidden states after
        the final norm, [T, D]."""
        hidden, residual = self.embed(input_ids), None
        for i, layer in enumerate(self.model.layers):
            kv_cache = kv_caches[f"model.layers.{i}.self_attn"]
            hidden, residual = layer(hidden, residual, positions, batch, kv_cache, self.cos_sin)
        norm = self.model.norm
        return self.ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)[0]

    @torch.no_grad()
    def prefill_context_parallel(self, input_ids: torch.Tensor, positions: torch.Tensor, cp) -> list[torch.Tensor]:
        """This rank's tokens (``input_ids`` at ``positions``, ``cp.positions()``) of a prompt prefix
        prefilled across a CP group; every rank of the group calls it. Returns every layer's latent
        rows of the whole prefix ([length, latent_dim] each): what ``write_context`` stores."""
        hidden, residual, rows = self.embed(input_ids), None, []

        def attend(layer: DecoderLayer):
            def run(h):
                out, full = layer.self_attn.forward_context_parallel(h, positions, cp, self.cos_sin)
                rows.append(full)
                return out
            return run

        for layer in self.model.layers:
            hidden, residual = layer.block(hidden, residual, attend(layer))
        return rows

    def write_context(self, kv_caches: dict[str, torch.Tensor], rows: list[torch.Tensor], blocks: dict[str, list[int]],
                      block_size: int) -> None:
        """Store ``prefill_context_parallel``'s rows of a prefix into the cache blocks ``blocks``
        (per group; the prefix fills them exactly)."""
        table = torch.tensor(blocks[CACHE_GROUP], dtype=torch.int64, device=self.device)
        slots = (table[:, None] * block_size + torch.arange(block_size, device=self.device)).flatten()
        r = self.config.kv_lora_rank
        for i, layer_rows in enumerate(rows):
            self.ops.write_latent_cache(kv_caches[f"model.layers.{i}.self_attn"], layer_rows[:, :r], layer_rows[:, r:], slots)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, D] -> [N, V] float32."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def forward_mtp(
        self,
        depth: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        batch: BatchMeta,
        kv_caches: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """MTP module ``depth``: input_ids are the tokens shifted by one (position p carries t_{p+1}),
        prev_hidden the previous stage's hidden (depth 0: forward()'s output). Uses
        kv_caches["mtp.layers.{depth}.self_attn"] (cache_groups(with_mtp=True)); returns the hidden
        after shared_head.norm, [T, D]."""
        if not 0 <= depth < self.num_mtp_layers:
            raise ValueError(f"MTP depth {depth} requested but the model has {self.num_mtp_layers} MTP layers loaded")
        layer: MTPLayer = self.mtp.layers[depth]
        ops = self.ops
        e = ops.rms_norm(self.embed(input_ids), layer.enorm.weight, layer.enorm.eps)
        h = ops.rms_norm(prev_hidden, layer.hnorm.weight, layer.hnorm.eps)
        z = layer.eh_proj(torch.cat([e, h], dim=-1))
        kv_cache = kv_caches[f"mtp.layers.{depth}.self_attn"]
        hidden, residual = layer(z, None, positions, batch, kv_cache, self.cos_sin)
        norm = layer.shared_head["norm"]
        return ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)[0]
