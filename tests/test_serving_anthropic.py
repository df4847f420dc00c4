"""Anthropic's Messages API (``/v1/messages``) on the server of ``tests/test_serving.py``, called
with the real ``anthropic`` client and raw HTTP: the answer streamed and not (the same text, the
same as chat's for the same conversation), stop_sequences, max_tokens, usage, a prefill, the
raw event sequence; x-api-key auth; bad input is a 4xx with Anthropic's error body."""

from __future__ import annotations

import json

import pytest

anthropic = pytest.importorskip("anthropic", reason="the anthropic client is a dev dependency (pip install -e .[dev])")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn", reason="fastapi and uvicorn are runtime dependencies")

from deepinfer_core.chat import chat_prompt  # noqa: E402
from tests.serving_server import KEY, MODEL, running_server  # noqa: E402

SYSTEM = "Answer in code."
ASK = [{"role": "user", "content": "sort a list"}]
GREEDY = {"model": MODEL, "system": SYSTEM, "messages": ASK, "max_tokens": 24, "temperature": 0}  # a raw body
# the client's keywords (recent clients have no temperature keyword: it travels as an extra field)
CALL = {**{k: v for k, v in GREEDY.items() if k != "temperature"}, "extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server[0], api_key=KEY, max_retries=0)


def _post(server, body, headers=None, **kw) -> httpx.Response:
    return httpx.post(server[0] + "/v1/messages", json=body, headers={"x-api-key": KEY} if headers is None else headers,
                      timeout=60, **kw)


def test_a_message_streamed_and_not_gives_the_same_text_as_chat(server, client):
    whole = client.messages.create(**CALL)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    with client.messages.stream(**CALL) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    # the system prompt leads the conversation through the chat template, as on chat's route
    chat = httpx.post(server[0] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"messages": [{"role": "system", "content": SYSTEM}, *ASK], "max_tokens": 24, "temperature": 0}).json()
    assert chat["choices"][0]["message"]["content"] == whole.content[0].text
    assert chat["usage"]["completion_tokens"] == whole.usage.output_tokens
    assert chat["usage"]["prompt_tokens"] == whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_usage_counts_the_prompt_once_cached_tokens_apart(server, client):
    prompt = chat_prompt(server[1].tokenizer, [{"role": "system", "content": SYSTEM}, *ASK])
    blocks = [{"type": "text", "text": "sort a "}, {"type": "text", "text": "list"}]  # as text blocks: the same prompt
    kw = {**CALL, "messages": [{"role": "user", "content": blocks}], "system": [{"type": "text", "text": SYSTEM}]}
    first, again = client.messages.create(**kw), client.messages.create(**kw)
    for out in (first, again):
        assert out.usage.input_tokens + out.usage.cache_read_input_tokens == len(prompt)
        assert out.usage.output_tokens == 24 or out.stop_reason == "end_turn"
    assert again.usage.cache_read_input_tokens > 0 and again.content[0].text == first.content[0].text


def test_stop_sequences_and_max_tokens(client):
    text = client.messages.create(**CALL).content[0].text
    stop = text.split()[2]
    out = client.messages.create(**CALL, stop_sequences=[stop, "never said"])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == text[: text.index(stop)]
    with client.messages.stream(**CALL, stop_sequences=[stop]) as stream:
        assert "".join(stream.text_stream) == out.content[0].text
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    short = client.messages.create(**{**CALL, "max_tokens": 3})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3 and text.startswith(short.content[0].text)


def test_a_last_assistant_message_is_a_prefill_the_answer_continues(server, client):
    prefill = "def sort_list("
    out = client.messages.create(**{**CALL, "messages": [*ASK, {"role": "assistant", "content": prefill}]})
    tokenizer = server[1].tokenizer
    ids = chat_prompt(tokenizer, [{"role": "system", "content": SYSTEM}, *ASK])
    ids += tokenizer(prefill, add_special_tokens=False)["input_ids"]
    raw = httpx.post(server[0] + "/v1/completions", headers={"x-api-key": KEY}, timeout=60,
                     json={"prompt": ids, "max_tokens": 24, "temperature": 0}).json()
    assert out.content[0].text == raw["choices"][0]["text"] and not out.content[0].text.startswith(prefill)
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        client.messages.create(**{**CALL, "messages": [*ASK, {"role": "assistant", "content": "def f( "}]})


