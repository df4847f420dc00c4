"""DeepSeek's chat protocol on a V4 checkpoint (deepseek-recipe), on a tiny random V4 whose
tokenizer carries DeepSeek's special tokens: the prompt the server builds is exactly
``DeepseekV4Encoding.encode``'s (chat and Anthropic bodies; V4.1's encoding for a V4.1
checkpoint); streamed and non-streamed answers agree; usage counts what ran; what the library
refuses is a 4xx with its message; scripted outputs come back split into reasoning, content and
tool calls, with stop sequences and EOS handled as DeepSeek's API does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

dr = pytest.importorskip("deepseek_recipe", reason="deepseek-recipe is a runtime dependency (pip install -e .)")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai", reason="the openai client is a dev dependency (pip install -e .[dev])")
uvicorn = pytest.importorskip("uvicorn", reason="fastapi and uvicorn are runtime dependencies")

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.api import CompletionOutput, RequestOutput  # noqa: E402
from deepinfer_core.config import ConfigError  # noqa: E402
from deepinfer_core.recipe import Recipe  # noqa: E402
from deepinfer_core.serving.async_llm import AsyncLLM  # noqa: E402
from deepinfer_core.serving.protocol import Limits  # noqa: E402
from deepinfer_core.serving.server import build_app, serve_in_thread  # noqa: E402
from tests.hf_checkpoints_v4 import write_chat_checkpoint_v4, write_chat_tokenizer  # noqa: E402

NAME = "deepseek-v4-tiny"
KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
BODIES = {  # chat bodies whose prompts must be the encoding's
    "plain": {"messages": [{"role": "user", "content": "hello"}]},
    "no-thinking": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                    "thinking": {"type": "disabled"}},
    "tools-history": {"messages": HISTORY, "tools": TOOLS, "reasoning_effort": "max"},
    "json-schema": {"messages": [{"role": "user", "content": "a json answer"}], "thinking": {"type": "disabled"},
                    "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
                        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_chat_checkpoint_v4(tmp_path_factory.mktemp("v4chat"))


@pytest.fixture(scope="module")
def server(checkpoint):
    """(base URL, AsyncLLM, the prompts the engine was given)."""
    llm = LLM(model=str(checkpoint), accelerator="cpu", dtype="float32", progress=False, max_num_seqs=4)
    engine = AsyncLLM(llm)
    prompts = []
    add = engine.engine.add_request

    def recording_add(prompt, params, **kw):
        prompts.append(list(prompt))
        return add(prompt, params, **kw)

    engine.engine.add_request = recording_add
    try:
        with serve_in_thread(build_app(engine, NAME, KEY, Limits(max_tokens=32))) as url:
            yield url, engine, prompts
    finally:
        engine.shutdown()


def _encoding(checkpoint: Path, v41: bool = False):
    enc = dr.DeepseekV41Encoding() if v41 else dr.DeepseekV4Encoding()
    return enc.with_tokenizer(dr.Tokenizer.from_file(str(checkpoint / "tokenizer.json")))


def _expected(checkpoint: Path, body: dict, anthropic: bool = False) -> list[int]:
    """The encoding's prompt for ``body`` under DeepSeek's own model name, computed here with the library alone."""
    request = (dr.MessagesRequest if anthropic else dr.ChatCompletionRequest)({**body, "model": "DeepSeek-V4-Pro"})
    return list(_encoding(checkpoint).encode(request.convert(dr.ConversionOptions()).conversation))


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server[0] + path, json=body, headers=AUTH, timeout=120, **kw)


@pytest.mark.parametrize("case", sorted(BODIES))
def test_the_chat_prompt_is_deepseeks_encoding(server, checkpoint, case):
    before = len(server[2])
    r = _post(server, "/v1/chat/completions", {**BODIES[case], "model": NAME, "max_tokens": 3})
    assert r.status_code == 200, r.text
    (prompt,) = server[2][before:]
    assert prompt == _expected(checkpoint, BODIES[case])
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)


def test_tokenize_lays_messages_out_as_the_chat_route(server, checkpoint):
    for case in ("plain", "tools-history"):
        body = BODIES[case]
        got = _post(server, "/tokenize", {"model": NAME, "messages": body["messages"], **({"tools": body["tools"]} if "tools" in body else {})})
        assert got.status_code == 200 and got.json()["tokens"] == _expected(checkpoint, {"messages": body["messages"],
                                                                                       **({"tools": body["tools"]} if "tools" in body else {})})
    off = _post(server, "/tokenize", {"messages": BODIES["no-thinking"]["messages"], "chat_template_kwargs": {"thinking": False}})
    assert off.json()["tokens"] == _expected(checkpoint, BODIES["no-thinking"])
    r = _post(server, "/tokenize", {"messages": BODIES["plain"]["messages"], "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    r = _post(server, "/tokenize", {"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and "wizard" in r.json()["error"]["message"]


def test_the_messages_prompt_is_deepseeks_encoding(server, checkpoint):
    body = {"system": "You are terse.", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "thinking": {"type": "disabled"}}
    before = len(server[2])
    r = _post(server, "/v1/messages", {**body, "model": NAME})
    assert r.status_code == 200, r.text
    (prompt,) = server[2][before:]
    assert prompt == _expected(checkpoint, body, anthropic=True)
    got = r.json()
    assert got["type"] == "message" and got["model"] == NAME and got["stop_reason"] == "max_tokens"
    assert got["usage"]["output_tokens"] == 3 and got["usage"]["input_tokens"] + got["usage"]["cache_read_input_tokens"] == len(prompt)


@pytest.mark.parametrize("thinking", ["enabled", "disabled"])
def test_streamed_and_non_streamed_answers_agree(server, thinking):
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)
    call = dict(model=NAME, messages=[{"role": "user", "content": "tell me"}], max_tokens=12, seed=7,
                extra_body={"thinking": {"type": thinking}})
    whole = client.chat.completions.create(**call)
    message = whole.choices[0].message
    reasoning = getattr(message, "reasoning_content", None) or ""
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    assert (reasoning if thinking == "enabled" else message.content)  # a random model rarely ends its thinking
    parts, texts, usage = {"reasoning": "", "content": ""}, None, None
    for chunk in client.chat.completions.create(**call, stream=True):
        assert chunk.choices  # DeepSeek's API puts the usage on the last chunk with choices: no empty-choices chunk
        if chunk.choices:
            delta = chunk.choices[0].delta
            parts["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            parts["content"] += delta.content or ""
            texts = chunk.choices[0].finish_reason or texts
        usage = chunk.usage or usage
    assert parts == {"reasoning": reasoning, "content": message.content or ""}
    assert texts == "length" and usage.completion_tokens == 12 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_stop_sequence_ends_generation_early(server):
    import time

    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 32, "stop": ["e"],
            "thinking": {"type": "disabled"}, "seed": 1, "temperature": 1.0}
    got = _post(server, "/v1/chat/completions", body).json()
    choice = got["choices"][0]
    assert choice["finish_reason"] == "stop" and "e" not in choice["message"]["content"]
    assert got["usage"]["completion_tokens"] < 32  # the request ended with the content, not at max_tokens
    deadline = time.time() + 10
    while server[1].num_unfinished() and time.time() < deadline:
        time.sleep(0.05)
    assert server[1].num_unfinished() == 0 and not server[1].engine.has_unfinished()


def test_usage_counts_cached_prompt_tokens(server):
    body = {"model": NAME, "messages": [{"role": "user", "content": "the same question " * 20}], "max_tokens": 2}
    first, second = (_post(server, "/v1/chat/completions", body).json()["usage"] for _ in range(2))
    assert first["prompt_tokens"] == second["prompt_tokens"]
    assert second["prompt_tokens_details"]["cached_tokens"] == second["prompt_cache_hit_tokens"] > 0
    assert second["prompt_cache_hit_tokens"] + second["prompt_cache_miss_tokens"] == second["prompt_tokens"]


@pytest.mark.parametrize("body, status, message", [
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400, "temperature"),
    ({"messages": []}, 400, "Empty input messages"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n = 1"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 33}, 400, "more than this server allows"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "wizard"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404, "not served here"),
    ({"messages": [{"role": "user", "content": "x"}], "guided_json": {"type": "object"}}, 400, "guided_json is not read"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "a"}}, 400, "use response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "best_of": 2}, 400, "best_of=2"),
])
def test_what_the_protocol_refuses_is_a_4xx_naming_it(server, body, status, message):
    r = _post(server, "/v1/chat/completions", {"model": NAME, **body})
    assert r.status_code == status and message in r.json()["error"]["message"], r.text
    r = httpx.post(server[0] + "/v1/chat/completions", content=b"{not json", headers=AUTH, timeout=30)
    assert r.status_code == 400 and "error" in r.json()
    r = _post(server, "/v1/messages", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "temperature": 3})
    assert r.status_code == 400 and r.json()["type"] == "error" and "temperature" in r.json()["error"]["message"]
    assert _post(server, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 2}).status_code == 200  # still serving


def test_count_tokens_is_the_encodings_length(server, checkpoint):
    body = {"system": "Be brief.", "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]}
    r = _post(server, "/v1/messages/count_tokens", {**body, "model": NAME})
    assert r.status_code == 200 and r.json() == {"input_tokens": len(_expected(checkpoint, body, anthropic=True))}
    r = _post(server, "/v1/messages/count_tokens", {"model": NAME, "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_anthropic_events_stream_in_order(server):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/messages", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in names and "content_block_delta" in names


# ---- outputs -> chunks, scripted (a random model writes no tool calls) --------------------------------
def _recipe(checkpoint):
    return Recipe(checkpoint, "deepseek_v4", NAME)


def _run(recipe, body: dict, text: str, finish: str = "stop", step: int = 3):
    """The chunks (as dicts) of ``text`` generated for ``body``, handed over ``step`` tokens at a time."""
    cr = recipe.convert(recipe.request({"model": NAME, **body}))
    answer = recipe.answer(cr, "chatcmpl-1", NAME, eos_ids=[1])
    ids = recipe.tokenizer.encode(text) + ([1] if finish == "stop" else [])
    chunks = []
    for end in range(step, len(ids) + step, step):
        done = end >= len(ids)
        out = RequestOutput("r", None, [0] * 5, None, [CompletionOutput(0, "", ids[:end], None, None, finish if done else None)],
                            done, num_cached_tokens=2)
        chunks += [json.loads(c.to_json()) for c in answer.update(out)]
        if answer.finished:
            break
    return chunks, answer


def _joined(chunks, key):
    return "".join((c["choices"][0]["delta"].get(key) or "") for c in chunks if c["choices"])


def test_reasoning_content_and_a_tool_call_are_parsed(checkpoint):
    recipe = _recipe(checkpoint)
    call = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">'
            'Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    chunks, answer = _run(recipe, {"messages": HISTORY[:2], "tools": TOOLS}, f"Need the tool.</think>Checking.{call}")
    assert answer.finished
    assert _joined(chunks, "reasoning_content") == "Need the tool." and _joined(chunks, "content") == "Checking."
    calls = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(t["function"]["arguments"] for t in calls)) == {"city": "Paris"}
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    assert last["usage"]["prompt_tokens"] == 5 and last["usage"]["prompt_cache_hit_tokens"] == 2
    assert "<｜end▁of▁sentence｜>" not in _joined(chunks, "content")  # EOS ends the answer, it is not text


def test_a_stop_sequence_ends_the_content_not_the_reasoning(checkpoint):
    recipe = _recipe(checkpoint)
    chunks, answer = _run(recipe, {"messages": [{"role": "user", "content": "x"}], "stop": ["END"]},
                          "think END on</think>answer END never sent", finish=None, step=2)
    assert answer.finished  # the caller stops generating here, before the output ran out
    assert _joined(chunks, "reasoning_content") == "think END on" and _joined(chunks, "content") == "answer "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_the_end_of_sentence_token_ends_the_answer_and_is_not_text(checkpoint):
    chunks, answer = _run(_recipe(checkpoint), {"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "disabled"}},
                          "all done")
    assert answer.finished and _joined(chunks, "content") == "all done" and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == len(_recipe(checkpoint).tokenizer.encode("all done"))


def test_a_length_limit_is_length(checkpoint):
    chunks, _ = _run(_recipe(checkpoint), {"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "disabled"}},
                     "cut short", finish="length")
    assert _joined(chunks, "content") == "cut short" and chunks[-1]["choices"][0]["finish_reason"] == "length"


# ---- offline and start-up ---------------------------------------------------------------------------
def test_llm_chat_uses_deepseeks_encoding(checkpoint):
    llm = LLM(model=str(checkpoint), accelerator="cpu", progress=False)
    messages = [{"role": "user", "content": "hello"}]
    for thinking in (True, False):
        (out,) = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False, chat_template_kwargs={"thinking": thinking})
        body = {"messages": messages, "thinking": {"type": "enabled" if thinking else "disabled"}}
        assert out.prompt_token_ids == _expected(checkpoint, body)
        assert llm.get_tokenizer().decode(out.prompt_token_ids[-1:]) == ("<think>" if thinking else "</think>")
    with pytest.raises(ValueError, match="takes only 'thinking'"):
        llm.chat(messages, chat_template_kwargs={"enable_thinking": True})


def test_llm_chat_continues_a_final_message_and_refuses_what_deepseeks_encoding_cannot(checkpoint):
    """vLLM's continue_final_message is DeepSeek's prefix completion; the output's prompt is the
    rendered text; a Jinja chat_template, or no assistant turn at the end, is refused."""
    llm = LLM(model=str(checkpoint), accelerator="cpu", progress=False)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Sure, "}]
    (out,) = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False, add_generation_prompt=False,
                      continue_final_message=True, chat_template_kwargs={"thinking": False})
    body = {"messages": [messages[0], {**messages[1], "prefix": True}], "thinking": {"type": "disabled"}}
    assert out.prompt_token_ids == _expected(checkpoint, body)
    request = dr.ChatCompletionRequest({**body, "model": "DeepSeek-V4-Pro"}).convert(dr.ConversionOptions())
    assert out.prompt == _encoding(checkpoint).render_conversation(request.conversation).prompt
    assert out.prompt.endswith("</think>Sure, ")
    (plain,) = llm.chat(messages[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert plain.prompt.endswith("<｜User｜>hello<｜Assistant｜><think>")
    with pytest.raises(ValueError, match="not by a Jinja template; drop chat_template"):
        llm.chat(messages[:1], chat_template="{{ messages }}")
    with pytest.raises(ValueError, match="always ends with the assistant's turn"):
        llm.chat(messages[:1], add_generation_prompt=False)
    with pytest.raises(ValueError, match="conversation 0: continue_final_message=True: the conversation must end with an assistant"):
        llm.chat(messages[:1], add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="pass add_generation_prompt=False to continue it"):
        llm.chat(messages, continue_final_message=True)


def test_a_v41_checkpoint_gets_v41s_encoding(tmp_path):
    write_chat_tokenizer(tmp_path)
    recipe = Recipe(tmp_path, "deepseek_v41")
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    request = dr.ChatCompletionRequest({"model": "DeepSeek-V4.1-Flash", "messages": messages})
    assert recipe.chat_prompt(messages) == list(_encoding(tmp_path, v41=True).encode(
        request.convert(dr.ConversionOptions()).conversation))
    assert recipe.chat_prompt(messages) != list(_encoding(tmp_path).encode(
        dr.ChatCompletionRequest({"model": "DeepSeek-V4-Pro", "messages": messages}).convert(dr.ConversionOptions()).conversation))


def test_a_tokenizer_without_deepseeks_tokens_fails_at_start_up():
    plain = Path(__file__).parent.parent / "deepinfer_core" / "conformance" / "tokenizer"
    with pytest.raises(ConfigError, match="cannot encode DeepSeek's chat format.*not in the added vocabulary"):
        Recipe(plain, "deepseek_v4")


def test_a_prefill_decode_pair_answers_deepseeks_chat_as_one_server(server, checkpoint):
    """V4's chat route through two instances, the router's two hops by hand: the prefill's answer
    carries kv_transfer_params, the decode's continues from the prompt's KV (NIXL, CPU) to one
    server's greedy answer."""
    url, _, _ = server
    body = {"model": NAME, "messages": [{"role": "user", "content": "hello there"}], "thinking": {"type": "disabled"},
            "max_tokens": 12, "temperature": 0}
    want = httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert want.status_code == 200, want.text
    engines = [AsyncLLM(LLM(model=str(checkpoint), accelerator="cpu", dtype="float32", progress=False, max_num_seqs=4, kv_role=role))
               for role in ("prefill", "decode")]
    try:
        with serve_in_thread(build_app(engines[0], NAME, KEY, Limits(max_tokens=32))) as prefill, \
                serve_in_thread(build_app(engines[1], NAME, KEY, Limits(max_tokens=32))) as decode:
            first = httpx.post(f"{prefill}/v1/chat/completions", headers=AUTH, timeout=60,
                               json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
            assert first.status_code == 200, first.text
            params = first.json()["kv_transfer_params"]
            assert params["do_remote_prefill"] and params["remote_num_tokens"] > 0
            got = httpx.post(f"{decode}/v1/chat/completions", json={**body, "kv_transfer_params": params}, headers=AUTH, timeout=60)
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]
            assert "kv_transfer_params" not in got.json()
            bad = httpx.post(f"{decode}/v1/chat/completions", json={**body, "kv_transfer_params": "x"}, headers=AUTH, timeout=60)
            assert bad.status_code == 400 and "kv_transfer_params must be an object" in bad.json()["error"]["message"]
    finally:
        for e in engines:
            e.shutdown()
