"""The OpenAI-compatible HTTP server (FastAPI) over ``AsyncLLM``.

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or
not), Anthropic's ``/v1/messages`` (``serving.anthropic``), ``/v1/models`` and
``/v1/models/{id}``, vLLM's ``/tokenize``, ``/detokenize`` (``serving.tokens``) and
``/version``, ``/health`` and Prometheus' ``/metrics`` (``serving.metrics``). A V4 / V4.1
checkpoint's chat routes are ``serving.deepseek``'s instead: DeepSeek's protocol through
deepseek-recipe. With an API key every route but ``/health`` (``/openapi.json`` included)
wants ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (401 otherwise). Malformed JSON,
unknown values, limits exceeded and requests the engine refuses (streamed or not) are 4xx
answers with OpenAI's error body (Anthropic's on ``/v1/messages``) naming the problem; never a
500. A client that disconnects cancels its request (its blocks are freed at once). Every
non-streamed response carries usage (prompt, completion and cached prompt tokens); a stream
ends with a usage chunk only when ``stream_options.include_usage`` asks for it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import socket
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from deepinfer_core import __version__
from deepinfer_core.engine.output import RequestOutput
from deepinfer_core.chat import chat_prompt
from deepinfer_core.recipe import recipe_for
from deepinfer_core.sampling.sampler import most_likely
from deepinfer_core.serving.async_llm import AsyncLLM
from deepinfer_core.serving.common import (BadRequest, Deltas, check_model, encode, error_body, fit_context, merged,
                                          run_all, sampling_params_of, sse, validation_message)
from deepinfer_core.serving.drivers import Unavailable
from deepinfer_core.serving.echo import Echo
from deepinfer_core.serving.metrics import ServerMetrics
from deepinfer_core.serving import tokens
from deepinfer_core.serving.protocol import ChatMessage, ChatRequest, CompletionRequest, Limits

log = logging.getLogger("deepinfer")


ANTHROPIC_PATHS = ("/v1/messages",)  # errors there have Anthropic's body
def _error(request: Request, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    """The error answer, with OpenAI's body or, on ANTHROPIC_PATHS, Anthropic's."""
    anthropic = request.url.path.startswith(ANTHROPIC_PATHS)
    return JSONResponse(error_body(status, message, kind, param, anthropic), status_code=status)


def _authorized(request: Request, api_key: str) -> bool:
    bearer = request.headers.get("authorization", "")
    given = (request.headers.get("x-api-key"), bearer[7:] if bearer.startswith("Bearer ") else None)
    return any(g is not None and secrets.compare_digest(g.encode(), api_key.encode()) for g in given)


class _Guard:
    """API key and body size, checked before a route runs. A plain ASGI middleware: FastAPI's
    ``@app.middleware`` wraps ``receive`` so that a route no longer sees its client disconnect."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            request = Request(scope)
            refusal = None
            if request.url.path != "/health" and self.api_key is not None and not _authorized(request, self.api_key):
                refusal = _error(request, 401, "missing or wrong API key (send Authorization: Bearer KEY or x-api-key: KEY)",
                                 "authentication_error")
            size = request.headers.get("content-length")
            if refusal is None and size is not None and (not size.isdigit() or int(size) > self.max_body_bytes):
                refusal = _error(request, 413, f"request body larger than {self.max_body_bytes} bytes")
            if refusal is not None:
                return await refusal(scope, receive, send)
            if size is None:  # a chunked body: counted as it arrives
                receive = self._capped(receive)
        await self.app(scope, receive, send)

    def _capped(self, receive):
        """``receive`` that refuses (413, through the app's HTTPException handler) a body that
        grows past the limit."""
        received = 0

        async def capped():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise HTTPException(413, f"request body larger than {self.max_body_bytes} bytes")
            return message

        return capped


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", timeout_s: float = 30.0):
    """Run ``app`` with uvicorn on ``host`` (a free port) in a daemon thread; yields its base URL
    and stops the server on exit (tests, benchmarks)."""
    import uvicorn

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + timeout_s
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def build_app(engine: AsyncLLM, model_name: str, api_key: str | None = None, limits: Limits | None = None) -> FastAPI:
    limits = limits or Limits()
    app = FastAPI(title="DeepInfer", docs_url=None, redoc_url=None)
    created = int(time.time())

    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        message, param = validation_message(e)
        return _error(request, 400, message, param=param)

    @app.exception_handler(BadRequest)
    async def bad(request, e: BadRequest):
        return _error(request, e.status, e.message, e.kind, e.param)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        if e.status_code in (404, 405):  # Starlette's routing: say which route was asked for
            what = "is not a route of this server" if e.status_code == 404 else "is not allowed on this route"
            return _error(request, e.status_code, f"{request.method} {request.url.path} {what} (see docs/serving.md)",
                          "not_found_error" if e.status_code == 404 else "invalid_request_error")
        return _error(request, e.status_code, str(e.detail))

    @app.exception_handler(Unavailable)
    async def unavailable(request, e: Unavailable):  # a data-parallel rank died: nothing can run any more
        return _error(request, 503, str(e), "server_error")

    @app.exception_handler(Exception)
    async def unexpected(request, e: Exception):  # a bug of ours: logged, reported as such, the server goes on
        log.exception("request failed")
        return _error(request, 500, f"internal error: {type(e).__name__}: {e}", "server_error")

    @app.get("/health")
    async def health():
        why = engine.unavailable()  # a data-parallel group is checked for ranks that died, not only failed steps
        if why:
            return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)
        return {"status": "ok"}

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "deepinfer",
            "max_model_len": engine.engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise BadRequest(f"the model {model_id!r} does not exist here; this server serves {model_name!r} (GET /v1/models)",
                             "model", 404, "not_found_error")
        return card

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model, model_name)
        params = sampling_params_of(body, limits, body.logprobs)
        so_field = body.structured()[1]
        given = body.prompts()
        prompts = [encode(engine, p) for p in given]
        if body.kv_transfer_params is not None and len(prompts) > 1:
            raise BadRequest(f"kv_transfer_params go with one prompt, and this request has {len(prompts)}; send one prompt "
                             "per request to a prefill/decode pair", "kv_transfer_params")
        fit_context(params, [len(p) for p in prompts], engine.engine.max_model_len, body.max_tokens is not None, "prompt")
        echo = Echo(engine.tokenizer, given, prompts, body.echo, body.scores_only, params.skip_special_tokens)
        prompts = [{"prompt_token_ids": p} for p in prompts]  # tokenized once
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return await sse(_stream_completion(engine, rid, model_name, prompts, params, *body.usage_chunks, so_field=so_field,
                                                echo=echo))
        outs = [echo.output(o) for o in await run_all(engine, rid, prompts, params, request, so_field)]
        choices = [_completion_choice(p * params.n + c.index, echo.choice(p, out, c), params.logprobs is not None, echo)[0]
                   for p, out in enumerate(outs) for c in out.outputs]
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": _usage(outs), **_kv_transfer(outs)}

    recipe = recipe_for(engine.llm.model_dir, engine.engine.generation, model_name)
    if recipe is not None:  # V4 / V4.1: DeepSeek's chat protocol, through deepseek-recipe
        from deepinfer_core.serving import deepseek

        deepseek.register(app, engine, recipe, model_name, limits)  # /v1/chat/completions, /v1/messages(/count_tokens)
    else:
        _register_chat(app, engine, model_name, limits)
        from deepinfer_core.serving.anthropic import register

        register(app, engine, model_name, limits)  # /v1/messages
    tokens.register(app, engine, model_name, recipe, lambda messages: _chat_prompt(engine, messages))  # /tokenize, /detokenize

    metrics = ServerMetrics(engine.driver.gauges)
    engine.listeners.append(metrics.observe)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _register_chat(app: FastAPI, engine: AsyncLLM, model_name: str, limits: Limits) -> None:
    """/v1/chat/completions of a V2/V3 checkpoint: the tokenizer's chat template."""

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        check_model(body.model, model_name)
        params = sampling_params_of(body, limits, (body.top_logprobs or 0) if body.logprobs else None)
        so_field = body.structured()[1]
        prompt = _chat_prompt(engine, body.messages)
        fit_context(params, [len(prompt)], engine.engine.max_model_len, body.max_tokens is not None, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return await sse(_stream_chat(engine, rid, model_name, prompt, params, *body.usage_chunks, so_field=so_field))
        (out,) = await run_all(engine, rid, [prompt], params, request, so_field)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason, "logprobs": _chat_logprobs(c, params.logprobs) if params.logprobs is not None else None}
                   for c in out.outputs]
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": _usage([out]), **_kv_transfer([out])}