def test_the_raw_event_sequence(server):
    events = []
    with httpx.stream("POST", server[0] + "/v1/messages", json={**GREEDY, "stream": True}, headers={"x-api-key": KEY,
                      "anthropic-version": "2023-06-01"}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name, line
                events.append(data)
                name = None
            else:
                assert line == "", line  # no [DONE]
    kinds = [e["type"] for e in events]
    deltas = kinds.count("content_block_delta")
    assert deltas > 0
    assert kinds == ["message_start", "content_block_start", "ping"] + ["content_block_delta"] * deltas + [
        "content_block_stop", "message_delta", "message_stop"]
    start, delta = events[0]["message"], events[-2]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] > 0
    assert events[1]["content_block"] == {"type": "text", "text": ""}
    assert all(e["index"] == 0 and e["delta"]["type"] == "text_delta" for e in events[3:-3])
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens") and delta["usage"]["output_tokens"] > 0


def test_auth_takes_x_api_key_or_bearer(server):
    url = server[0]
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = _post(server, GREEDY, headers)
        assert r.status_code == 401 and r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                                                  "message": r.json()["error"]["message"]}}
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(**CALL)
    bearer = anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0).messages.create(**{**CALL, "max_tokens": 2})
    assert bearer.usage.output_tokens > 0
    # the OpenAI routes take either header too, and keep OpenAI's error body
    assert httpx.get(url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    r = httpx.get(url + "/v1/models", headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error" and "param" in r.json()["error"]


@pytest.mark.parametrize("body, status, names", [
    (b"{not json", 400, ""),
    ({"model": MODEL, "messages": ASK}, 400, "max_tokens"),
    ({**GREEDY, "max_tokens": 0}, 400, "max_tokens"),
    ({**GREEDY, "max_tokens": 1000}, 400, "max_tokens"),
    ({**GREEDY, "temperature": 1.5}, 400, "temperature"),
    ({**GREEDY, "messages": []}, 400, "messages"),
    ({**GREEDY, "messages": [{"role": "system", "content": "x"}]}, 400, "role"),
    ({**GREEDY, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]}, 400, "'image'"),
    ({**GREEDY, "system": [{"type": "document", "source": {}}]}, 400, "'document'"),
    ({**GREEDY, "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, 400, "not supported"),
    ({**GREEDY, "kv_transfer_params": {"do_remote_decode": True}}, 400, "route a prefill/decode pair through /v1/completions"),
    ({**GREEDY, "model": "claude-sonnet-4"}, 404, "claude-sonnet-4"),
    ({**GREEDY, "max_tokens": True}, 400, "max_tokens: Input should be a valid integer"),
    ({**GREEDY, "stop_sequences": ["", "a"]}, 400, "stop_sequences cannot contain an empty string"),
    ({**GREEDY, "messages": [{"role": "user", "content": "x " * 5000}]}, 400, "max_model_len"),
    ({**GREEDY, "messages": [{"role": "user", "content": "x " * 5000}], "stream": True}, 400, "max_model_len"),
])
def test_bad_requests_are_4xx_with_anthropics_error_body(server, body, status, names):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server[0] + "/v1/messages", content=data, headers={"x-api-key": KEY, "Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == status, r.text
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind and set(r.json()["error"]) == {"type", "message"}
    assert names in r.json()["error"]["message"], r.json()
    assert _post(server, {**GREEDY, "max_tokens": 2}).status_code == 200  # the server goes on


def test_the_client_sees_bad_requests_and_big_bodies(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**{**CALL, "extra_body": {"temperature": 1.5}})
    assert e.value.status_code == 400 and e.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(server[0] + "/v1/messages", content=b"x" * (1 << 17), headers={"x-api-key": KEY})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_count_tokens_is_the_prompt_a_message_gets(server, client):
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    whole = client.messages.create(**CALL)
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 0
    r = httpx.post(server[0] + "/v1/messages/count_tokens", json={"model": "other", "messages": ASK}, headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["type"] == "error"
    r = httpx.post(server[0] + "/v1/messages/count_tokens", json={"model": MODEL, "messages": []}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(server[0] + "/v1/messages/count_tokens", json={"messages": ASK}).status_code == 401
