"""vLLM's logit controls (SamplingParams.logit_bias, allowed_token_ids, bad_words) on the embedded
default model: their effect on greedy and sampled outputs, composition with a batch, speculative
decoding and overlapped scheduling, and clear errors for invalid values."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from deepinfer_core.engine.requests import bad_words_token_ids
from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.engine import RequestError
from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.sampling.sampler import SampleRow, apply_penalties, needs_history
from tests.hf_checkpoints import write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["def foo(x):", "The capital of France is"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=5, n=2)


def default_llm(**kw) -> LLM:
    return LLM(accelerator="cpu", dtype="float32", progress=False, **kw)


@pytest.fixture(scope="module")
def llm():
    return default_llm()


def ids(llm, prompts, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i : i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def with_(params: SamplingParams, **update) -> SamplingParams:
    return SamplingParams(**{**params.model_dump(exclude_unset=True), **update})


def test_the_controls_on_hand_made_logits():
    """allowed ids keep only themselves, the bias is added to what is left; a one-token bad word
    is always banned, a longer one's last token only after its other tokens (drafts count)."""
    controlled = Sequence(0, "r", 0, [1], SamplingParams(allowed_token_ids=[2, 3], logit_bias={3: 1.5, 4: 2.0}), 0)
    words = Sequence(1, "r", 0, [1], SamplingParams(bad_words=["w"]), 0, bad_words_token_ids=[[5], [1, 2, 6], [7, 7]])
    words.output_token_ids = [0, 1, 2]
    out = apply_penalties(torch.zeros(3, 8), [controlled, words, SampleRow(words, drafts=[1])], eos_ids=())
    inf = math.inf
    assert out[0].tolist() == [-inf, -inf, 0.0, 1.5, -inf, -inf, -inf, -inf]
    assert out[1].tolist() == [0, 0, 0, 0, 0, -inf, -inf, 0]  # ends with [1, 2]: 6 banned
    assert out[2].tolist() == [0, 0, 0, 0, 0, -inf, 0, 0]  # ends with the draft 1: 6 allowed again
    assert needs_history(words.params) and not needs_history(controlled.params)


def test_logit_bias_forces_or_removes_a_token(llm):
    free = ids(llm, PROMPTS[:1], GREEDY)[0][0]
    forced = ids(llm, PROMPTS[:1], with_(GREEDY, logit_bias={1234: 100}))[0][0]
    assert forced == [1234] * len(forced)
    clamped = with_(GREEDY, logit_bias={1234: 1e6, free[0]: -1e6})
    assert clamped.logit_bias == {1234: 100.0, free[0]: -100.0}
    first = free[0]
    avoided = ids(llm, PROMPTS[:1], with_(GREEDY, logit_bias={first: -100}))[0][0]
    assert avoided[0] != first and first not in avoided
    # sampled rows see the bias too
    assert all(t == 1234 for c in ids(llm, PROMPTS[:1], with_(SAMPLED, logit_bias={1234: 100}))[0] for t in c)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_allowed_token_ids_restrict_every_output_token(llm, params):
    free = ids(llm, PROMPTS, params)
    allowed = [7, 99, 512, 3000]
    for out in ids(llm, PROMPTS, with_(params, allowed_token_ids=allowed)):
        for c in out:
            assert c and set(c) <= set(allowed), c
    assert free != ids(llm, PROMPTS, with_(params, allowed_token_ids=allowed))


def banned_in(llm, word: str) -> list[list[int]]:
    return bad_words_token_ids(llm.engine, SamplingParams(bad_words=[word]))


def test_bad_words_block_their_token_sequences_and_leave_other_requests_alone(llm):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    free = [o.outputs[0].token_ids for o in outs]
    # a multi-token word the unconstrained greedy output of the first prompt holds
    word = next(w for w in outs[0].outputs[0].text.split()
                if any(len(b) > 1 and contains(free[0], b) for b in banned_in(llm, w)))
    banned = banned_in(llm, word)
    got = ids(llm, PROMPTS, [with_(GREEDY, bad_words=[word]), GREEDY])
    assert not any(contains(got[0][0], b) for b in banned), (word, banned, got[0][0])
    assert got[0][0] != free[0]
    assert got[1][0] == free[1]  # the request without bad_words in the same batch is unchanged
    # a one-token word is banned at every step
    single, text = next((t, llm.tokenizer.decode([t])) for t in free[1] if [t] in banned_in(llm, llm.tokenizer.decode([t])))
    got = ids(llm, PROMPTS[1:], with_(GREEDY, bad_words=[text]))[0][0]
    assert single not in got and got != free[1]


