"""Op by op, what the Ascend backend runs on a 950 and why it leaves an op to the reference.

Plain data, cheap to import (no torch, no torch_npu): ``backend.deepinfer_op_plan`` reads it on any
machine (``deepinfer backends --plan ascend``), and ``npu_ops`` gives each of its callables the
``PROVIDES`` line as its ``impl``. Nothing here has run on an Ascend chip (see README.md).

Doc paths: ``OP/<op>`` is ``Ascend/op-plugin: docs/zh/custom_APIs/torch_npu/torch_npu-<op>.md`` (the
torch_npu custom-op documentation, master 517f2e7, 2026-08-21); ``GOLDEN/<op>`` is that repository's
``test/test_custom_ops/test_<op>.py``, whose CPU golden functions settle what the prose leaves open;
``VA`` is ``vllm-project/vllm-ascend`` (main 182b75e), the closest public user of these operators.
"""

from __future__ import annotations

# op -> what runs on the 950 (the ops npu_ops.OPS provides). Each line names the stock operator(s)
# and the cases the callable hands back to the reference implementation.
PROVIDES: dict[str, str] = {
    "rms_norm": "torch_npu.npu_rms_norm (float32 inside, one rounding; the reference rounds before the weight)",
    "add_rms_norm": "torch_npu.npu_add_rms_norm -> (y, x + residual); empty inputs: the reference",
    "rotary_embedding": "torch_npu.npu_interleave_rope on q and k viewed [T, N, 1, 64] with rotate-half cos/sin, its "
                        "de-interleaved result re-interleaved by one permutation; fp32, NeoX pairs or rope_dim != 64: "
                        "the reference",
    "silu_and_mul": "torch_npu.npu_swiglu(x, dim=-1) ([gate | up] halves, as the contract)",
    "moe_route": "torch_npu.npu_moe_gating_top_k on float32 logits: V3 noaux_tc with norm_topk_prob (sigmoid, top-2 "
                 "group sums, bias), V2 group_limited_greedy and V2-Lite greedy (softmax); other gates and shapes "
                 "outside its limits (E <= 2048, > 2 experts a group): the reference",
    "moe_experts": "torch_npu.npu_moe_init_routing_v2 + npu_grouped_matmul (w13) + npu_swiglu + npu_grouped_matmul (w2), "
                   "then a gather and a float32 weighted sum; bf16 / fp16 / fp32 experts, 2..1024 of them; block-FP8 "
                   "and MXFP4 experts: the reference",
    "mla_prefill_attention": "torch_npu.npu_fused_infer_attention_score, TND, sparse_mode 3 (bottom-right causal) with "
                             "the 2048x2048 mask, cumulative host lengths; bf16 only (TND), (d_qk, d_v) in (192, 128), "
                             "(192, 192), (128, 128), <= 256 heads; anything else (fp16: a bf16 cast misses its "
                             "tolerance): the reference",
    "rms_norm_f32": "torch_npu.npu_rms_norm with the weight as float32 gamma (one rounding, as the contract)",
    "rms_normalize": "torch_npu.npu_rms_norm's rstd (gamma of ones), then x * rstd in x's dtype",
    "moe_experts_clamped": "as moe_experts, the clamped SwiGLU between the grouped matmuls in torch (vllm-ascend's 950 "
                           "path: npu_clipped_swiglu is not used there)",
    "mhc_pre": "torch_npu.npu_mhc_pre + npu_mhc_sinkhorn; bf16 / fp16 streams, hc 4/6/8, hidden a multiple of 16 up "
               "to 16384; otherwise the reference",
    "mhc_post": "torch_npu.npu_mhc_post(x, comb, out, post) (comb as is: its golden sums h_res[j, k] x_j); bf16 / "
                "fp16 streams, hc 4/6/8; otherwise the reference",
    "mhc_head": "torch_npu.npu_mhc_pre without H_res (alpha [scale, 0], phi [fn; zeros], bias [base; zeros]): its "
                "h_in; same limits as mhc_pre",
    "mhc_pre_delayed": "torch_npu.npu_mhc_pre (out_flag 1: h_pre, h_post, h_res) + npu_mhc_sinkhorn; the collapse "
                       "with pre_in in torch; same limits as mhc_pre",
}

# The ops the TileLang kernels of tilelang_ops provide where that package is installed and
# TileLang can run (op_table: its KERNELS name them in the plan). Elsewhere they run the reference
# on the NPU, and the plan says why.
TILELANG_PLANNED: frozenset[str] = frozenset({
    "moe_route_sqrtsoftplus", "write_cache", "compress_pool", "compress_entries", "engram_hash_ids", "engram_gate",
})

SPLIT_CACHE = ("CANN's MLA operators take the latent and the rope key as two caches ([blocks, bs, 1, 512] and "
               "[blocks, bs, 1, 64], VA AscendMLABackend.get_kv_cache_shape); DeepInfer keeps one [blocks, bs, 576] "
               "cache (ops/attention.py), and the core has no seam for a backend's cache layout yet")

