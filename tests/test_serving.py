"""The OpenAI-compatible server on the embedded default model, started here on 127.0.0.1 (a free
port), called with the real ``openai`` client and raw HTTP: completions and chat, streamed and
not (the same text), n, stop, seeds, logprobs, usage; auth; bad input is a 400 naming the
field, streamed or not; a client that goes away mid-stream frees its request."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import re
import time

import pytest

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency (pip install -e .[dev])")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn", reason="fastapi and uvicorn are runtime dependencies")

from deepinfer_core import LLM  # noqa: E402
from deepinfer_core.serving.common import DISCONNECT_POLL_S  # noqa: E402
from tests.serving_server import KEY, MODEL, running_server  # noqa: E402


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def _stream_text(chunks, chat: bool) -> tuple[dict[int, str], dict[int, str], dict | None]:
    texts, reasons, usage = {}, {}, None
    for chunk in chunks:
        if getattr(chunk, "usage", None):
            usage = chunk.usage
        for c in chunk.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_completions_streamed_and_not_give_the_same_text(client):
    kw = {"model": MODEL, "prompt": "def fib(n):", "max_tokens": 24, "temperature": 0.8, "seed": 7, "n": 2}
    whole = client.completions.create(**kw)
    texts, reasons, usage = _stream_text(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw),
                                         chat=False)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == [texts[0], texts[1]]
    assert {c.finish_reason for c in whole.choices} <= {"stop", "length"} and set(reasons) == {0, 1}
    assert whole.usage.completion_tokens == usage.completion_tokens > 0
    assert whole.usage.prompt_tokens == usage.prompt_tokens > 0
    again = client.completions.create(**kw)  # the seed makes it reproducible
    assert [c.text for c in again.choices] == [c.text for c in whole.choices]
    assert client.completions.create(**{**kw, "seed": 8}).choices[0].text != whole.choices[0].text


def test_a_greedy_completion_is_the_same_alone_and_beside_another_prompt(client):
    one = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=20, temperature=0)
    two = client.completions.create(model=MODEL, prompt=["import os\n", "class A:"], max_tokens=20, temperature=0)
    assert two.choices[0].text == one.choices[0].text and [c.index for c in two.choices] == [0, 1]


def test_stop_strings_and_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="def f(x):\n    return", max_tokens=40, temperature=0, stop=["\n"], logprobs=2)
    choice = out.choices[0]
    assert "\n" not in choice.text
    assert choice.logprobs is not None and len(choice.logprobs.tokens) == out.usage.completion_tokens
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    streamed, _, _ = _stream_text(client.completions.create(model=MODEL, prompt="def f(x):\n    return", max_tokens=40,
                                                             temperature=0, stop=["\n"], stream=True), chat=False)
    assert streamed[0] == choice.text
    # a stop string of several characters: the stream holds back what could be its start
    for stop in (["self"], [" = ", ":\n"]):
        kw = {"model": MODEL, "prompt": "class A:\n    def __init__(self", "max_tokens": 60, "temperature": 0, "stop": stop}
        whole = client.completions.create(**kw).choices[0]
        streamed, _, _ = _stream_text(client.completions.create(stream=True, **kw), chat=False)
        assert streamed[0] == whole.text, (stop, whole)


def test_vllms_stop_token_ids_include_stop_str_in_output_and_skip_special_tokens(client, server):
    tokenizer = server[1].tokenizer
    kw = {"model": MODEL, "prompt": "def f(x):\n    return", "max_tokens": 12, "temperature": 0}
    plain = client.completions.create(**kw).choices[0]
    ids = tokenizer(plain.text, add_special_tokens=False).input_ids  # the tokens it generated (greedy, this model)
    stopped = client.completions.create(**kw, extra_body={"stop_token_ids": [ids[2]]}).choices[0]
    assert stopped.finish_reason == "stop" and stopped.model_extra["stop_reason"] == ids[2] and len(stopped.text) < len(plain.text)
    word = plain.text.split()[1]
    kept = client.completions.create(**kw, stop=[word], extra_body={"include_stop_str_in_output": True}).choices[0].text
    assert kept.endswith(word) and kept == plain.text[:plain.text.index(word) + len(word)]
    bos = tokenizer.bos_token_id
    forced = {"logit_bias": {str(bos): 100}, "max_tokens": 2}
    shown = client.completions.create(**{**kw, **forced}, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    hidden = client.completions.create(**{**kw, **forced}, extra_body={"ignore_eos": True})
    assert shown.choices[0].text == tokenizer.bos_token * 2 and hidden.choices[0].text == ""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError, match="functions are not supported"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       functions=[{"name": "f", "parameters": {"type": "object"}}])


def test_completion_logprobs_have_each_tokens_text_offset(client):
    """text_offset: where each token's text starts in the choice's text (it was an empty list)."""
    kw = {"model": MODEL, "prompt": "def f(x):\n    return", "max_tokens": 12, "temperature": 0, "logprobs": 1, "extra_body": {"ignore_eos": True}}
    choice = client.completions.create(**kw).choices[0]
    lp = choice.logprobs
    assert len(lp.text_offset) == len(lp.tokens) == 12 and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == choice.text  # this model's tokens are whole characters: each offset is exact
    for offset, token in zip(lp.text_offset, lp.tokens):
        assert choice.text[offset:offset + len(token)] == token
    streamed = [o for chunk in client.completions.create(stream=True, **kw) for c in chunk.choices for o in c.logprobs.text_offset]
    assert streamed == lp.text_offset  # offsets into the whole text, across chunks


def test_chat_streamed_and_not(client):
    kw = {"model": MODEL, "messages": [{"role": "system", "content": "Answer in code."}, {"role": "user", "content": "sort a list"}],
          "max_tokens": 20, "temperature": 0}
    whole = client.chat.completions.create(**kw)
    texts, reasons, usage = _stream_text(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw),
                                         chat=True)
    assert whole.choices[0].message.content == texts[0] and whole.choices[0].message.role == "assistant"
    assert whole.usage.total_tokens == usage.total_tokens
    lp = client.chat.completions.create(**kw, logprobs=True, top_logprobs=2).choices[0].logprobs
    assert lp is not None and len(lp.content) == whole.usage.completion_tokens
    for token in lp.content:  # greedy: the token is the most likely one, first of exactly 2
        assert [t.token for t in token.top_logprobs][0] == token.token and len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob and token.top_logprobs[0].logprob == token.logprob


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_ends_with_a_usage_chunk_only_when_asked(client, server, chat):
    """OpenAI's rule (and vLLM's): the usage chunk, which has no choices, comes only with
    stream_options.include_usage; without it the usual ``chunk.choices[0]`` loop works."""
    create = client.chat.completions.create if chat else client.completions.create
    kw = {"model": MODEL, "max_tokens": 6, "temperature": 0, "stream": True,
          **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "def f(x):"})}
    text = ""
    for chunk in create(**kw):
        choice = chunk.choices[0]  # an IndexError here was the bug
        text += (choice.delta.content or "") if chat else choice.text
        assert chunk.usage is None
    assert text
    chunks = list(create(**kw, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.choices and c.usage is None for c in chunks[:-1])
    assert "".join((c.choices[0].delta.content or "") if chat else c.choices[0].text for c in chunks[:-1]) == text
    chunks = list(create(**kw, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1].choices == []
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {k: v for k, v in kw.items() if k not in ("model", "stream")}
    for options, name in (({"include_usage": True}, "stream: true"), ({"include_usage": True, "per_token": True}, "per_token")):
        r = httpx.post(server[0] + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       json={**body, "stream_options": options, **({"stream": True} if "per_token" in options else {})})
        assert r.status_code == 400 and name in r.json()["error"]["message"], r.text


def test_response_format_json_schema_constrains_chat(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a number"}], max_tokens=30, temperature=0,
                                         response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert isinstance(json.loads(out.choices[0].message.content, strict=False)["n"], int)


def test_vllms_structured_output_fields_and_response_format_constrain_both_routes(client):
    """guided_json / guided_regex / guided_choice / guided_grammar and structured_outputs (vLLM's,
    through extra_body) and response_format (on completions too) were accepted and ignored."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    cases = [({"guided_regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
             ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
             ({"guided_grammar": 'root ::= "ab" | "cd"'}, lambda t: t in ("ab", "cd")),
             ({"guided_json": schema}, lambda t: isinstance(json.loads(t)["n"], int)),
             ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
             ({"structured_outputs": {"regex": "[ab]{2}c", "disable_any_whitespace": True}}, lambda t: re.fullmatch("[ab]{2}c", t)),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}},
              lambda t: isinstance(json.loads(t)["n"], int)),
             ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict))]
    for extra, ok in cases:
        text = client.completions.create(model=MODEL, prompt="The answer:", max_tokens=24, temperature=0, extra_body=extra).choices[0].text
        assert ok(text), (extra, text)
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "answer"}], max_tokens=24,
                                              temperature=0, extra_body=extra).choices[0].message.content
        assert ok(chat), (extra, chat)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra, param, says", [
    ({"guided_regex": "[0-9]", "guided_choice": ["a"]}, "guided_choice", "give only one"),
    ({"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}}, "guided_json", "give only one"),
    ({"guided_regex": "("}, "guided_regex", "guided_regex is not a valid regular expression"),
    ({"guided_json": {"type": "nope"}}, "guided_json", "guided_json is not a valid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema is not a valid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format", "schema is missing"),
    ({"response_format": {"json_schema": {"name": "a", "schema": {}}}}, "response_format", "type is missing"),
    ({"guided_grammar": "root ::= nowhere"}, "guided_grammar", "guided_grammar is not a valid EBNF grammar"),
    ({"guided_choice": []}, "guided_choice", "empty list"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"whitespace_pattern": " *", "regex": "a"}}, "structured_outputs.whitespace_pattern", "not supported"),
    ({"structured_outputs": {"regex": "a", "backend": "outlines"}}, "structured_outputs.backend", "leave it out"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "xgrammar"),
    ({"best_of": 3}, "best_of", "n=3"),
    ({"best_of": 1, "n": 2}, "best_of", "at least n"),
    ({"n": 9}, "n", "more than this server allows"),
    ({"max_tokens": 1000}, "max_tokens", "more than this server allows"),
])
def test_structured_output_and_sampling_fields_it_cannot_honour_are_400s_naming_them(server, path, extra, param, says):
    body = {"max_tokens": 4, **({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}), **extra}
    for stream in (False, True):
        r = httpx.post(server[0] + path, json={**body, "stream": stream}, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and says in error["message"], r.text
        assert "so_args" not in error["message"]


def test_top_logprobs_without_logprobs_is_a_400_as_on_openai(client):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs" and "logprobs: true" in e.value.body["message"]
    assert client.chat.completions.create(**kw, logprobs=True, top_logprobs=2).choices[0].logprobs.content


def test_models_health_and_auth(server):
    url = server[0]
    assert httpx.get(url + "/health").status_code == 200
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, url + path, headers=headers, json={})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, headers)
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    # the API description wants the key too; the interactive pages are off
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(url + path).status_code == 401, path
    assert "/v1/completions" in httpx.get(url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()["paths"]
    r = httpx.get(url + "/docs", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["message"].startswith("GET /docs is not a route of this server")


def test_version_tokenize_detokenize_and_one_model_by_id(client, server):
    """vLLM's GET /version, POST /tokenize and /detokenize, and GET /v1/models/{id}, behind the key."""
    import deepinfer_core

    url, engine = server
    auth = {"Authorization": f"Bearer {KEY}"}
    tokenizer = engine.tokenizer
    for method, path in (("GET", "/version"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", f"/v1/models/{MODEL}")):
        assert httpx.request(method, url + path, json={}).status_code == 401, path
    assert httpx.get(url + "/version", headers=auth).json() == {"version": deepinfer_core.__version__}
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.models.retrieve("gpt-4")

    def post(path, body):
        if isinstance(body, bytes):
            return httpx.post(url + path, content=body, headers={**auth, "Content-Type": "application/json"}, timeout=30)
        return httpx.post(url + path, json=body, headers=auth, timeout=30)

    got = post("/tokenize", {"prompt": "def f(x):", "model": MODEL}).json()
    ids = tokenizer("def f(x):").input_ids
    assert got == {"count": len(ids), "max_model_len": engine.engine.max_model_len, "tokens": ids, "token_strs": None}
    assert client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=1).usage.prompt_tokens == len(ids)
    bare = post("/tokenize", {"prompt": "def f(x):", "add_special_tokens": False, "return_token_strs": True}).json()
    assert bare["tokens"] == tokenizer("def f(x):", add_special_tokens=False).input_ids != ids
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])
    messages = [{"role": "system", "content": "Answer in code."}, {"role": "user", "content": "sort a list"}]
    chat = post("/tokenize", {"messages": messages}).json()
    assert chat["count"] == client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens
    assert post("/detokenize", {"tokens": chat["tokens"]}).json() == {"prompt": tokenizer.decode(chat["tokens"])}
    for path, body, param in (("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"messages": messages, "add_generation_prompt": False}, "add_generation_prompt"),
                              ("/tokenize", {"prompt": "x", "tools": []}, "tools"),
                              ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.role"),
                              ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model"),
                              ("/tokenize", b'{"prompt": "a\\ud800b"}', "prompt"),  # a lone surrogate
                              ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")):
        r = post(path, body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (body, r.text)


@pytest.mark.parametrize("body, status, names", [
    (b"{not json", 400, ""),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),
    ({"prompt": "x", "n": 9}, 400, "n="),
    ({"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "gpt-4"),
    ({"prompt": "x", "max_tokens": 0}, 400, "allowed only with echo"),  # scoring only: max_tokens=0 wants echo
    ({"prompt": "x", "max_tokens": -1, "echo": True}, 400, "max_tokens"),
    ({"prompt": "x", "echo": "yes"}, 400, "echo: Input should be a valid boolean"),
    ({}, 400, "prompt"),
    ({"prompt": [99999]}, 400, "99999"),
    ({"prompt": "x " * 5000}, 400, "max_model_len"),
    ({"prompt": "x", "stop": 5}, 400, "stop"),
    ({"prompt": "x", "stop": ""}, 400, "stop cannot contain an empty string"),  # as vLLM: "" and ["", "a"] alike
    ({"prompt": "x", "stop": ["", "a"]}, 400, "stop cannot contain an empty string"),
    ({"prompt": "x", "max_tokens": True}, 400, "max_tokens: Input should be a valid integer"),  # a bool is not an int
    ({"prompt": "x", "max_tokens": 2.0}, 400, "max_tokens: Input should be a valid integer"),
    ({"prompt": "x", "n": True}, 400, "n: Input should be a valid integer"),
    ({"prompt": "x", "temperature": True}, 400, "temperature: Input should be a valid number"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream: Input should be a valid boolean"),
    ({"prompt": [1, True]}, 400, "prompt"),
])
def test_bad_completion_requests_are_4xx_naming_the_problem(server, body, status, names):
    url, engine = server
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + "/v1/completions", content=data, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    assert names in r.json()["error"]["message"], r.json()
    ok = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers, timeout=60)
    assert ok.status_code == 200  # the server goes on


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages"])
def test_a_body_that_is_not_a_json_object_is_named_so(server, path):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for body, says in ((b'{"prompt": "x",\n "max_tokens": }', "not valid JSON: Expecting value at line 2, column 16 (character 31)"),
                       (b"\xff\xfe{}", "not valid JSON"), (b"", "body is empty"), (b"[1, 2]", "must be a JSON object, got an array"),
                       (b'"hi"', "must be a JSON object, got a string")):
        r = httpx.post(server[0] + path, content=body, headers=headers, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and says in error["message"] and error.get("param") is None, (body, r.text)
    r = httpx.post(server[0] + path, content=b'{"prompt": "x"}', headers={**headers, "Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"], r.text


def test_bad_chat_requests(server):
    url = server[0]
    headers = {"Authorization": f"Bearer {KEY}"}
    for body, name in (({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
                       ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}, "yaml"),
                       ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools")):
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 400 and name in r.json()["error"]["message"], (body, r.text)
    big = httpx.post(url + "/v1/completions", content=b"x" * (1 << 17), headers=headers)
    assert big.status_code == 413

    def chunks(n: int, size: int = 4096):  # a body without Content-Length (chunked transfer), counted as it arrives
        yield b'{"prompt": "'
        for _ in range(n):
            yield b"x" * size
        yield b'", "max_tokens": 2}'

    for path in ("/v1/completions", "/v1/messages"):
        big = httpx.post(url + path, content=chunks(40), headers=headers, timeout=60)
        assert big.status_code == 413 and "larger than" in big.text, big.text
    small = httpx.post(url + "/v1/completions", content=chunks(4, 16), headers={**headers, "Content-Type": "application/json"}, timeout=60)
    assert small.status_code == 200, small.text


def test_prompt_plus_max_tokens_beyond_the_context_is_a_400_and_a_default_max_tokens_fits(client, server):
    """As OpenAI and vLLM: a max_tokens asked for that does not fit after the prompt is refused
    (it used to be cut silently at max_model_len); the server's default is lowered to fit."""
    limit = server[1].engine.max_model_len
    prompt = [7] * (limit - 10)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
    assert e.value.body["param"] == "prompt" and e.value.body["message"].startswith(
        f"This model's maximum context length is {limit} tokens (max_model_len). However, you requested {limit + 10} tokens "
        f"({limit - 10} in the prompt, 20 in the completion).")
    with pytest.raises(openai.BadRequestError, match="in the prompt"):  # the longest of several prompts decides
        client.completions.create(model=MODEL, prompt=[[7, 8], prompt], max_tokens=20)
    out = client.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})  # 16 by default
    assert out.usage.completion_tokens == 10 and out.choices[0].finish_reason == "length"
    text = server[1].tokenizer.decode(prompt[:-3])  # about as long, as chat messages
    ids = len(server[1].tokenizer(text).input_ids)
    messages = [{"role": "user", "content": text}]
    with pytest.raises(openai.BadRequestError, match=r"in the messages, 60 in the completion\)") as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=60)
    r = httpx.post(server[0] + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                   json={"messages": messages, "max_tokens": 60})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"], r.text
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == limit and ids < chat.usage.prompt_tokens


def test_a_refused_streamed_request_is_a_400_not_a_broken_stream(server):
    url = server[0]
    headers = {"Authorization": f"Bearer {KEY}"}
    for path, body in (("/v1/completions", {"prompt": "x " * 5000}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 5000}]})):
        r = httpx.post(url + path, json={**body, "stream": True}, headers=headers, timeout=60)
        assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"], (path, r.text)


def test_a_client_leaving_mid_stream_frees_its_request(server, monkeypatch, caplog):
    url, engine = server
    aborted = []
    abort = engine.engine.abort
    monkeypatch.setattr(engine.engine, "abort", lambda rid: aborted.append(rid) or abort(rid))
    body = {"prompt": "def main():", "max_tokens": 64, "temperature": 0.7, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
    deadline = time.time() + 20
    while not aborted or engine.engine.requests:
        assert time.time() < deadline, "the request was not aborted"
        time.sleep(0.05)
    assert aborted[0].startswith("cmpl-") and engine.num_unfinished() == 0
    gc.collect()
    time.sleep(0.2)
    noise = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not noise, noise


def test_offline_chat_lays_messages_out_with_the_chat_template():
    from deepinfer_core import SamplingParams
    from deepinfer_core.chat import chat_prompt

    llm = LLM(accelerator="cpu", dtype="float32", progress=False)
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.tokenizer
    conversation = [{"role": "system", "content": "Answer in code."}, {"role": "user", "content": "sort a list"}]
    ids = chat_prompt(tokenizer, conversation)
    assert tokenizer.decode(ids) == "<｜begin▁of▁sentence｜>Answer in code.\n\nUser: sort a list\n\nAssistant:"
    params = SamplingParams(max_tokens=8, temperature=0)
    (out,) = llm.chat(conversation, params, use_tqdm=False)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(llm.chat([conversation, conversation[1:]], params, use_tqdm=False)) == 2
    with pytest.raises(ValueError, match="conversation 0: the chat template refused these messages: role wizard"):
        llm.chat([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match="string 'content'"):
        llm.chat([{"role": "user", "content": 5}])


def test_deepinfer_serve_is_a_command():
    from deepinfer_core.cli import build_parser

    args = build_parser().parse_args(["serve", "--port", "9000", "--api-key", "k"])
    assert args.model is None and args.port == 9000 and args.api_key == "k" and args.host == "127.0.0.1"


@pytest.mark.parametrize("argv, message", [
    (["/nonexistent"], "error: model '/nonexistent' is not a directory"),
    (["--accelerator", "no-such-chip"], "error: backend 'no-such-chip'"),
    (["--max-num-seqs", "0"], "error: --max-num-seqs: Input should be greater than 0"),
    (["--gpu-memory-utilization", "1.5"], "error: --gpu-memory-utilization: Input should be less than or equal to 1"),
    (["--kv-cache-dtype", "fp16"], "error: --kv-cache-dtype 'fp16' is not supported"),
    (["--kv-cache-dtype", "fp8"], "error: kv_cache_dtype='fp8' is supported for DeepSeek-V4"),  # the default model is V3
    (["--data-parallel-size", "0"], "error: --data-parallel-size: Input should be greater than 0"),
    (["--mtp", "17"], "error: --mtp 17: the number of draft tokens per step must be 0 (off) to 16"),
    (["--max-tokens", "0"], "error: --max-tokens 0: a request's limit must be at least 1"),
])
def test_serve_reports_a_configuration_error_in_one_line(capsys, argv, message):
    """As generate does: exit status 1, one error: line, no traceback (it printed 16-22 lines)."""
    from deepinfer_core.cli import main

    assert main(["serve", "--port", "0", *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "Traceback" not in err
    assert [line for line in err.splitlines() if not line.startswith("INFO ")] == [err.splitlines()[-1]]


def test_serve_takes_the_port_before_loading_the_model(monkeypatch, capsys):
    import socket

    import deepinfer_core
    from deepinfer_core.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was taken")

    monkeypatch.setattr(deepinfer_core, "LLM", no_model)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1
    assert capsys.readouterr().err == (f"error: cannot listen on 127.0.0.1:{port}: Address already in use; port {port} is "
                                       "in use: stop what holds it or pass another --port\n")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_generate_and_serve_take_the_same_engine_flags(llm_arguments, command):
    """One definition of the engine flags (vLLM's names), handed to LLM() alike by both commands."""
    from deepinfer_core.cli import main

    seen = llm_arguments
    flags = ["--dtype", "half", "--max-model-len", "256", "--max-num-seqs", "3", "--seed", "5", "--kv-cache-dtype", "auto",
             "--gpu-memory-utilization", "0.5", "--mtp", "2", "--no-prefix-caching", "--batch-invariant", "--accelerator", "cpu",
             "--data-parallel-size", "2", "--expert-parallel", "--context-parallel-size", "2", "--num-gpu-blocks-override", "40",
             "--load-format", "dummy"]
    argv = ["generate", "--prompt", "x", *flags] if command == "generate" else ["serve", "--port", "0", *flags]
    assert main(argv) == 1
    assert seen == {"model": None, "accelerator": "cpu", "dtype": "half", "max_model_len": 256, "max_num_seqs": 3, "seed": 5,
                    "gpu_memory_utilization": 0.5, "kv_cache_dtype": "auto", "enable_prefix_caching": False,
                    "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}, "batch_invariant": True,
                    "data_parallel_size": 2, "expert_parallel": True, "context_parallel_size": 2,
                    "kv_offload_gb": 0, "kv_disk_dir": None, "kv_disk_gb": None, "num_kv_blocks": 40, "load_format": "dummy"}


def test_serve_role_flags_reach_llm_and_bad_ones_are_refused(llm_arguments, capsys):
    from deepinfer_core.cli import main

    seen = llm_arguments
    assert main(["serve", "--port", "0", "--role", "decode", "--kv-transfer-timeout", "30"]) == 1
    assert seen["kv_role"] == "decode" and seen["kv_transfer_timeout"] == 30
    capsys.readouterr()
    assert main(["serve", "--port", "0", "--role", "prefill", "--ngram", "2"]) == 1
    assert "--role runs one engine per instance without speculative decoding" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--role", "prefill", "--kv-transfer-timeout", "0"]) == 1
    assert "--kv-transfer-timeout 0.0: give a positive number of seconds" in capsys.readouterr().err


def test_deepinfer_version(capsys):
    import deepinfer_core
    from deepinfer_core.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"deepinfer {deepinfer_core.__version__}\n"


def test_deepinfer_serve_serves_on_the_port_it_took(tmp_path):
    """The command end to end in its own process: the port bound first, then the model loaded
    with the engine flags, then uvicorn serving on that socket; SIGTERM stops it cleanly."""
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "deepinfer_core.cli", "serve", "--port", str(port), "--accelerator", "cpu",
                                 "--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "64", "--served-model-name", "m"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "m", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "m", "prompt": "x " * 100, "max_tokens": 4})
        # --max-model-len reached the engine: the server's context check answers with it
        assert r.status_code == 400 and "maximum context length is 64 tokens" in r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    text = (tmp_path / "serve.log").read_text()
    assert f"Uvicorn running on http://127.0.0.1:{port}" in text and "dtype torch.float32" in text
    assert "Application shutdown complete" in text and "Traceback" not in text


def test_concurrent_streams_with_cancellations_and_bad_requests(server):
    """200 requests at once, 20 streams dropped midway and 10 malformed: every other one streams
    the text it gets alone (checked on 10 of them), nothing else fails, and afterwards no request
    is left and every KV block is free again."""
    url, engine = server
    headers = {"Authorization": f"Bearer {KEY}"}
    prompts = [f"def f{i}(x):" for i in range(170)]

    async def stream(client, i, prompt, drop=False):
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
        text = ""
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += "".join(c["text"] for c in event["choices"])
                if drop and text:
                    return None
        return text

    async def bad(client, i):
        r = await client.post(url + "/v1/completions", json={"prompt": "x", "temperature": "hot" if i % 2 else -3}, headers=headers)
        return r.status_code

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            jobs = [stream(client, i, p) for i, p in enumerate(prompts)]
            jobs += [stream(client, 1000 + i, "while True:", drop=True) for i in range(20)]
            jobs += [bad(client, i) for i in range(10)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    assert results[190:] == [400] * 10 and results[170:190] == [None] * 20
    assert all(isinstance(t, str) and t for t in results[:170])
    checked = list(range(0, 170, 17))
    with httpx.Client(timeout=60) as client:
        for i in checked:
            r = client.post(url + "/v1/completions", json={"prompt": prompts[i], "max_tokens": 24, "temperature": 0}, headers=headers)
            assert results[i] == r.json()["choices"][0]["text"], i
    deadline = time.time() + 20
    while engine.engine.requests or engine.num_unfinished():
        assert time.time() < deadline, "requests were left behind"
        time.sleep(0.05)
    kv = engine.engine.kv
    assert kv.num_free == kv.num_blocks  # cached prefixes count as free: nothing is held


def test_prometheus_metrics(server):
    url = server[0]
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(url + "/metrics").status_code == 401
    before = httpx.get(url + "/metrics", headers=headers).text
    body = {"prompt": "x = [1, 2, 3]\nprint(x)\n" * 4, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    for _ in range(2):  # the second one reads the first one's prompt from the prefix cache
        assert httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60).status_code == 200
    text = httpx.get(url + "/metrics", headers=headers).text

    def value(name: str, page: str) -> float:
        lines = [ln for ln in page.splitlines() if ln.startswith(name + " ") or ln.startswith(name + "{")]
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)

    for gauge in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_ratio", "prefix_cache_hit_ratio",
                  "spec_decode_draft_tokens"):
        assert f"deepinfer_{gauge} " in text, gauge
    assert value("deepinfer_generation_tokens_total", text) - value("deepinfer_generation_tokens_total", before) == 10
    assert value("deepinfer_time_to_first_token_seconds_count", text) - value("deepinfer_time_to_first_token_seconds_count", before) == 2
    assert value("deepinfer_time_per_output_token_seconds_count", text) > value("deepinfer_time_per_output_token_seconds_count", before)
    assert value("deepinfer_cached_prompt_tokens_total", text) > value("deepinfer_cached_prompt_tokens_total", before)
    assert value("deepinfer_prefix_cache_hit_ratio", text) > 0
    assert 'deepinfer_requests_finished_total{finish_reason="length"}' in text


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "def main():"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_client_leaving_a_non_streamed_request_frees_it(server, monkeypatch, caplog, path, body):
    url, engine = server
    aborted = []
    abort, step = engine.engine.abort, engine.engine.step
    monkeypatch.setattr(engine.engine, "abort", lambda rid: aborted.append(rid) or abort(rid))
    monkeypatch.setattr(engine.engine, "step", lambda: time.sleep(0.05) or step())  # 64 steps: ~3 s
    # Anthropic's /v1/messages has no ignore_eos: a sampled EOS would end the request before the client
    # leaves (it did, once an earlier test had moved the sampling RNG), so no token is EOS here
    monkeypatch.setattr(engine.engine.output, "eos_ids", ())
    body = {**body, "max_tokens": 64, "temperature": 0.7, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.8)
    deadline = time.time() + 10
    while not aborted or engine.engine.requests:
        assert time.time() < deadline, "the request was not aborted"
        time.sleep(0.05)
    assert engine.num_unfinished() == 0
    # the cancelled work is collected quietly: no "exception was never retrieved" with a traceback
    # (futures log that when they are garbage-collected, on the server's thread)
    time.sleep(DISCONNECT_POLL_S + 0.2)
    gc.collect()
    time.sleep(0.2)
    noise = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not noise, noise


def test_logit_bias_allowed_token_ids_and_bad_words_reach_the_sampler(client, server):
    tokenizer = server[1].tokenizer
    token = tokenizer.encode(" return", add_special_tokens=False)[0]
    out = client.completions.create(model=MODEL, prompt="x = 1", max_tokens=5, temperature=0, logit_bias={str(token): 100})
    assert out.choices[0].text == tokenizer.decode([token] * 5)
    allowed = tokenizer.encode(" a b c", add_special_tokens=False)
    out = client.completions.create(model=MODEL, prompt="x = 1", max_tokens=6, temperature=1.0, seed=3,
                                    extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert set(tokenizer.encode(out.choices[0].text, add_special_tokens=False)) <= set(allowed)
    r = httpx.post(server[0] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": "x", "logit_bias": {"abc": 1}})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"]
