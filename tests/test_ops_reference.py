"""Reference ops against independent formulations (transformers' modules where they exist)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deepinfer_core.ops import attention, linear, moe, norm, rope
from tests.hf_checkpoints import dequantize, quantize_fp8_block

GEN = torch.Generator().manual_seed(0)


def randn(*shape, scale=1.0):
    return torch.randn(*shape, generator=GEN) * scale


def _paged(lens: list[int], bs: int, d: int, width: int | None = None):
    """A random cache of [latent | k_pe] rows and block tables giving each sequence its own blocks."""
    width = width or max(1, max((-(-n // bs) for n in lens), default=1))
    num_blocks = len(lens) * width + 3
    cache = randn(num_blocks, bs, d)
    perm = torch.randperm(num_blocks, generator=GEN).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for b, n in enumerate(lens):
        for i in range(-(-n // bs)):
            tables[b, i] = perm.pop()
    return cache, tables


def _starts(query_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(query_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [4, 1, 3]], ids=["one_row", "rows_1_plus_k"])
def test_absorbed_decode_equals_expanded_attention(query_lens):
    """Decode in the absorbed form (q_nope through W_UK, the output through W_UV) equals prefill
    attention in the expanded form over the same cache: each sequence's query rows are its newest
    tokens, causal, as a prefill chunk over a cached prefix is."""
    h, d_c, d_r, d_n, d_v, bs = 4, 32, 8, 16, 12, 4
    w_kvb = randn(h * (d_n + d_v), d_c, scale=d_c**-0.5)
    lens = [4, 7, 13]
    cache, tables = _paged(lens, bs, d_c + d_r)
    rows = sum(query_lens)
    q_nope, q_pe = randn(rows, h, d_n), randn(rows, h, d_r)
    w = w_kvb.view(h, d_n + d_v, d_c)
    w_uk, w_uv = w[:, :d_n], w[:, d_n:]
    scale = 0.3
    q_latent = torch.einsum("bhn,hnc->bhc", q_nope, w_uk)
    starts = _starts(query_lens)
    got = attention.mla_decode_attention(q_latent, q_pe, cache, tables, torch.tensor(lens, dtype=torch.int32), starts, scale)
    got = torch.einsum("bhc,hvc->bhv", got, w_uv)

    for b, n in enumerate(lens):
        slots = torch.tensor([tables[b, p // bs].item() * bs + p % bs for p in range(n)])
        ctx = attention.gather_latent_cache(cache, slots)
        kv = F.linear(ctx[:, :d_c], w_kvb).view(n, h, d_n + d_v)
        k = torch.cat([kv[..., :d_n], ctx[:, None, d_c:].expand(n, h, d_r)], dim=-1)
        first, last = starts[b].item(), starts[b + 1].item()
        q = torch.cat([q_nope[first:last], q_pe[first:last]], dim=-1)
        cu_q, cu_k = torch.tensor([0, last - first], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32)
        expanded = attention.mla_prefill_attention(q, k, kv[..., d_n:], cu_q, cu_k, scale)
        torch.testing.assert_close(got[first:last], expanded, atol=1e-5, rtol=1e-5)


def _decode_case(lens, query_lens, h=3, d_c=16, d_r=8, bs=4, dtype=torch.float32):
    cache, tables = _paged(lens, bs, d_c + d_r, width=max(1, max((-(-n // bs) for n in lens), default=1)) + 1)
    rows = sum(query_lens)
    q_latent = randn(rows, h, d_c).to(dtype)
    q_pe = randn(rows, h, d_r + 2)[..., :d_r].to(dtype)  # a strided view, as the model passes it
    return q_latent, q_pe, cache.to(dtype), tables, torch.tensor(lens, dtype=torch.int32), _starts(query_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,query_lens", [([7, 1, 13], [4, 1, 3]), ([3, 5], [3, 5]), ([9, 2, 6], [2, 0, 3]), ([8], [8])],
                         ids=["mixed", "q_len_is_seq_len", "a_sequence_without_rows", "one_sequence_all_rows"])
def test_decode_rows_are_the_op_once_per_row_with_a_truncated_seq_len(lens, query_lens, dtype):
    """Row i of a sequence with q rows and n cached entries is exactly (bit for bit) the op on that
    row alone, as one-row decode over the first n - q + 1 + i entries."""
    q_latent, q_pe, cache, tables, seq_lens, starts = _decode_case(lens, query_lens, dtype=dtype)
    got = attention.mla_decode_attention(q_latent, q_pe, cache, tables, seq_lens, starts, 0.25)
    assert got.shape == q_latent.shape and got.dtype == dtype
    one = torch.tensor([0, 1], dtype=torch.int32)
    for b, (n, q) in enumerate(zip(lens, query_lens)):
        for i in range(q):
            row = int(starts[b]) + i
            alone = attention.mla_decode_attention(q_latent[row : row + 1], q_pe[row : row + 1], cache, tables[b : b + 1],
                                                   torch.tensor([n - q + 1 + i], dtype=torch.int32), one, 0.25)
            assert torch.equal(got[row], alone[0]), (b, i)


def test_decode_with_one_row_per_sequence_is_plain_decode():
    """query_start_loc = 0, 1, .., B: each row attends to all seq_lens[b] entries of its sequence
    (softmax over s_j = (q_latent . c_j + q_pe . k_pe_j) * scale, weights on c), written out here."""
    lens = [1, 4, 9, 5]
    q_latent, q_pe, cache, tables, seq_lens, starts = _decode_case(lens, [1] * len(lens), bs=2)
    assert starts.tolist() == [0, 1, 2, 3, 4]
    got = attention.mla_decode_attention(q_latent, q_pe, cache, tables, seq_lens, starts, 0.4)
    d_c = q_latent.shape[-1]
    for b, n in enumerate(lens):
        entries = torch.stack([cache[tables[b, p // 2], p % 2] for p in range(n)])
        scores = torch.einsum("hd,nd->hn", torch.cat([q_latent[b], q_pe[b]], -1), entries) * 0.4
        torch.testing.assert_close(got[b], scores.softmax(-1) @ entries[:, :d_c], atol=1e-6, rtol=1e-6)


def test_decode_rows_with_nothing_to_attend_to_are_zeros():
    """seq_lens 0 (graph padding) and rows whose count seq_len - q + 1 + i is <= 0 give zeros; an
    empty batch gives an empty output."""
    lens, query_lens = [0, 2, 5, 0], [1, 4, 2, 3]  # the second: rows see -1, 0, 1, 2 entries
    q_latent, q_pe, cache, tables, seq_lens, starts = _decode_case(lens, query_lens)
    got = attention.mla_decode_attention(q_latent, q_pe, cache, tables, seq_lens, starts, 0.3)
    zero_rows = [0, 1, 2, 7, 8, 9]
    assert all(torch.count_nonzero(got[r]) == 0 for r in zero_rows)
    assert all(torch.count_nonzero(got[r]) > 0 for r in range(got.shape[0]) if r not in zero_rows)
    empty = attention.mla_decode_attention(q_latent[:0], q_pe[:0], cache, tables[:0], seq_lens[:0],
                                           torch.zeros(1, dtype=torch.int32), 0.3)
    assert empty.shape == (0, *q_latent.shape[1:])


def test_prefill_attention_with_cached_prefix_matches_dense():
    h, d, dv = 3, 10, 6
    lq, lk = [3, 1, 5], [7, 1, 5]
    q = randn(sum(lq), h, d)
    k, v = randn(sum(lk), h, d), randn(sum(lk), h, dv)
    cu_q = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 8, 13], dtype=torch.int32)
    got = attention.mla_prefill_attention(q, k, v, cu_q, cu_k, 0.5)
    for b in range(3):
        qs, ks, vs = q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        mask = torch.ones(lq[b], lk[b], dtype=torch.bool).tril(lk[b] - lq[b])
        dense = F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=mask, scale=0.5
        ).transpose(0, 1)
        torch.testing.assert_close(got[cu_q[b] : cu_q[b + 1]], dense, atol=1e-5, rtol=1e-5)


def test_latent_cache_write_skips_padding_and_gathers():
    cache = torch.zeros(4, 4, 6)
    latent, k_pe = randn(3, 4), randn(3, 2)
    attention.write_latent_cache(cache, latent, k_pe, torch.tensor([5, -1, 14]))
    rows = attention.gather_latent_cache(cache, torch.tensor([14, 5]))
    torch.testing.assert_close(rows, torch.cat([latent, k_pe], -1)[[2, 0]])
    assert cache.view(-1, 6).abs().sum(-1).nonzero().flatten().tolist() == [5, 14]


@pytest.mark.parametrize("block", [(128, 128), (32, 32), (16, 64)])
def test_fp8_dequant_round_trip(block):
    w = randn(100, 200)
    q, s = quantize_fp8_block(w, block)
    assert s.shape == (math.ceil(100 / block[0]), math.ceil(200 / block[1]))
    deq = linear.dequantize_fp8_block(q, s, block, torch.float32)
    torch.testing.assert_close(deq, dequantize(q, s, block), atol=0, rtol=0)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for values in the normal range.
    big = w.abs() > w.abs().max() / 64
    assert ((deq - w).abs()[big] / w.abs()[big]).max() <= 2**-4
    # Quantising the dequantised weight again is exact (amax blocks map back to 448).
    q2, s2 = quantize_fp8_block(deq, block)
    torch.testing.assert_close(linear.dequantize_fp8_block(q2, s2, block, torch.float32), deq, atol=0, rtol=1e-6)
    x = randn(5, 200)
    torch.testing.assert_close(linear.fp8_block_linear(x, q, s, block), x @ deq.T, atol=1e-4, rtol=1e-5)
    stacked = linear.dequantize_fp8_block(torch.stack([q, q]), torch.stack([s, 2 * s]), block, torch.float32)
    torch.testing.assert_close(stacked[1], 2 * deq)


def _hf_v3_router(num_experts, n_group, topk_group, top_k, norm_topk_prob, hidden=32):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(
        hidden_size=hidden, n_routed_experts=num_experts, n_group=n_group, topk_group=topk_group,
        num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5,
    )
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(randn(num_experts, hidden, scale=hidden**-0.5))
        router.e_score_correction_bias.copy_(randn(num_experts, scale=0.1))
    return router


def _same_routing(weights, ids, hf_weights, hf_ids):
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "num_experts,n_group,topk_group,top_k,norm", [(8, 1, 1, 2, True), (16, 4, 2, 4, True), (32, 8, 3, 6, False), (256, 8, 4, 8, True)]
)
def test_noaux_tc_matches_hf_router(num_experts, n_group, topk_group, top_k, norm):
    router = _hf_v3_router(num_experts, n_group, topk_group, top_k, norm)
    x = randn(40, 32)
    _, hf_w, hf_ids = router(x)
    w, ids = moe.moe_route(
        x, router.weight, router.e_score_correction_bias, top_k=top_k, scoring_func="sigmoid", topk_method="noaux_tc",
        n_group=n_group, topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5,
    )
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    _same_routing(w, ids, hf_w, hf_ids)


@pytest.mark.parametrize("method,n_group,topk_group", [("greedy", 1, 1), ("group_limited_greedy", 4, 2)])
def test_v2_routing_matches_hf_router(method, n_group, topk_group):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(
        hidden_size=32, n_routed_experts=16, n_group=n_group, topk_group=topk_group, num_experts_per_tok=3,
        topk_method=method, routed_scaling_factor=16.0,
    )
    router = DeepseekV2TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(randn(16, 32, scale=32**-0.5))
    x = randn(40, 32)
    _, hf_w, hf_ids = router(x)
    w, ids = moe.moe_route(
        x, router.weight, None, top_k=3, scoring_func="softmax", topk_method=method, n_group=n_group,
        topk_group=topk_group, norm_topk_prob=False, routed_scaling_factor=16.0,
    )
    _same_routing(w, ids, hf_w, hf_ids)


def test_moe_experts_matches_hf_eager_experts():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    config = DeepseekV3Config(hidden_size=32, n_routed_experts=8, moe_intermediate_size=16)
    config._experts_implementation = "eager"
    experts = DeepseekV3Experts(config)
    with torch.no_grad():
        experts.gate_up_proj.copy_(randn(8, 32, 32, scale=32**-0.5))
        experts.down_proj.copy_(randn(8, 32, 16, scale=16**-0.5))
    x = randn(10, 32)
    ids = torch.stack([torch.randperm(7, generator=GEN)[:2] for _ in range(10)])  # expert 7 never chosen
    w = randn(10, 2).abs()
    golden = experts(x, ids, w)
    torch.testing.assert_close(moe.moe_experts(x, experts.gate_up_proj, experts.down_proj, w, ids), golden, atol=1e-6, rtol=1e-6)
    assert moe.moe_experts(x[:0], experts.gate_up_proj, experts.down_proj, w[:0], ids[:0]).shape == (0, 32)


def test_rms_norm_matches_hf():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    hf = DeepseekV3RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.1 * randn(48))
    for dtype in (torch.float32, torch.bfloat16):
        x, r = randn(5, 48).to(dtype), randn(5, 48).to(dtype)
        w = hf.weight.detach().to(dtype)
        hf_d = hf.to(dtype)
        torch.testing.assert_close(norm.rms_norm(x, w, 1e-6), hf_d(x), atol=0, rtol=0)
        out, res = norm.add_rms_norm(x, r, w, 1e-6)
        torch.testing.assert_close(res, r + x, atol=0, rtol=0)
        torch.testing.assert_close(out, hf_d(r + x), atol=0, rtol=0)


def test_rotary_matches_hf_layouts():
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb, apply_rotary_pos_emb_interleave

    r, h, t = 16, 3, 9
    table = rope.rope_cos_sin_table(r, 10000.0, None, 64)
    positions = torch.tensor([0, 1, 2, 5, 8, 13, 21, 34, 63])
    q, k = randn(t, h, r), randn(t, r)
    freqs = table[positions]
    cos, sin = torch.cat([freqs[:, : r // 2]] * 2, -1), torch.cat([freqs[:, r // 2 :]] * 2, -1)

    qi, ki = rope.rotary_embedding(q, k, positions, table, interleaved=True)
    hq, hk = apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k[None, None], cos[None], sin[None])
    # HF-V3 writes the rotated pairs de-interleaved: [evens | odds].
    deinterleave = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])
    torch.testing.assert_close(qi[..., deinterleave], hq[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ki[..., deinterleave], hk[0, 0], atol=1e-6, rtol=1e-6)

    angles = positions[:, None].float() * rope.rope_inv_freq(r, 10000.0, None)[0]
    v2q, v2k = apply_rotary_emb(q.transpose(0, 1)[None], k[None, None], torch.polar(torch.ones_like(angles), angles)[None])
    torch.testing.assert_close(qi, v2q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ki, v2k[0, 0], atol=1e-6, rtol=1e-6)

    qn, kn = rope.rotary_embedding(q, k, positions, table, interleaved=False)
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k[None, None], cos[None], sin[None])
    torch.testing.assert_close(qn, hq[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kn, hk[0, 0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "params",
    [
        # DeepSeek-V3 and V2-Lite rope_scaling
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.5},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "truncate": False},
        {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1, "attention_factor": 1.0},
    ],
)
def test_yarn_matches_transformers(params):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base = 10000.0
    config = DeepseekV3Config(
        qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters={**params, "rope_theta": base}
    )
    hf_inv, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    inv, factor = rope.rope_inv_freq(64, base, params)
    torch.testing.assert_close(inv, hf_inv.float(), atol=0, rtol=1e-6)
    assert factor == pytest.approx(hf_factor, rel=1e-12)
    table = rope.rope_cos_sin_table(64, base, params, 100)
    angles = torch.arange(100).float()[:, None] * inv
    torch.testing.assert_close(table, torch.cat([angles.cos(), angles.sin()], -1) * factor)


def test_yarn_softmax_scale_values():
    from deepinfer_core.models.deepseek_v3 import softmax_scale
    from deepinfer_core.config import ModelConfig
    from tests.hf_checkpoints import hf_config

    for mscale, expected in [(1.0, 0.135234), (0.707, 0.114721)]:
        hf = hf_config("v3_yarn", qk_nope_head_dim=128, qk_rope_head_dim=64, rope_parameters={
            "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": mscale,
            "mscale_all_dim": mscale, "rope_theta": 10000.0})
        assert softmax_scale(ModelConfig.from_hf(hf)) == pytest.approx(expected, abs=1e-6)


def test_ops_toml_covers_every_op():
    import tomllib
    from pathlib import Path

    from deepinfer_core.ops import OP_NAMES

    spec = tomllib.loads((Path(__file__).parent.parent / "specs" / "ops.toml").read_text())["ops"]
    assert set(spec) == set(OP_NAMES)
    for name, entry in spec.items():
        assert set(entry["tolerance"]) == {"float32", "bfloat16", "float16"}, name
        assert all({"atol", "rtol"} <= set(t) for t in entry["tolerance"].values()), name
        assert entry["shapes"] and all(isinstance(s, dict) for s in entry["shapes"]), name
