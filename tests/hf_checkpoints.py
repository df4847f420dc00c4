"""Tiny random DeepSeek V2/V3 checkpoints written by transformers' save_pretrained, for tests.

``write_checkpoint(name, dir)`` saves the named tiny config (see CONFIGS) and returns the HF
golden model (float32, eager attention, eager experts) reloaded from what was written. FP8
variants store block-FP8 weights written here (transformers cannot save them on CPU); their
golden is the same model with the dequantised weights. ``add_mtp_weights`` appends random MTP
layer tensors to a saved single-file checkpoint; ``hf_mtp_layer`` builds transformers' own
MtpLayer with them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer_core.conformance.checkpoints import (is_fp8_linear, mtp_checkpoint_tensors, quantize_fp8_block)  # noqa: F401 (quantize_fp8_block: re-exported)

BASE = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "rope_theta": 10000.0,
}
V2_YARN = dict(YARN, mscale=0.707, mscale_all_dim=0.707)
# mscale != mscale_all_dim: the softmax scale takes mscale_all_dim alone (yarn_apply_mscale), the cos/sin
# attention factor mscale / mscale_all_dim; every other config has the two equal (factor 1).
YARN_ASYMMETRIC = dict(YARN, mscale=0.9, mscale_all_dim=0.707)
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

# name -> (family, config overrides, FP8 block or None)
CONFIGS: dict[str, tuple[str, dict, tuple[int, int] | None]] = {
    "v3_yarn": ("v3", dict(q_lora_rank=48, n_shared_experts=1, n_group=2, topk_group=2, rope_parameters=YARN), None),
    "v3_no_q_lora": ("v3", dict(q_lora_rank=None, n_shared_experts=1, n_group=1, topk_group=1, rope_parameters=DEFAULT_ROPE), None),
    "v3_grouped": (
        "v3",
        dict(q_lora_rank=48, n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, rope_parameters=YARN),
        None,
    ),
    "v3_shared2": ("v3", dict(q_lora_rank=48, n_shared_experts=2, n_group=1, topk_group=1, rope_parameters=YARN), None),
    "v3_yarn_mscale": ("v3", dict(q_lora_rank=48, n_shared_experts=1, n_group=2, topk_group=2, rope_parameters=YARN_ASYMMETRIC), None),
    # the routed weights are the raw sigmoid scores (times routed_scaling_factor), not renormalised
    "v3_unnormed_topk": (
        "v3",
        dict(q_lora_rank=None, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=False, rope_parameters=YARN),
        None,
    ),
    "v3_neox": ("v3", dict(q_lora_rank=48, n_shared_experts=1, n_group=1, topk_group=1, rope_interleave=False, rope_parameters=YARN), None),
    "v2_greedy": (
        "v2",
        dict(q_lora_rank=None, n_shared_experts=2, topk_method="greedy", routed_scaling_factor=1.0, rope_parameters=V2_YARN),
        None,
    ),
    "v2_group_limited": (
        "v2",
        dict(
            q_lora_rank=48,
            n_shared_experts=1,
            n_routed_experts=16,
            num_experts_per_tok=3,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=4.0,
            rope_parameters=V2_YARN,
        ),
        None,
    ),
    "v3_fp8": ("v3", dict(q_lora_rank=48, n_shared_experts=1, n_group=2, topk_group=1, rope_parameters=YARN), (32, 32)),
    # non-square blocks (bn, bk) = (16, 32), partial blocks both ways: a swapped (bk, bn) reads the grid wrong
    "v3_fp8_nonsquare": ("v3", dict(q_lora_rank=48, n_shared_experts=1, n_group=2, topk_group=1, rope_parameters=YARN), (16, 32)),
    # every dimension a multiple of the block: transformers itself can dequantise this one
    # (it derives the block from the scale grid, which partial blocks like v3_fp8's defeat)
    "v3_fp8_aligned": ("v3", dict(q_lora_rank=48, n_shared_experts=1, n_group=2, topk_group=1, rope_parameters=YARN), (8, 8)),
}


def hf_classes(family: str):
    if family == "v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        return DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    return DeepseekV2Config, DeepseekV2ForCausalLM


def hf_config(name: str, **overrides):
    family, extra, _ = CONFIGS[name]
    config_cls, _ = hf_classes(family)
    return config_cls(**{**BASE, **extra, **overrides})


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) activations, non-trivial norms, a non-zero router bias and spread-out logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name.endswith("e_score_correction_bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=gen))
            elif "norm" in name:
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=gen))
            elif "embed_tokens" in name:
                t.copy_(torch.randn(t.shape, generator=gen))
            elif name.endswith(".bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=gen))
            else:
                gain = 3.0 if "lm_head" in name else 2.0 if name.endswith("mlp.gate.weight") else 1.0
                t.copy_(gain * torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[-1]))


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    n, k = q.shape
    s = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.float() * s


def load_golden(path: Path, family: str):
    _, model_cls = hf_classes(family)
    try:
        model = model_cls.from_pretrained(str(path), attn_implementation="eager", experts_implementation="eager")
    except TypeError:
        model = model_cls.from_pretrained(str(path), attn_implementation="eager")
    return model.float().eval()


def write_checkpoint(name: str, path: Path, *, seed: int = 0, max_shard_size: str | None = None):
    """Save tiny config ``name`` into ``path``; return the HF golden model (float32, eager)."""
    family, _, block = CONFIGS[name]
    _, model_cls = hf_classes(family)
    torch.manual_seed(seed)
    model = model_cls(hf_config(name))
    randomize(model, seed)
    path = Path(path)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    if block is None:
        model.save_pretrained(str(path), **kwargs)
        return load_golden(path, family)

    # FP8: save normally into a staging dir, quantise the linears, and keep a dequantised twin for the golden.
    golden_dir = path.parent / (path.name + "_dequantised")
    model.save_pretrained(str(golden_dir))
    src = golden_dir / "model.safetensors"
    quantised, dequantised = {}, {}
    with safe_open(str(src), framework="pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            if is_fp8_linear(key):
                q, s = quantize_fp8_block(t, block)
                quantised[key], quantised[key + "_scale_inv"] = q, s
                dequantised[key] = dequantize(q, s, block)
            else:
                quantised[key] = dequantised[key] = t
    save_file(dequantised, str(src), metadata={"format": "pt"})
    path.mkdir(parents=True, exist_ok=True)
    save_file(quantised, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((golden_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return load_golden(golden_dir, family)


def mtp_layer_tensors(hf_config_obj, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random tensors of one MTP layer, keyed as transformers' MtpLayer state_dict (mtp_block.*, post_norm)."""
    from transformers.modeling_layers import MtpLayer

    layer = build_mtp_layer(hf_config_obj, MtpLayer)
    randomize(layer, seed)
    return {k: v.detach().clone() for k, v in layer.state_dict().items()}


