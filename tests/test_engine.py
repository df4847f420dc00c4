"""End to end through the public API: parity with transformers, batching, preemption, stops, errors."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from deepinfer_core import LLM, GenerationError, SamplingParams
from deepinfer_core.config import DEFAULT_MODEL_DIR, ConfigError
from deepinfer_core.engine.engine import RequestError
from deepinfer_core.plugins import BackendError
from tests.hf_checkpoints import CONFIGS, write_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
PROMPTS = [[5, 17, 42, 99, 3, 64, 7], [11, 12], [150, 2, 2, 8, 33, 41, 90, 100, 120, 7, 6, 5, 4]]


def make_llm(path, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    return LLM(model=str(path), accelerator="cpu", progress=False, **kw)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    golden = write_checkpoint(request.param, path)
    return path, golden


def hf_logprobs(golden, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = golden(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_greedy_matches_transformers(checkpoint):
    path, golden = checkpoint
    outs = make_llm(path).generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        gen = out.outputs[0]
        assert out.prompt_token_ids == prompt and len(gen.token_ids) == 6
        ref = hf_logprobs(golden, prompt + gen.token_ids)
        for i, token in enumerate(gen.token_ids):
            row = ref[len(prompt) - 1 + i]
            assert int(row.argmax()) == token, f"step {i}: transformers' greedy token differs"
            assert abs(gen.logprobs[i][token] - float(row[token])) < 1e-4
    # and transformers' own generate agrees on the first prompt
    with torch.no_grad():
        hf = golden.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert hf[0, len(PROMPTS[0]) :].tolist() == outs[0].outputs[0].token_ids


def test_prompt_logprobs_match_transformers(checkpoint):
    path, golden = checkpoint
    out = make_llm(path).generate([PROMPTS[2]], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    ref = hf_logprobs(golden, PROMPTS[2])
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPTS[2])
    for pos in range(1, len(PROMPTS[2])):
        entry = out.prompt_logprobs[pos]
        token = PROMPTS[2][pos]
        assert abs(entry[token] - float(ref[pos - 1, token])) < 1e-4
        top2 = ref[pos - 1].topk(2).indices.tolist()
        assert all(t in entry for t in top2) and len(entry) in (2, 3)


def test_fp8_checkpoint_matches_transformers_reading_it(tmp_path):
    """transformers dequantises the block-FP8 checkpoint itself (FineGrainedFP8Config); our
    loader's dequantisation must give the same model."""
    from transformers import DeepseekV3ForCausalLM, FineGrainedFP8Config

    path = tmp_path / "fp8"
    write_checkpoint("v3_fp8_aligned", path)
    hf = DeepseekV3ForCausalLM.from_pretrained(
        str(path),
        quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=(8, 8)),
        attn_implementation="eager",
        experts_implementation="eager",
        dtype=torch.float32,
    ).eval()
    gen = make_llm(path).generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0]
    ref = hf_logprobs(hf, PROMPTS[0] + gen.token_ids)
    for i, token in enumerate(gen.token_ids):
        row = ref[len(PROMPTS[0]) - 1 + i]
        assert int(row.argmax()) == token and abs(gen.logprobs[i][token] - float(row[token])) < 1e-4


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = tmp_path_factory.mktemp("v3") / "ckpt"
    write_checkpoint("v3_grouped", path)
    return path


def run_alone(llm, prompts, params):
    return [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]


def test_results_do_not_depend_on_the_batch(v3):
    llm = make_llm(v3)
    together = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    alone = run_alone(llm, PROMPTS, GREEDY)
    for a, b in zip(together, alone):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in la:
                assert abs(la[t] - lb[t]) < 1e-5


def test_chunked_prefill_and_small_blocks_change_nothing(v3):
    base = make_llm(v3).generate(PROMPTS, GREEDY, use_tqdm=False)
    chunked = make_llm(v3, block_size=4, max_num_batched_tokens=5).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in base] == [o.outputs[0].token_ids for o in chunked]


