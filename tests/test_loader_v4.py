"""The checkpoint loader on DeepSeek-V4 checkpoints: the three key namings (DeepSeek's original,
what transformers' save_pretrained writes, transformers' module names), block FP8 with e8m0 or
float32 scales, MXFP4 routed experts, MTP, and the errors for broken checkpoints.

The model is a stand-in: a module whose state_dict names, shapes and dtypes are those of
transformers' DeepseekV4ForCausalLM (plus an MTP block under ``mtp.layers.0.``), which is what
the V4 model's are."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from deepinfer_core.models.v4.checkpoint import V4Checkpoint, normalize_v4_key, rename_v4_state, v4_checkpoint_key
from deepinfer_core.models.registry import read_config
from deepinfer_core.conformance.checkpoints import quantize_fp8_block, quantize_fp8_block_e8m0, quantize_mxfp4
from deepinfer_core.loader import CheckpointError, checkpoint_format, dequantize_mxfp4, e8m0_to_float, load_model
from deepinfer_core.ops.linear import dequantize_fp8_block
from tests.hf_checkpoints_v4 import mtp_params_v4, quant_config_v4, quantize_original

BLOCK = (16, 16)
HF_CONFIG = {
    "vocab_size": 64,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 24,  # partial FP8 blocks (24 rows in 16-row blocks)
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 4,
    "sliding_window": 8,
    "partial_rotary_factor": 0.25,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 4096,
}


# ---------------------------------------------------------------- the stand-in model and its weights


class StandIn(nn.Module):
    """Empty tensors named, shaped and typed as ``spec``; the loader's model protocol."""

    checkpoint_format = V4Checkpoint()

    def __init__(self, config, spec: dict[str, torch.Tensor]):
        super().__init__()
        self.config = config
        self.post_loaded = False
        for name, t in spec.items():
            *path, leaf = name.split(".")
            module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            empty = torch.full(t.shape, 7, dtype=t.dtype) if not t.is_floating_point() else torch.empty(t.shape, dtype=t.dtype)
            if t.is_floating_point():
                module.register_parameter(leaf, nn.Parameter(empty, requires_grad=False))
            else:
                module.register_buffer(leaf, empty)

    @property
    def num_mtp_layers(self) -> int:
        return len(list(self.mtp.layers.children())) if hasattr(self, "mtp") else 0

    def drop_mtp_layers(self) -> None:
        del self.mtp

    def post_load(self) -> None:
        self.post_loaded = True


def _random(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Distinct random values for every tensor (so that a tensor loaded into the wrong place shows)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        if t.is_floating_point():
            out[name] = (torch.randn(t.shape, generator=gen) * 0.1).to(t.dtype)
        else:  # tid2eid: expert ids
            out[name] = torch.randint(0, HF_CONFIG["n_routed_experts"], t.shape, generator=gen, dtype=t.dtype)
    return out


def _mtp_state(seed: int) -> dict[str, torch.Tensor]:
    """An MTP block's tensors: a sliding-window, non-hash decoder layer plus the MTP extras."""
    return _random(mtp_params_v4(DeepseekV4Config(**HF_CONFIG)), seed)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**HF_CONFIG))
    model.load_state_dict(_random(model.state_dict(), 1))
    return model


@pytest.fixture(scope="module")
def truth(hf_model) -> dict[str, torch.Tensor]:
    """Every parameter of the stand-in, MTP included, in parameter names (fused experts)."""
    return {**{k: v.clone() for k, v in hf_model.state_dict().items()}, **_mtp_state(2)}


