"""benchmarks/serve.py runs end to end on the default model (a tiny sweep): every request
answers, and the report holds what the README quotes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")


def test_the_serving_benchmark_runs(tmp_path):
    from benchmarks import serve

    serve.main(["--rates", "4", "--requests", "6", "--max-tokens", "4", "--system-tokens", "40", "--accelerator", "cpu",
                "--out", str(tmp_path)])
    report = json.loads((tmp_path / "serve.json").read_text())
    (point,) = report["points"]
    assert point["num_errors"] == 0 and point["output_tokens"] == 6 * 4
    assert point["ttft_s"]["p50"] > 0 and point["tpot_s"]["p99"] >= point["tpot_s"]["p50"] > 0
    assert 0 < point["prefix_hit_rate"] < 1  # the shared system prompt is found after the first request
