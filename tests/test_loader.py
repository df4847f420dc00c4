"""The checkpoint loader: layouts it accepts and the errors it gives for broken checkpoints."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer_core.config import ConfigError
from deepinfer_core.models.registry import read_config
from deepinfer_core.models.v4.config import V4ModelConfig
from deepinfer_core.loader import CheckpointError, all_finite, load_model
from deepinfer_core.models.dummy_weights import init_dummy_weights
from deepinfer_core.models.registry import get_model_class
from deepinfer_core.models.layers import checkpoint_weights
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.linear import dequantize_fp8_block
from tests.hf_checkpoints import add_mtp_weights, hf_config, write_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("loader") / "ckpt"
    write_checkpoint("v3_yarn", path)
    return path


@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("loader_fp8") / "ckpt"
    write_checkpoint("v3_fp8", path)
    return path


def read_all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def variant(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def new_model(path: Path, keep_fp8: bool = False):
    config = read_config(path)
    model = get_model_class(config.model_type)(config, OpTable.reference(), torch.float32, torch.device("cpu"), keep_fp8=keep_fp8)
    return config, model


def load(path: Path, keep_fp8: bool = False):
    config, model = new_model(path, keep_fp8)
    load_model(path, config, model, progress=False)
    return model


def same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k].float(), sb[k].float()), k


def test_sharded_loads_like_single_file(base, tmp_path):
    sharded = tmp_path / "sharded"
    write_checkpoint("v3_yarn", sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    same_weights(load(sharded), load(base))


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    fused = {k: t for k, t in tensors.items() if ".mlp.experts." not in k}
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts"
        for sfx, tl in [("weight", ""), ("weight_scale_inv", "_scale_inv")]:
            if f"{p}.0.down_proj.{sfx}" not in tensors:
                continue
            fused[f"{p}.gate_up_proj{tl}"] = torch.stack(
                [torch.cat([tensors[f"{p}.{e}.gate_proj.{sfx}"], tensors[f"{p}.{e}.up_proj.{sfx}"]]) for e in range(8)]
            )
            fused[f"{p}.down_proj{tl}"] = torch.stack([tensors[f"{p}.{e}.down_proj.{sfx}"] for e in range(8)])
    return fused


def test_fused_expert_keys_load_like_per_expert(base, tmp_path):
    same_weights(load(variant(base, tmp_path / "fused", fuse_experts(read_all(base)))), load(base))


@pytest.mark.parametrize("keep_fp8", [False, True])
def test_fused_fp8_expert_keys_load_like_per_expert(fp8, tmp_path, keep_fp8):
    fused = variant(fp8, tmp_path / "fused", fuse_experts(read_all(fp8)))
    assert "model.layers.1.mlp.experts.gate_up_proj_scale_inv" in read_all(fused)
    same_weights(load(fused, keep_fp8=keep_fp8), load(fp8, keep_fp8=keep_fp8))


def test_fp8_dequantised_and_kept(fp8):
    kept = load(fp8, keep_fp8=True)
    deq = load(fp8, keep_fp8=False)
    attn_k, attn_d = kept.model.layers[1].self_attn, deq.model.layers[1].self_attn
    assert attn_k.q_b_proj.weight.dtype == torch.float8_e4m3fn and attn_d.q_b_proj.weight.dtype == torch.float32
    assert "model.layers.1.mlp.experts.gate_up_proj_scale_inv" in kept.state_dict()
    assert "model.layers.1.self_attn.q_b_proj.weight_scale_inv" not in deq.state_dict()
    torch.testing.assert_close(attn_k.q_b_proj.dequantized_weight(torch.float32), attn_d.q_b_proj.weight, atol=0, rtol=0)
    torch.testing.assert_close(attn_k.w_uk_t, attn_d.w_uk_t, atol=0, rtol=0)
    ek, ed = kept.model.layers[2].mlp.experts, deq.model.layers[2].mlp.experts
    for e in range(ek.gate_up_proj.shape[0]):
        w = dequantize_fp8_block(ek.gate_up_proj[e], ek.gate_up_proj_scale_inv[e], ek.block, torch.float32)
        torch.testing.assert_close(w, ed.gate_up_proj[e], atol=0, rtol=0)


def test_mtp_weights_are_mapped(base, tmp_path):
    path = tmp_path / "mtp"
    hf = write_checkpoint("v3_yarn", path)
    tensors = add_mtp_weights(path, hf)
    model = load(path)
    assert model.num_mtp_layers == 1
    state = model.state_dict()
    assert torch.equal(state["mtp.layers.0.eh_proj.weight"], tensors["eh_proj.weight"])
    assert torch.equal(state["mtp.layers.0.shared_head.norm.weight"], tensors["post_norm.weight"])
    assert torch.equal(state["mtp.layers.0.mlp.experts.gate_up_proj"], tensors["mtp_block.mlp.experts.gate_up_proj"])


def test_config_mtp_without_keys_warns(base, caplog):
    with caplog.at_level(logging.WARNING, logger="deepinfer.loader"):
        model = load(base)
    assert model.num_mtp_layers == 0
    assert "MTP" in caplog.text


def test_partial_mtp_layer_is_missing_key(base, tmp_path):
    path = tmp_path / "mtp"
    hf = write_checkpoint("v3_yarn", path)
    add_mtp_weights(path, hf)
    tensors = read_all(path)
    del tensors["model.layers.3.eh_proj.weight"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.eh_proj\.weight"):
        load(variant(path, tmp_path / "partial", tensors))


def test_partial_mtp_layers_error(base, tmp_path):
    path = tmp_path / "mtp"
    hf = write_checkpoint("v3_yarn", path)
    add_mtp_weights(path, hf)
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 2
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"only some of the 2 MTP layers.*\[4\]"):
        load(path)


def test_no_safetensors(tmp_path, base):
    shutil.copy(base / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="safetensors"):
        load(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*refused"):
        load(tmp_path)


def test_index_with_missing_shard(tmp_path):
    path = tmp_path / "sharded"
    write_checkpoint("v3_yarn", path, max_shard_size="40KB")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}.*does not exist"):
        load(path)


def test_truncated_shard(base, tmp_path):
    dst = tmp_path / "trunc"
    shutil.copytree(base, dst)
    data = (dst / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(truncated|corrupt)"):
        load(dst)
    (dst / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load(dst)


def test_missing_key(base, tmp_path):
    tensors = read_all(base)
    del tensors["model.layers.2.self_attn.kv_b_proj.weight"]
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"lacks 2 tensor.*experts\.3\.up_proj\.weight.*kv_b_proj\.weight"):
        load(variant(base, tmp_path / "missing", tensors))


def test_unexpected_key(base, tmp_path):
    tensors = read_all(base)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    with pytest.raises(CheckpointError, match=r"does not use.*rotary_emb\.inv_freq \(model\.safetensors\)"):
        load(variant(base, tmp_path / "unexpected", tensors))


def test_shape_mismatch(base, tmp_path):
    tensors = read_all(base)
    tensors["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(64, 60)
    with pytest.raises(CheckpointError, match=r"o_proj\.weight has shape \[64, 60\] but config\.json implies \[64, 64\]"):
        load(variant(base, tmp_path / "shape", tensors))
    tensors = read_all(base)
    tensors["model.layers.2.mlp.experts.5.down_proj.weight"] = torch.zeros(64, 16)
    with pytest.raises(CheckpointError, match=r"experts\.5\.down_proj\.weight has shape \[64, 16\].*\[64, 32\]"):
        load(variant(base, tmp_path / "shape2", tensors))


@pytest.mark.parametrize("keep_fp8", [False, True])
def test_fp8_weight_without_scale(fp8, tmp_path, keep_fp8):
    tensors = read_all(fp8)
    del tensors["model.layers.1.self_attn.q_b_proj.weight_scale_inv"]
    with pytest.raises(CheckpointError, match=r"model\.safetensors: FP8 weight model\.layers\.1\.self_attn\.q_b_proj\.weight has no scale"):
        load(variant(fp8, tmp_path / "noscale", tensors), keep_fp8=keep_fp8)


def test_fp8_scale_shape_mismatch(fp8, tmp_path):
    tensors = read_all(fp8)
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(3, 3)
    with pytest.raises(CheckpointError, match=r"o_proj\.weight_scale_inv has shape \[3, 3\]"):
        load(variant(fp8, tmp_path / "badscale", tensors))


def test_unknown_model_type():
    with pytest.raises(ConfigError, match="deepseek_v3, deepseek_v2"):
        get_model_class("llama")


# --------------------------------------------------------------------------------------------
# non-square FP8 blocks: (bn, bk) = weight_block_size, rows first


@pytest.fixture(scope="module")
def fp8_nonsquare(tmp_path_factory):
    path = tmp_path_factory.mktemp("loader_fp8_nonsquare") / "ckpt"
    return path, write_checkpoint("v3_fp8_nonsquare", path)


def float_weights(model) -> dict[str, torch.Tensor]:
    """Every linear / expert weight of our model in float32 under transformers' key, FP8 dequantised
    with the model's own block (fused gate/up and the stacked input projections split back)."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "dequantized_weight") and module.weight.numel():
            out.update(checkpoint_weights(model, name, module.dequantized_weight(torch.float32)))
        elif name.endswith("mlp.experts"):
            for proj in ("gate_up_proj", "down_proj"):
                w, s = getattr(module, proj), getattr(module, proj + "_scale_inv")
                out[f"{name}.{proj}"] = w.float() if s is None else dequantize_fp8_block(w, s, module.block, torch.float32)
    return out


