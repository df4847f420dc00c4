"""The engine under interrupts, threads and bad input: nothing corrupted, nothing lost, clear errors.

Runs on the embedded default model (it has a tokenizer) in float32 on the reference backend.
"""

from __future__ import annotations

from collections import OrderedDict

import json
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_core import LLM, GenerationError, SamplingParams
from deepinfer_core.cli import main
from deepinfer_core.config import DEFAULT_MODEL_DIR, ConfigError
from deepinfer_core.engine.engine import RequestError
from deepinfer_core.loader import CheckpointError

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def __init__(self):"]
# greedy, seeded and unseeded sampling: an engine "as new" reproduces all three
PARAMS = [
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),
]


def make_llm(**kw) -> LLM:
    kw.setdefault("dtype", "float32")
    return LLM(accelerator="cpu", progress=False, **kw)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.requests and not engine.has_unfinished()
    assert engine.kv.num_free == engine.kv.num_blocks
    for pool in engine.kv.pools.values():
        assert sorted(pool.free) == list(range(engine.kv.num_blocks)) and not any(pool.refs)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    """What a fresh engine produces for PROMPTS / PARAMS."""
    return tokens(make_llm().generate(PROMPTS, PARAMS, use_tqdm=False))


@pytest.fixture
def llm() -> LLM:
    return make_llm()


def interrupt_on_call(monkeypatch, owner, name: str, n: int, after: bool = False) -> None:
    """``owner.name`` raises KeyboardInterrupt (what Ctrl-C raises) on its n-th call: instead of
    running, or ``after`` it ran."""
    real = getattr(owner, name)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] != n:
            return real(*args, **kwargs)
        if after:
            real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, wrapper)


# ---- interrupts --------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3, 6])
def test_ctrl_c_during_sampling_leaves_the_engine_as_new(llm, expected, monkeypatch, n):
    interrupt_on_call(monkeypatch, llm.engine.ops, "sample_tokens", n)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    monkeypatch.undo()
    assert_clean(llm)
    assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected


@pytest.mark.parametrize("n", [1, 2, 5])
def test_ctrl_c_between_steps_withdraws_the_interrupted_requests(llm, expected, monkeypatch, n):
    interrupt_on_call(monkeypatch, llm.engine, "step", n, after=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    monkeypatch.undo()
    assert_clean(llm)
    # the next call runs its own requests only, and exactly as a fresh engine would
    assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected


def test_ctrl_c_while_queueing_leaves_nothing_behind(llm, expected, monkeypatch):
    interrupt_on_call(monkeypatch, llm.engine, "add_request", 3)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    monkeypatch.undo()
    assert_clean(llm)
    assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected


def test_ctrl_c_inside_block_bookkeeping_is_repaired(llm, expected, monkeypatch):
    """An interrupt between taking a block off the free list and recording it would leak the block."""
    (pool,) = llm.engine.kv.pools.values()
    calls = {"n": 0}

    class LeakyQueue(OrderedDict):
        def popitem(self, *args, **kwargs):
            value = super().popitem(*args, **kwargs)
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt  # the popped block is in no block table
            return value

    pool.free = LeakyQueue(pool.free)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert_clean(llm)
    assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected


def test_a_step_cut_short_between_its_tokens_resumes_exactly(llm, monkeypatch):
    """Driving the Engine directly (no generate to withdraw anything): an interrupt after some of
    a step's tokens were appended loses nothing; stepping on gives the uninterrupted tokens."""
    engine = llm.engine
    greedy = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 3
    expected = tokens(llm.generate(PROMPTS, greedy, use_tqdm=False))
    ids = [engine.add_request(p, g) for p, g in zip(PROMPTS, greedy)]
    for _ in range(3):
        engine.step()
    interrupt_on_call(monkeypatch, engine.output, "process", 2)  # the second of the step's three sequences
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.undo()
    done = {}
    while engine.has_unfinished():
        done.update({r.request_id: r for r in engine.step()})
    assert [done[i].seqs[0].output_token_ids for i in ids] == expected
    assert_clean(llm)


# ---- threads -----------------------------------------------------------------------------------
def test_generate_from_several_threads_runs_them_one_after_another(llm, expected):
    results, errors = {}, []

    def worker(i: int) -> None:
        try:
            for _ in range(2):
                out = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 3, use_tqdm=False)
                results.setdefault(i, []).append(tokens(out))
        except BaseException as e:  # noqa: BLE001 - any failure in a thread is the test's failure
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    greedy = make_llm().generate(PROMPTS, [PARAMS[0]] * 3, use_tqdm=False)
    assert all(r == tokens(greedy) for runs in results.values() for r in runs) and len(results) == 4
    assert_clean(llm)


