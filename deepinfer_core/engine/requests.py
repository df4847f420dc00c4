"""What a request is (``Request``) and the checks it passes before anything is queued: its
prompt encoded (``encode_prompt``: text, token ids, vLLM's dict forms) and checked against the model and
the engine's limits (``check_request``), its bad words tokenised (``bad_words_token_ids``). Every refusal
is a ``RequestError`` naming what was wrong and how to fix it. ``self`` is the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.sampling.params import SamplingParams

PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt / TokensPrompt
# Samples of one request beyond max_num_seqs run in waves; this bounds the host memory a single
# request can claim (n=10**9 would build a billion sequences before any runs).
MAX_SAMPLES_PER_REQUEST = 4096


class RequestError(ValueError):
    """A request that cannot be served as given (too long, bad token ids, no tokenizer...)."""


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    # wall-clock times (time.time()): added; its first output token reached the host; it ended
    arrival_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None  # why the engine ended it (a failed KV transfer), beside finish_reason "abort"

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def encode_prompt(self, prompt: str | list[int] | dict, label: str = "prompt") -> tuple[str | None, list[int]]:
    """(text, token ids) of a prompt: a string, a list of token ids, or vLLM's dict forms
    ``{"prompt": text}`` and ``{"prompt_token_ids": ids}``."""
    if isinstance(prompt, dict):
        unknown = sorted(map(str, set(prompt) - set(PROMPT_KEYS)))
        if unknown or len(prompt) != 1:
            raise RequestError(
                f"{label} is a dict with keys {sorted(map(str, prompt))}; a dict prompt has exactly one of the keys "
                f"{' or '.join(map(repr, PROMPT_KEYS))}" + (f" (unknown: {unknown})" if unknown else "")
            )
        (key, prompt), = prompt.items()
        if key == "prompt" and not isinstance(prompt, str):
            raise RequestError(f"{label}: 'prompt' must be a string, got {type(prompt).__name__}")
        if key == "prompt_token_ids" and isinstance(prompt, str):
            raise RequestError(f"{label}: 'prompt_token_ids' must be a list of token ids, got a string")
    if isinstance(prompt, str):
        if self.tokenizer is None:
            raise RequestError(
                "this model directory has no tokenizer files, so text prompts cannot be encoded; pass token "
                "ids (a list of ints) instead, or add tokenizer.json / tokenizer_config.json to the directory"
            )
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(
                f"{label} is not valid Unicode text: {e.reason} {prompt[e.start:e.end]!r} at character {e.start} "
                f"(lone surrogates cannot be tokenised); fix the text or pass token ids"
            ) from None
        return prompt, list(self.tokenizer(prompt).input_ids)
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise RequestError(
            f"{label} must be a string, a list of token ids (ints) or a dict with 'prompt' or 'prompt_token_ids', "
            f"got {_describe(prompt)}"
        )
    return None, list(prompt)


def check_request(self, prompt_token_ids: list[int], params: SamplingParams, label: str = "prompt") -> None:
    """Raise RequestError if the request cannot run; nothing has been queued yet."""
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestError(f"{label} is empty; give at least one token")
    vocab = self.model_config.vocab_size
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"{label} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    image = getattr(self.model_config, "image_token_id", None)
    if image is not None and image in prompt_token_ids:
        raise RequestError(
            f"{label} holds the image token id {image}: image input is not supported by DeepInfer (the vision tower "
            "is not loaded); send text only"
        )
    if n >= self.max_model_len:
        raise RequestError(
            f"{label} is too long: {n} tokens, but max_model_len is {self.max_model_len} (the prompt plus at "
            f"least one generated token must fit); shorten it or raise max_model_len"
        )
    if params.stop and self.tokenizer is None:
        raise RequestError("stop strings need a tokenizer, and this model directory has none; use stop_token_ids")
    bad_stop = [t for t in params.stop_token_ids if t >= vocab]
    if bad_stop:
        raise RequestError(f"stop_token_ids {bad_stop} are outside the vocabulary [0, {vocab})")
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
        outside = [t for t in ids if t >= vocab]
        if outside:
            raise RequestError(f"{label}: {name} has token ids outside the vocabulary [0, {vocab}): {outside[:5]}")
    if params.bad_words and self.tokenizer is None:
        raise RequestError(f"{label}: bad_words need a tokenizer, and this model directory has none; use logit_bias "
                           "or allowed_token_ids with token ids")
    if params.logprobs is not None and params.logprobs > vocab or params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
        raise RequestError(f"logprobs / prompt_logprobs exceed the vocabulary size {vocab}")
    if params.so_args is not None:
        self.compile_grammar(params, label)
    if params.n > MAX_SAMPLES_PER_REQUEST:
        raise RequestError(
            f"n={params.n} samples exceed {MAX_SAMPLES_PER_REQUEST}, the most one request may ask for (each sample "
            f"holds its own copy of the prompt in host memory from the start); split it into several requests"
        )


def bad_words_token_ids(self, params: SamplingParams, label: str = "prompt") -> list[list[int]]:
    """``params.bad_words`` as token id lists, as vLLM tokenizes them: each word (leading
    whitespace stripped) without special tokens, and again after a space when that gives
    another first token and as many tokens (the word in the middle of a text)."""
    out: list[list[int]] = []
    for word in params.bad_words or ():
        plain = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    vocab = self.model_config.vocab_size
    outside = sorted({t for ids in out for t in ids if not 0 <= t < vocab})
    if outside:
        raise RequestError(f"{label}: bad_words tokenize to ids outside the model's vocabulary [0, {vocab}): {outside[:5]}")
    return out


def _describe(value) -> str:
    """A short description of a bad prompt for an error message."""
    if isinstance(value, (list, tuple)):
        bad = next((t for t in value if not isinstance(t, int) or isinstance(t, bool)), None)
        return f"a {type(value).__name__} holding {type(bad).__name__} {bad!r:.40}"
    return type(value).__name__
