"""Anthropic's Messages API, ``POST /v1/messages``, on the same server (text only).

The system prompt and the messages go through the tokenizer's chat template, as chat's do; a
last assistant message is a prefill that the answer continues (not repeated in the answer).
``stop_reason``: "end_turn" (EOS or a stop token), "max_tokens" (max_tokens, or the model's
context full), "stop_sequence" (``stop_sequence`` names it). ``usage.input_tokens`` counts the
prompt tokens not read from the prefix cache, as Anthropic's does; ``cache_read_input_tokens``
the others. Streamed, it sends Anthropic's named events: message_start, content_block_start,
ping, content_block_delta (text_delta)..., content_block_stop, message_delta, message_stop.
Errors, before or during a stream, carry Anthropic's body (``server.ANTHROPIC_PATHS``).
``POST /v1/messages/count_tokens`` answers ``{"input_tokens": N}``: the prompt's length.
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI, Request

from deepinfer_core.chat import chat_prompt
from deepinfer_core.serving.async_llm import AsyncLLM
from deepinfer_core.serving.protocol import CountTokensRequest, Limits, MessagesRequest
from deepinfer_core.serving.common import (BadRequest, Deltas, check_model, fit_context, merged, run_all, sampling_params_of,
                                          sse)

_NO_STOP = {"stop_reason": None, "stop_sequence": None}


def register(app: FastAPI, engine: AsyncLLM, model_name: str, limits: Limits) -> None:
    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        check_model(body.model, model_name)
        params = sampling_params_of(body, limits, None)
        prompt = _prompt(engine, body)
        fit_context(params, [len(prompt)], engine.engine.max_model_len, True, "messages")
        mid = f"msg_{uuid.uuid4().hex}"
        if body.stream:
            return await sse(_stream(engine, mid, model_name, prompt, params), anthropic=True)
        (out,) = await run_all(engine, mid, [prompt], params, request)
        return _message(mid, model_name, [{"type": "text", "text": out.outputs[0].text}], _stop(out.outputs[0]), _usage(out))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        check_model(body.model, model_name)
        return {"input_tokens": len(_prompt(engine, body))}


def _prompt(engine: AsyncLLM, body: MessagesRequest) -> list[int]:
    try:
        messages = body.conversation()
        prefill = messages.pop()["content"] if messages[-1]["role"] == "assistant" else ""
        if prefill != prefill.rstrip():
            raise ValueError("final assistant content cannot end with trailing whitespace")
        ids = chat_prompt(engine.tokenizer, messages)
    except ValueError as e:
        raise BadRequest(str(e), "messages") from None
    return ids + (engine.tokenizer(prefill, add_special_tokens=False)["input_ids"] if prefill else [])


def _message(mid: str, model: str, content: list, stop: dict, usage: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content, **stop, "usage": usage}


def _stop(c) -> dict:
    sequence = c.stop_reason if isinstance(c.stop_reason, str) else None
    reason = "max_tokens" if c.finish_reason == "length" else "stop_sequence" if sequence is not None else "end_turn"
    return {"stop_reason": reason, "stop_sequence": sequence}


def _usage(out) -> dict:
    cached = out.num_cached_tokens or 0
    return {"input_tokens": len(out.prompt_token_ids) - cached, "output_tokens": len(out.outputs[0].token_ids),
            "cache_read_input_tokens": cached}


async def _stream(engine: AsyncLLM, mid: str, model: str, prompt: list[int], params):
    deltas, last = Deltas(), None
    async for _, out in merged(engine, mid, [prompt], params):
        if last is None:  # the request started (a refused one raised)
            yield {"type": "message_start", "message": _message(mid, model, [], _NO_STOP, _usage(out))}
            yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
            yield {"type": "ping"}
        delta, _ = deltas.take(0, out.outputs[0])
        if delta:
            yield {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": delta}}
        last = out
    yield {"type": "content_block_stop", "index": 0}
    yield {"type": "message_delta", "delta": _stop(last.outputs[0]), "usage": {"output_tokens": len(last.outputs[0].token_ids)}}
    yield {"type": "message_stop"}