# ---- requests -----------------------------------------------------------------------------------
def _chat_prompt(engine: AsyncLLM, messages: list[ChatMessage]) -> list[int]:
    try:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
        return chat_prompt(engine.tokenizer, messages)
    except ValueError as e:
        raise BadRequest(str(e), "messages") from None


def _usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _kv_transfer(outs: list[RequestOutput]) -> dict:
    """A prefill instance's answer for its decode instance, as vLLM's (``kv_transfer_params`` beside the choices)."""
    params = [o.kv_transfer_params for o in outs if o.kv_transfer_params is not None]
    return {"kv_transfer_params": params[0]} if params else {}


def _piece(token: int, logprob) -> str:
    """A token's text, from its Logprob (decoded by the engine; the id without a tokenizer)."""
    return logprob.decoded_token if getattr(logprob, "decoded_token", None) is not None else str(token)


def _completion_choice(index: int, c, logprobs: bool, echo: Echo, start: int = 0, offset: int = 0,
                       text: str | None = None) -> tuple[dict, int]:
    """(the choice of sample ``c`` from its token ``start`` on, the text offset after it)."""
    lp, end = _completion_logprobs(c, start, offset, echo) if logprobs else (None, offset)
    return {"index": index, "text": c.text if text is None else text, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason, "logprobs": lp}, end


