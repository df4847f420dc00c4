"""The DeepSeek-V4 golden tooling itself (tests/hf_checkpoints_v4.py): configs build and save,
quantised checkpoints' goldens hold exactly the dequantised weights (read back by transformers'
own loaders), greedy goldens are non-degenerate and agree with transformers' cached generate,
the CSA indexer really selects, and routing is spread out."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer_core.conformance.checkpoints import quantize_fp8_block_e8m0, quantize_mxfp4
from deepinfer_core.loader import dequantize_mxfp4
from deepinfer_core.ops.linear import dequantize_fp8_block
from tests.hf_checkpoints_v4 import (
    CONFIGS_V4,
    CSA,
    FP8_BLOCK,
    HCA,
    PROMPT_LEN_V4,
    SWA,
    build_model_v4,
    compress_ratios,
    hf_cached_greedy,
    hf_config_v4,
    hf_greedy_goldens,
    hf_logprobs,
    hf_mtp_logits,
    load_golden_v4,
    random_prompt,
    read_checkpoint_dequantised,
    write_checkpoint_v4,
)

NAMES = list(CONFIGS_V4)
NEW_TOKENS = 12


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    return {name: build_model_v4(name) for name in NAMES}


def _load(path, **kwargs):
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(str(path), attn_implementation="eager", experts_implementation="eager", **kwargs)
    return model.float().eval()


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    bad = [k for k in sa if not torch.equal(sa[k], sb[k].to(sa[k].dtype))]
    assert not bad, bad[:10]


# ---------------------------------------------------------------------------------------------- configs


def test_configs_cover_what_they_claim():
    cfgs = {name: hf_config_v4(name) for name in NAMES}
    assert {c.hc_mult for c in cfgs.values()} == {2, 4}
    assert {sum(t == "hash_moe" for t in c.mlp_layer_types) for c in cfgs.values()} == {0, 1, 2}
    assert {c.sliding_window for c in cfgs.values()} == {8, 16}
    assert {c.qk_rope_head_dim for c in cfgs.values()} == {8, 16}
    assert {c.compress_rates[HCA] for c in cfgs.values() if HCA in c.layer_types} == {8, 16, 128}
    assert all(c.o_groups == 2 and c.num_experts_per_tok == 2 and 4 <= c.n_routed_experts <= 8 for c in cfgs.values())
    yarn = [c.rope_parameters["compress"] for c in cfgs.values() if c.rope_parameters["compress"]["rope_type"] == "yarn"]
    assert yarn and all(r["factor"] == 16 and r["attention_factor"] == 1.0 for r in yarn)
    assert cfgs["v4_swa_nohash"].rope_parameters["compress"]["rope_type"] == "default"
    assert all(c.rope_parameters["main"]["rope_type"] == "default" for c in cfgs.values())
    # the legacy list is folded into layer_types, its MTP tail dropped
    legacy = cfgs["v4_legacy_ratios"]
    assert legacy.layer_types == [SWA, CSA, HCA, CSA]
    assert compress_ratios(legacy) == [0, 4, 128, 4, 0]
    assert compress_ratios(cfgs["v4_flash_like"]) == [0, 4, 8, 4, 0]
    assert compress_ratios(cfgs["v4_pro_like"]) == [16, 16, 4, 16, 0]
    # index_topk below the CSA entries of the prompt (the indexer selects) in all but v4_pro_like
    for name, c in cfgs.items():
        entries = PROMPT_LEN_V4[name] // c.compress_rates[CSA]
        assert (c.index_topk < entries) == (name != "v4_pro_like"), name
        if HCA in c.layer_types:
            assert PROMPT_LEN_V4[name] // c.compress_rates[HCA] >= 2, name
        assert PROMPT_LEN_V4[name] > c.sliding_window


def test_transformers_compress_ratios_are_type_tags():
    """transformers 5.24 maps compress_ratios values through {0, 4, 128} only; a real small HCA
    ratio is a KeyError, so configs with one give layer_types + compress_rates instead."""
    from transformers import DeepseekV4Config

    with pytest.raises(KeyError):
        DeepseekV4Config(num_hidden_layers=2, compress_ratios=[4, 8, 0])
    c = DeepseekV4Config(num_hidden_layers=2, compress_ratios=[4, 128, 0], compress_rates={CSA: 4, HCA: 8})
    assert c.layer_types == [CSA, HCA] and c.compress_rates[HCA] == 8


# ---------------------------------------------------------------------------------------------- writing


@pytest.mark.parametrize("name", NAMES)
def test_save_pretrained_roundtrip(name, tmp_path, models):
    golden = write_checkpoint_v4(name, tmp_path)
    assert golden.dtype == torch.float32 and golden.config._attn_implementation == "eager"
    assert golden.config._experts_implementation == "eager"
    _assert_same_state(golden, models[name])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["layer_types"] == models[name].config.layer_types
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "head.weight" in keys and "model.embed_tokens.weight" in keys  # transformers' hybrid naming
    assert "model.layers.0.attn.norm.weight" in keys  # the kv_norm, written back lossily as attn.norm


def _fp8_keys(keys):
    return {k for k in keys if k.endswith(".scale")}


@pytest.mark.parametrize("quant", ["fp8", "fp8+fp4"])
@pytest.mark.parametrize("name", NAMES)
def test_quantised_golden_is_the_dequantised_checkpoint(name, quant, tmp_path, models):
    ckpt = tmp_path / "ckpt"
    golden = write_checkpoint_v4(name, ckpt, quant=quant)
    config, values = read_checkpoint_dequantised(ckpt)
    assert config["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
        "weight_block_size": list(FP8_BLOCK), "activation_scheme": "dynamic",
    }
    assert config["expert_dtype"] == ("fp4" if quant == "fp8+fp4" else "fp8")
    assert config["compress_ratios"] == compress_ratios(golden.config)[: golden.config.num_hidden_layers]
    assert config["num_nextn_predict_layers"] == 0 and config["architectures"] == ["DeepseekV4ForCausalLM"]
    if golden.config.rope_parameters["compress"]["rope_type"] == "yarn":
        assert config["rope_scaling"] == {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}

    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert not any(k.startswith("model.") for k in dtypes)
    scaled = {k[: -len(".scale")] for k in _fp8_keys(dtypes)}
    assert all(dtypes[k + ".scale"] == "F8_E8M0" for k in scaled)
    for k in scaled:
        kind = k.split(".", 2)[-1]
        assert kind.startswith(("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
                                "ffn.shared_experts.", "ffn.experts.")), k
        want = "I8" if quant == "fp8+fp4" and ".ffn.experts." in k else "F8_E4M3"
        assert dtypes[k + ".weight"] == want, k
    for k, dt in dtypes.items():
        if k.endswith((".wkv.weight", ".wgate.weight", "weights_proj.weight", "gate.weight", "norm.weight")) and ".compressor." in k:
            assert dt == "BF16", k
        if k.endswith(("weights_proj.weight", "gate.weight", "norm.weight")) or k in ("embed.weight", "head.weight"):
            assert dt == "BF16", k
        if k.endswith(("attn_sink", "ape", "gate.bias")) or "hc_" in k:
            assert dt == "F32", k
    assert dtypes.get("layers.0.ffn.gate.tid2eid", "I64") == "I64"

    # quantisation moved the weights, but not by much
    original = models[name].state_dict()
    w = golden.state_dict()["model.layers.0.self_attn.q_a_proj.weight"]
    assert not torch.equal(w, original["model.layers.0.self_attn.q_a_proj.weight"])
    assert torch.allclose(w, original["model.layers.0.self_attn.q_a_proj.weight"], atol=0.1)

    # 1. transformers' own FP8 / FP4 loader (dequantize=True) on the quantised checkpoint
    _assert_same_state(golden, load_golden_v4(ckpt))

    # 2. the dequantised values (our dequantiser) in original naming, through transformers' key conversion
    twin = tmp_path / "twin"
    twin.mkdir()
    for key in ("quantization_config", "expert_dtype"):
        config.pop(key)
    config["dtype"] = "float32"
    (twin / "config.json").write_text(json.dumps(config))
    save_file(values, str(twin / "model.safetensors"), metadata={"format": "pt"})
    _assert_same_state(golden, _load(twin))

    # and the golden is still close to the unquantised model (FP8: mean KL ~0.05, FP4 experts ~0.2)
    prompt = random_prompt(40)
    a, b = hf_logprobs(models[name], prompt), hf_logprobs(golden, prompt)
    assert (a.exp() * (a - b)).sum(-1).mean() < 0.5
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.4


def test_partial_fp8_blocks(tmp_path):
    """A block that does not divide the dimensions (v4_pro_like: q_lora_rank 48 at 32x32)."""
    golden = write_checkpoint_v4("v4_pro_like", tmp_path / "ckpt", quant="fp8", block=(32, 32))
    config, values = read_checkpoint_dequantised(tmp_path / "ckpt")
    assert config["quantization_config"]["weight_block_size"] == [32, 32]
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), framework="pt") as f:
        assert list(f.get_slice("layers.0.attn.wq_a.scale").get_shape()) == [2, 2]  # [48, 64] in 32x32 blocks
    torch.testing.assert_close(values["layers.0.attn.wq_a.weight"], golden.state_dict()["model.layers.0.self_attn.q_a_proj.weight"], rtol=0, atol=0)


def test_quantisers():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(40, 64, generator=gen) * torch.logspace(-3, 1, 64)  # per-column magnitudes over 4 decades
    q, s = quantize_fp8_block_e8m0(w, (16, 16))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (3, 4)
    sf = s.float()
    assert torch.equal(sf, torch.exp2(torch.log2(sf).round()))  # powers of two
    deq = dequantize_fp8_block(q, s, (16, 16), torch.float32)
    assert ((deq - w).abs() <= 2.0**-4 * w.abs() + 1e-30 + sf.repeat_interleave(16, 0)[:40].repeat_interleave(16, 1) * 2.0**-9).all()
    assert torch.equal(deq, deq.bfloat16().float())  # e4m3 x 2^k is exact in bf16

    p, s4 = quantize_mxfp4(w)
    assert p.dtype == torch.int8 and p.shape == (40, 32) and s4.shape == (40, 2)
    deq4 = dequantize_mxfp4(p, s4, torch.float32)
    # low nibble first: element 0 of row 0 is the low nibble of byte 0
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    b0 = int(p.view(torch.uint8)[0, 0])
    v0 = table[b0 & 7] * (-1 if b0 & 8 else 1) * float(s4[0, 0].float())
    assert deq4[0, 0].item() == v0
    step = s4.float().repeat_interleave(32, 1)
    assert ((deq4 - w).abs() <= step).all()  # half the widest E2M1 gap (4 -> 6) times the scale
    group_max = w.abs().view(40, 2, 32).amax(-1).repeat_interleave(32, 1)
    assert ((group_max / step > 3) & (group_max / step <= 6)).all()  # no clipping, scale as small as it can be
    x = torch.tensor([[6.0, -6.0, 0.7, -1.3, 2.6, 5.1, 0.2, -0.3, 0.25, -2.5, 5.0] + [0.0] * 21])
    q4, sc4 = quantize_mxfp4(x)
    assert float(sc4[0, 0].float()) == 1.0
    assert dequantize_mxfp4(q4, sc4, torch.float32)[0, :11].tolist() == [6.0, -6.0, 0.5, -1.5, 3.0, 6.0, 0.0, -0.5, 0.5, -3.0, 6.0]  # ties up
    assert q4.view(torch.uint8)[0, 0].item() == 0x7 | (0xF << 4)  # 6 -> code 7 (low nibble), -6 -> code 15


def test_mtp_tensors(tmp_path):
    golden, mtp = write_checkpoint_v4("v4_flash_like", tmp_path / "ckpt", quant="fp8+fp4", with_mtp=True)
    config, values = read_checkpoint_dequantised(tmp_path / "ckpt")
    assert config["num_nextn_predict_layers"] == 1 and config["compress_ratios"] == [0, 4, 8, 4, 0]
    assert set(mtp) == {k for k in values if k.startswith("mtp.0.")}
    assert all(torch.equal(mtp[k], values[k]) for k in mtp)
    names = {k[len("mtp.0."):] for k in mtp}
    for key in ("enorm.weight", "hnorm.weight", "norm.weight", "e_proj.weight", "h_proj.weight", "hc_head_fn", "hc_head_base",
                "hc_head_scale", "attn.wq_a.weight", "attn.attn_sink", "ffn.gate.bias", "ffn.experts.0.w1.weight",
                "hc_attn_fn", "hc_ffn_scale", "attn_norm.weight", "ffn_norm.weight"):
        assert key in names, key
    assert not any("compressor" in k or "indexer" in k or "tid2eid" in k for k in names)
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("mtp.0.e_proj.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("mtp.0.e_proj.scale").get_dtype() == "F8_E8M0"
        assert f.get_slice("mtp.0.ffn.experts.0.w2.weight").get_dtype() == "I8"
    _assert_same_state(golden, load_golden_v4(tmp_path / "ckpt"))  # transformers skips mtp.*
    # the MTP reference composed from transformers' modules runs and is not degenerate
    ids = random_prompt(40)
    logits = hf_mtp_logits(golden, mtp, ids)
    assert logits.shape == (39, golden.config.vocab_size) and torch.isfinite(logits).all()
    assert len(set(logits.argmax(-1).tolist())) >= 10
    torch.testing.assert_close(hf_mtp_logits(golden, mtp, ids[:20]), logits[:19], atol=1e-4, rtol=0)  # causal
    # bf16 naming for save_pretrained checkpoints too
    _, mtp2 = write_checkpoint_v4("v4_flash_like", tmp_path / "hf", with_mtp=True)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert {k for k in f.keys() if k.startswith("mtp.")} == set(mtp2)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1


# ---------------------------------------------------------------------------------------------- goldens


@pytest.mark.parametrize("name", NAMES)
def test_greedy_goldens_and_cached_generate(name, models):
    model = models[name]
    prompt = random_prompt(PROMPT_LEN_V4[name])
    tokens, chosen, full = hf_greedy_goldens(model, prompt, NEW_TOKENS)
    assert len(tokens) == NEW_TOKENS and full.shape == (NEW_TOKENS, model.config.vocab_size)
    assert len(set(tokens)) >= NEW_TOKENS // 2, tokens  # no collapse into a repeated token
    assert torch.equal(chosen, full[torch.arange(NEW_TOKENS), tokens])
    assert (chosen > -4).all() and (chosen < -0.01).all()  # peaked but not one-hot
    # greedy margins are clear (no near-ties an engine could flip)
    top2 = full.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4
    # teacher-forced full forward over prompt + continuation gives the same rows
    tf = hf_logprobs(model, prompt + tokens)
    torch.testing.assert_close(tf[len(prompt) - 1 : -1], full, atol=2e-5, rtol=0)
    # transformers' own cached generate
    cached, cached_logprobs = hf_cached_greedy(model, prompt, NEW_TOKENS)
    assert cached == tokens
    torch.testing.assert_close(cached_logprobs, full, atol=1e-4, rtol=0)


def _run_capturing(model, prompt, *cls_names) -> list[list[tuple]]:
    """One transformers forward over ``prompt``; per class name, the (module, args, output) of
    every call of a module of that class, in call order."""
    outs = [[] for _ in cls_names]
    hooks = [mod.register_forward_hook(lambda m, a, o, out=out: out.append((m, a, o)))
             for mod in model.modules() for name, out in zip(cls_names, outs) if type(mod).__name__ == name]
    try:
        hf_logprobs(model, prompt)
    finally:
        for h in hooks:
            h.remove()
    return outs


@pytest.mark.parametrize("name", NAMES)
def test_indexer_selects(name, models):
    model = models[name]
    c = model.config
    rate, topk = c.compress_rates[CSA], c.index_topk
    prompt = random_prompt(PROMPT_LEN_V4[name])
    picks, scores = _run_capturing(model, prompt, "DeepseekV4Indexer", "DeepseekV4IndexerScorer")
    assert len(picks) == sum(t == CSA for t in c.layer_types) and picks
    T = len(prompt)
    for (_, _, sel), (_, _, sc) in zip(picks, scores):
        sel, sc = sel[0], sc[0]  # [T, k], [T, entries]
        for p in range(T):
            visible = (p + 1) // rate
            row = sel[p]
            valid = row[row >= 0]
            assert len(valid) == min(topk, visible) and len(set(valid.tolist())) == len(valid)
            assert (valid < visible).all()
            if visible > topk:  # a real selection: some visible entries dropped, with a clear margin
                s = sc[p, :visible].sort(descending=True).values
                assert s[topk - 1] - s[topk] > 1e-6, (p, s[topk - 1 : topk + 1])
        late = [frozenset(sel[p].tolist()) for p in range(T) if (p + 1) // rate > topk]
        if name == "v4_pro_like":
            assert not late  # index_topk above the entry count: everything visible is selected
        else:
            assert len(late) > 10
            assert len(set(late)) > len(late) // 3  # the selection moves from query to query
            recent = [frozenset(range((p + 1) // rate - topk, (p + 1) // rate)) for p in range(T) if (p + 1) // rate > topk]
            assert sum(a != b for a, b in zip(late, recent)) > len(late) // 2  # not just the most recent entries
        assert (sel[: rate - 1] == -1).all() and (sel[rate - 1, 0] == 0)  # nothing before the first entry closes


@pytest.mark.parametrize("name", NAMES)
def test_routing_spread(name, models):
    model = models[name]
    c = model.config
    (picks,) = _run_capturing(model, random_prompt(PROMPT_LEN_V4[name]), "DeepseekV4TopKRouter")
    assert len(picks) == sum(t == "moe" for t in c.mlp_layer_types)
    for _, _, (_, weights, idx) in picks:
        counts = torch.bincount(idx.flatten(), minlength=c.n_routed_experts).float()
        assert (counts > 0).all(), counts  # every expert used
        assert counts.max() / counts.sum() < 0.5, counts
        assert len({tuple(sorted(r)) for r in idx.tolist()}) >= min(4, c.n_routed_experts)
        torch.testing.assert_close(weights.sum(-1), torch.full((idx.shape[0],), c.routed_scaling_factor), atol=1e-5, rtol=0)
    for layer, kind in zip(model.model.layers, c.mlp_layer_types):
        if kind == "hash_moe":
            t = layer.mlp.gate.tid2eid
            assert ((t >= 0) & (t < c.n_routed_experts)).all()
            assert (t[:, 0] != t[:, 1]).all() and len(set(t[:, 0].tolist())) == c.n_routed_experts


def test_bf16_golden_keeps_fp32_modules(tmp_path):
    golden = write_checkpoint_v4("v4_flash_like", tmp_path, quant="fp8+fp4")
    bf16 = load_golden_v4(tmp_path, dtype=torch.bfloat16)
    state, ref = bf16.state_dict(), golden.state_dict()
    fp32 = ("sinks", "position_bias", "_hc.", "hc_head.", "norm.weight", "layernorm.weight", "e_score_correction_bias")
    for k, v in state.items():
        if k.endswith("tid2eid"):
            continue
        assert v.dtype == (torch.float32 if any(f in k for f in fp32) else torch.bfloat16), k
        assert torch.equal(v.float(), ref[k]), k  # checkpoint values, exactly
    logits = hf_logprobs(bf16, random_prompt(40))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", NAMES)
def test_mhc_not_degenerate(name, models):
    model = models[name]
    (outs,) = _run_capturing(model, random_prompt(PROMPT_LEN_V4[name]), "DeepseekV4HyperConnection")
    post = torch.stack([o[0] for _, _, o in outs])
    comb = torch.stack([o[1] for _, _, o in outs])
    hc = model.config.hc_mult
    assert post.std() > 0.1 and comb.std() > 0.03
    assert (comb - 1.0 / hc).abs().max() > 0.1 and (comb - torch.eye(hc)).abs().max() > 0.3  # neither uniform nor identity