def test_preemption_loses_nothing_and_changes_no_greedy_output(v3):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [[i + 1, i + 2, i + 3, 7, 9] for i in range(6)]
    base = make_llm(v3).generate(prompts, params, use_tqdm=False)
    # 12 blocks of 4 tokens cannot hold six sequences of 25 tokens at once
    tight = make_llm(v3, block_size=4, num_kv_blocks=12, max_model_len=40)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    assert tight.engine.kv.num_free == 12


def test_requests_may_fill_the_kv_cache_to_its_last_block(v3):
    """6 blocks of 4 tokens: one request of 24 tokens (23 computed: the last token is never fed
    back) needs every block; then two requests of 13 tokens (12 computed) need 3 blocks each, all
    6 at once. Nobody is preempted and the greedy tokens are those of a roomy cache."""
    params = [SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)]
    one, two = [PROMPTS[0]], [PROMPTS[0], [3, 1, 4, 1, 5, 9, 2]]
    roomy = make_llm(v3, block_size=4)
    tight = make_llm(v3, block_size=4, num_kv_blocks=6)
    engine = tight.engine
    assert engine.max_model_len == 24 == len(PROMPTS[0]) + 17
    lowest, real_schedule = [], engine.scheduler.schedule

    def schedule():
        out = real_schedule()
        lowest.append(engine.kv.num_free)
        return out

    engine.scheduler.schedule = schedule
    for prompts, p in ((one, params[0]), (two, params[1])):
        expected = roomy.generate(prompts, p, use_tqdm=False)
        lowest.clear()
        outs = tight.generate(prompts, p, use_tqdm=False)
        assert min(lowest) == 0, "the run was meant to take every block"
        assert engine.num_preemptions == 0 and engine.kv.num_free == 6
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
        assert all(len(o.outputs[0].token_ids) == p.max_tokens and o.outputs[0].finish_reason == "length" for o in outs)
        for a, b in zip(expected, outs):
            assert all(abs(la[t] - lb[t]) < 1e-5 for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs) for t in la)


def test_stop_conditions(v3):
    llm = make_llm(v3)
    free = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    stop_tok = free.token_ids[3]
    first = free.token_ids.index(stop_tok)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok and out.token_ids == free.token_ids[: first + 1]
    # EOS: make the eos the token greedy picks at step 2, unless ignore_eos
    llm.engine.eos_ids = (free.token_ids[2],)
    first_eos = free.token_ids.index(free.token_ids[2])
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None and out.token_ids == free.token_ids[: first_eos + 1]
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids
    # min_tokens suppresses the EOS
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, min_tokens=8), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and free.token_ids[2] not in out.token_ids


def test_max_model_len_is_enforced(v3):
    llm = make_llm(v3, max_model_len=12)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(PROMPTS[0]) + len(out.outputs[0].token_ids) == 12
    with pytest.raises(RequestError, match="too long"):
        llm.generate([list(range(1, 13))], GREEDY, use_tqdm=False)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        make_llm(v3, max_model_len=10**7)


def test_max_tokens_none_runs_to_the_context_and_logprobs_minus_one_is_the_vocabulary(v3):
    """vLLM's open values: max_tokens=None generates until max_model_len (prompt + output), and
    logprobs=-1 / prompt_logprobs=-1 give every token's logprob, those of logprobs=vocab."""
    llm = make_llm(v3, max_model_len=12)
    vocab = llm.engine.model_config.vocab_size
    whole = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, logprobs=-1, prompt_logprobs=-1)
    out = llm.generate([PROMPTS[0]], whole, use_tqdm=False)[0]
    gen = out.outputs[0]
    assert len(PROMPTS[0]) + len(gen.token_ids) == 12 and gen.finish_reason == "length"
    assert all(len(top) == vocab for top in gen.logprobs) and all(len(top) == vocab for top in out.prompt_logprobs[1:])
    named = llm.generate([PROMPTS[0]], whole.model_copy(update={"max_tokens": 5, "logprobs": vocab, "prompt_logprobs": vocab}),
                         use_tqdm=False)[0]
    assert named.outputs[0].token_ids == gen.token_ids
    assert [dict(t) for t in named.outputs[0].logprobs] == [dict(t) for t in gen.logprobs]
    assert [dict(t) for t in named.prompt_logprobs[1:]] == [dict(t) for t in out.prompt_logprobs[1:]]
    with pytest.raises(ValidationError, match="logprobs"):
        SamplingParams(logprobs=-2)


