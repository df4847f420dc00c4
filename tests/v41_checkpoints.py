"""Tiny random DeepSeek-V4.1 checkpoints in DeepSeek's original key layout, for tests.

transformers has no V4.1, so there is no golden model: tests compare engine runs against each
other (incremental vs full forward, chunked vs whole, cached vs uncached) and components against
the spec. ``write_checkpoint_v41(name, path, quant)`` builds tiny config ``name`` (CONFIGS_V41),
random weights from the model's own parameter list, and writes config.json (the official layout:
a nested ``text_config``, the root ``quantization_config`` and ``image_token_id``), the
safetensors (original names; ``quant="fp8+fp4"``: 32x32 block-FP8 linears with e8m0 scales,
MXFP4 routed experts, FP8 Engram rows with one e8m0 scale per 32 values) and the conformance
tokenizer (Engram's compressed vocabulary is read from it). Returns the model's float state.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer_core.models.v41.checkpoint import rename_v41_state
from deepinfer_core.models.v41.config import V41ModelConfig
from deepinfer_core.conformance.checkpoints import quantize_fp8_block_e8m0, quantize_mxfp4
from deepinfer_core.models.dummy_weights import init_dummy_weights
from deepinfer_core.models.v41.model import DeepseekV41ForCausalLM
from deepinfer_core.ops import OpTable

TOKENIZER = Path(__file__).parent.parent / "deepinfer_core" / "conformance" / "tokenizer"
COMPRESSED_VOCAB = 1426  # of the conformance tokenizer (2048 tokens), by DeepSeek's rule
IMAGE_TOKEN = 2047

BASE_V41 = dict(
    model_type="deepseek_v41_text", vocab_size=2048, hidden_size=64, moe_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32,
    o_lora_rank=16, o_groups=2, hidden_act="silu", swiglu_limit=10.0, rms_norm_eps=1e-20, tie_word_embeddings=False,
    max_position_embeddings=1024, rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1},
    compress_rope_theta=160000.0, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.5,
    sliding_window=8, index_n_heads=16, index_head_dim=16, index_topk=4, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    engram_max_ngram_size=4, engram_n_heads=2, engram_head_dim=32, engram_vocab_size=50,
    engram_compressed_vocab_size=COMPRESSED_VOCAB, engram_pad_token_id=2, bos_token_id=0, eos_token_id=1,
)
CONFIGS_V41 = {
    # sources at 2 (ratio 2) and 5 (ratio 1, the candidate source), REUSE 3, 4, 6, REINDEX 7
    # (scores only the candidate blocks: 2 entries a block, 3 blocks kept), Engram in 1 and 3
    "v41-tiny": dict(
        num_hidden_layers=8, compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0], kv_source_layer_ids=[2, 5],
        index_source_layer_ids=[2, 5, 7], candidate_source_layer_id=5, candidate_block_size=2, candidate_topk_blocks=3,
        engram_layer_ids=[1, 3], num_nextn_predict_layers=1,
    ),
    # v41-tiny with three DSpark stages (taps from layers 5-7, blocks of 3, 4 experts top-2)
    "v41-dspark": dict(
        num_hidden_layers=8, compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0], kv_source_layer_ids=[2, 5],
        index_source_layer_ids=[2, 5, 7], candidate_source_layer_id=5, candidate_block_size=2, candidate_topk_blocks=3,
        engram_layer_ids=[1, 3], num_nextn_predict_layers=3, dspark_target_layer_ids=[5, 6, 7], dspark_block_size=3,
        dspark_noise_token_id=2040, dspark_markov_rank=8, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2,
    ),
    # two ratio-2 sources, a REINDEX layer without candidates, a window-only layer last, no Engram
    "v41-sources": dict(
        num_hidden_layers=6, compress_ratios=[0, 2, 2, 2, 1, 0], kv_source_layer_ids=[1, 2, 4],
        index_source_layer_ids=[1, 2, 3, 4], engram_layer_ids=[],
    ),
}
QUANT_V41 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [32, 32],
             "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
# The linears (module names) DeepSeek ships in FP8; the compressors, indexer keys and weights stay bf16.
FP8_MODULES = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj", "self_attn.o_a_proj", "self_attn.o_b_proj",
               "indexer.q_b_proj", "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj",
               "engram.kv_proj", "engram.embed", "main_proj")


def config_json(name: str, quant: str | None = "fp8+fp4", **overrides) -> dict:
    text = copy.deepcopy(BASE_V41) | copy.deepcopy(CONFIGS_V41[name]) | overrides
    raw = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"], "text_config": text,
           "vision_config": {"model_type": "deepseek_v41_vision", "hidden_size": 32}, "image_token_id": IMAGE_TOKEN}
    if quant:
        raw["quantization_config"] = dict(QUANT_V41)
    return raw


def _is_fp8(name: str) -> bool:
    return name.endswith(".weight") and name.removesuffix(".weight").endswith(FP8_MODULES)


def random_state(config: V41ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Float32 weights of the model for ``config`` (unquantised): N(0, 1/fan_in) matrices, norm
    weights 1 + 0.1 N(0, 1), sinks and mHC biases random."""
    plain = config.model_copy(update={"fp8_block": None})
    model = DeepseekV41ForCausalLM(plain, OpTable.reference(), torch.float32, torch.device("cpu"))
    model.post_load = lambda: None  # keep the checkpoint's layout (post_load fuses the shared experts)
    init_dummy_weights(model, seed=seed, progress=False)
    gen = torch.Generator().manual_seed(seed + 1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k, v in state.items():
        if k.endswith("norm.weight"):
            state[k] = 1 + 0.1 * torch.randn(v.shape, generator=gen)
    return state


def quantize_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(what the checkpoint stores: FP8 / MXFP4 / bf16 as DeepSeek ships V4.1, the float values
    it dequantises to)."""
    stored, values = {}, {}
    for k, v in state.items():
        if _is_fp8(k):
            block = (1, 32) if k.endswith("engram.embed.weight") else (32, 32)
            w, s = quantize_fp8_block_e8m0(v, block)
            stored[k], stored[k[: -len(".weight")] + ".weight_scale_inv"] = w, s
        elif k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            w, s = quantize_mxfp4(v)
            stored[k], stored[k + "_scale_inv"] = w, s
        elif k.endswith(("sinks", "_hc.fn", "_hc.base", "_hc.scale", "e_score_correction_bias", "confidence_head.proj.weight")):
            stored[k] = v.float()
        else:
            stored[k] = v.to(torch.bfloat16)
        values[k] = v
    return stored, values


def write_checkpoint_v41(name: str, path: Path, quant: str | None = "fp8+fp4", seed: int = 0, extra: dict | None = None,
                         **overrides) -> Path:
    """Write tiny V4.1 checkpoint ``name`` to ``path`` (see the module docstring); ``extra``: more
    tensors to store under their own (checkpoint) names."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = config_json(name, quant, **overrides)
    config = V41ModelConfig.from_raw(raw)
    state = random_state(config, seed)
    stored = quantize_state(state)[0] if quant else {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
    tensors = rename_v41_state(stored) | (extra or {})
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for f in TOKENIZER.iterdir():
        shutil.copy(f, path / f.name)
    return path
