"""``/v1/completions`` with ``echo`` (the prompt before the completion, in the text and the
logprobs) on the embedded default model, and scoring with ``max_tokens=0``: what
lm-evaluation-harness's ``local-completions`` loglikelihood requests need. The loglikelihoods
the server returns equal the engine's own prompt logprobs (float32, ``LLM.generate`` with
``SamplingParams(prompt_logprobs=...)``), and a greedy completion equals ``LLM.generate``'s."""

from __future__ import annotations

from operator import itemgetter

import pytest

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency (pip install -e .[dev])")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn", reason="fastapi and uvicorn are runtime dependencies")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from tests.serving_server import KEY, MODEL, running_server  # noqa: E402

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def offline():
    """The engine offline, as the server's (float32, batch-invariant), for the reference numbers."""
    return LLM(accelerator="cpu", dtype="float32", progress=False, max_num_seqs=8, batch_invariant=True)


def _post(server, body: dict, stream: bool = False):
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, **body, "stream": stream},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()
    import json
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def _ids(server, text: str, special: bool = True) -> list[int]:
    return server[1].tokenizer.encode(text, add_special_tokens=special)


def _offsets_point_into_the_text(choice: dict, skipped: set[int], ids: list[int]) -> None:
    lp = choice["logprobs"]
    for token_id, token, offset in zip(ids, lp["tokens"], lp["text_offset"]):
        if token_id not in skipped:
            assert choice["text"][offset:offset + len(token)] == token


def test_echo_returns_the_prompt_before_the_completion_with_its_logprobs(server):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    plain = _post(server, body)["choices"][0]
    out = _post(server, {**body, "echo": True})
    (choice,), ids = out["choices"], _ids(server, PROMPT)
    assert choice["text"] == PROMPT + plain["text"]
    lp, n = choice["logprobs"], len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n + 6
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first token
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert all(tok in top and len(top) <= 3 for tok, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:]))
    for key in ("tokens", "token_logprobs", "top_logprobs"):  # the completion's part is the plain request's
        assert lp[key][n:] == plain["logprobs"][key]
    assert lp["text_offset"][n] == len(PROMPT) and lp["text_offset"][1] == 0  # the BOS is not in the text
    _offsets_point_into_the_text(choice, {ids[0]}, ids + [0] * 6)
    assert out["usage"]["prompt_tokens"] == n and out["usage"]["completion_tokens"] == 6


def test_an_echoed_stream_sends_the_prompt_in_its_first_chunk_and_adds_up_to_the_answer(server):
    body = {"prompt": [PROMPT, "import os"], "max_tokens": 5, "temperature": 0, "logprobs": 1, "echo": True, "n": 2,
            "ignore_eos": True}
    whole = _post(server, body)["choices"]
    chunks = _post(server, body, stream=True)
    assert len(whole) == 4 and [c["index"] for c in whole] == [0, 1, 2, 3]
    for c in whole:  # each sample echoes its own prompt
        assert c["text"].startswith(PROMPT if c["index"] < 2 else "import os")
    for index, want in enumerate(whole):
        parts = [c for chunk in chunks for c in chunk["choices"] if c["index"] == index]
        assert parts[0]["text"].startswith(PROMPT if index < 2 else "import os")
        assert "".join(p["text"] for p in parts) == want["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for p in parts for x in p["logprobs"][key]] == want["logprobs"][key]


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_with_echo_scores_the_prompt_alone(server, stream):
    prompts = [_ids(server, "class A:", special=False), _ids(server, PROMPT)]  # token ids, the first without a BOS
    body = {"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 0, "n": 2}
    if stream:
        body["stream_options"] = {"include_usage": True}
        chunks = _post(server, body, stream=True)
        choices, usage = [c for chunk in chunks for c in chunk["choices"]], chunks[-1]["usage"]
    else:
        out = _post(server, body)
        choices, usage = out["choices"], out["usage"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2, 3]  # one chunk each: the prompt, finished
    for c in choices:
        ids = prompts[c["index"] // 2]
        assert c["text"] == server[1].tokenizer.decode(ids, skip_special_tokens=True)
        assert c["finish_reason"] == "length" and len(c["logprobs"]["tokens"]) == len(ids)
        assert c["logprobs"]["token_logprobs"][0] is None and None not in c["logprobs"]["token_logprobs"][1:]
    assert usage["prompt_tokens"] == sum(map(len, prompts)) and usage["completion_tokens"] == 0  # prompts once, not per n


def test_echo_through_the_openai_client(server):
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert out.choices[0].text == PROMPT and out.choices[0].logprobs.token_logprobs[0] is None
    assert out.usage.completion_tokens == 0


def _lm_eval_loglikelihood(out: dict, ctxlens: list[int], trailing: int) -> list[tuple[float, bool]]:
    """lm-eval's ``LocalCompletionsAPI.parse_logprobs``: per choice (by index), the sum of the
    continuation's ``token_logprobs`` and whether each continuation token was the greedy one
    (its logprob the best of ``top_logprobs``); ``trailing`` generated tokens cut off the end."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        end = len(choice["logprobs"]["token_logprobs"]) - trailing
        lps = choice["logprobs"]["token_logprobs"][ctxlen:end]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:end]
        res.append((sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))))
    return res


@pytest.mark.parametrize("max_tokens", [1, 0])  # lm-eval's request today (max_tokens=1, [ctxlen:-1]), and scoring alone
def test_lm_eval_loglikelihood_requests_get_the_engines_prompt_logprobs(server, offline, max_tokens):
    pairs = [(PROMPT, "\n    return a + b"), ("import os\n", "import sys"), ("x = [1, 2,", " 3]")]
    ctx = [_ids(server, c) for c, _ in pairs]
    whole = [c + _ids(server, cont, special=False) for c, (_, cont) in zip(ctx, pairs)]
    # what lm-eval's local-completions sends for a batch of loglikelihood requests (tokenized_requests)
    payload = {"model": MODEL, "prompt": whole, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1, "seed": 1234,
               "echo": True}
    got = _lm_eval_loglikelihood(_post(server, payload), [len(c) for c in ctx], trailing=max_tokens)

    ref = offline.generate([{"prompt_token_ids": w} for w in whole], SamplingParams(prompt_logprobs=1, max_tokens=1, temperature=0),
                           use_tqdm=False)
    for (ll, greedy), c, w, r in zip(got, ctx, whole, ref):
        want = [r.prompt_logprobs[i][w[i]] for i in range(len(c), len(w))]
        assert ll == sum(want)  # the same floats, summed in the same order
        assert greedy == all(r.prompt_logprobs[i][w[i]].rank == 1 for i in range(len(c), len(w)))
    assert not all(g for _, g in got)  # the check can tell (a random model does not predict these continuations)


def test_a_greedy_completion_through_the_server_is_llm_generates(server, offline):
    prompts = [PROMPT, "class Stack:\n    def push(self"]
    out = _post(server, {"prompt": prompts, "max_tokens": 24, "temperature": 0, "logprobs": 1})
    ref = offline.generate(prompts, SamplingParams(max_tokens=24, temperature=0, logprobs=1), use_tqdm=False)
    for choice, r in zip(sorted(out["choices"], key=itemgetter("index")), ref):
        assert choice["text"] == r.outputs[0].text
        assert choice["logprobs"]["token_logprobs"] == [lp[t] for t, lp in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)]