def test_seeded_sampling_is_reproducible_and_batch_independent(v3):
    llm = make_llm(v3)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=123, max_tokens=8, ignore_eos=True)
    a = llm.generate(PROMPTS, params, use_tqdm=False)
    b = run_alone(llm, PROMPTS, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    many = llm.generate([PROMPTS[0]], params.model_copy(update={"n": 3}), use_tqdm=False)[0]
    assert [c.index for c in many.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in many.outputs}) > 1
    top1 = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, top_k=1, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    greedy = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_a_seed_sweep_draws_new_samples(v3):
    """The n samples of one seed never repeat another seed's: with seed + sample index, seed=7,
    n=3 drew seed 8's and seed 9's samples again. Sample 0 is the seed's n=1 sample."""
    llm = make_llm(v3)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    sweep = llm.generate([PROMPTS[0]], params.model_copy(update={"seed": 7, "n": 3}), use_tqdm=False)[0]
    alone = [llm.generate([PROMPTS[0]], params.model_copy(update={"seed": s}), use_tqdm=False)[0].outputs[0].token_ids
             for s in (7, 8, 9)]
    assert sweep.outputs[0].token_ids == alone[0]
    assert sweep.outputs[1].token_ids != alone[1] and sweep.outputs[2].token_ids != alone[2]
    streams = {llm.engine._seed(SamplingParams(seed=s), i, 0) for s in range(64) for i in range(8)}
    assert len(streams) == 64 * 8 and all(0 <= x < 2**63 for x in streams)


def test_penalties_change_the_choice(v3):
    llm = make_llm(v3)
    base = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(set(base.token_ids)) < 40, "the unpenalised greedy output should repeat itself for this test to mean much"
    rep = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1e6), use_tqdm=False)[0].outputs[0]
    # an enormous repetition penalty forbids every token already seen in the prompt or output
    assert len(set(rep.token_ids)) == 40 and not set(rep.token_ids) & set(PROMPTS[0])
    freq = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0), use_tqdm=False)[0].outputs[0]
    assert freq.token_ids != base.token_ids and len(set(freq.token_ids)) > len(set(base.token_ids))


