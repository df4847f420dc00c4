"""OpenAI-style request bodies (the fields we honour) and Anthropic's Messages request, and their
mapping to SamplingParams.

Fields a client sends that we do not know are ignored, as OpenAI's and Anthropic's own SDKs add
new ones over time; fields we know but cannot honour (``echo``, ``best_of`` > n, ``suffix``,
function tools on models without them, content blocks other than text) are a 400 naming the field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deepinfer_core.sampling.params import SamplingParams


class Limits(BaseModel):
    """What one request may ask of a public endpoint (``deepinfer serve --max-...``)."""

    max_tokens: int = 4096
    max_n: int = 16
    max_body_bytes: int = 4 << 20


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options`` (and vLLM's ``continuous_usage_stats``): a streamed answer ends
    with a usage chunk (``"choices": []``) only when ``include_usage`` is true; with
    ``continuous_usage_stats`` as well, every chunk carries the usage so far."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[int, float] | None = None  # OpenAI sends the token ids as strings: pydantic reads them as ints
    allowed_token_ids: list[int] | None = None  # vLLM's extensions
    bad_words: list[str] | None = None

    @model_validator(mode="after")
    def _stream_options_with_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true; drop it, or set stream: true")
        return self

    @property
    def usage_chunks(self) -> tuple[bool, bool]:
        """(a usage chunk ends the stream, every chunk carries the usage so far)."""
        o = self.stream_options
        return (o is not None and o.include_usage), (o is not None and o.include_usage and o.continuous_usage_stats)

    def sampling_params(self, limits: Limits, logprobs: int | None, so_args: dict | None = None) -> SamplingParams:
        if self.n > limits.max_n:
            raise ValueError(f"n={self.n} is more than this server allows ({limits.max_n})")
        max_tokens = self.max_tokens or (min(16, limits.max_tokens) if isinstance(self, CompletionRequest) else limits.max_tokens)
        if max_tokens > limits.max_tokens:
            raise ValueError(f"max_tokens={max_tokens} is more than this server allows ({limits.max_tokens})")
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop or [], ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=logprobs, so_args=so_args, logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
        )


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        return _text(self.content)


def _text(content: str | list[dict] | None) -> str:
    """A message's content, a string or a list of text blocks, as one string."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ValueError(f"message content of type {part.get('type')!r} is not supported (text only)")
        parts.append(part.get("text", ""))
    return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict | None = None
    tools: list | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatRequest:
        if self.tools:
            raise ValueError("tools are not supported for this model")
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self

    def so_args(self) -> dict | None:
        """response_format as a structured-output constraint: json_schema, json_object, or text."""
        rf = self.response_format
        if not rf or rf.get("type") in (None, "text"):
            return None
        if rf["type"] == "json_object":
            return {"json_object": True}
        if rf["type"] == "json_schema":
            schema = (rf.get("json_schema") or {}).get("schema")
            if schema is None:
                raise ValueError("response_format.json_schema.schema is missing")
            return {"json": schema}
        raise ValueError(f"response_format type {rf['type']!r} is not supported (text, json_object, json_schema)")


class AnthropicMessage(ChatMessage):
    role: Literal["user", "assistant"]
    content: str | list[dict]


class MessagesRequest(BaseModel):
    """Anthropic's ``/v1/messages`` body (``metadata`` and unknown fields ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list | None = None
    tool_choice: dict | None = None

    @model_validator(mode="after")
    def _supported(self) -> MessagesRequest:
        if self.tools or self.tool_choice:
            raise ValueError("tools and tool_choice are not supported for this model")
        return self

    def conversation(self) -> list[dict]:
        """The system prompt and messages as {"role", "content"} dicts (ValueError: a block that is not text)."""
        messages = [{"role": m.role, "content": m.text()} for m in self.messages]
        system = _text(self.system)
        return ([{"role": "system", "content": system}] if system else []) + messages

    def sampling_params(self, limits: Limits, logprobs: int | None = None, so_args: dict | None = None) -> SamplingParams:
        if self.max_tokens > limits.max_tokens:
            raise ValueError(f"max_tokens={self.max_tokens} is more than this server allows ({limits.max_tokens})")
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=self.max_tokens,
                              stop=self.stop_sequences or [])


class CountTokensRequest(MessagesRequest):
    """Anthropic's ``/v1/messages/count_tokens`` body: a Messages request without max_tokens."""

    max_tokens: int | None = Field(None, ge=1)
