"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` on the same server (behind the API key like
the other routes).

``/tokenize`` takes a ``prompt`` (encoded as ``/v1/completions`` encodes it, with the
tokenizer's special tokens unless ``add_special_tokens`` is false) or chat ``messages`` (laid
out as ``/v1/chat/completions`` lays them out: the tokenizer's chat template, or DeepSeek's
encoding on a V4 / V4.1 checkpoint) and answers ``{"count", "max_model_len", "tokens",
"token_strs"}`` (``token_strs`` with ``return_token_strs``). ``/detokenize`` takes ``tokens`` and
answers ``{"prompt": text}``.
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import ValidationError

from deepinfer_core.serving.async_llm import AsyncLLM
from deepinfer_core.serving.common import BadRequest, check_model, validation_message
from deepinfer_core.serving.protocol import (
    ChatMessage,
    DetokenizeRequest,
    TokenizeRequest,
)


def register(app: FastAPI, engine: AsyncLLM, model_name: str, recipe, chat_prompt) -> None:
    """``recipe``: the V4 / V4.1 checkpoint's (None for others); ``chat_prompt(messages)``: the
    chat route's prompt of a list of ``ChatMessage`` (V2/V3)."""

    def tokenizer():
        if engine.tokenizer is None:
            raise BadRequest("this model directory has no tokenizer files: the server cannot tokenize or detokenize text")
        return engine.tokenizer

    def chat_ids(body: TokenizeRequest) -> list[int]:
        if recipe is not None:
            kwargs = dict(body.chat_template_kwargs or {})
            thinking = kwargs.pop("thinking", None)
            if kwargs or not isinstance(thinking, (bool, type(None))):
                raise BadRequest("chat_template_kwargs takes only {\"thinking\": true|false} on this model", "chat_template_kwargs")
            try:
                return recipe.chat_prompt(body.messages, body.tools, thinking)
            except ValueError as e:  # the protocol refused the messages
                raise BadRequest(str(e), "messages") from None
        for name in ("tools", "chat_template_kwargs"):
            if getattr(body, name) is not None:
                raise BadRequest(f"{name} is not supported for this model (its chat route refuses them too); leave it out", name)
        try:
            messages = [ChatMessage.model_validate(m) for m in body.messages]
        except ValidationError as e:
            message, param = validation_message(e)
            raise BadRequest(f"messages: {message}", f"messages.{param}" if param else "messages") from None
        return chat_prompt(messages)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model, model_name)
        if body.messages is not None:
            ids = chat_ids(body)
        else:
            try:
                body.prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # the tokenizer would raise a TypeError that says nothing
                raise BadRequest(f"prompt is not valid Unicode text: {e.reason} at character {e.start} (lone surrogates "
                                 "cannot be tokenized)", "prompt") from None
            ids = list(tokenizer()(body.prompt, add_special_tokens=body.add_special_tokens is not False)["input_ids"])
        strs = tokenizer().convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model, model_name)
        vocab = engine.engine.model_config.vocab_size
        outside = [t for t in body.tokens if not 0 <= t < vocab]
        if outside:
            raise BadRequest(f"tokens holds ids outside the vocabulary [0, {vocab}): {outside[:5]}", "tokens")
        return {"prompt": tokenizer().decode(body.tokens)}
