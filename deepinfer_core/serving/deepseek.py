"""The chat routes of a V4 / V4.1 checkpoint: ``/v1/chat/completions`` and ``/v1/messages``
answered as DeepSeek's API answers them, through deepseek-recipe (``deepinfer_core.recipe``).

The body goes to the library as it came (it reads OpenAI's and Anthropic's fields itself:
thinking, reasoning_effort, tools, tool_choice, response_format, stop); what it refuses is a 4xx
with its message. The prompt is DeepSeek's encoding; the generated tokens go through its stream
processor, which splits reasoning from content, parses tool calls, applies stop sequences and
counts usage (prompt, cached, completion, reasoning tokens). Streamed or not, the same chunks:
a non-streamed answer is the chunks accumulated. ``n`` is 1, as on DeepSeek's API.
``/v1/messages/count_tokens``: the length of the prompt the same body would get.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response

from deepinfer_core.recipe import ProtocolError, Recipe
from deepinfer_core.serving.async_llm import AsyncLLM
from deepinfer_core.serving.protocol import Limits
from deepinfer_core.serving.common import BadRequest, check_model, merged, sse, unless_disconnected


# vLLM's fields that DeepSeek's protocol does not read (the library would ignore them): a 400 naming them
_NOT_READ = {"guided_json": "response_format (json_schema or json_object)", "guided_regex": "response_format (regex)",
             "guided_choice": None, "guided_grammar": None, "structured_outputs": "response_format (json_schema, json_object, regex)",
             "guided_decoding_backend": None, "guided_whitespace_pattern": None, "use_beam_search": None}


def _refuse_unread(raw: bytes) -> None:
    """BadRequest for a body (already accepted by the library: a JSON object) that sets vLLM's
    fields DeepSeek's protocol has no place for, or ``best_of`` other than 1 (``n`` is 1)."""
    body = json.loads(raw)
    for name, instead in _NOT_READ.items():
        if body.get(name) not in (None, False):
            hint = f"use {instead} instead" if instead else "it has no equivalent here; leave it out"
            raise BadRequest(f"{name} is not read on this model's DeepSeek API; {hint}", name)
    if body.get("best_of") not in (None, 1):
        raise BadRequest(f"best_of={body['best_of']!r} is not supported: this API gives one answer (n = 1); leave it out", "best_of")


def register(app: FastAPI, engine: AsyncLLM, recipe: Recipe, model_name: str, limits: Limits) -> None:
    def converted(raw: bytes, anthropic: bool):
        """(the ConversationRequest, its prompt ids) of a body; BadRequest for what the protocol refuses."""
        try:
            req = recipe.request(raw, anthropic)
            _refuse_unread(raw)
            check_model(req.model, model_name)  # read before convert (which consumes the request)
            cr = recipe.convert(req)
            return cr, recipe.prompt(cr)
        except ProtocolError as e:
            raise BadRequest(str(e), status=e.status) from None

    async def answer(request: Request, anthropic: bool, prefix: str):
        raw = await request.body()
        cr, prompt = converted(raw, anthropic)
        try:
            params = recipe.sampling_params(cr, len(prompt), engine.engine.max_model_len, limits.max_tokens)
        except ProtocolError as e:
            raise BadRequest(str(e), status=e.status) from None
        kv = json.loads(raw).get("kv_transfer_params")  # prefill/decode disaggregation (vLLM's router): not DeepSeek's field
        if kv is not None and not isinstance(kv, dict):
            raise BadRequest("kv_transfer_params must be an object (as a prefill instance answers it)", "kv_transfer_params")
        params = params.model_copy(update={"kv_transfer_params": kv})
        rid = f"{prefix}{uuid.uuid4().hex}"
        ended = []  # the last output: a prefill instance's answer carries kv_transfer_params
        chunks = _chunks(engine, recipe.answer(cr, rid, model_name, engine.engine.output.eos_ids, anthropic), rid, prompt, params,
                         ended)
        if cr.stream:
            return await sse(_events(chunks), anthropic)
        response = recipe.response(rid, model_name, int(time.time()), anthropic)

        async def collect():
            async for chunk in chunks:
                response.accumulate(chunk)

        await unless_disconnected(collect(), request)
        if ended and ended[-1].kv_transfer_params is not None:
            return {**json.loads(response.to_json()), "kv_transfer_params": ended[-1].kv_transfer_params}
        return Response(response.to_json(), media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(request, False, "chatcmpl-")

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await answer(request, True, "msg_")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return {"input_tokens": len(converted(await request.body(), anthropic=True)[1])}


async def _chunks(engine: AsyncLLM, answer, rid: str, prompt: list[int], params, seen: list | None = None):
    """The answer's protocol chunks as generation goes (``seen`` gets each output). A stop
    sequence ends the answer early: leaving the loop ends the request (its blocks are freed)."""
    try:
        async for _, out in merged(engine, rid, [prompt], params):
            if seen is not None:
                seen[:] = [out]
            for chunk in answer.update(out):
                yield chunk
            if answer.finished:
                return
    finally:
        answer.close()


async def _events(chunks):
    async for chunk in chunks:
        yield json.loads(chunk.to_json())
