"""Structured outputs (sampling.structured, SamplingParams.so_args): every constrained output is
valid, checked by tools that know nothing of xgrammar (jsonschema, re, json); invalid constraints
are clear errors; the constraint composes with sampling, n > 1, stop strings, preemption,
overlapped scheduling and speculative decoding."""

from __future__ import annotations

import json
import logging
import os
import re

import jsonschema
import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.engine import RequestError
from deepinfer_core.ops import REFERENCE_OPS
from deepinfer_core.sampling import structured

# Bounded schemas: strings, arrays and numbers have limits, so every output ends within max_tokens
# even under random weights (nothing may go on forever).
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "additionalProperties": False, "required": ["point"],
     "properties": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                              "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                             "y": {"type": "integer", "minimum": 0, "maximum": 99}}}}},
    {"type": "object", "additionalProperties": False, "required": ["tags"],
     "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3, "uniqueItems": False}}},
    {"type": "string", "pattern": "^[a-z]{2,5}$"},
    {"type": "object", "additionalProperties": False, "required": ["id", "kind"],
     "properties": {"id": {"type": "string", "maxLength": 4}, "kind": {"const": "user"}, "note": {"type": "null"}}},
    {"anyOf": [{"type": "boolean"}, {"type": "object", "additionalProperties": False, "required": ["n"],
                                      "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}}}]},
]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-z] [a-z]?'
GRAMMAR_AS_REGEX = r"\((?:[a-z]{1,2})(?:,[a-z]{1,2})*\)"  # the same language, for an independent check
CHOICES = ["yes", "no", "maybe so"]
PROMPTS = ["def f(x):\n    return", "Answer:", "{", "import os\n"]


@pytest.fixture(scope="module")
def random_llm():
    """The default model's architecture and tokenizer with random weights: they would produce
    anything, so only the masks keep the outputs valid."""
    return LLM(accelerator="cpu", dtype="float32", load_format="dummy", seed=3, progress=False)


@pytest.fixture(scope="module")
def trained_llm():
    return LLM(accelerator="cpu", dtype="float32", progress=False)


def constrained(so: dict, temperature: float = 0.0, seed: int | None = None, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=kw.pop("max_tokens", 120), so_args=so, **kw)


def assert_valid(so: dict, text: str) -> None:
    kind = next(iter(so))
    # strict=False: xgrammar 0.2.8's JSON strings admit raw control characters (U+0000..U+001F but
    # \n, \r), which a strict parser refuses; the random model does emit them (README: structured outputs)
    if kind == "json":
        jsonschema.validate(json.loads(text, strict=False), so["json"])
    elif kind == "json_object":
        assert isinstance(json.loads(text, strict=False), dict), text
    elif kind == "regex":
        assert re.fullmatch(so["regex"], text), text
    elif kind == "grammar":
        assert re.fullmatch(GRAMMAR_AS_REGEX, text), text
    else:
        assert text in so["choice"], text


BOUNDED = [{"json": s} for s in SCHEMAS] + [{"regex": REGEX}, {"grammar": GRAMMAR}, {"choice": CHOICES}]
KINDS = BOUNDED + [{"json_object": True}]  # any object: unbounded, so random weights need not end it


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_constrained_output_is_valid_in_a_batch_with_free_requests(random_llm, temperature):
    params = [constrained(so, temperature, seed=i) for i, so in enumerate(BOUNDED)]
    free = SamplingParams(temperature=temperature, seed=99, max_tokens=12, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(BOUNDED))] + ["free text"]
    outs = random_llm.generate(prompts, params + [free], use_tqdm=False)
    for so, out in zip(BOUNDED, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (so, c.text)
        assert_valid(so, c.text)
    assert len(outs[-1].outputs[0].token_ids) == 12  # the free request was not constrained
    unmasked = random_llm.generate(prompts[:1], SamplingParams(temperature=temperature, seed=0, max_tokens=20), use_tqdm=False)
    with pytest.raises(Exception):  # the random model does not make valid JSON of itself
        jsonschema.validate(json.loads(unmasked[0].outputs[0].text), SCHEMAS[0])


def test_json_object_gives_an_object(trained_llm):
    # seed 3: under hash(seed, sample) streams seed 1's draw for "import os\n" runs past 120 tokens (an object that never closes)
    outs = trained_llm.generate(PROMPTS, [constrained({"json_object": True}, t, seed=3) for t in (0, 0, 0.7, 0.7)], use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        assert_valid({"json_object": True}, out.outputs[0].text)


def test_n_samples_are_each_valid_and_differ(random_llm):
    out = random_llm.generate(["x"], constrained({"json": SCHEMAS[0]}, 1.0, seed=5, n=6), use_tqdm=False)[0]
    texts = [c.text for c in out.outputs]
    for text in texts:
        assert_valid({"json": SCHEMAS[0]}, text)
    assert len(set(texts)) > 1


def test_the_grammar_decides_when_the_output_ends(random_llm):
    """min_tokens cannot hold a finished grammar open, ignore_eos cannot extend it, and a stop
    string still cuts the output."""
    for kw in ({"min_tokens": 30}, {"ignore_eos": True}):
        out = random_llm.generate(["q"], constrained({"choice": CHOICES}, **kw), use_tqdm=False)[0].outputs[0]
        assert out.text in CHOICES and out.finish_reason == "stop", (kw, out.text)
    out = random_llm.generate(["q"], constrained({"regex": "ab(cd)+"}, stop=["cd"]), use_tqdm=False)[0].outputs[0]
    assert out.text == "ab" and out.finish_reason == "stop" and out.stop_reason == "cd"


def test_min_tokens_cannot_ban_eos_where_the_grammar_allows_it(random_llm):
    """Where the grammar allows EOS beside other tokens, EOS stays the model's to choose under
    min_tokens: the mask, not min_tokens, decides when a constrained output may end. With EOS
    biased far above everything, each output ends at the first point its grammar accepts EOS
    (after "ab", not after "abcdcd..."; "yes", not "yes sir"), while a free request beside them
    is held open for its min_tokens."""
    eos = random_llm.engine.eos_ids[0]
    bias = {eos: 100.0}
    prompts = ["q", "q", "q"]
    params = [constrained({"regex": "ab(cd)*"}, min_tokens=30, logit_bias=bias),
              constrained({"choice": ["yes", "yes sir"]}, min_tokens=30, logit_bias=bias),
              SamplingParams(temperature=0.0, max_tokens=60, min_tokens=30, logit_bias=bias)]
    regex, choice, free = (o.outputs[0] for o in random_llm.generate(prompts, params, use_tqdm=False))
    assert (regex.text, regex.finish_reason) == ("ab", "stop"), regex.text
    assert (choice.text, choice.finish_reason) == ("yes", "stop"), choice.text
    assert len(free.token_ids) == 31 and free.token_ids[-1] == eos and free.finish_reason == "stop"  # 30 outputs, then EOS


@pytest.mark.parametrize("so, words", [
    ({"json": {"type": "nonsense"}}, "so_args['json'] is not a valid JSON schema"),
    ({"json": "{not json"}, "so_args['json'] is not a valid JSON schema"),
    ({"regex": "(unclosed"}, "so_args['regex'] is not a valid regular expression"),
    ({"grammar": "root ::= ("}, "so_args['grammar'] is not a valid EBNF grammar"),
    ({"grammar": 'start ::= "a"'}, "so_args['grammar'] is not a valid EBNF grammar"),
])
def test_an_invalid_constraint_is_a_clear_error_and_the_engine_keeps_serving(random_llm, so, words):
    with pytest.raises(RequestError, match=re.escape(words)) as info:
        random_llm.generate(["a", "b"], [SamplingParams(max_tokens=3), constrained(so)], use_tqdm=False)
    assert isinstance(info.value, ValueError) and "prompt 1" in str(info.value)
    assert not random_llm.engine.has_unfinished()
    out = random_llm.generate(["a"], constrained({"choice": CHOICES}), use_tqdm=False)[0].outputs[0]
    assert out.text in CHOICES


@pytest.mark.parametrize("so", [{}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"jsonn": {}}, {"json_object": False}])
def test_malformed_so_args_are_rejected_when_the_params_are_made(so):
    with pytest.raises(ValueError, match="so_args"):
        SamplingParams(so_args=so)


def test_vllm_spellings_are_accepted():
    for name in ("so_args", "structured_outputs", "guided_decoding"):
        assert SamplingParams(**{name: {"regex": "a+"}}).so_args.regex == "a+"


def test_compiled_grammars_are_cached_by_their_text(random_llm):
    grammars = random_llm.engine.grammars
    a = grammars.compile(SamplingParams(so_args={"json": SCHEMAS[1]}).so_args)
    b = grammars.compile(SamplingParams(so_args={"json": json.dumps(SCHEMAS[1])}).so_args)
    c = grammars.compile(SamplingParams(so_args={"json": SCHEMAS[2]}).so_args)
    assert a is b and a is not c


def test_preemption_and_overlapped_scheduling_change_no_constrained_output(monkeypatch):
    """A preempted sequence's matcher keeps its state through the recompute; in overlapped mode
    the masks are filled while the next forward runs. Both emit what the plain engine does."""
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * i for i in range(8)]
    params = [constrained({"json": SCHEMAS[i % len(SCHEMAS)]}, 1.0 if i % 2 else 0.0, seed=i) for i in range(8)]

    def run(**kw):
        llm = LLM(accelerator="cpu", dtype="float32", load_format="dummy", seed=3, progress=False, enable_prefix_caching=False, **kw)
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    _, base = run()
    tight, got = run(block_size=4, num_kv_blocks=24, max_model_len=96)
    assert tight.engine.num_preemptions > 0
    assert got == base
    monkeypatch.setenv("DEEPINFER_ASYNC_SCHEDULING", "1")
    overlapped, got = run()
    assert overlapped.engine.async_scheduling
    assert got == base


@pytest.mark.parametrize("spec", [{"method": "mtp", "num_speculative_tokens": 3}, {"method": "ngram", "num_speculative_tokens": 2}],
                         ids=["mtp", "ngram"])
def test_speculative_decoding_emits_the_constrained_outputs_of_plain_decoding(trained_llm, spec):
    """Drafts the grammar rejects are never accepted; greedy and seeded outputs equal plain
    decoding's, and the drafts did get verified (some accepted)."""
    llm = LLM(accelerator="cpu", dtype="float32", progress=False, speculative_config=spec)
    sos = [so for so in KINDS for _ in (0.0, 0.7)]
    params = [constrained(so, t, seed=i) for i, so in enumerate(KINDS) for t in (0.0, 0.7)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    want = trained_llm.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for so, out in zip(sos, got):
        assert out.outputs[0].finish_reason in ("stop", "length")
        if out.outputs[0].finish_reason == "stop":
            assert_valid(so, out.outputs[0].text)
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_rejection_sampled_drafts_follow_the_constrained_distribution():
    """Unseeded requests verify sampled drafts by rejection sampling against the MASKED target
    distribution: the outputs stay valid."""
    llm = LLM(accelerator="cpu", dtype="float32", progress=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "acceptance": "rejection"})
    outs = llm.generate(["x"] * 6, [constrained({"json": SCHEMAS[i]}, 0.8) for i in range(6)], use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].finish_reason in ("stop", "length")  # "abort": the matcher refused an accepted draft
        if out.outputs[0].finish_reason == "stop":
            assert_valid({"json": SCHEMAS[i]}, out.outputs[0].text)
    assert llm.engine.spec_stats.num_draft_tokens > 0


def test_the_reference_bitmask_op_reads_xgrammars_layout():
    """apply_token_bitmask against xgrammar's own (CPU) application of the same masks."""
    import xgrammar

    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 33, 1000):
        logits = torch.randn(5, vocab, generator=gen)
        mask = torch.randint(-(2**31), 2**31 - 1, (5, (vocab + 31) // 32 + 1), dtype=torch.int32, generator=gen)
        mask[0] = -1
        want = logits.clone()
        xgrammar.apply_token_bitmask_inplace(want, mask, vocab_size=vocab, backend="torch_native")
        got = REFERENCE_OPS["apply_token_bitmask"](logits, mask)
        assert torch.equal(got, want) and torch.equal(got[0], logits[0])


def test_the_conformance_check_passes_the_reference_and_fails_a_mask_that_lets_everything_through(monkeypatch, capsys):
    """``deepinfer conformance --e2e --check-structured-output``'s checks: every constrained output
    valid on the reference; a backend whose apply_token_bitmask masks nothing fails them."""
    from deepinfer_core.conformance import structured as checks

    assert checks.report("cpu") == 0
    assert "9/9 constrained outputs valid: PASS" in capsys.readouterr().out
    monkeypatch.setitem(REFERENCE_OPS, "apply_token_bitmask", lambda logits, bitmask: logits.clone())
    assert checks.report("cpu") == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "constrained outputs valid: FAIL" in out


def mixed_requests() -> tuple[list[str], list[SamplingParams]]:
    """Constrained requests (greedy and seeded, n > 1, a stop string) beside free ones."""
    params = [constrained(so, 1.0 if i % 2 else 0.0, seed=i) for i, so in enumerate(BOUNDED)]
    params += [constrained({"json": SCHEMAS[0]}, 1.0, seed=50, n=3), constrained({"regex": "ab(cd)+"}, stop=["cd"]),
               SamplingParams(temperature=1.0, seed=51, max_tokens=20, ignore_eos=True), SamplingParams(temperature=0, max_tokens=9)]
    return [PROMPTS[i % len(PROMPTS)] + " " * i for i in range(len(params))], params


def test_a_token_the_grammar_refuses_ends_its_sequence_alone(monkeypatch, caplog):
    """With a mask that lets everything through, the random model emits tokens the grammars
    refuse: each such sequence ends with "abort" and the log line, and the free request runs on."""
    monkeypatch.setitem(REFERENCE_OPS, "apply_token_bitmask", lambda logits, bitmask: logits.clone())
    llm = LLM(accelerator="cpu", dtype="float32", load_format="dummy", seed=3, progress=False)
    prompts, params = mixed_requests()
    with caplog.at_level(logging.ERROR, logger="deepinfer"):
        outs = llm.generate(prompts, params, use_tqdm=False)
    aborted = sum(c.finish_reason == "abort" for o in outs for c in o.outputs)
    assert aborted > 1 and len([r for r in caplog.records if "is not allowed by its grammar" in r.getMessage()]) == aborted
    assert len(outs[-2].outputs[0].token_ids) == 20  # free


@pytest.mark.parametrize("files, cpus", [
    ({}, 64),
    ({"cpu.max": "max 100000\n"}, 64),
    ({"cpu.max": "1600000 100000\n"}, 16),
    ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: two threads may run
    ({"cpu.max": "20000 100000\n"}, 1),
    ({"cpu.max": "max 100000\n", "cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 64),  # v2 wins
    ({"cpu/cpu.cfs_quota_us": "800000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 8),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, 64),
    ({"cpu.max": "\n"}, 64),  # unreadable: no quota
    ({"cpu.max": "12800000 100000\n"}, 64),  # a quota above the affinity mask
], ids=["none", "v2-max", "v2-16", "v2-fraction", "v2-small", "v2-over-v1", "v1-8", "v1-none", "v2-garbage", "v2-large"])
def test_usable_cpus_is_the_affinity_mask_lowered_by_the_cgroup_quota(tmp_path, monkeypatch, files, cpus):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(structured, "CGROUP", tmp_path)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert structured.usable_cpus() == cpus
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert structured.usable_cpus() == min(3, cpus)


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 1), (5, 4), (16, 8), (224, 8)])
def test_the_batch_matchers_threads_fit_the_usable_cpus(monkeypatch, cpus, threads):
    import xgrammar

    made = []
    monkeypatch.setattr(structured, "usable_cpus", lambda: cpus)
    monkeypatch.setattr(xgrammar, "BatchGrammarMatcher", lambda max_threads: made.append(max_threads))
    structured._batch_matcher.cache_clear()
    try:
        structured._batch_matcher()
    finally:
        structured._batch_matcher.cache_clear()  # the next use makes a real one
    assert made == [threads]
