"""What a vLLM user trips over first: constructor names we cannot honour are refused with what
to do instead; request metrics carry vLLM's timestamps."""

from __future__ import annotations

import time

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ConfigError


@pytest.mark.parametrize("kwargs, match", [
    ({"trust_remote_code": True}, "never runs code shipped with a checkpoint"),
    ({"tensor_parallel_size": 2}, "does not take tensor_parallel_size"),
    ({"quantization": "awq"}, "quantization='awq', but this checkpoint is stored unquantized"),
])
def test_vllm_names_we_cannot_honour_are_refused_clearly(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LLM(accelerator="cpu", progress=False, **kwargs)


def test_quantization_naming_the_checkpoints_own_format_is_accepted(tmp_path):
    from deepinfer_core.conformance import checkpoints

    path = checkpoints.materialize("tiny-v3-fp8", tmp_path)
    LLM(model=path, accelerator="cpu", progress=False, quantization="fp8", load_format="dummy")
    with pytest.raises(ConfigError, match="stored as 'fp8'.*quantization='fp8'"):
        LLM(model=path, accelerator="cpu", progress=False, quantization="gptq")


def test_request_metrics_carry_arrival_first_token_and_finish_times():
    llm = LLM(accelerator="cpu", progress=False)
    before = time.time()
    out = llm.generate(["def f():", "class A:"], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    after = time.time()
    for o in out:
        m = o.metrics
        assert before <= m.arrival_time <= m.first_token_time <= m.finished_time <= after
        assert m.time_to_first_token == m.first_token_time - m.arrival_time
