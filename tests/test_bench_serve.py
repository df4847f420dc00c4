"""benchmarks/serve.py runs end to end on the default model (a tiny sweep): every request
answers, and the report holds what the README quotes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")


def test_the_serving_benchmark_runs(tmp_path):
    from benchmarks import serve

    serve.main(["--rates", "4", "--requests", "6", "--max-tokens", "4", "--system-tokens", "40", "--accelerator", "cpu",
                "--warmup", "2", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "serve.json").read_text())
    (point,) = report["points"]
    assert point["num_errors"] == 0 and point["output_tokens"] == 6 * 4
    assert point["ttft_s"]["p50"] > 0 and point["tpot_s"]["p99"] >= point["tpot_s"]["p50"] > 0
    assert 0 < point["prefix_hit_rate"] <= 1  # the shared system prompt was found
    assert report["warmup"]["num_errors"] == 0 and point["engine"]["steps"] >= 4  # 4 tokens a request: at least 4 steps
    assert 0 < point["engine"]["stepping_share"] <= 1


def test_a_random_weight_model_speaks_the_tokenizers_vocabulary():
    """--model v2-lite: V2-Lite's shapes with the default tokenizer, its vocabulary cut to the
    tokenizer's so every streamed token has text (else TTFT would wait for a token that has some)."""
    from benchmarks.generate import model_with_tokenizer
    from deepinfer_core.engine.startup import load_tokenizer

    path = model_with_tokenizer("v2-lite", 1, tokenizer_vocab=True)
    config, tokenizer = json.loads(open(f"{path}/config.json").read()), load_tokenizer(Path(path))
    assert config["vocab_size"] == len(tokenizer) and config["hidden_size"] == 2048 and config["num_hidden_layers"] == 1
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert json.loads(open(f"{model_with_tokenizer('v2-lite', 1)}/config.json").read())["vocab_size"] == 102400
