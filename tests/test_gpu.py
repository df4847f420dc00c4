"""On an NVIDIA GPU: the nvidia backend loads, and (with the reference ops it falls back to for
now) gives the CPU reference's results. Skipped without a GPU (see conftest.py)."""

from __future__ import annotations

import pytest

from deepinfer_core import LLM, SamplingParams
from tests.hf_checkpoints import write_checkpoint

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 99, 3, 64, 7], [11, 12], [150, 2, 2, 8, 33, 41, 90, 100, 120, 7, 6, 5, 4]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "ckpt"
    write_checkpoint("v3_grouped", path)
    return path


def test_nvidia_backend_matches_cpu_reference(checkpoint):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    cpu = LLM(model=str(checkpoint), accelerator="cpu", dtype="float32", progress=False).generate(PROMPTS, params, use_tqdm=False)
    gpu_llm = LLM(model=str(checkpoint), accelerator="nvidia", dtype="float32", progress=False)
    assert gpu_llm.engine.platform.name in ("nvidia-sm90", "nvidia-sm100")
    assert gpu_llm.engine.device.type == "cuda"
    gpu = gpu_llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(cpu, gpu):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t, v in la.items():
                assert abs(v - lb[t]) < 1e-3  # TF32/cuBLAS vs CPU float32


def test_nvidia_backend_runs_bf16_and_sampling(checkpoint):
    llm = LLM(model=str(checkpoint), accelerator="nvidia", dtype="bfloat16", progress=False)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True, n=2)
    a = llm.generate(PROMPTS, params, use_tqdm=False)
    b = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    assert all(len(c.token_ids) == 16 for o in a for c in o.outputs)


def test_default_model_on_gpu():
    llm = LLM(accelerator="nvidia", progress=False)
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert out.outputs[0].token_ids and out.outputs[0].finish_reason in ("stop", "length")
