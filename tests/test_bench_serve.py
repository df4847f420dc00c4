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


def test_the_chat_workload_gets_its_prefixes_back_from_the_host_tier(tmp_path):
    """--workload chat on a cache too small for the conversations: without a host tier little is
    reused; with one, the evicted turns come back from host memory and fewer prompt tokens are
    computed (the counters the README's comparison quotes)."""
    from benchmarks import serve

    points = {}
    for offload in ("0", "0.25"):
        out = tmp_path / offload
        serve.main(["--workload", "chat", "--turns", "3", "--rates", "8", "--requests", "8", "--max-tokens", "4",
                    "--system-tokens", "120", "--num-kv-blocks", "24", "--kv-offload-gb", offload, "--accelerator", "cpu",
                    "--warmup", "0", "--out", str(out)])
        (points[offload],) = json.loads((out / "serve.json").read_text())["points"]
    without, with_host = points["0"], points["0.25"]
    assert without["num_errors"] == with_host["num_errors"] == 0 and without["requests"] == 8 * 3
    assert without["prompt_tokens"] == with_host["prompt_tokens"]  # greedy: the same conversations
    assert without["cached_prompt_tokens_by_tier"]["host"] == 0 < with_host["cached_prompt_tokens_by_tier"]["host"]
    assert with_host["prompt_tokens_computed"] < without["prompt_tokens_computed"]


def test_a_prefill_decode_pair_behind_vllm_router_serves_the_benchmark(tmp_path):
    """--launch pd: two deepinfer serve processes and vllm-router; every prompt token is counted
    once (the prefill's prompt lacks the last token, the decode's received the rest)."""
    from benchmarks import serve

    serve.main(["--launch", "pd", "--rates", "8", "--requests", "4", "--max-tokens", "4", "--system-tokens", "40",
                "--accelerator", "cpu", "--warmup", "0", "--out", str(tmp_path)])
    (point,) = json.loads((tmp_path / "serve.json").read_text())["points"]
    assert point["num_errors"] == 0 and point["output_tokens"] == 4 * 4
    assert 0 < point["prompt_tokens_computed"] <= point["prompt_tokens"]


def test_replicas_behind_vllm_router_serve_the_benchmark(tmp_path):
    """--launch one --replicas 2: two deepinfer serve processes behind vllm-router's policy; the
    servers' counters add up over both."""
    from benchmarks import serve

    serve.main(["--launch", "one", "--replicas", "2", "--router-policy", "round_robin", "--rates", "8", "--requests", "4",
                "--max-tokens", "4", "--system-tokens", "40", "--accelerator", "cpu", "--warmup", "0", "--out", str(tmp_path)])
    (point,) = json.loads((tmp_path / "serve.json").read_text())["points"]
    assert point["num_errors"] == 0 and point["output_tokens"] == 4 * 4 and point["prompt_tokens"] > 0
    assert sorted(p.name for p in tmp_path.glob("server-*.log")) == ["server-0.log", "server-1.log"]