def build_mtp_layer(hf_config_obj, mtp_layer_cls=None):
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    config = hf_config_obj.get_mtp_config()
    config._attn_implementation = "eager"
    return (mtp_layer_cls or MtpLayer)(config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, 0).float().eval()


def mtp_checkpoint_keys(tensors: dict[str, torch.Tensor], layer: int, hidden: int, vocab: int) -> dict[str, torch.Tensor]:
    """MtpLayer state_dict -> checkpoint keys under model.layers.{layer} (experts split per expert),
    plus random embed_tokens / shared_head.head, which DeepSeek's checkpoints store in the MTP layer too."""
    out = mtp_checkpoint_tensors(tensors, layer)
    prefix = f"model.layers.{layer}."
    gen = torch.Generator().manual_seed(123)
    out[prefix + "embed_tokens.weight"] = torch.randn(vocab, hidden, generator=gen)
    out[prefix + "shared_head.head.weight"] = torch.randn(vocab, hidden, generator=gen)
    return out


def add_mtp_weights(path: Path, hf_model, *, seed: int = 1) -> dict[str, torch.Tensor]:
    """Append one random MTP layer to the single-file checkpoint in ``path``; returns its MtpLayer state_dict."""
    cfg = hf_model.config
    tensors = mtp_layer_tensors(cfg, seed)
    file = Path(path) / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        all_tensors = {k: f.get_tensor(k) for k in f.keys()}
    all_tensors.update(mtp_checkpoint_keys(tensors, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size))
    save_file(all_tensors, str(file), metadata={"format": "pt"})
    config_path = Path(path) / "config.json"
    config = json.loads(config_path.read_text())
    config["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2))
    return tensors


def hf_mtp_layer(hf_model, tensors: dict[str, torch.Tensor]):
    """transformers' MtpLayer for hf_model's config, holding ``tensors``."""
    layer = build_mtp_layer(hf_model.config)
    layer.load_state_dict(tensors)
    return layer


def causal_mask(t: int) -> torch.Tensor:
    """Additive [1, 1, t, t] float32 causal mask for calling HF layers directly."""
    return torch.full((t, t), float("-inf")).triu(1)[None, None]
