"""Reference ops against independent formulations (transformers' modules where they exist)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deepinfer_core.ops import attention, hyper, linear, moe, norm, rope, sparse
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


@pytest.mark.parametrize("norm", [False, True])
def test_routing_weights_by_hand(norm):
    """One token, 4 experts, logits [2, 0, -1, 1] (x = e0): noaux_tc's bias [0, 0.6, 0, 0] picks
    experts 0 and 1 (biased 0.88, 1.1 over 0.73), weighted by their unbiased sigmoid; V4's
    sqrtsoftplus picks 0 and 3. Renormalised to sum 1 only with norm_topk_prob, then times 2.5."""
    x = torch.tensor([[1.0, 0.0]])
    gate = torch.tensor([[2.0, 0.3], [0.0, -0.7], [-1.0, 0.2], [1.0, 0.9]])  # second column unused (x1 = 0)

    def sigmoid(v):
        return 1 / (1 + math.exp(-v))

    def sqrtsoftplus(v):
        return math.sqrt(math.log1p(math.exp(v)))

    for (w, ids), raw, want_ids in [
        (moe.moe_route(x, gate, torch.tensor([0.0, 0.6, 0.0, 0.0]), top_k=2, scoring_func="sigmoid", topk_method="noaux_tc",
                       n_group=1, topk_group=1, norm_topk_prob=norm, routed_scaling_factor=2.5), [sigmoid(2), sigmoid(0)], [0, 1]),
        (moe.moe_route_sqrtsoftplus(x, gate, None, None, top_k=2, norm_topk_prob=norm, routed_scaling_factor=2.5),
         [sqrtsoftplus(2), sqrtsoftplus(1)], [0, 3]),
    ]:
        order = ids[0].argsort()
        assert ids[0, order].tolist() == want_ids
        want = [2.5 * r / (sum(raw) if norm else 1.0) for r in raw]
        torch.testing.assert_close(w[0, order], torch.tensor(want), atol=1e-6, rtol=0)


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


def test_rotary_pairs_by_hand():
    """Rotations written out for r = 4 (independent of transformers): inv_freq = [1, 10000^-1/2] =
    [1, 0.01]; interleaved rotates (x0, x1) by p and (x2, x3) by 0.01 p, NeoX (x0, x2) and (x1, x3)."""
    positions = torch.tensor([0, 1, 3])
    table = torch.tensor([[math.cos(p), math.cos(0.01 * p), math.sin(p), math.sin(0.01 * p)] for p in range(4)])
    torch.testing.assert_close(rope.rope_cos_sin_table(4, 10000.0, None, 4), table)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    q, k = x.repeat(3, 2, 1), x.repeat(3, 1)  # [T=3, H=2, 4], [T=3, 4]

    def interleaved(p):
        c0, s0, c1, s1 = math.cos(p), math.sin(p), math.cos(0.01 * p), math.sin(0.01 * p)
        return [1 * c0 - 2 * s0, 2 * c0 + 1 * s0, 3 * c1 - 4 * s1, 4 * c1 + 3 * s1]

    def neox(p):
        c0, s0, c1, s1 = math.cos(p), math.sin(p), math.cos(0.01 * p), math.sin(0.01 * p)
        return [1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1]

    for is_interleaved, rotation in [(True, interleaved), (False, neox)]:
        want = torch.tensor([rotation(p) for p in positions.tolist()])
        got_q, got_k = rope.rotary_embedding(q, k, positions, table, interleaved=is_interleaved)
        torch.testing.assert_close(got_k, want, atol=1e-6, rtol=0)
        torch.testing.assert_close(got_q, want[:, None].expand(3, 2, 4), atol=1e-6, rtol=0)
    # (position 0 above is the identity) a unit vector on x0 moves only within its own pair
    e0 = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    _, k_i = rope.rotary_embedding(e0[:, None], e0, torch.tensor([1]), table, interleaved=True)
    _, k_n = rope.rotary_embedding(e0[:, None], e0, torch.tensor([1]), table, interleaved=False)
    torch.testing.assert_close(k_i[0], torch.tensor([math.cos(1), math.sin(1), 0.0, 0.0]))
    torch.testing.assert_close(k_n[0], torch.tensor([math.cos(1), 0.0, math.sin(1), 0.0]))


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
    from deepinfer_core.models.v3.model import softmax_scale
    from deepinfer_core.models.v3.config import V3ModelConfig
    from tests.hf_checkpoints import hf_config

    # (192^-1/2 * (0.1 * mscale_all_dim * ln 40 + 1)^2: mscale itself goes only into the cos/sin factor)
    for mscale, mscale_all_dim, expected in [(1.0, 1.0, 0.135234), (0.707, 0.707, 0.114721), (1.0, 0.707, 0.114721)]:
        hf = hf_config("v3_yarn", qk_nope_head_dim=128, qk_rope_head_dim=64, rope_parameters={
            "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": mscale,
            "mscale_all_dim": mscale_all_dim, "rope_theta": 10000.0})
        assert softmax_scale(V3ModelConfig.from_hf(hf)) == pytest.approx(expected, abs=1e-6)


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
        fp8 = entry.get("tolerance_fp8", {})  # looser tolerances for block-FP8 cases (W8A8 admitted)
        assert set(fp8) <= {"float32", "bfloat16", "float16"} and all({"atol", "rtol"} <= set(t) for t in fp8.values()), name
        assert not fp8 or any(s.get("fp8_block") for s in entry["shapes"]), name


def test_fp8_cases_get_the_fp8_tolerance():
    from deepinfer_core.conformance.spec import ops_spec, tolerance

    fp8, plain = {"fp8_block": [128, 128]}, {"fp8_block": []}
    assert tolerance("moe_experts", torch.bfloat16, fp8) == {k: float(v) for k, v in ops_spec()["moe_experts"]["tolerance_fp8"]["bfloat16"].items()}
    assert tolerance("moe_experts", torch.bfloat16, fp8)["atol"] > tolerance("moe_experts", torch.bfloat16, plain)["atol"]
    assert tolerance("moe_experts", torch.bfloat16, plain) == tolerance("moe_experts", torch.bfloat16)
    for dtype in (torch.float32, torch.float16):  # no W8A8 there
        assert tolerance("moe_experts", dtype, fp8) == tolerance("moe_experts", dtype)
    assert tolerance("fp8_block_linear", torch.bfloat16, {"block": [128, 128]}) == tolerance("fp8_block_linear", torch.bfloat16)


# ---- DeepSeek-V4 ops against transformers' deepseek_v4 modules -----------------------------------


def _v4_config(**overrides):
    from transformers import DeepseekV4Config

    base = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32,
            "q_lora_rank": 16, "n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 16,
            "index_n_heads": 16, "index_head_dim": 16, "index_topk": 5, "o_groups": 2, "o_lora_rank": 8, "hc_mult": 4,
            "hc_sinkhorn_iters": 20, "sliding_window": 4}
    return DeepseekV4Config(**{**base, **overrides})


def _v4(name: str):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4

    return getattr(modeling_deepseek_v4, name)


def _fill(module: torch.nn.Module, **scales) -> None:
    """Every parameter ~ N(0, scale^2) (scale by name, else 1 / sqrt(fan_in)); norms ~ 1 + 0.1 N(0, 1)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * randn(*p.shape))
            else:
                p.copy_(randn(*p.shape, scale=scales.get(leaf, p.shape[-1] ** -0.5)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v4_norms_match_hf(dtype):
    hf = _v4("DeepseekV4RMSNorm")(48, eps=1e-6)
    _fill(hf)
    with torch.no_grad():  # a bf16 checkpoint value, which transformers holds in float32
        hf.weight.copy_(hf.weight.bfloat16().float())
    x = randn(7, 48).to(dtype)
    assert hf.weight.dtype == torch.float32
    torch.testing.assert_close(norm.rms_norm_f32(x, hf.weight, 1e-6), hf(x), atol=0, rtol=0)
    # the weight as the checkpoint stores it: used in float32 all the same
    torch.testing.assert_close(norm.rms_norm_f32(x, hf.weight.bfloat16(), 1e-6), hf(x), atol=0, rtol=0)
    q = randn(5, 3, 64).to(dtype)  # per head, as V4's q_b_norm
    torch.testing.assert_close(norm.rms_normalize(q, 1e-6), _v4("DeepseekV4UnweightedRMSNorm")(eps=1e-6)(q), atol=0, rtol=0)
    assert norm.rms_norm_f32(x[:0], hf.weight, 1e-6).shape == (0, 48)


@pytest.mark.parametrize("limit", [10.0, 1.0])
def test_clamped_swiglu_matches_hf_mlp(limit):
    config = _v4_config(moe_intermediate_size=24, swiglu_limit=limit)
    mlp = _v4("DeepseekV4MLP")(config)
    _fill(mlp, weight=12 / math.sqrt(32))  # gate and up ~ N(0, 144): the clamp bites
    x = randn(9, 32)
    gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
    assert (gate_up.abs() > limit).float().mean() > 0.2
    from deepinfer_core.ops.activation import silu_and_mul_clamped

    ours = F.linear(silu_and_mul_clamped(gate_up, limit), mlp.down_proj.weight)
    torch.testing.assert_close(ours, mlp(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_sqrtsoftplus_routing_matches_hf_topk_router(norm_topk_prob):
    config = _v4_config(n_routed_experts=16, num_experts_per_tok=4, routed_scaling_factor=2.5)
    router = _v4("DeepseekV4TopKRouter")(config)
    with torch.no_grad():
        router.weight.copy_(randn(16, 32, scale=32**-0.5))
        router.e_score_correction_bias.copy_(randn(16, scale=0.1))
    x = randn(40, 32)
    _, hf_w, hf_ids = router(x)
    w, ids = moe.moe_route_sqrtsoftplus(x, router.weight, router.e_score_correction_bias, None, top_k=4,
                                        norm_topk_prob=True, routed_scaling_factor=2.5)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    _same_routing(w, ids, hf_w, hf_ids)
    # transformers always renormalises; without it the weights are the scores at the ids, scaled
    w_raw, ids_raw = moe.moe_route_sqrtsoftplus(x, router.weight, router.e_score_correction_bias, None, top_k=4,
                                                norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5)
    assert torch.equal(ids_raw.sort(-1).values, hf_ids.sort(-1).values)
    if not norm_topk_prob:
        scores = F.softplus(F.linear(x, router.weight)).sqrt()
        torch.testing.assert_close(w_raw, scores.gather(1, ids_raw) * 2.5, atol=1e-6, rtol=1e-6)
    # without a bias the top-k of the scores themselves
    _, no_bias_ids = moe.moe_route_sqrtsoftplus(x, router.weight, None, None, top_k=4, norm_topk_prob=True, routed_scaling_factor=2.5)
    assert torch.equal(no_bias_ids.sort(-1).values, F.linear(x, router.weight).topk(4, -1).indices.sort(-1).values)


def test_sqrtsoftplus_fixed_ids_match_hf_hash_router():
    config = _v4_config(n_routed_experts=16, num_experts_per_tok=4, routed_scaling_factor=1.5)
    router = _v4("DeepseekV4HashRouter")(config)
    with torch.no_grad():
        router.weight.copy_(randn(16, 32, scale=32**-0.5))
        router.tid2eid.copy_(torch.stack([torch.randperm(16, generator=GEN)[:4] for _ in range(config.vocab_size)]))
    input_ids = torch.randint(0, config.vocab_size, (2, 11), generator=GEN)
    x = randn(2, 11, 32)
    _, hf_w, hf_ids = router(x, input_ids)
    fixed = router.tid2eid[input_ids.reshape(-1)]
    bias = randn(16, scale=10.0)  # a (huge) bias must not matter: hash layers ignore it
    for b in (None, bias):
        w, ids = moe.moe_route_sqrtsoftplus(x.reshape(-1, 32), router.weight, b, fixed, top_k=4, norm_topk_prob=True,
                                            routed_scaling_factor=1.5)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(w, hf_w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("limit, std, block", [(10.0, 12.0, None), (1.0, 1.0, None), (10.0, 12.0, (16, 16))],
                         ids=["limit10", "limit1", "fp8"])
def test_clamped_experts_match_hf_eager_experts(limit, std, block):
    config = _v4_config(hidden_size=48, n_routed_experts=8, moe_intermediate_size=24, swiglu_limit=limit)
    config._experts_implementation = "eager"
    experts = _v4("DeepseekV4Experts")(config)
    w13, w2 = randn(8, 48, 48, scale=std / math.sqrt(48)), randn(8, 48, 24, scale=24**-0.5 / std**2)
    if block:  # FP8 experts: transformers runs the dequantised weights
        (q13, s13), (q2, s2) = zip(*[quantize_fp8_block(w, block) for w in w13]), zip(*[quantize_fp8_block(w, block) for w in w2])
        q13, s13, q2, s2 = torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)
        w13 = torch.stack([dequantize(q, s, block) for q, s in zip(q13, s13)])
        w2 = torch.stack([dequantize(q, s, block) for q, s in zip(q2, s2)])
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
    x = randn(10, 48)
    ids = torch.stack([torch.randperm(7, generator=GEN)[:3] for _ in range(10)])  # expert 7 never chosen
    w = randn(10, 3).abs()
    golden = experts(x, ids, w)
    h = F.linear(x, w13[ids[0, 0]])
    assert (h.abs() > limit).any()  # the clamp bites
    if block:
        ours = moe.moe_experts_clamped(x, q13, q2, w, ids, limit, s13, s2, block)
    else:
        ours = moe.moe_experts_clamped(x, experts.gate_up_proj, experts.down_proj, w, ids, limit)
    torch.testing.assert_close(ours, golden, atol=1e-5, rtol=1e-5)
    unclamped = moe.moe_experts(x, w13, w2, w, ids)
    assert (unclamped - golden).abs().max() > 1e-2  # and the clamp matters
    assert moe.moe_experts_clamped(x[:0], w13, w2, w[:0], ids[:0], limit).shape == (0, 48)


@pytest.mark.parametrize("op", ["moe_experts", "moe_experts_clamped"])
def test_mxfp4_experts_are_the_dequantised_experts(op):
    """uint8 w13 / w2 (packed E2M1, low nibble first) with UE8M0 scales: exactly the experts
    dequantised by ops.linear.dequantize_mxfp4, in any compute dtype; bad shapes are refused."""
    from deepinfer_core.conformance.checkpoints import quantize_mxfp4

    e, hidden, inter = 4, 64, 48  # I = 48: a partial scale group
    q13, s13 = quantize_mxfp4(randn(e, 2 * inter, hidden, scale=hidden**-0.5))  # w13 from float weights
    q2 = torch.randint(0, 256, (e, hidden, inter // 2), dtype=torch.uint8, generator=GEN)  # w2 random codes
    s2 = torch.randint(118, 123, (e, hidden, 2), dtype=torch.uint8, generator=GEN)
    q13, s13 = q13.view(torch.uint8), s13.view(torch.uint8)
    extra = (1.0,) if op == "moe_experts_clamped" else ()
    x = randn(6, hidden)
    ids = torch.stack([torch.randperm(3, generator=GEN)[:2] for _ in range(6)])  # expert 3 never chosen
    w = randn(6, 2).abs()
    fn = getattr(moe, op)
    for dtype in (torch.float32, torch.bfloat16):
        ours = fn(x.to(dtype), q13, q2, w, ids, *extra, s13, s2)
        deq = [linear.dequantize_mxfp4(q, s, dtype) for q, s in ((q13, s13), (q2, s2))]
        assert torch.equal(ours, fn(x.to(dtype), *deq, w, ids, *extra))
    with pytest.raises(ValueError, match="MXFP4 experts"):
        fn(x, q13, q2, w, ids, *extra, s13[..., :1], s2)
    with pytest.raises(ValueError, match="MXFP4 experts"):
        fn(x[:, :32], q13, q2, w, ids, *extra, s13, s2)


def _hf_hyper(cls: str, hidden: int, hc: int = 4, iters: int = 20):
    module = _v4(cls)(_v4_config(hidden_size=hidden, hc_mult=hc, hc_sinkhorn_iters=iters))
    fn_name, base_name, scale_name = ("fn", "base", "scale") if cls == "DeepseekV4HyperConnection" else ("hc_fn", "hc_base", "hc_scale")
    with torch.no_grad():
        fn = getattr(module, fn_name)
        fn.copy_(randn(*fn.shape, scale=(hc * hidden) ** -0.5))
        getattr(module, base_name).copy_(randn(*getattr(module, base_name).shape, scale=0.1))
        getattr(module, scale_name).copy_(1 + randn(*getattr(module, scale_name).shape, scale=0.1))
    return module, getattr(module, fn_name), getattr(module, base_name), getattr(module, scale_name)


@pytest.mark.parametrize("hc, iters", [(4, 20), (3, 1), (2, 5)])
def test_mhc_pre_matches_hf_hyper_connection(hc, iters):
    module, fn, base, scale = _hf_hyper("DeepseekV4HyperConnection", 40, hc, iters)
    x = randn(2, 6, hc, 40)
    hf_post, hf_comb, hf_collapsed = module(x)
    post, comb, collapsed = hyper.mhc_pre(x.reshape(12, hc, 40), fn, base, scale, hc_eps=module.hc_eps, rms_eps=1e-6,
                                          sinkhorn_iters=iters)
    assert post.dtype == comb.dtype == torch.float32 and collapsed.dtype == x.dtype
    torch.testing.assert_close(post, hf_post.reshape(12, hc), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(comb, hf_comb.reshape(12, hc, hc), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(collapsed, hf_collapsed.reshape(12, 40), atol=1e-6, rtol=1e-6)
    assert hyper.mhc_pre(x[0, :0], fn, base, scale, hc_eps=1e-6, rms_eps=1e-6, sinkhorn_iters=iters)[2].shape == (0, 40)


def test_mhc_post_is_hfs_stream_update():
    """The decoder layer's update, new = post * out + comb^T x (transformers' DeepseekV4DecoderLayer,
    here in float32), on the coefficients mhc_pre gives for the streams x."""
    module = _hf_hyper("DeepseekV4HyperConnection", 40)[0]
    x = randn(1, 7, 4, 40)
    post, comb, _ = module(x)
    out = randn(1, 7, 40)  # the block's output
    hf_new = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)
    ours = hyper.mhc_post(out[0], x[0], post[0], comb[0])
    torch.testing.assert_close(ours, hf_new[0], atol=1e-6, rtol=1e-6)
    # written out: stream k gets post_k * out + sum_j comb[j, k] x_j
    k = 2
    torch.testing.assert_close(ours[:, k], post[0, :, k, None] * out[0] + (comb[0, :, :, k, None] * x[0]).sum(1), atol=1e-6, rtol=1e-6)
    bf = hyper.mhc_post(out[0].bfloat16(), x[0].bfloat16(), post[0], comb[0])
    assert bf.dtype == torch.bfloat16


def test_mhc_head_matches_hf_hyper_head():
    module, fn, base, scale = _hf_hyper("DeepseekV4HyperHead", 40)
    x = randn(2, 5, 4, 40)
    ours = hyper.mhc_head(x.reshape(10, 4, 40), fn, base, scale, hc_eps=module.eps, rms_eps=1e-6)
    torch.testing.assert_close(ours, module(x).reshape(10, 40), atol=1e-6, rtol=1e-6)


def _sliding_indices(lens: list[int], window: int, gen=GEN) -> torch.Tensor:
    """Each token of each sequence (one pool of all their keys, sequence after sequence) names
    the keys of its sliding window, in a random order with -1 padding mixed in."""
    rows, start = [], 0
    width = window + 2
    for n in lens:
        for p in range(n):
            keys = torch.arange(start + max(0, p - window + 1), start + p + 1)
            row = torch.full((width,), -1, dtype=torch.int64)
            row[torch.randperm(width, generator=gen)[: keys.numel()]] = keys[torch.randperm(keys.numel(), generator=gen)]
            rows.append(row)
        start += n
    return torch.stack(rows)


@pytest.mark.parametrize("window", [4, 64])
def test_sparse_attention_matches_hf_eager_with_sinks(window):
    """A causal sliding-window layer as transformers computes it (eager attention with sinks, K = V,
    one KV head): the same keys named as indices, two sequences in one pool."""
    from types import SimpleNamespace

    h, d, lens = 4, 32, [9, 6]
    sinks = randn(h)
    module = SimpleNamespace(num_key_value_groups=h, sinks=sinks, training=False)
    q, kv = randn(sum(lens), h, d), randn(sum(lens), d)
    indices = _sliding_indices(lens, window)
    ours = sparse.sparse_attention(q, kv, indices, sinks, d**-0.5)
    eager = _v4("eager_attention_forward")
    start = 0
    for n in lens:
        pos = torch.arange(n)
        visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
        mask = torch.zeros(n, n).masked_fill(~visible, float("-inf"))[None, None]
        qs, ks = q[start : start + n].transpose(0, 1)[None], kv[start : start + n][None, None]
        hf, _ = eager(module, qs, ks, ks, mask, scaling=d**-0.5)
        torch.testing.assert_close(ours[start : start + n], hf[0], atol=1e-5, rtol=1e-5)
        start += n


def test_sparse_attention_sinks_and_empty_rows():
    """The sink takes probability without a value (o = the keys' softmax weights times
    1 - P_sink); a query naming no key (or an empty pool) gets zeros."""
    q, kv, sinks = randn(3, 2, 8), randn(5, 8), torch.tensor([0.5, -1.0])
    indices = torch.tensor([[1, -1, 3], [-1, -1, -1], [4, 0, 2]])
    got = sparse.sparse_attention(q, kv, indices, sinks, 0.3)
    s = q[0] @ kv[[1, 3]].T * 0.3
    p = torch.cat([s, sinks[:, None]], -1).softmax(-1)[:, :2]
    torch.testing.assert_close(got[0], p @ kv[[1, 3]], atol=1e-6, rtol=1e-6)
    assert torch.count_nonzero(got[1]) == 0 and torch.count_nonzero(got[2]) > 0
    assert torch.count_nonzero(sparse.sparse_attention(q, kv[:0], torch.full((3, 2), -1), sinks, 0.3)) == 0


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_sparse_attention_key_pools_are_their_concatenation(batch_invariant):
    """kv as 1-3 pools (a tuple or a list; empty ones anywhere; row-strided views) is the pool of
    their rows in order: same bits as the concatenated tensor, in the plain and the
    batch-invariant reference tables (which the Ascend plugin falls back to). Bad mixes are refused."""
    from deepinfer_core.ops import reference_ops

    op = reference_ops(batch_invariant)["sparse_attention"]
    q, kv, sinks = randn(4, 3, 8), randn(12, 8), randn(3)
    indices = torch.tensor([[0, 4, 5, 11], [-1, 3, -1, 6], [-1, -1, -1, -1], [11, 10, 9, 8]])
    whole = op(q, kv, indices, sinks, 0.3)
    wide = torch.cat([kv, kv], dim=1)[:, 8:]  # row stride 16
    for pools in [(kv,), [kv[:5], kv[5:]], (kv[:5], kv[:0], wide[5:]), (kv[:0], wide[:7], kv[7:]), (kv[:4], kv[4:8], wide[8:])]:
        assert torch.equal(op(q, pools, indices, sinks, 0.3), whole), [p.shape for p in pools]
    assert torch.equal(sparse.key_pool((kv[:5], wide[5:])), kv) and sparse.key_pool(kv) is kv
    for bad in [(), (kv,) * 4, (kv, kv[:, :4]), (kv, kv.double()), (kv, kv[None]), kv.tolist()]:
        with pytest.raises(ValueError, match="kv"):
            op(q, bad, indices, sinks, 0.3)


def _windows(kv: torch.Tensor, gate: torch.Tensor, m: int, overlap: bool):
    """HF's compressor layout for one sequence: [n, m, C] (HCA), or [n, 2m, C/2] for CSA (window w
    pools window w-1's first half of channels and its own second half; window 0's first half
    empty: kv 0, gate -inf)."""
    n = kv.shape[0] // m
    kv, gate = kv[: n * m].view(n, m, -1), gate[: n * m].view(n, m, -1)
    if not overlap:
        return kv, gate
    c = kv.shape[-1] // 2
    new_kv, new_gate = kv.new_zeros(n, 2 * m, c), gate.new_full((n, 2 * m, c), float("-inf"))
    new_kv[:, m:], new_gate[:, m:] = kv[..., c:], gate[..., c:]
    new_kv[1:, :m], new_gate[1:, :m] = kv[:-1, :, :c], gate[:-1, :, :c]
    return new_kv, new_gate


@pytest.mark.parametrize("kind", ["heavily_compressed_attention", "compressed_sparse_attention"])
def test_compress_pool_matches_hf_compressors(kind):
    """transformers' stateless compressor forward (pooled in kv's dtype, DeepseekV4RMSNorm, RoPE at
    each window's first position) equals compress_pool on its windows, then the same RoPE."""
    m = 4
    config = _v4_config(compress_rates={"compressed_sparse_attention": m, "heavily_compressed_attention": m})
    cls = "DeepseekV4HCACompressor" if kind.startswith("heavily") else "DeepseekV4CSACompressor"
    comp = _v4(cls)(config)
    _fill(comp, position_bias=1.0)
    x, seq = randn(1, 18, 32), 18  # 4 windows and 2 tokens of an unfinished one
    hf_kv, _ = comp(x, randn(1, seq, config.q_lora_rank), torch.arange(seq)[None], None, 0)
    kv = comp.kv_proj(x[0])
    gate = comp.gate_proj(x[0])
    gate = gate + comp.position_bias.repeat(seq // m + 1, 1)[:seq]
    windows_kv, windows_gate = _windows(kv, gate, m, overlap=kind.startswith("compressed"))
    pooled = sparse.compress_pool(windows_kv, windows_gate, comp.kv_norm.weight, 1e-6)
    positions = torch.arange(pooled.shape[0])[None] * m
    cos, sin = comp.rotary_emb(pooled, position_ids=positions, layer_type="compress")
    ours = _v4("apply_rotary_pos_emb")(pooled[None, None], cos, sin)[0, 0]
    torch.testing.assert_close(ours, hf_kv[0, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_pool_weighs_in_kv_dtype_as_hf(dtype):
    """HF's pooling math itself, (kv * softmax_fp32(gate).to(kv.dtype)).sum then the norm, bit for bit."""
    kv, gate = randn(5, 8, 24).to(dtype), randn(5, 8, 24)
    gate[0, :4] = float("-inf")
    weight = 1 + 0.1 * randn(24)
    hf_norm = _v4("DeepseekV4RMSNorm")(24, eps=1e-6)
    with torch.no_grad():
        hf_norm.weight.copy_(weight)
    hf = hf_norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))
    torch.testing.assert_close(sparse.compress_pool(kv, gate, weight, 1e-6), hf, atol=0, rtol=0)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_entries_is_pool_then_rope_on_the_named_rows(overlap, dtype):
    """compress_entries over two row-strided pools (a ring of the older rows, this step's newer
    ones) is, bit for bit, compress_pool on HF's window layout of the same rows (kv rounded to
    the dtype first) and then rotary_embedding of the trailing dims at each window's start."""
    m, seq, c, r = 4, 18, 12, 6
    width = 2 * c if overlap else c
    kv, gate = randn(seq, width).to(dtype).float(), randn(seq, width)
    wide = torch.cat([randn(seq, 3), kv, gate], dim=1)  # rows of a wider tensor: columns 3.. are the op's
    state, rows = wide[:10, 3:], wide[10:, 3:]  # tokens 0..9 in the ring, 10..17 new: row 8 + t is ring row t
    n = seq // m
    span = 2 * m if overlap else m
    tokens = torch.arange(n)[:, None] * m + torch.arange(span)[None, :] - (m if overlap else 0)
    windows = torch.where(tokens < 0, -1, torch.where(tokens >= 10, tokens - 10, tokens + rows.shape[0]))
    positions = torch.arange(n) * m
    table = rope.rope_cos_sin_table(r, 10000.0, None, 64)
    weight = 1 + 0.1 * randn(c)
    got = sparse.compress_entries(rows, state, windows, positions, weight, 1e-6, table, overlap, dtype)
    windows_kv, windows_gate = _windows(kv, gate, m, overlap)
    pooled = sparse.compress_pool(windows_kv.to(dtype), windows_gate, weight, 1e-6)
    pe = rope.rotary_embedding(pooled[:, None, -r:], pooled[:, -r:], positions, table, True)[0][:, 0]
    assert got.dtype == dtype and torch.equal(got, torch.cat([pooled[:, :-r], pe], dim=-1))


def test_compress_entries_refuses_inconsistent_shapes():
    rows, windows, positions, table = torch.zeros(3, 32), torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), torch.zeros(9, 4)
    ok = (rows, rows[:0], windows, positions, torch.ones(8), 1e-6, table, True, torch.float32)
    assert sparse.compress_entries(*ok).shape == (2, 8)
    for i, bad, says in [(1, torch.zeros(3, 16), "rows"), (0, torch.zeros(3, 30), "multiple of 4"),
                         (2, windows[:, :7], "even"), (3, positions[:1], "positions"), (4, torch.ones(16), "norm_weight"),
                         (6, torch.zeros(9, 10), "r <= dim"), (6, torch.zeros(9, 3), "r even")]:
        with pytest.raises(ValueError, match=says):
            sparse.compress_entries(*ok[:i], bad, *ok[i + 1 :])


def test_indexer_topk_matches_hf_scorer_and_topk():
    """transformers' DeepseekV4IndexerScorer with its causal top-k (entries w < (p + 1) // m, picks
    beyond them -1): the same queries with each one's visible entries as candidates."""
    m, seq, entries = 4, 21, 5
    config = _v4_config(index_topk=3)
    scorer = _v4("DeepseekV4IndexerScorer")(config)
    _fill(scorer)
    hidden = randn(1, seq, 32)
    q = randn(1, seq, config.index_n_heads, config.index_head_dim)
    keys = randn(1, entries, config.index_head_dim)
    scores = scorer(q, keys, hidden)  # [1, S, T]
    threshold = (torch.arange(seq) + 1) // m
    future = torch.arange(entries)[None, :] >= threshold[:, None]
    top = scores[0].masked_fill(future, float("-inf")).topk(3, dim=-1).indices
    hf_ids = torch.where(top >= threshold[:, None], -1, top)
    weights = scorer.weights_proj(hidden[0]).float() * scorer.weights_scaling
    candidates = torch.full((seq, entries + 2), -1)
    for p in range(seq):
        visible = torch.arange(int(threshold[p].clamp(max=entries)))
        candidates[p, torch.randperm(entries + 2, generator=GEN)[: visible.numel()]] = visible[torch.randperm(visible.numel(), generator=GEN)]
    ours = sparse.indexer_topk(q[0], weights, keys[0], candidates, 3, scorer.softmax_scale)
    assert ours.shape == (seq, 3) and ours.dtype == torch.int64
    assert torch.equal(ours.sort(-1).values, hf_ids.sort(-1).values)
    assert (ours[:3] == -1).all() and (ours[11:] >= 0).all()  # no entry yet; then at least 3 (p >= 11)


def test_write_cache_stores_rows_casts_and_skips_padding():
    cache = torch.zeros(3, 4, 6)
    values = randn(4, 6).bfloat16()
    sparse.write_cache(cache, values, torch.tensor([9, -1, 0, 5]))
    flat = cache.view(-1, 6)
    torch.testing.assert_close(flat[[9, 0, 5]], values[[0, 2, 3]].float(), atol=0, rtol=0)
    assert flat.abs().sum(-1).nonzero().flatten().tolist() == [0, 5, 9]