@pytest.fixture(scope="module")
def saved(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("v4") / "hf_save"
    hf_model.save_pretrained(path)
    return path


def write(path: Path, config_dir: Path, tensors: dict[str, torch.Tensor], **config_changes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((config_dir / "config.json").read_text())
    config.update(config_changes)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def quantized(tensors: dict[str, torch.Tensor], scales: str, quant: str) -> dict[str, torch.Tensor]:
    """Original-naming float tensors -> DeepSeek-V4's storage (``quant`` "fp8" or "fp8+fp4", the
    latter with MXFP4 routed experts), FP8 block scales ``scales`` (e8m0 / float32); the other
    tensors unchanged."""
    fp8 = quantize_fp8_block_e8m0 if scales == "e8m0" else quantize_fp8_block
    return quantize_original(tensors, quant, BLOCK, fp8=fp8, cast=False)[0]


def new_model(path: Path, truth: dict[str, torch.Tensor], *, mtp: bool = True, keep: dict[str, torch.Tensor] | None = None):
    """(config, stand-in) for the checkpoint at ``path``; ``keep``: the FP8 tensors (weights and
    their *_scale_inv, in parameter names) the model keeps, as keep_fp8 models do."""
    config = read_config(path)
    spec = {k: v for k, v in truth.items() if mtp or not k.startswith("mtp.")}
    spec.update(keep or {})
    return config, StandIn(config, spec)


def load(path: Path, truth, **kwargs) -> StandIn:
    config, model = new_model(path, truth, **kwargs)
    load_model(path, config, model, progress=False)
    assert model.post_loaded
    return model


def assert_state(model: nn.Module, want: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == want.keys(), set(state) ^ set(want)
    for k, v in want.items():
        assert state[k].dtype == v.dtype and torch.equal(state[k], v), k


# ---------------------------------------------------------------- namings


def test_save_pretrained_checkpoint_loads(saved, hf_model, truth, caplog):
    keys = set(rename_v4_state(hf_model.state_dict(), "hf_save"))
    from safetensors import safe_open

    with safe_open(str(saved / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == keys  # our hf_save naming is what transformers writes
    assert "model.layers.0.attn.norm.weight" in keys and "head.weight" in keys
    with caplog.at_level(logging.WARNING, logger="deepinfer.loader"):
        model = load(saved, truth)  # the stand-in has an MTP block; save_pretrained wrote none
    assert model.num_mtp_layers == 0 and "MTP" in caplog.text
    assert_state(model, hf_model.state_dict())


@pytest.mark.parametrize("naming", ["original", "hf"])
def test_original_and_module_naming_load_identically(saved, truth, tmp_path, naming):
    tensors = rename_v4_state(truth, naming)
    if naming == "original":
        assert "mtp.0.hc_head_fn" in tensors and "layers.1.attn.indexer.compressor.norm.weight" in tensors
    else:
        assert "mtp.layers.0.mlp.experts.gate_up_proj" in tensors and "lm_head.weight" in tensors
    model = load(write(tmp_path / naming, saved, tensors), truth)
    assert model.num_mtp_layers == 1
    assert_state(model, truth)


def test_original_names_are_deepseeks(truth):
    """The original names of one CSA layer and the MTP block, as DeepSeek's release spells them."""
    keys = set(rename_v4_state(truth, "original"))
    layer = {k.removeprefix("layers.1.") for k in keys if k.startswith("layers.1.")}
    assert layer == {
        "attn_norm.weight", "ffn_norm.weight", "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn",
        "hc_ffn_base", "hc_ffn_scale", "attn.attn_sink", "attn.wq_a.weight", "attn.q_norm.weight", "attn.wq_b.weight",
        "attn.wkv.weight", "attn.kv_norm.weight", "attn.wo_a.weight", "attn.wo_b.weight", "attn.compressor.wkv.weight",
        "attn.compressor.wgate.weight", "attn.compressor.ape", "attn.compressor.norm.weight", "attn.indexer.wq_b.weight",
        "attn.indexer.weights_proj.weight", "attn.indexer.compressor.wkv.weight", "attn.indexer.compressor.wgate.weight",
        "attn.indexer.compressor.ape", "attn.indexer.compressor.norm.weight", "ffn.gate.weight", "ffn.gate.tid2eid",
        *(f"ffn.experts.{e}.w{i}.weight" for e in range(4) for i in (1, 2, 3)),
        *(f"ffn.shared_experts.w{i}.weight" for i in (1, 2, 3)),
    }
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"} <= keys
    assert "layers.2.ffn.gate.bias" in keys and "layers.2.attn.compressor.ape" in keys
    mtp = {k.removeprefix("mtp.0.") for k in keys if k.startswith("mtp.0.")}
    assert {"enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "norm.weight", "hc_head_fn",
            "ffn.gate.bias", "attn.wkv.weight", "hc_attn_fn", "ffn.experts.3.w2.weight"} <= mtp
    assert not any("compressor" in k or "tid2eid" in k for k in mtp)


def test_transformers_reads_our_original_naming_the_same(saved, hf_model, truth, tmp_path):
    """transformers' own V4 renames (conversion_mapping) turn our original-naming checkpoint into
    the same weights: the rename table agrees with transformers', independently of our reader."""
    path = write(tmp_path / "orig", saved, rename_v4_state(truth, "original"))
    other = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32)
    for k, v in hf_model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k


def test_namings_mix_per_key(saved, truth, tmp_path):
    original, hf = rename_v4_state(truth, "original"), rename_v4_state(truth, "hf")
    tensors = {k: v for k, v in original.items() if "layers.1." in k or k.startswith("mtp.") or "experts" in k}
    tensors |= {k: v for k, v in hf.items() if not ("layers.1." in k or k.startswith("mtp.") or "experts" in k)}
    assert_state(load(write(tmp_path / "mixed", saved, tensors), truth), truth)


def test_key_normalisation_round_trips(truth):
    for naming in ("original", "hf_save", "hf"):
        for key in rename_v4_state(truth, naming):
            p = normalize_v4_key(key)
            assert p is not None and v4_checkpoint_key(p.target, naming, p.expert, p.half, p.scale) == key, key
    assert normalize_v4_key("norm.weight").target == "model.norm.weight"
    assert normalize_v4_key("mtp.0.norm.weight").target == "mtp.layers.0.norm.weight"
    assert normalize_v4_key("layers.3.attn.kv_norm.weight").target == "model.layers.3.self_attn.kv_norm.weight"
    assert normalize_v4_key("model.layers.3.attn.norm.weight").target == "model.layers.3.self_attn.kv_norm.weight"
    assert normalize_v4_key("layers.1.attn.compressor.norm.weight").target == "model.layers.1.self_attn.compressor.kv_norm.weight"
    k = normalize_v4_key("layers.2.ffn.experts.3.w3.scale")
    assert (k.param, k.expert, k.half) == ("model.layers.2.mlp.experts.gate_up_proj_scale_inv", 3, 1)
    assert normalize_v4_key("layers.0.hc_attn_scale").param == "model.layers.0.attn_hc.scale"  # not an FP8 scale
    assert normalize_v4_key("layers.0.attn.rotary_emb.inv_freq") is None
    assert V4Checkpoint().scale_keys("layers.0.attn.wq_a.weight") == ("layers.0.attn.wq_a.scale", "layers.0.attn.wq_a.weight_scale_inv")


def test_format_is_the_models(saved, truth):
    config, model = new_model(saved, truth)
    assert isinstance(checkpoint_format(model), V4Checkpoint)
    model.checkpoint_format = fmt = object()
    assert checkpoint_format(model) is fmt


# ---------------------------------------------------------------- FP8 and MXFP4


def test_mxfp4_nibble_order_and_negative_codes():
    # byte 0x21: element 0 = code 1 (0.5), element 1 = code 2 (1.0); 0xF8: -0 then code 15 (-6);
    # 0x7B: code 11 (-1.5) then code 7 (6); 0x9C: code 12 (-2) then code 9 (-0.5)
    row = [0x21, 0xF8, 0x7B, 0x9C] + [0x00] * 12
    packed = torch.tensor([row, row], dtype=torch.uint8).view(torch.int8)
    scale = torch.tensor([[127], [129]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 1 and 4
    w = dequantize_mxfp4(packed, scale, torch.float32)
    assert w.shape == (2, 32)
    want = torch.tensor([0.5, 1.0, -0.0, -6.0, -1.5, 6.0, -2.0, -0.5])
    assert torch.equal(w[0, :8], want) and torch.equal(w[1, :8], want * 4) and not w[:, 8:].any()
    # uint8 and float4_e2m1fn_x2 storage read the same; the quantiser writes these very bytes
    assert torch.equal(dequantize_mxfp4(packed.view(torch.uint8), scale, torch.float32), w)
    assert torch.equal(dequantize_mxfp4(packed.view(torch.float4_e2m1fn_x2), scale.view(torch.uint8), torch.float32), w)
    q, s = quantize_mxfp4(w)
    assert torch.equal(s.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(dequantize_mxfp4(q, s, torch.float32), w)
    assert q.view(torch.uint8)[0, :4].tolist()[:3] == [0x21, 0xF0, 0x7B]  # -0 is written as +0


def test_e8m0_is_read_bitwise():
    byte = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    want = [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    for t in (byte, byte.view(torch.float8_e8m0fnu)):
        f = e8m0_to_float(t)
        assert f.dtype == torch.float32 and f[:6].tolist() == want and torch.isnan(f[6])


@pytest.fixture(scope="module")
def original(truth) -> dict[str, torch.Tensor]:
    return rename_v4_state(truth, "original")


@pytest.fixture(scope="module")
def fp4_tensors(original) -> dict[str, torch.Tensor]:
    return quantized(original, "e8m0", "fp8+fp4")


def _fp8_case(original, tmp_path, saved, scales: str, quant: str, tensors=None):
    tensors = dict(tensors or quantized(original, scales, quant))
    return tensors, write(tmp_path / f"{scales}-{quant}", saved, tensors, **quant_config_v4(quant, BLOCK))


@pytest.mark.parametrize("scales,quant", [("e8m0", "fp8+fp4"), ("float32", "fp8")])
def test_quantized_checkpoint_dequantised_at_load(saved, truth, original, tmp_path, scales, quant):
    tensors, path = _fp8_case(original, tmp_path, saved, scales, quant)
    assert tensors["layers.0.attn.wq_a.scale"].dtype == (torch.float8_e8m0fnu if scales == "e8m0" else torch.float32)
    model = load(path, truth)
    state = model.state_dict()
    want = dict(truth)
    checked = 0
    for key, t in tensors.items():
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors[key.removesuffix(".weight") + ".scale"]
            deq = dequantize_fp8_block(t, e8m0_to_float(scale), BLOCK, torch.float32)
        elif t.dtype == torch.int8:
            scale = tensors[key.removesuffix(".weight") + ".scale"]
            deq = dequantize_mxfp4(t, scale, torch.float32)
            err = (deq - original[key]).abs()
            assert (err <= e8m0_to_float(scale).repeat_interleave(32, -1)).all(), key  # within one scale step
        else:
            continue
        p = normalize_v4_key(key)
        dst = want[p.target] = want[p.target].clone()
        (dst[p.expert] if p.expert is not None else dst)[
            slice(None) if p.half is None else slice(p.half * 32, p.half * 32 + 32)
        ].copy_(deq)
        checked += 1
    assert checked == len([k for k in tensors if k.endswith(".scale")])
    assert_state(model, want)  # exactly the quantiser's dequantisation
    for k, v in truth.items():  # and close to the float weights
        torch.testing.assert_close(state[k], v, atol=0.07, rtol=0.3)


def test_kept_fp8_weights_and_scales(saved, truth, original, fp4_tensors, tmp_path):
    tensors, path = _fp8_case(original, tmp_path, saved, "e8m0", "fp8+fp4", fp4_tensors)
    keep = {}
    for key, t in tensors.items():
        if t.dtype == torch.float8_e4m3fn:
            name = normalize_v4_key(key).target
            keep[name] = t
            keep[name + "_scale_inv"] = e8m0_to_float(tensors[key.removesuffix(".weight") + ".scale"])
    config, model = new_model(path, truth, keep=keep)
    load_model(path, config, model, progress=False)
    state = model.state_dict()
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    for name, t in keep.items():  # FP8 weights bit for bit, their e8m0 scales as float32
        assert state[name].dtype == t.dtype and torch.equal(bits(state[name]), bits(t)), name
    assert state["model.layers.0.self_attn.q_a_proj.weight_scale_inv"].dtype == torch.float32
    e = tensors["layers.2.ffn.experts.1.w3.weight"], tensors["layers.2.ffn.experts.1.w3.scale"]
    assert torch.equal(state["model.layers.2.mlp.experts.gate_up_proj"][1, 32:], dequantize_mxfp4(*e, torch.float32))


def test_fused_mxfp4_experts_in_module_naming(saved, truth, tmp_path):
    """transformers' names with packed FP4 fused experts (gate_up_proj [E, 2I, D/2] + _scale_inv)."""
    tensors = rename_v4_state(truth, "hf")
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[key], tensors[key + "_scale_inv"] = quantize_mxfp4(tensors[key])
    model = load(write(tmp_path / "fused", saved, tensors, expert_dtype="fp4"), truth)
    key = "mtp.layers.0.mlp.experts.down_proj"
    assert torch.equal(model.state_dict()[key], dequantize_mxfp4(tensors[key], tensors[key + "_scale_inv"], torch.float32))


# ---------------------------------------------------------------- errors


@pytest.fixture
def fp4_case(fp4_tensors) -> dict[str, torch.Tensor]:
    """A V4-Flash-like checkpoint's tensors (e8m0 FP8 linears, MXFP4 experts), to break."""
    return dict(fp4_tensors)


def _broken(tmp_path, saved, tensors, **config):
    return write(tmp_path / "broken", saved, tensors, **(config or quant_config_v4("fp8+fp4", BLOCK)))


def test_missing_tensor_is_named_in_the_checkpoints_naming(fp4_case, saved, truth, tmp_path):
    tensors = fp4_case
    del tensors["layers.1.attn.indexer.compressor.norm.weight"]
    del tensors["layers.3.ffn.experts.2.w3.weight"], tensors["layers.3.ffn.experts.2.w3.scale"]
    with pytest.raises(CheckpointError, match=r"lacks 2 tensor.*layers\.1\.attn\.indexer\.compressor\.norm\.weight, "
                                              r"layers\.3\.ffn\.experts\.2\.w3\.weight; the checkpoint does not match"):
        load(_broken(tmp_path, saved, tensors), truth)


def test_fp8_weight_without_scale(fp4_case, saved, truth, tmp_path):
    tensors = fp4_case
    del tensors["layers.0.attn.wo_a.scale"]
    with pytest.raises(CheckpointError, match=r"model\.safetensors: FP8 weight layers\.0\.attn\.wo_a\.weight has no scale "
                                              r"layers\.0\.attn\.wo_a\.scale or layers\.0\.attn\.wo_a\.weight_scale_inv"):
        load(_broken(tmp_path, saved, tensors), truth)


def test_fp4_expert_without_scale(fp4_case, saved, truth, tmp_path):
    tensors = fp4_case
    del tensors["mtp.0.ffn.experts.0.w1.scale"]
    with pytest.raises(CheckpointError, match=r"packed FP4 \(MXFP4\) weight mtp\.0\.ffn\.experts\.0\.w1\.weight has no scale"):
        load(_broken(tmp_path, saved, tensors), truth)


def test_wrong_shape(fp4_case, saved, truth, tmp_path):
    tensors = fp4_case
    tensors["layers.2.attn.compressor.ape"] = torch.zeros(64, 32)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: layers\.2\.attn\.compressor\.ape has shape \[64, 32\] "
                                              r"but config\.json implies \[128, 32\]"):
        load(_broken(tmp_path, saved, tensors), truth)


def test_fp4_expert_wrong_packed_shape(fp4_case, saved, truth, tmp_path):
    tensors = fp4_case
    tensors["layers.3.ffn.experts.1.w2.weight"] = torch.zeros(64, 32, dtype=torch.int8)  # unpacked size
    with pytest.raises(CheckpointError, match=r"experts\.1\.w2\.weight has shape \[64, 32\] but config\.json implies "
                                              r"\[64, 16\] \(packed FP4 of a \[64, 32\] weight"):
        load(_broken(tmp_path, saved, tensors), truth)


def test_fp4_expert_wrong_scale_shape(fp4_case, saved, truth, tmp_path):
    tensors = fp4_case
    tensors["layers.3.ffn.experts.1.w2.scale"] = tensors["layers.3.ffn.experts.1.w2.scale"][:32]
    with pytest.raises(CheckpointError, match=r"model\.safetensors: layers\.3\.ffn\.experts\.1\.w2\.scale has shape \[32, 1\] "
                                              r"but packed FP4 weight layers\.3\.ffn\.experts\.1\.w2\.weight of \[64, 32\] "
                                              r"needs \[64, 1\]"):
        load(_broken(tmp_path, saved, tensors), truth)


def test_fp8_scale_wrong_grid(fp4_case, saved, truth, tmp_path):
    tensors = fp4_case
    tensors["layers.0.attn.wq_a.scale"] = tensors["layers.0.attn.wq_a.scale"][:1]
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.scale has shape \[1, 4\] but weight \[24, 64\] "
                                              r"with weight_block_size \[16, 16\] needs \[2, 4\]"):
        load(_broken(tmp_path, saved, tensors), truth)


def test_fp4_experts_need_expert_dtype(fp4_case, saved, truth, tmp_path):
    tensors = fp4_case
    quant = quant_config_v4("fp8+fp4", BLOCK)["quantization_config"]
    with pytest.raises(CheckpointError, match=r"layers\.\d\.ffn\.experts\.\d\.w\d\.weight is packed FP4 \(I8\) but "
                                              r"config\.json's expert_dtype is None"):
        load(_broken(tmp_path, saved, tensors, quantization_config=quant), truth)


def test_nan_e8m0_scale(fp4_case, saved, truth, tmp_path):
    tensors = fp4_case
    scale = tensors["layers.1.ffn.experts.0.w2.scale"].view(torch.uint8).clone()
    scale[3, 0] = 255
    tensors["layers.1.ffn.experts.0.w2.scale"] = scale.view(torch.float8_e8m0fnu)
    with pytest.raises(CheckpointError, match=r"layers\.1\.ffn\.experts\.0\.w2\.weight \(model\.safetensors\) is "
                                              r"dequantised with the non-finite scale layers\.1\.ffn\.experts\.0\.w2\.scale"):
        load(_broken(tmp_path, saved, tensors), truth)


def test_same_tensor_under_two_names(saved, truth, tmp_path):
    tensors = rename_v4_state(truth, "original")
    tensors["model.layers.0.self_attn.sinks"] = tensors["layers.0.attn.attn_sink"].clone()
    with pytest.raises(CheckpointError, match=r"are the same tensor \(model\.layers\.0\.self_attn\.sinks\) under two names"):
        load(write(tmp_path / "twice", saved, tensors), truth)


def test_unknown_key(saved, truth, tmp_path):
    tensors = rename_v4_state(truth, "original")
    tensors["layers.0.attn.rotary_emb.inv_freq"] = torch.zeros(4)
    with pytest.raises(CheckpointError, match=r"does not use: layers\.0\.attn\.rotary_emb\.inv_freq \(model\.safetensors\)"):
        load(write(tmp_path / "unknown", saved, tensors), truth)


# ---------------------------------------------------------------- MTP


def test_mtp_block_the_model_lacks_is_ignored(saved, truth, tmp_path, caplog):
    tensors = rename_v4_state(truth, "original")
    with caplog.at_level(logging.WARNING, logger="deepinfer.loader"):
        model = load(write(tmp_path / "mtp", saved, tensors), truth, mtp=False)
    assert "mtp.[0].* that the model does not have" in caplog.text
    assert_state(model, {k: v for k, v in truth.items() if not k.startswith("mtp.")})


def test_mtp_blocks_partly_present(saved, truth, tmp_path):
    tensors = rename_v4_state(truth, "original")
    two = {**truth, **{k.replace("mtp.layers.0.", "mtp.layers.1."): v for k, v in truth.items() if k.startswith("mtp.")}}
    with pytest.raises(CheckpointError, match=r"only some of the 2 MTP layers: no keys for mtp\.\[1\]\.\*"):
        load(write(tmp_path / "mtp", saved, tensors), two)


def test_partial_mtp_block_is_missing_keys(saved, truth, tmp_path):
    tensors = rename_v4_state(truth, "original")
    del tensors["mtp.0.e_proj.weight"]
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor.*mtp\.0\.e_proj\.weight"):
        load(write(tmp_path / "mtp", saved, tensors), truth)


# ---------------------------------------------------------------- DeepInfer's own V4 model


@pytest.mark.parametrize("keep_fp8", [False, True])
def test_deepinfer_v4_model_loads(saved, truth, original, fp4_tensors, tmp_path, keep_fp8):
    """The V4 model's parameters are the stand-in's: every tensor lands where the stand-in's does
    (compared before post_load, which fuses the shared experts' gate and up projections)."""
    from deepinfer_core.models.registry import get_model_class
    from deepinfer_core.ops import OpTable

    tensors = fp4_tensors if keep_fp8 else original
    path = write(tmp_path / "ckpt", saved, tensors, **(quant_config_v4("fp8+fp4", BLOCK) if keep_fp8 else {}))
    config, reference = new_model(path, truth)
    load_model(path, config, reference, progress=False)
    model = get_model_class("deepseek_v4")(config, OpTable.reference(), torch.float32, torch.device("cpu"), keep_fp8=keep_fp8)
    model.post_load = lambda: None
    load_model(path, config, model, progress=False)
    state, want = model.state_dict(), reference.state_dict()
    assert model.num_mtp_layers == 1
    fp8 = {k for k, v in state.items() if v.dtype == torch.float8_e4m3fn}
    assert bool(fp8) == keep_fp8
    for k, v in want.items():
        if k in fp8:  # kept: the stored bits and the scales, which dequantise to the stand-in's values
            w = dequantize_fp8_block(state[k], state[k + "_scale_inv"], BLOCK, torch.float32)
            assert torch.equal(w, v), k
        else:
            assert torch.equal(state[k], v), k
    assert set(state) - set(want) == {k + "_scale_inv" for k in fp8}