def test_text_prompts_stop_strings_and_detokenisation():
    llm = LLM(accelerator="cpu", dtype="float32", progress=False)  # the embedded default, with a tokenizer
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = llm.generate("def foo(x):", greedy, use_tqdm=False)[0]
    text, ids = free.outputs[0].text, free.outputs[0].token_ids
    assert free.prompt == "def foo(x):" and free.prompt_token_ids[0] == 0  # BOS added
    assert text == llm.tokenizer.decode(ids, skip_special_tokens=True)
    # a stop string made of the last character of one token and the first of the next
    pieces = [llm.tokenizer.decode(ids[: i + 1], skip_special_tokens=True) for i in range(len(ids))]
    i = next(i for i in range(2, len(ids) - 1) if len(pieces[i]) > len(pieces[i - 1]) and len(pieces[i + 1]) > len(pieces[i]))
    stop = pieces[i][-1] + pieces[i + 1][len(pieces[i])]
    cut = llm.generate("def foo(x):", greedy.model_copy(update={"stop": [stop]}), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)] and len(cut.token_ids) <= i + 2
    kept = llm.generate("def foo(x):", greedy.model_copy(update={"stop": [stop], "include_stop_str_in_output": True}), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    # stop strings wait for min_tokens
    late = llm.generate("def foo(x):", greedy.model_copy(update={"stop": [stop], "min_tokens": 12}), use_tqdm=False)[0].outputs[0]
    assert late.token_ids == ids and late.finish_reason == "length"


def test_incremental_text_is_the_full_decode_token_by_token():
    """OutputProcessor.text_so_far decodes a window, not the whole output, each time: its text
    must be the full decode's (less an unfinished character) after every token, multi-byte
    characters split over tokens and special tokens included."""
    from deepinfer_core.engine.output import OutputProcessor
    from deepinfer_core.engine.sequence import Sequence
    from deepinfer_core.engine.startup import load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    text = "déjà vu: 数据库 🚀🚀 naïve\n\tend"
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = ids[:5] + [tokenizer.eos_token_id] + ids[5:]  # a special token in the middle, skipped in the text
    assert any("\ufffd" in tokenizer.decode(ids[:i]) for i in range(len(ids)))  # characters do split over tokens
    for skip in (True, False):
        proc = OutputProcessor(tokenizer, (), 1 << 20)
        seq = Sequence(seq_id=0, request_id="r", index=0, prompt_token_ids=[0], params=SamplingParams(skip_special_tokens=skip), seed=0)
        for i, token in enumerate(ids):
            seq.output_token_ids.append(token)
            assert proc.text_so_far(seq) == proc.detokenize(seq).rstrip("\ufffd"), (skip, i)
        assert proc.text_so_far(seq) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_a_stop_string_completed_before_min_tokens_never_stops_the_sequence():
    """A stop string must end in the text the newest output added: "a" completed at output 2 (under
    min_tokens=3) does not stop the sequence at output 3, whatever longer stop strings sit beside it
    (the search once restarted as far back as the longest one reached)."""
    from deepinfer_core.engine.output import OutputProcessor
    from deepinfer_core.engine.sequence import Sequence

    class Chars:  # token i is the character chr(i)
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    for stops in (["a"], ["a", "abcdef"]):
        proc = OutputProcessor(Chars(), (), 1 << 20)
        params = SamplingParams(max_tokens=8, min_tokens=3, stop=stops)
        seq = Sequence(seq_id=0, request_id="r", index=0, prompt_token_ids=[0], params=params, seed=0)
        assert proc.process(seq, [ord(c) for c in "xab"], None) is False, stops
        assert proc.process(seq, [ord("a")], None) is True and seq.text == "xab" and seq.stop_reason == "a", stops


def test_one_token_chunks_in_the_middle_of_a_prompt_do_not_sample(v3):
    """A budget of 2 tokens leaves one-token chunks beside decodes: the batch mixes prefill and decode."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    prompts = [[5, 17, 42], [150, 2, 2, 8, 33, 41, 90, 100, 120, 7]]
    alone = run_alone(make_llm(v3), prompts, params)
    tight = make_llm(v3, max_num_batched_tokens=2).generate(prompts, params, use_tqdm=False)
    for a, b in zip(alone, tight):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids)
        for la, lb in zip(a.prompt_logprobs[1:] + a.outputs[0].logprobs, b.prompt_logprobs[1:] + b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and all(abs(la[t] - lb[t]) < 1e-5 for t in la)


def test_prompt_logprobs_survive_preemption_and_rechunking(v3):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    prompts = [[(7 * i + j) % 150 + 1 for j in range(9 + i)] for i in range(6)]
    alone = run_alone(make_llm(v3), prompts, params)
    tight = make_llm(v3, block_size=2, num_kv_blocks=20, max_num_batched_tokens=16, max_model_len=40)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.num_preemptions > 0
    for a, b in zip(alone, outs):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids)
        for la, lb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert la.keys() == lb.keys() and all(abs(la[t] - lb[t]) < 1e-5 for t in la)


def test_small_requests_and_shapes(v3):
    llm = make_llm(v3)
    one = llm.generate([[9]], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None] and len(one.outputs[0].token_ids) == 2
    as_tuple = llm.generate((5, 17, 42), GREEDY, use_tqdm=False)
    assert len(as_tuple) == 1 and as_tuple[0].prompt_token_ids == [5, 17, 42]
    assert llm.generate([], GREEDY, use_tqdm=False) == []


def test_bad_input_is_reported_and_the_engine_keeps_working(v3):
    llm = make_llm(v3)
    with pytest.raises(ValidationError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValidationError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValidationError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValidationError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValidationError, match="seed"):
        SamplingParams(seed=2**64)
    with pytest.raises(TypeError, match="not a SamplingParams"):
        llm.generate([PROMPTS[0]], [dict(temperature=0)], use_tqdm=False)
    with pytest.raises(RequestError, match="stop strings need a tokenizer"):
        llm.generate([PROMPTS[0]], SamplingParams(stop=["x"]), use_tqdm=False)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**6]], GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.generate("hello", GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(PROMPTS, [GREEDY, GREEDY], use_tqdm=False)
    # a bad prompt among good ones queues nothing; the next call works
    with pytest.raises(RequestError, match="prompt 1"):
        llm.generate([PROMPTS[0], [10**6]], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == 3


def test_a_request_that_fails_to_queue_leaves_nothing_behind(v3, monkeypatch):
    llm = make_llm(v3)
    real_seed = llm.engine._seed

    def seed_fails_for_the_second(params, index, seq_id):
        if seq_id >= 1:
            raise RuntimeError("cannot build the sequence")
        return real_seed(params, index, seq_id)

    monkeypatch.setattr(llm.engine, "_seed", seed_fails_for_the_second)
    with pytest.raises(RuntimeError, match="cannot build"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    monkeypatch.setattr(llm.engine, "_seed", real_seed)
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == 3


def test_engine_failure_keeps_finished_results(v3, monkeypatch):
    llm = make_llm(v3)
    short = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    model = llm.engine.model
    real_forward = model.forward
    calls = {"n": 0}

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("simulated device failure")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", failing_forward)
    with pytest.raises(GenerationError, match="simulated device failure") as info:
        llm.generate([PROMPTS[0], PROMPTS[1]], [short, long], use_tqdm=False)
    first, second = info.value.outputs
    assert first.finished and len(first.outputs[0].token_ids) == 1 and first.outputs[0].finish_reason == "length"
    assert second.outputs[0].finish_reason == "abort" and 0 < len(second.outputs[0].token_ids) < 30
    monkeypatch.setattr(model, "forward", real_forward)
    assert llm.engine.kv.num_free == llm.engine.kv.num_blocks
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == 3


def test_unknown_backend_and_model_errors(tmp_path):
    with pytest.raises(BackendError, match="not installed"):
        LLM(model=str(DEFAULT_MODEL_DIR), accelerator="no-such-chip", progress=False)
    with pytest.raises(ConfigError, match="not a directory"):
        LLM(model=str(tmp_path / "missing"), accelerator="cpu", progress=False)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match="deepseek_v3, deepseek_v2"):
        LLM(model=str(bad), accelerator="cpu", progress=False)


def test_repo_id_offline_gives_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="DEEPINFER_HF_MODEL_DIR"):
        LLM(model="deepseek-ai/DeepSeek-V2-Lite", accelerator="cpu", progress=False)


def test_environment_selects_model_and_backend(monkeypatch, v3):
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(v3))
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    monkeypatch.setenv("DEEPINFER_DTYPE", "float32")
    llm = LLM(progress=False)
    assert llm.model_dir == v3 and llm.engine.backend.name == "reference" and llm.engine.dtype == torch.float32
