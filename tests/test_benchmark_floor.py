"""benchmarks/e2e.py's HBM floor (the bytes one decode step must read) against a hand count on
small configs, term by term: the embedded default model (bf16, one MTP layer that a step without
speculative tokens does not run) and an FP8 variant of it with a tied lm_head. The models are
built on the meta device (no memory), as the engine builds them, and post_load()ed (absorbed
W_UK / W_UV, fused gate/up)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import e2e

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "deepinfer_core" / "default_model"
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def build(model_dir: Path, keep_fp8: bool = False):
    from deepinfer_core.models.registry import read_config
    from deepinfer_core.models.registry import get_model_class
    from deepinfer_core.ops import OpTable

    config = read_config(model_dir)
    model = get_model_class(config.model_type)(config, OpTable.reference(), torch.bfloat16, torch.device("meta"), keep_fp8=keep_fp8)
    model.post_load()
    return model


def expected_experts(batch: int, e: int = 8, k: int = 2) -> float:
    """Distinct routed experts B tokens touch under uniform top-k routing: E (1 - (1 - k/E)^B)."""
    return e * (1 - (1 - k / e) ** batch)


def check_shapes(c, **want):
    got = {name: getattr(c, name) for name in want}
    assert got == want, "the hand counts below assume these config values"


@pytest.fixture(scope="module")
def default_model():
    return build(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def fp8_tied_model(tmp_path_factory):
    raw = json.loads((DEFAULT_MODEL / "config.json").read_text())
    raw.update(quantization_config=FP8, tie_word_embeddings=True, moe_intermediate_size=128, n_shared_experts=2)
    path = tmp_path_factory.mktemp("fp8-tied")
    (path / "config.json").write_text(json.dumps(raw))
    return build(path, keep_fp8=True)


# The default model: D=256, V=4096, 4 layers (layer 0 dense, 1-3 MoE), H=8, q_lora 128, kv_lora 64,
# nope 32, rope 16, v 32, dense intermediate 768, 8 routed experts of 160 (top-2) + 1 shared,
# noaux_tc routing (a float32 correction bias), bf16 (2 bytes), one MTP layer.
BF16 = 2
ATTENTION = BF16 * (
    128 * 256            # q_a_proj [q_lora, D]
    + 128                # q_a_layernorm
    + (8 * 48) * 128     # q_b_proj [H * (nope + rope), q_lora]
    + (64 + 16) * 256    # kv_a_proj_with_mqa [kv_lora + rope, D]
    + 64                 # kv_a_layernorm
    + 8 * 32 * 64        # W_UK [H, nope, kv_lora] (kv_b_proj itself is not read by decode)
    + 8 * 32 * 64        # W_UV [H, v, kv_lora]
    + 256 * (8 * 32)     # o_proj [D, H * v]
)
LAYER_NORMS = BF16 * 2 * 256  # input_layernorm, post_attention_layernorm
DENSE_MLP = BF16 * (2 * 768 * 256 + 256 * 768)  # fused gate_up [2I, D], down [D, I]
ROUTER = 4 * 8 * 256 + 4 * 8  # float32 gate weight [E, D] + e_score_correction_bias [E]
SHARED_EXPERT = BF16 * (2 * 160 * 256 + 256 * 160)  # one shared expert of 160: gate_up, down
ONE_EXPERT = BF16 * (2 * 160 * 256 + 256 * 160)  # one routed expert: gate_up [2I, D], down [D, I]
FINAL_NORM = BF16 * 256
LM_HEAD = BF16 * 4096 * 256
EMBED_ROW = BF16 * 256
KV_PER_TOKEN = 4 * (64 + 16) * BF16  # 4 layers x [c | k_pe] latents (the MTP layer's cache is not read)


def hand_count_default(batch: int) -> float:
    return (
        4 * (ATTENTION + LAYER_NORMS)
        + 1 * DENSE_MLP
        + 3 * (ROUTER + SHARED_EXPERT + expected_experts(batch) * ONE_EXPERT)
        + batch * EMBED_ROW + FINAL_NORM + LM_HEAD
    )


def test_the_counts_are_what_the_config_says(default_model):
    check_shapes(default_model.config, hidden_size=256, vocab_size=4096, num_hidden_layers=4, first_k_dense_replace=1,
                 num_attention_heads=8, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                 v_head_dim=32, intermediate_size=768, moe_intermediate_size=160, n_routed_experts=8,
                 num_experts_per_tok=2, n_shared_experts=1, topk_method="noaux_tc", tie_word_embeddings=False,
                 num_nextn_predict_layers=1)
    assert default_model.num_mtp_layers == 1  # built, and left out of the floor
    assert (ATTENTION, DENSE_MLP, ONE_EXPERT, LM_HEAD) == (401_792, 1_179_648, 245_760, 2_097_152)


@pytest.mark.parametrize("batch", [1, 3, 32])
def test_weight_floor_matches_the_hand_count(default_model, batch):
    assert e2e.step_weight_bytes(default_model, batch) == pytest.approx(hand_count_default(batch), rel=1e-12)


def test_expected_experts_grow_to_all_of_them():
    assert expected_experts(1) == pytest.approx(2)  # one token: its top-2
    assert expected_experts(2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
    assert expected_experts(1000) == pytest.approx(8)


def test_kv_floor_matches_the_hand_count(default_model):
    engine = SimpleNamespace(cache_groups=default_model.cache_groups())
    assert e2e.kv_bytes(engine, 3, 100) == 3 * 100 * KV_PER_TOKEN == 192_000
    # decode_point: 3 untimed steps, then 16 timed ones; the first attends over the L context
    # tokens and each step adds one: L + 3 ... L + 18, mean L + 10.5.
    assert e2e.timed_context(1024, 16) == 1024 + 10.5
    assert e2e.kv_bytes(engine, 2, e2e.timed_context(1024, 16)) == 2 * 1034.5 * KV_PER_TOKEN


# The FP8 variant: the same shapes with moe_intermediate 128, 2 shared experts (one MLP of 256),
# block-FP8 [128, 128] weights (1 byte, plus one float32 scale per 128 x 128 block) in every
# Linear but lm_head; W_UK / W_UV are dequantised to bf16; lm_head is the embedding (tied).
FP8_BYTE = 1
SCALE = 4


def fp8_linear(out_features: int, in_features: int) -> int:
    return FP8_BYTE * out_features * in_features + SCALE * -(-out_features // 128) * -(-in_features // 128)


FP8_ATTENTION = (
    fp8_linear(128, 256)           # q_a_proj: 32768 + 1 x 2 scales
    + BF16 * 128                   # q_a_layernorm
    + fp8_linear(8 * 48, 128)      # q_b_proj: 49152 + 3 x 1 scales
    + fp8_linear(64 + 16, 256)     # kv_a_proj_with_mqa: 20480 + 1 x 2 scales
    + BF16 * 64                    # kv_a_layernorm
    + BF16 * 2 * 8 * 32 * 64       # W_UK + W_UV, bf16
    + fp8_linear(256, 8 * 32)      # o_proj: 65536 + 2 x 2 scales
)
FP8_DENSE_MLP = fp8_linear(2 * 768, 256) + fp8_linear(256, 768)
FP8_SHARED = fp8_linear(2 * 256, 256) + fp8_linear(256, 256)
FP8_ONE_EXPERT = fp8_linear(2 * 128, 256) + fp8_linear(256, 128)


def test_fp8_tied_weight_floor_matches_the_hand_count(fp8_tied_model):
    m = fp8_tied_model
    check_shapes(m.config, moe_intermediate_size=128, n_shared_experts=2, tie_word_embeddings=True, fp8_block=(128, 128))
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert (FP8_ATTENTION, FP8_ONE_EXPERT) == (32776 + 256 + 49164 + 20488 + 128 + 65536 + 65552, 65552 + 32776)
    for batch in (1, 5):
        want = (
            4 * (FP8_ATTENTION + LAYER_NORMS)
            + FP8_DENSE_MLP
            + 3 * (ROUTER + FP8_SHARED + expected_experts(batch) * FP8_ONE_EXPERT)
            + batch * EMBED_ROW + FINAL_NORM
            + LM_HEAD  # tied: the same tensor as the embedding, but the logits read all of it
        )
        assert e2e.step_weight_bytes(m, batch) == pytest.approx(want, rel=1e-12)
