"""benchmarks.v4_slice's summary: the issue's ratios come from the run's own rows (no timing is
asserted: the rows are made up)."""

from __future__ import annotations

import pytest

from benchmarks.v4_slice import SGLANG_V4_FLASH_TPOT_MS, summarize


def test_summary_ratios_from_the_rows():
    result = {
        "model": "v4-flash-slice",
        "generate": [{"batch": 1, "call": "first", "seconds": 1.1}, {"batch": 1, "call": "repeat", "seconds": 1.0}],
        "cadence": [{"batch": 1, "prompt_len": 2048, "decode_step_ms": 2.0, "seconds_1": 0.05, "step_over_floor": 1.8},
                    {"batch": 8, "prompt_len": 2048, "decode_step_ms": 4.0, "seconds_1": 0.2, "step_over_floor": 1.4}],
        "transformers": [{"batch": 1, "context": 2048, "step_s": 0.0225, "prefill_s": 0.076},
                         {"batch": 8, "context": 1024, "step_s": 0.05, "prefill_s": 0.3},  # another prompt length: not paired
                         {"batch": 2, "context": 2048, "error": "OOM"}],
    }
    s = summarize(result, slice_layers=4)
    assert s["cadence_over_floor"] == {1: 1.8, 8: 1.4}
    assert s["versus_transformers"] == [{"batch": 1, "context": 2048, "decode_x_transformers": pytest.approx(11.25),
                                         "prefill_x_transformers": pytest.approx(1.52)}]
    assert s["first_over_repeat"] == {1: pytest.approx(1.1)}
    proj = s["projection"]
    assert proj["projected_tpot_ms"] == pytest.approx(2.0 / 4 * 43) and proj["sglang_published_tpot_ms"] == SGLANG_V4_FLASH_TPOT_MS
    assert "projection" in proj["label"] and "not a comparison" in proj["label"]


def test_summary_without_cadence_has_no_projection():
    s = summarize({"model": "v4-pro-slice", "generate": []}, slice_layers=4)
    assert s["versus_transformers"] == [] and "projection" not in s


def test_the_transformers_peer_gets_fp8_linears_dequantised():
    """benchmarks.e2e hands transformers (a model built from a config, no quantizer) our block-FP8
    linears as bf16, before a stacked weight is split: the weight is the dequantised one and its
    weight_scale_inv is gone; other tensors pass as they are (the 2026-12-07 H100 runs failed on
    the unexpected scales, first of the attention, then of the fused shared-expert gate_up)."""
    import torch

    from benchmarks.e2e import peer_params
    from deepinfer_core.ops.linear import dequantize_fp8_block

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 384, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=gen) + 0.5
    norm = torch.randn(384, generator=gen)
    params = {"mlp.gate_up_proj.weight": weight, "mlp.gate_up_proj.weight_scale_inv": scale, "norm.weight": norm}
    out = peer_params(params, (128, 128))
    assert set(out) == {"mlp.gate_up_proj.weight", "norm.weight"}
    got = out["mlp.gate_up_proj.weight"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, dequantize_fp8_block(weight, scale, (128, 128), torch.bfloat16))
    assert got[200, 300] == (weight[200, 300].float() * scale[1, 2]).to(torch.bfloat16)
    assert out["norm.weight"] is norm
