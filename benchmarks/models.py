"""The model shapes the benchmarks run: real DeepSeek configs, with random weights.

``v2-lite``: DeepSeek-V2-Lite's config.json as published (27 layers, 64 routed experts of 1408
top-6 + 2 shared, MLA without q_lora, ~15.7B parameters, bf16): it fits one 141 GB GPU.
``v3-slice``: DeepSeek-V3's config.json with 4 layers (1 dense + 3 MoE) instead of 61 and no MTP
layer, block-FP8 weights as DeepSeek ships them: every per-layer shape is the real one.
``v3``, ``v4-flash``, ``v4-pro``: the full configs (cache sizing; too large to run on one GPU).
``v4-flash-slice`` / ``v4-pro-slice``: DeepSeek-V4-Flash's / V4-Pro's config.json with its first 4
layers and no MTP block.
``v41-flash``: DeepSeek-V4.1-Flash's config.json (§4.9); ``v41-flash-slice``: its per-layer shapes
in 6 layers (see below).
"""

from __future__ import annotations

import json
from pathlib import Path

_YARN_V2 = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
_YARN_V3 = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "torch_dtype": "bfloat16",
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "n_group": 1, "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
    "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6, "rope_theta": 10000, "rope_scaling": _YARN_V2,
    "max_position_embeddings": 163840, "attention_bias": False, "tie_word_embeddings": False,
    "bos_token_id": 100000, "eos_token_id": 100001, "hidden_act": "silu", "initializer_range": 0.02,
}

V3_SLICE = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 4, "num_attention_heads": 128, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "rope_theta": 10000, "rope_scaling": _YARN_V3,
    "max_position_embeddings": 163840, "attention_bias": False, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu", "initializer_range": 0.02,
    "num_nextn_predict_layers": 0,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
}

_YARN_V4 = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
_V4_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}

# DeepSeek-V4-Flash's config.json (deepseek_architectures.md §3.9), legacy keys as DeepSeek ships them.
V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "torch_dtype": "bfloat16",
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0], "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "sliding_window": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "num_hash_layers": 3, "swiglu_limit": 10.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": _YARN_V4, "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1, "expert_dtype": "fp4",
    "quantization_config": _V4_FP8, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}
V4_PRO = {
    **V4_FLASH, "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536, "o_groups": 16,
    "compress_ratios": [128, 128] + [4, 128] * 29 + [4] + [0], "index_topk": 1024, "n_routed_experts": 384,
    "moe_intermediate_size": 3072, "routed_scaling_factor": 2.5,
}
# V4-Flash's first four layers (sliding-only, sliding-only, CSA, HCA; the first three hash-routed), no MTP:
# every per-layer shape is the real one.
V4_FLASH_SLICE = {**V4_FLASH, "num_hidden_layers": 4, "compress_ratios": [0, 0, 4, 128, 0], "num_nextn_predict_layers": 0}
# V4-Pro's first four layers (HCA, HCA, CSA, HCA; the first three hash-routed), no MTP: its real per-layer shapes.
V4_PRO_SLICE = {**V4_PRO, "num_hidden_layers": 4, "compress_ratios": [128, 128, 4, 128, 0], "num_nextn_predict_layers": 0}
V3_FULL = {**V3_SLICE, "num_hidden_layers": 61}


def _v41() -> dict:
    from tests.v41_official import OFFICIAL_CONFIG

    return json.loads(json.dumps(OFFICIAL_CONFIG))


V41_FLASH = _v41()
# V4.1-Flash's per-layer shapes in 6 layers: window-only, two ratio-2 (a KV source, a REUSE), three
# ratio-1 (a KV source that is also the candidate source, a REUSE, a REINDEX that filters by its
# candidate blocks); Engram in layer 1 with a 1M-row hash space (the real 16M would need 98 GB of
# table) and 128 routed experts instead of 384 (bf16 experts: 384 of them are 27 GB a layer).
V41_FLASH_SLICE = _v41()
V41_FLASH_SLICE["text_config"].update(
    num_hidden_layers=6, compress_ratios=[0, 2, 2, 1, 1, 1], kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3, 5],
    candidate_source_layer_id=3, engram_layer_ids=[1], engram_num_embeddings=[], engram_vocab_size=1000000,
    engram_compressed_vocab_size=1426, n_routed_experts=128, num_nextn_predict_layers=0, dspark_target_layer_ids=[],
)
del V41_FLASH_SLICE["image_token_id"]  # benchmarks draw random prompts over the whole vocabulary

MODELS = {"v2-lite": V2_LITE, "v3-slice": V3_SLICE, "v3": V3_FULL, "v4-flash": V4_FLASH, "v4-pro": V4_PRO, "v4-flash-slice": V4_FLASH_SLICE,
          "v4-pro-slice": V4_PRO_SLICE,
          "v41-flash": V41_FLASH, "v41-flash-slice": V41_FLASH_SLICE}
# Engram hashes read a tokenizer: V4.1 slices get the conformance tokenizer (1426 compressed ids).
NEEDS_TOKENIZER = ("v41-flash-slice",)


def write_config(name: str, directory: Path) -> Path:
    """A checkpoint directory holding only config.json (weights come from load_format='dummy')."""
    path = Path(directory) / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODELS[name], indent=1))
    if name in NEEDS_TOKENIZER:
        import shutil

        for f in (Path(__file__).parent.parent / "deepinfer_core" / "conformance" / "tokenizer").iterdir():
            shutil.copy(f, path / f.name)
    return path