@pytest.mark.parametrize("keep_fp8", [False, True])
def test_fp8_non_square_blocks_load_the_dequantised_golden(fp8_nonsquare, keep_fp8):
    path, golden = fp8_nonsquare
    assert read_config(path).fp8_block == (16, 32)
    model = load(path, keep_fp8=keep_fp8)
    attn = model.model.layers[0].self_attn
    assert attn.o_proj.weight.dtype == (torch.float8_e4m3fn if keep_fp8 else torch.float32)
    if keep_fp8:
        assert attn.o_proj.block == (16, 32) and attn.o_proj.weight_scale_inv.shape == (4, 2)  # [64, 64]: 4 row x 2 column blocks
    got, want = float_weights(model), golden.state_dict()
    linears = {k for k in want if k.endswith("proj.weight") or k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert linears <= set(got) and len(linears) > 20
    for key in sorted(linears):
        torch.testing.assert_close(got[key], want[key].float(), atol=0, rtol=0, msg=key)


@pytest.mark.parametrize("keep_fp8", [False, True])
def test_fp8_scale_grid_of_the_wrong_orientation(fp8_nonsquare, tmp_path, keep_fp8):
    """o_proj [64, 64] with blocks (16, 32) has a [4, 2] scale grid; the transposed [2, 4] (what a
    (32, 16) reading would want) is refused, naming both."""
    path, _ = fp8_nonsquare
    tensors = read_all(path)
    assert tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"].shape == (4, 2)
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(2, 4)
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.o_proj\.weight_scale_inv has shape \[2, 4\] but ") as info:
        load(variant(path, tmp_path / "transposed", tensors), keep_fp8=keep_fp8)
    message = str(info.value)
    assert "[4, 2]" in message
    if not keep_fp8:
        assert "weight [64, 64] with weight_block_size [16, 32] needs [4, 2]" in message


# --------------------------------------------------------------------------------------------
# load_format="dummy"


def _poison(model) -> None:
    """What torch.empty might hold, at its worst: NaN everywhere (FP8 NaN bits), -1 ids."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype == torch.float8_e4m3fn:
                p.view(torch.uint8).fill_(0x7F)
            elif p.is_floating_point():
                p.fill_(float("nan"))
            else:
                p.fill_(-1)


def _dummy_v3(tmp_path, seed: int):
    path = tmp_path / "dummy_v3"
    if not path.is_dir():
        hf_config("v3_fp8_nonsquare", n_routed_experts=64).save_pretrained(str(path))
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 32]}
        (path / "config.json").write_text(json.dumps(config))
    _, model = new_model(path, keep_fp8=True)
    _poison(model)
    init_dummy_weights(model, seed=seed, progress=False)
    return model


def test_dummy_weights_are_what_the_docstring_promises(tmp_path):
    model = _dummy_v3(tmp_path, seed=0)
    assert model.model.layers[0].self_attn.w_uk_t is not None  # post_load ran
    params = dict(model.named_parameters())
    normalised, biases = [], []
    for name, p in params.items():
        if not p.numel():  # released by post_load's gate/up fusion
            continue
        assert bool(all_finite(p)), f"{name} left uninitialised"
        if name.endswith("_scale_inv"):
            fan_in = params[name[: -len("_scale_inv")]].shape[-1]
            assert torch.equal(p, torch.full_like(p, fan_in**-0.5)), name
        elif name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("e_score_correction_bias"):
            biases.append(p)
        elif p.dim() >= 2:
            # FP8: N(0, 1) values (the scale carries 1/sqrt(fan_in)); else N(0, 1/fan_in)
            z = p.float() if p.dtype == torch.float8_e4m3fn else p * p.shape[-1] ** 0.5
            if p.numel() >= 1024:
                assert abs(z.std() - 1) < 0.1 and abs(z.mean()) < 0.1, (name, float(z.std()), float(z.mean()))
            normalised.append(z.flatten())
    z = torch.cat(normalised)
    assert abs(z.std() - 1) < 0.02 and abs(z.mean()) < 0.02
    bias = torch.cat(biases)
    assert bias.numel() >= 128 and 0.008 < bias.std() < 0.012 and bias.abs().max() < 0.05
    fp8 = [p for p in params.values() if p.dtype == torch.float8_e4m3fn and p.numel()]
    assert len(fp8) > 20
    q_b = model.model.layers[1].self_attn.q_b_proj
    assert q_b.weight_scale_inv.shape == (6, 2)  # [96, 48] in (16, 32) blocks
    assert abs(q_b.dequantized_weight(torch.float32).std() * 48**0.5 - 1) < 0.1  # activations stay O(1)

    same_weights(_dummy_v3(tmp_path, seed=0), model)  # determined by the seed
    other = _dummy_v3(tmp_path, seed=1).state_dict()
    for key in ("model.embed_tokens.weight", "model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.mlp.gate.e_score_correction_bias"):
        assert not torch.equal(other[key].float(), model.state_dict()[key].float()), key


def test_dummy_weights_of_an_expert_shard_are_the_full_models(tmp_path):
    """A rank's model holding some expert slots (expert parallelism) gets the single-process
    model's weights: its experts' rows by logical id (a twice-held expert twice), every other
    tensor identical; so random-weight benchmarks compute the same model at any EP size."""
    path = tmp_path / "v3"
    hf_config("v3_grouped").save_pretrained(str(path))
    config = read_config(path)
    cls = get_model_class(config.model_type)
    slots = (5, 2, 2, config.n_routed_experts - 1)
    full, shard = (cls(config, OpTable.reference(), torch.float32, torch.device("cpu"), expert_slots=s) for s in (None, slots))
    for m in (full, shard):
        _poison(m)
        init_dummy_weights(m, seed=3, progress=False)
    want, got = full.state_dict(), shard.state_dict()
    assert want.keys() == got.keys()
    sharded = [k for k in got if k.startswith("model.") and k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(sharded) == 2 * (config.num_hidden_layers - config.first_k_dense_replace)
    for key, tensor in got.items():
        if key in sharded:
            assert tensor.shape[0] == len(slots)
            assert torch.equal(tensor, want[key][list(slots)]), key
        else:
            assert torch.equal(tensor, want[key]), key
    assert not torch.equal(got[sharded[0]][0], got[sharded[0]][1])  # experts differ from one another


def test_dummy_weights_hash_routing_tables_and_buffers():
    """V4's tid2eid (a parameter of our model, a buffer of transformers'): uniform ids of the
    router's experts; a router bias held as a buffer is drawn too."""
    from tests.hf_checkpoints_v4 import hf_config_v4, quant_config_v4

    hf = hf_config_v4("v4_flash_like")
    config = V4ModelConfig.from_hf(hf, {**hf.to_dict(), **quant_config_v4("fp8")})
    model = get_model_class(config.model_type)(config, OpTable.reference(), torch.float32, torch.device("cpu"), keep_fp8=True)
    _poison(model)
    init_dummy_weights(model, seed=0, progress=False)
    tables = {n: p for n, p in model.named_parameters() if n.endswith("tid2eid")}
    assert len(tables) == config.num_hash_layers >= 1
    for name, ids in tables.items():
        assert ids.shape == (config.vocab_size, config.num_experts_per_tok)
        assert ids.min() >= 0 and ids.max() < config.n_routed_experts, name
        assert torch.bincount(ids.flatten(), minlength=config.n_routed_experts).min() > 0.5 * ids.numel() / config.n_routed_experts
    assert all(bool(all_finite(p)) for p in model.parameters() if p.is_floating_point())

    class Gate(torch.nn.Module):  # transformers' V4 router layout: weight a parameter, the rest buffers
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((64, 16), float("nan")))
            self.register_buffer("tid2eid", torch.full((160, 2), -1, dtype=torch.int64))
            self.register_buffer("e_score_correction_bias", torch.full((64,), float("nan")))

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.loaded = Gate(), False

        def post_load(self):
            self.loaded = True

    holder = Holder()
    init_dummy_weights(holder, seed=0, progress=False)
    assert holder.loaded and abs(holder.gate.weight.std() * 4 - 1) < 0.1
    assert holder.gate.tid2eid.min() >= 0 and holder.gate.tid2eid.max() < 64 and len(holder.gate.tid2eid.unique()) > 56
    assert 0.007 < holder.gate.e_score_correction_bias.std() < 0.013
