"""What the HTTP routes share (``server``: OpenAI's routes; ``anthropic``; ``deepseek``): the
error type a route raises and the bodies it becomes, sampling parameters from a request body,
running prompts to their final outputs or merging their streams (a client that disconnects
cancels its requests), and server-sent events."""

from __future__ import annotations

import asyncio
import json
import logging
import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from deepinfer_core.engine.output import GenerationError, KVTransferFailed, RequestOutput
from deepinfer_core.engine.requests import encode_prompt
from deepinfer_core.serving.async_llm import AsyncLLM
from deepinfer_core.serving.protocol import FieldError, Limits

log = logging.getLogger("deepinfer")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


ANTHROPIC_KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error"}


def error_body(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                anthropic: bool = False) -> dict:
    if anthropic:  # Anthropic's error type follows the status
        kind = "api_error" if status >= 500 else ANTHROPIC_KINDS.get(status, "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def validation_message(e: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of a request that did not validate: the first error, named by its field."""
    first = e.errors()[0]
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":  # FastAPI's: loc is ("body", character offset)
        return _json_error(getattr(e, "body", None), loc[-1] if loc else None, (first.get("ctx") or {}).get("error")), None
    if loc == ("body",) and first.get("type") in ("missing", "model_attributes_type", "dict_type", "model_type"):  # the body itself
        if first.get("type") == "missing":
            return "the request body is empty; send a JSON object (Content-Type: application/json)", None
        value = first.get("input")
        if isinstance(value, (bytes, bytearray)):  # not read as JSON: FastAPI reads JSON only when the Content-Type says so
            return "the request body was not read as JSON: send a JSON object with Content-Type: application/json", None
        return f"the request body must be a JSON object, got {_kind(value)}", None
    error = (first.get("ctx") or {}).get("error")
    if isinstance(error, FieldError):  # our own checks name their field
        return str(error), error.param
    param = ".".join(str(p) for p in loc if p != "body") or None
    if first.get("type") == "extra_forbidden":
        return f"{param} is not a field this server reads here; leave it out", param
    message = first["msg"].removeprefix("Value error, ")
    return (f"{param}: {message}" if param else message), param


def _json_error(doc, pos, why: str | None) -> str:
    """The message for a body that is not valid JSON: what the parser said and where."""
    where = ""
    if isinstance(pos, int):
        where = f" at character {pos}"
        if isinstance(doc, str):
            line, column = doc.count("\n", 0, pos) + 1, pos - doc.rfind("\n", 0, pos)  # as json.JSONDecodeError counts
            where = f" at line {line}, column {column} (character {pos})"
    return f"the request body is not valid JSON: {why or 'cannot be parsed'}{where}"


def _kind(value) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


def check_model(asked: str | None, served: str) -> None:
    if asked not in (None, "", served):
        raise BadRequest(f"model {asked!r} is not served here; this server serves {served!r} (GET /v1/models)", "model", 404,
                         "not_found_error")


def sampling_params_of(body, limits: Limits, logprobs: int | None):
    try:
        return body.sampling_params(limits, logprobs)
    except ValidationError as e:
        message, param = validation_message(e)
        raise BadRequest(message, param) from None
    except FieldError as e:
        raise BadRequest(str(e), e.param) from None
    except ValueError as e:
        raise BadRequest(str(e)) from None


def fit_context(params, prompt_lengths: list[int], max_model_len: int, asked: bool, what: str) -> None:
    """Check the request's prompts and max_tokens against the context, as vLLM and OpenAI do: a
    ``max_tokens`` the client ``asked`` for must fit after its longest prompt (else a 400
    naming both), and the server's default is lowered to what is left."""
    longest = max(prompt_lengths)
    room = max_model_len - longest
    if asked or room < 1:
        if longest + params.max_tokens > max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {max_model_len} tokens (max_model_len). However, you requested "
                f"{longest + params.max_tokens} tokens ({longest} in the {what}, {params.max_tokens} in the completion). "
                f"Please reduce the length of the {what} or max_tokens.", what)
        return
    if params.max_tokens > room:
        try:
            params.max_tokens = room
        except ValidationError:  # min_tokens above what is left
            raise BadRequest(f"min_tokens={params.min_tokens} does not fit: the {what} ({longest} tokens) leaves room for "
                             f"{room} of this model's maximum context length, {max_model_len} tokens (max_model_len)",
                             "min_tokens") from None


def encode(engine: AsyncLLM, prompt) -> list[int]:
    """A prompt's token ids (a string through the tokenizer, as the engine encodes it); 400 for a bad one."""
    try:
        return encode_prompt(engine.engine, prompt)[1]
    except ValueError as e:
        raise BadRequest(str(e), "prompt") from None


# the engine's refusal of a constraint: "prompt: so_args['json'] is not a valid JSON schema: ..."
_SO_REFUSAL = re.compile(r"^(?:\w+: )?so_args\[[^\]]*\]")


