"""DeepSeek-V4.1 pieces against the spec's formulas (deepseek_architectures.md §4), and the
official config.json."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.config import ConfigError
from deepinfer_core.models.v41.config import FULL, REINDEX, REUSE, WINDOW, V41ModelConfig
from deepinfer_core.models.v41.model import DeepseekV41ForCausalLM
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.hyper import mhc_pre, mhc_pre_delayed
from deepinfer_core.ops.sparse import indexer_block_candidates
from tests.v41_official import OFFICIAL_CONFIG


def test_official_config_topology_and_real_shapes():
    c = V41ModelConfig.from_raw(OFFICIAL_CONFIG)
    assert c.num_hidden_layers == 40 and c.fp8_block == (32, 32) and c.expert_dtype == "fp4" and c.image_token_id == 129264
    assert c.compress_rope_parameters["attention_factor"] == 1.0  # no YaRN mscale on the compress rope
    modes = [c.mode(i) for i in range(40)]
    assert modes[:2] == [WINDOW] * 2 and [i for i, m in enumerate(modes) if m == FULL] == [2, 8, 14, 20]
    assert [i for i, m in enumerate(modes) if m == REINDEX] == [24, 28, 32, 36]
    assert all(m == REUSE for i, m in enumerate(modes) if i > 2 and i not in (8, 14, 20, 24, 28, 32, 36))
    assert [c.kv_owner(i) for i in (3, 19, 21, 39)] == [2, 14, 20, 20]
    assert [c.index_owner(i) for i in (3, 21, 25, 39)] == [2, 20, 24, 36]
    assert [i for i in range(40) if c.filters_candidates(i)] == [24, 28, 32, 36]
    model = DeepseekV41ForCausalLM(c, OpTable.reference(), torch.bfloat16, torch.device("meta"), keep_fp8=True)
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    f8 = torch.float8_e4m3fn
    # §5.4's shapes (scales: one per 32 x 32 block)
    assert shapes["model.layers.2.self_attn.q_a_proj.weight"] == ((1280, 5120), f8)
    assert shapes["model.layers.2.self_attn.q_a_proj.weight_scale_inv"][0] == (40, 160)
    assert shapes["model.layers.2.self_attn.q_b_proj.weight_scale_inv"][0] == (1024, 40)
    assert shapes["model.layers.2.self_attn.kv_proj.weight_scale_inv"][0] == (16, 160)
    assert shapes["model.layers.2.self_attn.o_a_proj.weight"] == ((8192, 4096), f8)
    assert shapes["model.layers.2.self_attn.o_b_proj.weight_scale_inv"][0] == (160, 256)
    assert shapes["model.layers.24.self_attn.indexer.q_b_proj.weight_scale_inv"][0] == (128, 40)
    assert shapes["model.layers.20.self_attn.indexer.k_proj.weight"][0] == (128, 512)
    assert "model.layers.20.self_attn.compressor.gate_proj.weight" not in shapes  # ratio 1: no gate
    assert shapes["model.layers.8.self_attn.compressor.gate_proj.weight"][0] == (512, 5120)
    assert "model.layers.24.self_attn.compressor.kv_proj.weight" not in shapes  # REINDEX owns no KV
    assert "model.layers.24.self_attn.indexer.k_proj.weight" not in shapes
    assert "model.layers.3.self_attn.indexer.q_b_proj.weight" not in shapes  # REUSE has no indexer
    assert shapes["model.layers.1.engram.embed.weight"] == ((384006168, 256), f8)
    assert shapes["model.layers.14.engram.embed.weight"][0] == (384016682, 256)
    assert shapes["model.layers.14.engram.kv_proj.weight_scale_inv"][0] == (800, 192)
    assert shapes["model.layers.1.engram.q_weight"][0] == (4, 5120)
    assert shapes["model.layers.0.mlp.gate.e_score_correction_bias"][0] == (384,)  # no hash layers
    assert shapes["model.layers.0.attn_hc.fn"][0] == (24, 20480)
    assert not any("hc_head" in k for k in shapes)  # the final collapse has no parameters
    groups = {g.name: g for g in model.cache_groups()}
    assert groups["c2_kv"].layers == tuple(f"model.layers.{i}.self_attn.compressed" for i in (2, 8, 14))
    assert groups["c1_kv"].layers == ("model.layers.20.self_attn.compressed",)
    assert len(groups["window"].layers) == 40


def test_config_errors_name_the_problem():
    bad = {**OFFICIAL_CONFIG, "text_config": {**OFFICIAL_CONFIG["text_config"], "kv_source_layer_ids": [8, 14, 20]}}
    with pytest.raises(ConfigError, match="layer 2 .*no KV source"):
        V41ModelConfig.from_raw(bad)
    bad = {**OFFICIAL_CONFIG, "text_config": {**OFFICIAL_CONFIG["text_config"], "engram_num_embeddings": [1, 2]}}
    model_config = V41ModelConfig.from_raw(bad)
    with pytest.raises(ConfigError, match="engram_num_embeddings"):
        DeepseekV41ForCausalLM(model_config, OpTable.reference(), torch.bfloat16, torch.device("meta"))


def test_delayed_mhc_mixes_from_the_streams_and_collapses_with_the_previous_pre():
    g = torch.Generator().manual_seed(0)
    t, hc, d = 5, 4, 16
    x = torch.randn(t, hc, d, generator=g)
    fn, base, scale = torch.randn((2 + hc) * hc, hc * d, generator=g) * 0.1, torch.randn((2 + hc) * hc, generator=g), torch.rand(3, generator=g)
    pre_in = torch.rand(t, hc, generator=g)
    pre, post, comb, y = mhc_pre_delayed(x, pre_in, fn, base, scale, hc_eps=1e-6, rms_eps=1e-20, sinkhorn_iters=20)
    post2, comb2, _ = mhc_pre(x, fn, base, scale, hc_eps=1e-6, rms_eps=1e-20, sinkhorn_iters=20)
    assert torch.equal(post, post2) and torch.equal(comb, comb2)
    flat = x.flatten(1)
    m = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-20)) @ fn.T
    assert torch.allclose(pre, torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + 1e-6, atol=1e-6)
    assert torch.allclose(y, (pre_in[:, :, None] * x).sum(1), atol=1e-6)


def _blocks_by_loop(q, w, keys, cands, scale, bs, top):
    out = []
    for t in range(cands.shape[0]):
        c = cands.shape[1]
        score = {}
        for col in range(c):
            j = int(cands[t, col])
            if j >= 0:
                s = sum(float(w[t, h]) * max(0.0, float(q[t, h] @ keys[j])) * scale for h in range(q.shape[1]))
                score[col // bs] = max(score.get(col // bs, float("-inf")), s)
        newest = max((col for col in range(c) if cands[t, col] >= 0), default=None)
        ranked = sorted(score, key=lambda b: (b != (newest // bs if newest is not None else -1), -score[b], b))
        keep = set(ranked[:top])
        out.append([b in keep for b in range(-(-c // bs))])
    return torch.tensor(out)


def test_block_candidates_keep_the_newest_block_and_the_best_scores():
    g = torch.Generator().manual_seed(3)
    t, heads, dim, c, bs, top = 6, 3, 8, 23, 4, 3
    q, w, keys = torch.randn(t, heads, dim, generator=g), torch.rand(t, heads, generator=g), torch.randn(c, dim, generator=g)
    seen = torch.tensor([23, 20, 13, 9, 4, 1])  # causal prefixes of different lengths
    cols = torch.arange(c)
    cands = torch.where(cols[None, :] < seen[:, None], cols[None, :], torch.full((t, c), -1))
    got = indexer_block_candidates(q, w, keys, cands, 0.5, bs, top)
    assert got.shape == (t, 6)
    assert torch.equal(got, _blocks_by_loop(q, w, keys, cands, 0.5, bs, top))
    assert (got.sum(1)[:3] == top).all()  # blocks are dropped where there are more than `top`
    for row, n in enumerate(seen.tolist()):
        assert got[row, (n - 1) // bs]  # the newest visible entry's block is always kept
    few = indexer_block_candidates(q, w, keys, cands[:, :12], 0.5, bs, top)
    assert few.all()  # no more blocks than places: all kept
