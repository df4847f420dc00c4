"""Fuzzing the public API: whatever a user passes, the engine answers with results or a clear
error (RequestError / ValueError / TypeError, pydantic's ValidationError among them), never an
internal exception, and is left clean; interrupted calls change nothing; bad checkpoints are
ConfigError / CheckpointError.

Hypothesis runs derandomised (the same cases every CI run; about 30 s on 2 cores); set
DEEPINFER_FUZZ_SEED=N to explore other cases and DEEPINFER_FUZZ_EXAMPLES=K for more of them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import traceback
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from pydantic import ValidationError

from deepinfer_core import LLM, GenerationError, SamplingParams
from deepinfer_core.config import DEFAULT_MODEL_DIR, ConfigError
from deepinfer_core.engine.engine import RequestError
from deepinfer_core.loader import CheckpointError
from deepinfer_core.sampling.sampler import NonFiniteLogitsError

from .test_engine_faults import assert_clean, interrupt_on_call, tokens

SEED = os.environ.get("DEEPINFER_FUZZ_SEED")
SCALE = int(os.environ.get("DEEPINFER_FUZZ_EXAMPLES", "1"))
VOCAB = 4096  # the default model's
MAX_MODEL_LEN = 32  # bounds every run: max_tokens=10**9 still stops after a few dozen tokens


def fuzz(examples: int):
    """Hypothesis settings for one fuzz test (derandomised unless DEEPINFER_FUZZ_SEED is set)."""
    def wrap(test):
        test = settings(max_examples=examples * SCALE, deadline=None, database=None, derandomize=SEED is None,
                        suppress_health_check=list(HealthCheck), print_blob=True)(test)
        return hypothesis_seed(int(SEED))(test) if SEED is not None else test
    return wrap


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(accelerator="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=2, progress=False)


# ---- strategies --------------------------------------------------------------------------------
# Valid-looking values often (so that generation runs), and anything at all besides.
anything = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4), st.lists(st.integers(), max_size=3))
good_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
bad_ids = st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(-3, VOCAB + 3), st.integers(), st.booleans(),
                             st.floats(allow_nan=True)), max_size=12)
good_text = st.text(min_size=1, max_size=24)
any_text = st.text(alphabet=st.characters(exclude_categories=()), max_size=24)  # surrogates included
dict_prompt = st.dictionaries(st.sampled_from(["prompt", "prompt_token_ids", "text"]), st.one_of(good_text, good_ids, anything),
                              min_size=1, max_size=2)
prompt = st.one_of(good_text, good_ids, good_text, good_ids, dict_prompt, any_text, bad_ids, anything)

good_values = {
    "n": st.integers(1, 2),
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0.0, 1e-40, 1e-6])),
    "top_p": st.floats(0.01, 1),
    "top_k": st.one_of(st.integers(-1, 50), st.just(2**63)),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.one_of(st.floats(0.5, 2), st.sampled_from([1e-300, 1e300])),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "seed": st.integers(0, 2**63 - 1),
    "max_tokens": st.one_of(st.integers(1, 8), st.just(10**9), st.none()),
    "min_tokens": st.integers(0, 3),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "logprobs": st.one_of(st.integers(0, 5), st.just(VOCAB), st.just(-1)),
    "prompt_logprobs": st.integers(0, 3),
    "skip_special_tokens": st.booleans(),
}
bad_values = {name: st.one_of(st.integers(), st.floats(), anything) for name in good_values}


def _params(values: dict) -> st.SearchStrategy[dict]:
    return st.dictionaries(st.sampled_from(sorted(values)), st.none(), max_size=6).flatmap(
        lambda keys: st.fixed_dictionaries({k: values[k] for k in keys}))


params = st.one_of(_params(good_values), _params(good_values), _params({**good_values, **bad_values}))

def _is_clear(error: BaseException) -> bool:
    """One of the API's own errors, or a ValueError / TypeError the engine raised itself with a
    message; not one escaping from deeper down (tokenizers' TypeError on a lone surrogate, an
    int64 overflow in torch, ...)."""
    if isinstance(error, (RequestError, ConfigError, ValidationError)):
        return bool(str(error))
    if not isinstance(error, (ValueError, TypeError)):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    return bool(str(error)) and bool(frames) and "deepinfer_core" in Path(frames[-1].filename).parts


def _check_outputs(outputs, count: int, sampling) -> None:
    assert len(outputs) == count
    for out, p in zip(outputs, sampling):
        assert len(out.outputs) == p.n
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length"), c.finish_reason
            limit = p.max_tokens if p.max_tokens is not None else MAX_MODEL_LEN  # None: up to the context
            assert 1 <= len(c.token_ids) <= limit and all(0 <= t < VOCAB for t in c.token_ids)
            assert isinstance(c.text, str)
            if c.logprobs is not None:
                assert len(c.logprobs) == len(c.token_ids)
                assert all(math.isfinite(v) for step in c.logprobs for v in step.values())


# ---- the API -----------------------------------------------------------------------------------
@fuzz(150)
@given(prompts=st.one_of(prompt, st.lists(prompt, min_size=1, max_size=3)), kwargs=st.lists(params, min_size=1, max_size=3))
def test_any_input_gets_results_or_a_clear_error(llm, prompts, kwargs):
    """``prompts`` is one prompt or a list of them; each refusal must be one of the API's clear
    errors, each result must be what was asked for (a tiny temperature is greedy)."""
    try:
        sampling = [SamplingParams(**kw) for kw in kwargs]
    except ValidationError:
        event("parameters refused")
        sampling = [SamplingParams(max_tokens=3)]
    assume(all(p.n <= 4 for p in sampling))  # samples run in waves of max_num_seqs: keep each example short
    bare = not isinstance(prompts, list) or (prompts and isinstance(prompts[0], int) and not isinstance(prompts[0], bool))
    count = 1 if bare else len(prompts)
    sampling = (sampling * count)[:count]
    try:
        outputs = llm.generate(prompts, sampling[0] if bare else sampling, use_tqdm=False)
    except GenerationError as e:  # valid input must never fail mid-run
        raise AssertionError(f"a request that passed the checks failed mid-run: {e}") from e
    except Exception as e:
        assert _is_clear(e), f"{type(e).__name__} escaped instead of a clear error: {''.join(traceback.format_exception(e))}"
        event(f"request refused: {type(e).__name__}")
    else:
        event("generated")
        _check_outputs(outputs, count, sampling)
        tiny = [i for i, p in enumerate(sampling) if 0 < p.temperature < 1e-5]
        if tiny:  # greedy, exactly
            greedy = [p.model_copy(update={"temperature": 0.0}) for p in sampling]
            again = llm.generate(prompts, greedy[0] if bare else greedy, use_tqdm=False)
            assert [tokens([again[i]]) for i in tiny] == [tokens([outputs[i]]) for i in tiny]
    assert_clean(llm)


@fuzz(30)
@given(where=st.sampled_from(["sample_tokens", "step", "add_request", "forward"]), call=st.integers(1, 12))
def test_an_interrupt_anywhere_changes_nothing(llm, where, call):
    prompts = ["def f(x):", [5, 6, 7], {"prompt": "import sys\n"}]
    sampling = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True),
                SamplingParams(temperature=0.7, top_k=5, seed=4, max_tokens=6, ignore_eos=True)]
    expected = tokens(llm.generate(prompts, sampling, use_tqdm=False))
    owner = {"sample_tokens": llm.engine.ops, "step": llm.engine, "add_request": llm.engine, "forward": llm.engine.model}[where]
    counters = (llm.engine.next_seq_id, llm.engine.next_request_id)  # they seed the unseeded row
    with pytest.MonkeyPatch.context() as mp:
        interrupt_on_call(mp, owner, where, call)
        try:
            llm.generate(prompts, sampling, use_tqdm=False)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
    assert_clean(llm)
    if interrupted:  # as before the call: the rerun samples what the interrupted call would have
        assert (llm.engine.next_seq_id, llm.engine.next_request_id) == counters
        rerun = tokens(llm.generate(prompts, sampling, use_tqdm=False))
        assert rerun[0] == expected[0] and rerun[2] == expected[2]  # greedy and seeded rows do not depend on the counters
    assert_clean(llm)


# ---- checkpoints -------------------------------------------------------------------------------
CONFIG = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
KEEP = object()  # "instead": keep the (changed) config object
config_values = st.one_of(st.integers(-2, 600), st.floats(allow_nan=True), st.text(max_size=6), st.none(), st.booleans(),
                          st.lists(st.integers(0, 4), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzzed") / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, path)
    return path


@fuzz(40)
@given(changes=st.dictionaries(st.sampled_from(sorted(CONFIG)), config_values, min_size=1, max_size=3),
       dropped=st.lists(st.sampled_from(sorted(CONFIG)), max_size=2),
       instead=st.one_of(st.just(KEEP), st.just(KEEP), st.just(KEEP), st.none(), st.integers(), st.text(max_size=6),
                         st.lists(st.integers(0, 4), max_size=2)))
def test_a_mangled_config_is_refused_clearly(model_dir, changes, dropped, instead):
    """Values changed or dropped, or the whole file a JSON value other than an object."""
    config = {k: v for k, v in {**CONFIG, **changes}.items() if k not in dropped} if instead is KEEP else instead
    (model_dir / "config.json").write_text(json.dumps(config))
    try:
        llm = LLM(model=str(model_dir), accelerator="cpu", dtype="float32", max_model_len=32, progress=False)
    except (ConfigError, CheckpointError) as e:
        event(f"refused: {type(e).__name__}")
        assert str(e)
        return
    event("loaded")
    try:  # what loaded runs, or an absurd but finite value (a scaling factor of 1e38) overflows: named as such
        out = llm.generate([[5, 6]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    except GenerationError as e:
        assert isinstance(e.__cause__, NonFiniteLogitsError) and "an activation overflowed" in str(e), e
        event("overflowed at run time")
        return
    assert len(out[0].outputs[0].token_ids) >= 1
