"""What a vLLM user trips over first: constructor names we cannot honour are refused with what
to do instead; request metrics carry vLLM's timestamps; logprobs are Logprob objects."""

from __future__ import annotations

import time

import pytest
import torch

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


def test_an_unknown_keyword_is_named_with_every_argument_llm_takes():
    """The list comes from LLM's signature (it cannot go stale), vLLM's tensor parallelism points
    at what DeepInfer has instead, and a near miss is spelled right; nothing is loaded first."""
    import inspect

    takes = [name for name in inspect.signature(LLM.__init__).parameters if name not in ("self", "unsupported")]
    with pytest.raises(ConfigError) as err:
        LLM(accelerator="cpu", progress=False, tensor_parallel_size=2)
    message = str(err.value)
    assert message.startswith("LLM() does not take tensor_parallel_size: DeepInfer has no tensor")
    assert "not available yet" not in message
    assert all(s in message for s in ("data_parallel_size=N", "expert_parallel=True", "context_parallel_size=C"))
    listed = message.split(". It takes ")[1].removesuffix(" (see help(LLM))").split(", ")
    assert listed == takes
    with pytest.raises(ConfigError, match=r"does not take max_num_seq \(did you mean max_num_seqs\?\)\. It takes model, "):
        LLM(accelerator="cpu", progress=False, max_num_seq=4)


def test_bad_settings_are_refused_before_the_model_is_looked_for():
    """Every argument is checked before a checkpoint is resolved (a download) or loaded: one
    ConfigError naming each bad one (pydantic's dump before), and vLLM's kv_cache_dtype and
    dtype spellings."""
    with pytest.raises(ConfigError, match=r"^bad LLM\(\) arguments: max_num_seqs: Input should be greater than 0; "
                                          r"gpu_memory_utilization: Input should be less than or equal to 1$"):
        LLM(model="/nonexistent", max_num_seqs=0, gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="kv_cache_dtype 'fp8_e5m2' is not supported: pass 'auto' .* or 'fp8'"):
        LLM(model="/nonexistent", kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp8' does not work with context parallelism"):
        LLM(model="/nonexistent", kv_cache_dtype="fp8_e4m3", context_parallel_size=2)
    llm = LLM(accelerator="cpu", dtype="float", kv_cache_dtype="auto", progress=False)
    assert llm.engine.dtype == torch.float32


def test_the_default_dtype_on_the_cpu_is_float32():
    assert LLM(accelerator="cpu", progress=False).engine.dtype == torch.float32  # the default model is stored bf16
    assert LLM(accelerator="cpu", dtype="bfloat16", progress=False).engine.dtype == torch.bfloat16


def test_quantization_naming_the_checkpoints_own_format_is_accepted(tmp_path):
    from deepinfer_core.conformance import checkpoints

    path = checkpoints.materialize("tiny-v3-fp8", tmp_path)
    LLM(model=path, accelerator="cpu", progress=False, quantization="fp8", load_format="dummy")
    with pytest.raises(ConfigError, match="stored as 'fp8'.*quantization='fp8'"):
        LLM(model=path, accelerator="cpu", progress=False, quantization="gptq")


def test_chat_takes_vllms_template_arguments_and_its_outputs_hold_the_rendered_prompt():
    llm = LLM(accelerator="cpu", dtype="float32", progress=False)
    tokenizer = llm.get_tokenizer()
    user = [{"role": "user", "content": "sort a list"}]
    params = SamplingParams(max_tokens=4, temperature=0)

    def chat(messages, **kw):
        (out,) = llm.chat(messages, params, use_tqdm=False, **kw)
        assert out.prompt_token_ids == tokenizer(out.prompt, add_special_tokens=False)["input_ids"]
        return out.prompt

    bos = tokenizer.bos_token
    assert chat(user) == f"{bos}User: sort a list\n\nAssistant:"
    assert chat(user, add_generation_prompt=False) == f"{bos}User: sort a list\n\n"
    opened = user + [{"role": "assistant", "content": "def sort(xs):"}]
    assert chat(opened, add_generation_prompt=False, continue_final_message=True) == (
        f"{bos}User: sort a list\n\nAssistant: def sort(xs):")
    assert chat(user, chat_template="Q: {{ messages[-1]['content'] }}\nA:") == "Q: sort a list\nA:"
    with pytest.raises(ValueError, match="pass add_generation_prompt=False to continue it"):
        llm.chat(opened, continue_final_message=True)


def test_llm_engine_runs_vllms_add_request_step_loop():
    """vLLM's llm.llm_engine loop (examples/offline_inference/llm_engine_example.py's shape) gives
    what generate gives; generate refuses to run over requests the loop has not finished."""
    llm = LLM(accelerator="cpu", dtype="float32", progress=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["def f(x):", "class A:"]
    want = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    assert engine.engine is llm.engine and engine.get_tokenizer() is llm.get_tokenizer()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"req-{i}", prompt, params)
    assert engine.get_num_unfinished_requests() == 2
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finished
            got[out.request_id] = out
    assert [got[f"req-{i}"].outputs[0].token_ids for i in range(2)] == [w.outputs[0].token_ids for w in want]
    assert got["req-0"].prompt == prompts[0]
    engine.add_request("left", prompts[0], params)
    with pytest.raises(RuntimeError, match="1 request.* added through llm_engine.add_request"):
        llm.generate(prompts, params, use_tqdm=False)
    engine.abort_request(["left", "unknown"])
    assert not engine.has_unfinished_requests()
    with pytest.raises(TypeError, match="not a SamplingParams"):
        engine.add_request(prompts[0], params, "id")  # DeepInfer's Engine.add_request order, not vLLM's
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == [w.outputs[0].token_ids for w in want]


def test_request_metrics_carry_arrival_first_token_and_finish_times():
    llm = LLM(accelerator="cpu", progress=False)
    before = time.time()
    out = llm.generate(["def f():", "class A:"], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    after = time.time()
    for o in out:
        m = o.metrics
        assert before <= m.arrival_time <= m.first_token_time <= m.finished_time <= after
        assert m.time_to_first_token == m.first_token_time - m.arrival_time


def test_logprobs_are_objects_with_rank_and_decoded_token():
    """vLLM's Logprob: .logprob, .rank (1 = most likely) and .decoded_token; still a float."""
    import torch

    llm = LLM(accelerator="cpu", dtype="float32", progress=False)
    params = SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2, temperature=1.0, seed=5, ignore_eos=True)
    out = llm.generate("def merge(a, b):", params, use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    for token, top in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert token in top and len(top) in (3, 4)
        ranked = sorted(top.values(), key=lambda v: v.rank)
        assert [v.rank for v in ranked][:3] == [1, 2, 3] and ranked == sorted(top.values(), reverse=True)
        for t, v in top.items():
            assert v.logprob == float(v) <= 0 and v.decoded_token == tokenizer.decode([t])
        if top[token].rank > 3:  # a sampled token outside the top 3: its true rank, from the whole distribution
            assert len(top) == 4
    ids = out.prompt_token_ids
    for pos, top in enumerate(out.prompt_logprobs[1:], start=1):
        actual = top[ids[pos]]
        assert actual.rank >= 1 and actual.decoded_token == tokenizer.decode([ids[pos]])
        if actual.rank <= 2:
            assert sorted(v.rank for v in top.values()) == [1, 2]
        else:
            assert len(top) == 3 and all(v > actual for t, v in top.items() if t != ids[pos])
    assert torch.tensor(list(out.outputs[0].logprobs[0].values())).dtype == torch.float32  # floats still