def _completion_logprobs(c, start: int, offset: int, echo: Echo) -> tuple[dict, int]:
    """OpenAI's completion logprobs of the tokens from ``start`` on, and the text offset after
    them. ``text_offset``: where each token's text starts in the choice's text (the lengths of
    the tokens' texts before it, from ``offset``: the text a stream sent before; a special token
    the text skips, as an echoed prompt's BOS, adds nothing). A token without logprobs (an echoed
    prompt's first) has None for them, and ``echo.piece`` for its text."""
    ids, tops = c.token_ids[start:], (c.logprobs or [])[start:]
    tokens = [echo.piece(t) if top is None else _piece(t, top.get(t)) for t, top in zip(ids, tops)]
    widths = [echo.width(t, piece) for t, piece in zip(ids, tokens)]
    return {"tokens": tokens, "token_logprobs": [None if top is None else top.get(t) for t, top in zip(ids, tops)],
            "top_logprobs": [None if top is None else {_piece(k, v): v for k, v in top.items()} for top in tops],
            "text_offset": list(itertools.accumulate(widths[:-1], initial=offset)) if tokens else []}, offset + sum(widths)


def _chat_logprobs(c, top_n: int, start: int = 0) -> dict:
    """OpenAI's chat logprobs: per token its own, and the ``top_n`` most likely (by rank)."""

    def entry(token: int, logprob) -> dict:
        piece = _piece(token, logprob)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    content = []
    for t, top in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        content.append({**entry(t, top.get(t)), "top_logprobs": [entry(k, v) for k, v in most_likely(top, top_n)]})
    return {"content": content}


async def _stream_completion(engine: AsyncLLM, rid: str, model: str, prompts: list, params, usage: bool = False,
                             continuous: bool = False, so_field: str | None = None, *, echo: Echo):
    """Completion chunks; with ``usage`` (stream_options.include_usage) a last chunk with no
    choices and the usage, and with ``continuous`` the usage so far on every chunk. With
    ``echo`` each choice's first chunk starts with its prompt (and the prompt's logprobs)."""
    created = int(time.time())
    deltas, latest, offsets = Deltas(), {}, {}  # offsets: text_offset of each choice's next token
    extra = {"usage": None} if usage else {}
    async for p, out in merged(engine, rid, prompts, params, so_field):
        latest[p] = out = echo.output(out)
        if continuous:
            extra = {"usage": _usage([latest[q] for q in sorted(latest)])}
        for c in out.outputs:
            index = p * params.n + c.index
            c = echo.choice(p, out, c)
            delta, start = deltas.take(index, c)
            if not delta and c.finish_reason is None:
                continue
            choice, offsets[index] = _completion_choice(index, c, params.logprobs is not None, echo, start,
                                                        offsets.get(index, 0), delta)
            yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice], **extra}
    if usage:
        yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
               "usage": _usage([latest[p] for p in sorted(latest)])}


async def _stream_chat(engine: AsyncLLM, rid: str, model: str, prompt, params, usage: bool = False, continuous: bool = False,
                       so_field: str | None = None):
    """Chat chunks: the role first, then the deltas; ``usage`` and ``continuous`` as for completions."""
    created = int(time.time())
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    if usage:
        head["usage"] = None
    deltas, last = Deltas(), None
    async for _, out in merged(engine, rid, [prompt], params, so_field):
        if continuous:
            head["usage"] = _usage([out])
        if last is None:  # the request started (a refused one raised): the role goes first
            yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                                       for i in range(params.n)]}
        for c in out.outputs:
            delta, start = deltas.take(c.index, c)
            if not delta and c.finish_reason is None:
                continue
            yield {**head, "choices": [{"index": c.index, "delta": {"content": delta} if delta else {},
                                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                        "logprobs": _chat_logprobs(c, params.logprobs, start) if params.logprobs is not None else None}]}
        last = out
    if usage:
        yield {**head, "choices": [], "usage": _usage([last])}