# op -> why the reference runs it on the NPU (every op of deepinfer_core.ops not in PROVIDES).
LEFT_OUT: dict[str, str] = {
    "linear": "F.linear is already CANN's MatMul (aclnnMatmul) on the npu device; there is no fused operator to add",
    "fp8_block_linear": "no stock GEMM is documented for DeepSeek's block FP8 (128x128 weight blocks, 1x128 "
                        "activation blocks) on the 950, so Platform.fp8_weights=False and the loader dequantises FP8 "
                        "checkpoints: the op is not called. npu_dynamic_quant (per-token FP8 / INT8 scales, OP/"
                        "npu_dynamic_quant) has no op to feed until such a GEMM is confirmed",
    "head_linear": "a batched matmul (torch.einsum, aclnnBatchMatMul) on the NPU; nothing to fuse",
    "write_latent_cache": "one torch index_put into the combined cache; " + SPLIT_CACHE,
    "norm_rope_write_latent": "npu_kv_rmsnorm_rope_cache writes a split cache and stores k_pe de-interleaved (OP/"
                              "npu_kv_rmsnorm_rope_cache, OP/npu_interleave_rope); " + SPLIT_CACHE,
    "gather_latent_cache": "one torch index (aclnnIndex) of the combined cache; npu_gather_sparse_index would be the "
                           "same single gather",
    "mla_decode_attention": "npu_fused_infer_attention_score_v2's paged MLA decode reads key / value / key_rope from "
                            "two contiguous caches, which DeepInfer's cache cannot be without a copy a step; its lengths "
                            "are host lists a graph must be updated with before each replay (OP/"
                            "npu_fused_infer_attention_score_v2; VA mla_v1.py update_graph_params); " + SPLIT_CACHE,
    "sample_tokens": "the contract seeds each row by (seed, step); npu_top_k_top_p_sample draws from its own "
                     "generator. The reference's torch ops run on the NPU",
    "apply_token_bitmask": "no CANN operator for xgrammar's bitmask; a masked_fill on the NPU",
    "silu_and_mul_clamped": "npu_clipped_swiglu is documented for A2/A3 only (OP/npu_clipped_swiglu) and vllm-ascend's "
                            "950 branch computes the clipped SwiGLU in torch instead (VA ops/fused_moe/moe_mlp.py "
                            "_apply_clipped_swiglu)",
    "moe_route_sqrtsoftplus": "npu_moe_gating_top_k scores with softmax or sigmoid only (norm_type 0 / 1, OP/"
                              "npu_moe_gating_top_k); V4's sqrt(softplus) gate is a vllm-ascend custom op "
                              "(_C_ascend.moe_gating_top_k_hash), not stock torch_npu",
    "write_cache": "bf16 caches: one torch index_put; no CANN operator writes V4's 584-byte FP8 records (448 e4m3 "
                   "NoPE values, 64 bf16 RoPE values, 8 scale bytes: ops/kv_record.py)",
    "compress_pool": "no stock torch_npu operator (vllm-ascend runs its custom compressor op)",
    "compress_entries": "no stock torch_npu operator (V4's compressor: gather, pool, norm, RoPE)",
    "indexer_topk": "npu_lightning_indexer picks from a causal prefix of one paged key pool (V3.2's DSA), takes bf16 / "
                    "fp16 weights on the 950 and documents no tie order (OP/npu_lightning_indexer); V4 names explicit "
                    "candidate rows per query, ties to the earlier column",
    "sparse_attention": "npu_sparse_flash_attention would need V4's 512-wide keys in its NoPE slot with a zero 64-wide "
                        "rope, the key pools concatenated a call, and per-head sinks, which torch_npu 2.13.0's "
                        "documented signature lacks (op-plugin master has them); npu_kv_quant_sparse_flash_attention "
                        "reads 656-byte rows (512 8-bit NoPE + 64 bf16 RoPE + 4 fp32 scales, OP/"
                        "npu_kv_quant_sparse_flash_attention), not V4's 584-byte FP8 records",
    "mhc_collapse": "no stock operator; a weighted sum over the hc streams",
    "indexer_block_candidates": "no stock operator (V4.1's block-level indexer)",
    "engram_hash_ids": "no stock operator (an int64 multiply / XOR / modulo hash)",
    "engram_gate": "no stock operator",
}

# Weight formats the stock path leaves to the reference, for the docs and the plan's notes.
NOT_MAPPED = {
    "MXFP4 experts (npu_grouped_matmul with float4_e2m1fn_x2 weights and e8m0 scales, npu_dynamic_mx_quant)":
        "CANN's MX grouped matmul takes weights prepared at load (unpacked, transposed, cast to FRACTAL_NZ, repacked "
        "by npu_convert_weight_to_int4pack: VA quantization/methods/w4a16_mxfp4.py), and its W4A8 form quantises "
        "activations (npu_dynamic_mx_quant), which moe_experts' contract forbids; the core has no seam for a "
        "backend's weight preparation, so Platform.fp4_experts=False and the loader dequantises MXFP4 experts",
}