def test_generate_inside_generate_is_refused(llm, monkeypatch):
    real_step = llm.engine.step

    def step_that_reenters():
        llm.generate("x", SamplingParams(max_tokens=1), use_tqdm=False)
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step_that_reenters)
    with pytest.raises(GenerationError, match="inside a running generate call in the same thread"):
        llm.generate(PROMPTS[0], PARAMS[0], use_tqdm=False)
    monkeypatch.undo()
    assert_clean(llm)


# ---- prompts -----------------------------------------------------------------------------------
def test_vllm_dict_prompts_are_accepted(llm):
    ids = llm.tokenizer(PROMPTS[0]).input_ids
    plain = tokens(llm.generate([PROMPTS[0], ids], PARAMS[0], use_tqdm=False))
    assert tokens(llm.generate({"prompt": PROMPTS[0]}, PARAMS[0], use_tqdm=False)) == plain[:1]
    both = llm.generate([{"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}], PARAMS[0], use_tqdm=False)
    assert tokens(both) == plain and both[0].prompt == PROMPTS[0] and both[1].prompt is None


@pytest.mark.parametrize(
    "prompt, needle",
    [
        ({"text": "x"}, "a dict prompt has exactly one of the keys 'prompt' or 'prompt_token_ids' (unknown: ['text'])"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "exactly one of the keys"),
        ({"prompt": [1, 2]}, "'prompt' must be a string"),
        ({"prompt_token_ids": "x"}, "'prompt_token_ids' must be a list of token ids"),
        ("x = '\ud800'", "prompt 0 is not valid Unicode text: surrogates not allowed '\\ud800' at character 5"),
        ([1, 2.5], "a list holding float 2.5"),
        ([1, True], "a list holding bool True"),
    ],
)
def test_bad_prompts_get_clear_errors(llm, prompt, needle):
    with pytest.raises(RequestError) as err:
        llm.generate(prompt, PARAMS[0], use_tqdm=False)
    assert needle in str(err.value)
    assert_clean(llm)


def test_a_lone_surrogate_on_the_command_line_is_a_clear_error(capsys):
    assert main(["generate", "--prompt", "x\udcffy", "--max-tokens", "2", "--accelerator", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("error: prompt 0 is not valid Unicode text") and "Traceback" not in err


def test_the_cli_checks_its_parameters_before_loading_a_model(monkeypatch, capsys):
    import deepinfer_core

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the parameters were checked")

    monkeypatch.setattr(deepinfer_core, "LLM", no_model)
    assert main(["generate", "--prompt", "x", "--max-tokens", "0"]) == 1
    assert "--max-tokens: Input should be greater than or equal to 1" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--ngram", "-1"]) == 1
    assert "--ngram -1: the number of draft tokens per step must be 0 (off) to 16" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--mtp", "17"]) == 1
    assert "--mtp 17: the number of draft tokens per step must be 0 (off) to 16" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--mtp", "2", "--ngram", "2"]) == 1
    assert "give one" in capsys.readouterr().err


# ---- sampling parameters -------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-6])
def test_a_tiny_temperature_is_greedy(llm, temperature):
    greedy = tokens(llm.generate(PROMPTS, PARAMS[0], use_tqdm=False))
    tiny = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=3)
    assert tokens(llm.generate(PROMPTS, tiny, use_tqdm=False)) == greedy


def test_a_top_k_beyond_the_vocabulary_keeps_it_all(llm):
    base = dict(temperature=1.0, max_tokens=6, ignore_eos=True, seed=11)
    huge = SamplingParams(top_k=2**63, **base)
    off = SamplingParams(top_k=0, **base)
    both = llm.generate([PROMPTS[0], PROMPTS[1]], [huge, PARAMS[0]], use_tqdm=False)  # its batch-mate is unharmed
    assert tokens(both)[0] == tokens(llm.generate(PROMPTS[0], off, use_tqdm=False))[0]
    assert len(both[1].outputs[0].token_ids) == 8


@pytest.mark.parametrize("field, value", [("temperature", float("inf")), ("top_p", float("nan")),
                                          ("repetition_penalty", float("inf")), ("min_p", float("nan"))])
def test_non_finite_parameters_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field}[\\s\\S]*finite number"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field, huge, largest_safe", [("temperature", 1e39, 1e30), ("repetition_penalty", 1e39, 1e30),
                                                      ("repetition_penalty", 1e-300, 1e-30)])
def test_parameters_beyond_float32_sample_like_the_largest_it_holds(llm, field, huge, largest_safe):
    """1e39 is a valid Python float but inf in float32 (and -inf / inf is NaN: token 0 again)."""
    base = dict(temperature=0.7, min_tokens=4, max_tokens=6, seed=5)  # EOS banned for 4 tokens: -inf logits
    beyond = llm.generate(PROMPTS, SamplingParams(**{**base, field: huge}), use_tqdm=False)
    safe = llm.generate(PROMPTS, SamplingParams(**{**base, field: largest_safe}), use_tqdm=False)
    assert tokens(beyond) == tokens(safe)


def test_extreme_penalties_stay_finite(llm):
    extreme = SamplingParams(temperature=0.5, repetition_penalty=1e-300, frequency_penalty=-2, max_tokens=6, seed=1)
    out = llm.generate(PROMPTS, extreme, use_tqdm=False)
    assert all(len(t) >= 1 for t in tokens(out))
    assert_clean(llm)


def test_samples_beyond_the_sequence_slots_run_in_waves_and_absurd_n_is_refused():
    small = make_llm(max_num_seqs=2)
    out = small.generate(PROMPTS[0], SamplingParams(n=5, max_tokens=3, seed=1), use_tqdm=False)[0]
    assert len(out.outputs) == 5 and all(len(c.token_ids) == 3 for c in out.outputs)
    with pytest.raises(RequestError, match="n=1000000000 samples exceed 4096, the most one request may ask for"):
        small.generate(PROMPTS[0], SamplingParams(n=10**9), use_tqdm=False)
    assert_clean(small)


# ---- non-finite weights and logits ---------------------------------------------------------------
@pytest.fixture
def model_copy(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, path)
    return path


def test_a_nan_weight_is_named_at_load(model_copy):
    key = "model.layers.2.mlp.experts.3.down_proj.weight"
    tensors = load_file(model_copy / "model.safetensors")
    tensors[key][5, 7] = float("nan")
    save_file(tensors, model_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        make_llm(model=str(model_copy))
    assert f"1 checkpoint tensor(s) are not finite: {key} (model.safetensors) holds NaN or inf" in str(err.value)


def test_a_weight_beyond_the_compute_dtype_is_named_at_load(model_copy):
    key = "model.layers.0.self_attn.o_proj.weight"
    tensors = load_file(model_copy / "model.safetensors")
    tensors[key] = tensors[key].float()
    tensors[key][0, 0] = 1e6  # float16 ends at 65504
    save_file(tensors, model_copy / "model.safetensors", metadata={"format": "pt"})
    assert make_llm(model=str(model_copy))  # float32 holds it
    with pytest.raises(CheckpointError, match=f"{key} .* holds values beyond the range of torch.float16"):
        make_llm(model=str(model_copy), dtype="float16")


def test_a_nan_fp8_scale_is_named_with_the_weight_it_scales(tmp_path, monkeypatch):
    from deepinfer_core.conformance import checkpoints

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "fp8"
    shutil.copytree(checkpoints.materialize("tiny-v3-fp8"), path)
    key = "model.layers.1.self_attn.o_proj.weight"
    tensors = load_file(path / "model.safetensors")
    tensors[key + "_scale_inv"][0, 0] = float("nan")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        make_llm(model=str(path))  # the reference dequantises FP8 weights at load
    msg = str(err.value)
    assert "2 checkpoint tensor(s) are not finite" in msg
    assert f"{key} (model.safetensors) is dequantised with the non-finite scale {key}_scale_inv" in msg
    assert f"{key}_scale_inv (model.safetensors) holds NaN or inf" in msg


def test_nan_logits_name_the_request_and_keep_the_others(llm, monkeypatch):
    model = llm.engine.model
    real = model.compute_logits
    steps = {"n": 0}

    def poisoned(hidden):
        logits = real(hidden)
        steps["n"] += 1
        if steps["n"] == 3:
            logits[-1, 17] = float("nan")  # the last row: the third request's decode step
        return logits

    monkeypatch.setattr(model, "compute_logits", poisoned)
    short = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with pytest.raises(GenerationError, match=r"NaN or inf logits for request\(s\) \d+ \(sample 0, 2 tokens generated\)") as err:
        llm.generate(PROMPTS, [short, PARAMS[0], PARAMS[0]], use_tqdm=False)
    first, second, third = err.value.outputs
    assert first.outputs[0].finish_reason == "length" and len(first.outputs[0].token_ids) == 1
    for aborted in (second, third):
        out = aborted.outputs[0]
        assert out.finish_reason == "abort" and out.token_ids
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True) != ""  # decoded, not ""
    monkeypatch.undo()
    assert_clean(llm)


# ---- checkpoints -------------------------------------------------------------------------------
@pytest.mark.parametrize("content, needle", [("[1, 2]", "holds a JSON list, not an object"), ('"x"', "holds a JSON str"),
                                             ("{", "is not valid JSON"), (b"\xff\xfe{}", "is not valid JSON")])
def test_a_config_json_that_is_not_an_object(model_copy, content, needle):
    path = model_copy / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError, match=needle):
        make_llm(model=str(model_copy))


def test_json_logits_of_the_default_model_are_finite(llm):
    """The guard above must not fire on a healthy model (and costs one transfer per step)."""
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=3, logprobs=2, temperature=0), use_tqdm=False)
    assert all(torch.isfinite(torch.tensor(list(step.values()))).all() for o in out for step in o.outputs[0].logprobs)
    json.dumps([o.outputs[0].logprobs for o in out], allow_nan=False)