async def start_request(engine: AsyncLLM, prompt, params, request_id: str, so_field: str | None = None):
    """The request's output stream, started (a refused request raises here, as a 400).
    ``so_field``: the request field its structured-output constraint came from, which a
    refused constraint names (the engine names its own ``so_args``)."""
    gen = engine.generate(prompt, params, request_id)
    try:
        first = await gen.__anext__()
    except (ValueError, TypeError) as e:
        message = str(e)
        if so_field is not None and _SO_REFUSAL.match(message):
            raise BadRequest(_SO_REFUSAL.sub(so_field, message), so_field) from None
        raise BadRequest(message, "prompt") from None
    return first, gen


DISCONNECT_POLL_S = 0.5  # how often a non-streamed request looks whether its client is still there


async def run_all(engine: AsyncLLM, rid: str, prompts: list, params, request: Request | None = None,
                  so_field: str | None = None) -> list[RequestOutput]:
    """Every prompt's final output. A client that disconnects (``request``) cancels them: each
    request is aborted and its blocks freed."""

    async def one(i: int, prompt) -> RequestOutput:
        last, gen = await start_request(engine, prompt, params, f"{rid}-{i}", so_field)
        async for out in gen:
            last = out
        return last

    tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
    try:
        return list(await unless_disconnected(asyncio.gather(*tasks), request))
    finally:
        for t in tasks:
            t.cancel()


async def unless_disconnected(work, request: Request | None):
    """``work``'s result; BadRequest 499 (and ``work`` cancelled) if the client disconnects first,
    500 if generation failed."""
    task = asyncio.ensure_future(work)
    try:
        while request is not None and not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                raise BadRequest("the client disconnected", status=499)
        return await task
    except GenerationError as e:
        raise _failed(e) from None
    finally:
        task.cancel()
        task.add_done_callback(_retrieved)


def _failed(e: GenerationError) -> BadRequest:
    """The answer to a request the engine could not finish: 502 when its KV cache did not come
    from its prefill instance (that instance failed, not this one), else 500."""
    if isinstance(e, KVTransferFailed):
        return BadRequest(str(e), status=502, kind="server_error")
    return BadRequest(f"generation failed: {e}", status=500, kind="server_error")


def _retrieved(future: asyncio.Future) -> None:
    """Read a cancelled future's outcome: a gather cancelled mid-way holds a CancelledError as
    its exception, which nobody else reads (asyncio would log it, with a traceback, as "never
    retrieved" when the future is collected)."""
    if not future.cancelled():
        future.exception()


# ---- streaming ----------------------------------------------------------------------------------
async def sse(events, anthropic: bool = False) -> StreamingResponse:
    """``events`` (dicts) as server-sent events, OpenAI's (``data:`` lines, then ``[DONE]``) or
    Anthropic's (each named by its ``type``). The first event is awaited before the 200 goes out:
    every stream starts its requests before its first event, so a refused one is a 4xx."""

    def line(event: dict) -> str:
        return (f"event: {event['type']}\n" if anthropic else "") + f"data: {json.dumps(event)}\n\n"

    try:
        first = await anext(events)
    except GenerationError as e:
        raise _failed(e) from None

    async def body():
        try:
            yield line(first)
            async for event in events:
                yield line(event)
        except Exception as e:  # after the 200 went out: the error travels as an event
            log.exception("streamed request failed")
            yield line(error_body(500, f"{type(e).__name__}: {e}", "server_error", anthropic=anthropic))
        if not anthropic:
            yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def merged(engine: AsyncLLM, rid: str, prompts: list, params, so_field: str | None = None):
    """(prompt index, output) as any prompt's output changes; the first of each is started before
    anything is sent, so a refused prompt is a 400, not a broken stream."""
    started = []
    try:
        for i, p in enumerate(prompts):
            started.append(await start_request(engine, p, params, f"{rid}-{i}", so_field))
    except BaseException:
        for _, gen in started:
            await gen.aclose()
        raise
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, first, gen):
        try:
            await queue.put((i, first))
            async for out in gen:
                await queue.put((i, out))
        except BaseException as e:
            await queue.put((i, e))
            raise
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, first, gen)) for i, (first, gen) in enumerate(started)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:  # the client left, or a sample failed: stop every pump (each aborts its request) and wait for them
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Deltas:
    """What each sample has not been sent yet: text and tokens."""

    def __init__(self):
        self.text: dict[int, str] = {}
        self.tokens: dict[int, int] = {}

    def take(self, key: int, c) -> tuple[str, int]:
        sent = self.text.get(key, "")
        if not c.text.startswith(sent):  # cannot happen with the held-back text; never resend
            log.warning("streamed text of sample %d is not a prefix of its final text", key)
            delta = ""
        else:
            delta = c.text[len(sent):]
        self.text[key] = sent + delta
        start = self.tokens.get(key, 0)
        self.tokens[key] = len(c.token_ids)
        return delta, start