def test_speculative_and_overlapped_decoding_see_the_controls(llm, monkeypatch):
    # "Decorator" is a multi-token word of the first prompt's greedy output: banning it needs the
    # output so far on the host at every step (the previous token too, in overlapped mode)
    params = [with_(GREEDY, bad_words=["Decorator"], max_tokens=20),
              with_(GREEDY, allowed_token_ids=list(range(200, 600)), logit_bias={290: 5.0}, max_tokens=12)]
    plain = ids(llm, PROMPTS, params)
    assert plain[0][0][:16] != ids(llm, PROMPTS[:1], GREEDY)[0][0]
    spec = default_llm(speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert ids(spec, PROMPTS, params) == plain and spec.engine.num_draft_tokens > 0
    monkeypatch.setenv("DEEPINFER_ASYNC_SCHEDULING", "1")
    overlapped = default_llm()
    assert overlapped.engine.async_scheduling
    assert ids(overlapped, PROMPTS, params) == plain


def test_invalid_values_are_clear_errors_and_the_engine_keeps_working(llm, tmp_path):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValidationError, match="allowed_token_ids is an empty list"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValidationError, match="allowed_token_ids must be non-negative"):
        SamplingParams(allowed_token_ids=[-1])
    with pytest.raises(ValidationError, match="logit_bias keys must be non-negative"):
        SamplingParams(logit_bias={-2: 1.0})
    with pytest.raises(ValidationError, match="logit_bias"):
        SamplingParams(logit_bias={3: float("nan")})
    with pytest.raises(ValidationError, match="bad_words"):
        SamplingParams(bad_words=["ok", "  "])
    with pytest.raises(RequestError, match=r"logit_bias has token ids outside the vocabulary.*\[%d\]" % vocab):
        llm.generate(PROMPTS, with_(GREEDY, logit_bias={vocab: 1.0}), use_tqdm=False)
    with pytest.raises(RequestError, match="allowed_token_ids has token ids outside the vocabulary"):
        llm.generate(PROMPTS, with_(GREEDY, allowed_token_ids=[1, vocab + 5]), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert ids(llm, PROMPTS, GREEDY) == ids(default_llm(), PROMPTS, GREEDY)
    # a model directory without a tokenizer cannot tokenize bad words
    path = tmp_path / "ckpt"
    write_checkpoint("v3_grouped", path)
    bare = LLM(model=str(path), accelerator="cpu", dtype="float32", progress=False)
    with pytest.raises(RequestError, match="bad_words need a tokenizer"):
        bare.generate([[5, 17, 42]], with_(GREEDY, bad_words=["x"]), use_tqdm=False)
    assert len(bare.generate([[5, 17, 42]], with_(GREEDY, logit_bias={3: 100}), use_tqdm=False)[0].outputs[0].token_ids) == 16


def test_a_request_whose_controls_allow_no_token_ends_and_its_neighbour_does_not(llm):
    """allowed_token_ids that bad_words ban entirely leave no token: the request ends at once
    with EOS (not a made-up token 0); the other request in the batch runs as alone."""
    token = next(t for t in range(300, 400) if [t] in banned_in(llm, llm.tokenizer.decode([t])))
    stuck = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[token], bad_words=[llm.tokenizer.decode([token])])
    alone = ids(llm, PROMPTS[1:], GREEDY)[0][0]
    got = llm.generate(PROMPTS, [stuck, GREEDY], use_tqdm=False)
    assert got[0].outputs[0].token_ids == [llm.tokenizer.eos_token_id] and got[0].outputs[0].finish_reason == "stop"
    assert got[1].outputs[0].token_ids == alone
