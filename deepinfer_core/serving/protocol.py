"""OpenAI-style request bodies (the fields we honour) and Anthropic's Messages request, and their
mapping to SamplingParams.

Fields a client sends that we do not know are ignored, as OpenAI's and Anthropic's own SDKs add
new ones over time; fields we know but cannot honour (``best_of`` other than n,
``suffix``, function tools on models without them, content blocks other than text, vLLM's
structured-output options we have no equivalent for) are a 400 naming the field and what to
send instead (``FieldError``).

Structured outputs: OpenAI's ``response_format`` (chat and completions) and vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and
``structured_outputs`` all become the one ``SamplingParams.so_args`` constraint
(``structured``); a request may give one of them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from deepinfer_core.sampling.params import SamplingParams


# The request bodies validate strictly: a boolean is not a number (``"max_tokens": true`` is a 400,
# not 1), a string is not a boolean (``"stream": "yes"``), a float is not an integer.


class Limits(BaseModel):
    """What one request may ask of a public endpoint (``deepinfer serve --max-...``)."""

    max_tokens: int = 4096
    max_n: int = 16
    max_body_bytes: int = 4 << 20


class FieldError(ValueError):
    """A request field that cannot be honoured as sent: the message says what to send instead,
    ``param`` names the field (the error body's ``param``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


SO_SCHEMA_FIELD = "response_format.json_schema.schema"


def _no_empty_stop(stop, name: str):
    """vLLM's rule: an empty stop string (alone or in the list) is refused; it would end every
    answer before its first character."""
    if stop == "" or (isinstance(stop, list) and "" in stop):
        raise FieldError(f"{name} cannot contain an empty string (it would stop at once); remove it", name)
    return stop


def _nonempty(value: str, name: str) -> str:
    if not value:
        raise FieldError(f"{name} is empty; give a non-empty value or leave the field out", name)
    return value


def _response_format(rf: dict) -> dict:
    """OpenAI's response_format as a structured-output constraint: json_schema or json_object."""
    if rf["type"] == "json_object":
        return {"json_object": True}
    if rf["type"] == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema")
        if schema is None:
            raise FieldError("response_format.json_schema.schema is missing; give the JSON schema there", "response_format")
        return {"json": schema}
    raise FieldError(f"response_format type {rf['type']!r} is not supported (text, json_object, json_schema)", "response_format")


class VllmStructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (StructuredOutputsParams): one of json, regex, choice, grammar,
    json_object. Of its options, those that only allow more than we generate are accepted (JSON
    is generated compact, so ``disable_any_whitespace`` holds either way; there is no fallback
    backend to disable); those that would change the constraint are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def so_args(self) -> dict:
        for name in ("disable_additional_properties", "whitespace_pattern", "structural_tag"):
            if getattr(self, name) not in (None, False):
                raise FieldError(f"structured_outputs.{name} is not supported; give the JSON schema itself (with "
                                 "additionalProperties where wanted) in structured_outputs.json", f"structured_outputs.{name}")
        kinds = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                 "json_object": self.json_object or None}
        given = {k: v for k, v in kinds.items() if v is not None}
        if len(given) != 1:
            raise FieldError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object (as true); "
                             + (f"got {', '.join(given)}" if given else "got none"), "structured_outputs")
        (kind, value), = given.items()
        if not value:
            raise FieldError(f"structured_outputs.{kind} is empty", f"structured_outputs.{kind}")
        return {kind: value}


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options`` (and vLLM's ``continuous_usage_stats``): a streamed answer ends
    with a usage chunk (``"choices": []``) only when ``include_usage`` is true; with
    ``continuous_usage_stats`` as well, every chunk carries the usage so far."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

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
    logit_bias: dict[Annotated[int, Strict(False)], float] | None = None  # OpenAI sends the token ids as strings: read as ints
    allowed_token_ids: list[int] | None = None  # vLLM's extensions
    bad_words: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    best_of: int | None = Field(None, ge=1)
    use_beam_search: bool = False
    # structured outputs: one of these (``structured``)
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: VllmStructuredOutputs | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # prefill/decode disaggregation, as vLLM's router sends it (engine/kv_transfer.py)
    kv_transfer_params: dict | None = None

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v):
        return _no_empty_stop(v, "stop")

    @model_validator(mode="after")
    def _common_checks(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options is only allowed when stream is true; drop it, or set stream: true", "stream_options")
        if self.best_of is not None and self.best_of != self.n:
            if self.best_of < self.n:
                raise FieldError(f"best_of ({self.best_of}) must be at least n ({self.n})", "best_of")
            raise FieldError(f"best_of={self.best_of} above n={self.n} is not supported (the server does not rank samples); "
                             f"ask for n={self.best_of} samples with logprobs and keep the best yourself", "best_of")
        if self.prompt_logprobs is not None:
            raise FieldError("prompt_logprobs is not a field of this server; ask completions for echo: true with logprobs "
                             "(the prompt's logprobs come back before the completion's), or use LLM.generate offline", "prompt_logprobs")
        if self.use_beam_search:
            raise FieldError("use_beam_search is not supported; sample with n and temperature instead", "use_beam_search")
        if self.guided_decoding_backend not in (None, "auto", "xgrammar"):
            raise FieldError(f"guided_decoding_backend {self.guided_decoding_backend!r} is not available: structured outputs "
                             "run on xgrammar here; leave the field out", "guided_decoding_backend")
        if self.guided_whitespace_pattern is not None:
            raise FieldError("guided_whitespace_pattern is not supported: JSON is generated compact (no free whitespace); "
                             "leave the field out", "guided_whitespace_pattern")
        self.structured()  # its FieldError, now
        return self

    def structured(self) -> tuple[dict | None, str | None]:
        """(so_args, the field it came from) for the one structured-output field given, as vLLM
        reads them; (None, None) without one. FieldError for two, or for one we cannot honour."""
        given = []
        rf = self.response_format
        if rf is not None and rf.get("type") is None:
            raise FieldError("response_format.type is missing (text, json_object or json_schema)", "response_format")
        if rf is not None and rf["type"] != "text":
            given.append(("response_format", _response_format(rf)))
        if self.guided_json is not None:
            given.append(("guided_json", {"json": self.guided_json}))
        if self.guided_regex is not None:
            given.append(("guided_regex", {"regex": _nonempty(self.guided_regex, "guided_regex")}))
        if self.guided_choice is not None:
            if not self.guided_choice:
                raise FieldError("guided_choice is an empty list; give at least one string", "guided_choice")
            given.append(("guided_choice", {"choice": self.guided_choice}))
        if self.guided_grammar is not None:
            given.append(("guided_grammar", {"grammar": _nonempty(self.guided_grammar, "guided_grammar")}))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs.so_args()))
        if len(given) > 1:
            names = [name for name, _ in given]
            raise FieldError(f"{' and '.join(names)} each constrain the output; give only one of them", names[1])
        if not given:
            return None, None
        name, so = given[0]
        if name == "structured_outputs":
            name = f"structured_outputs.{next(iter(so))}"
        return so, (SO_SCHEMA_FIELD if name == "response_format" and "json" in so else name)

    @property
    def usage_chunks(self) -> tuple[bool, bool]:
        """(a usage chunk ends the stream, every chunk carries the usage so far)."""
        o = self.stream_options
        return (o is not None and o.include_usage), (o is not None and o.include_usage and o.continuous_usage_stats)

    def sampling_params(self, limits: Limits, logprobs: int | None) -> SamplingParams:
        so_args, _ = self.structured()
        if self.n > limits.max_n:
            raise FieldError(f"n={self.n} is more than this server allows ({limits.max_n})", "n")
        max_tokens = self.max_tokens if self.max_tokens is not None else (
            min(16, limits.max_tokens) if isinstance(self, CompletionRequest) else limits.max_tokens)
        if max_tokens > limits.max_tokens:
            raise FieldError(f"max_tokens={max_tokens} is more than this server allows ({limits.max_tokens})", "max_tokens")
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
            # max_tokens 0 (completions with echo: the prompt scored) runs 1 token, which the route drops
            max_tokens=max(max_tokens, 1), min_tokens=self.min_tokens, stop=self.stop if self.stop is not None else [],
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=logprobs, so_args=so_args, logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words, stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            kv_transfer_params=self.kv_transfer_params,
        )


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: the prompt scored, nothing generated
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens=0 generates nothing; it is allowed only with echo: true (to score the prompt, "
                             "with logprobs); ask for at least 1 token, or set echo", "max_tokens")
        if self.suffix:
            raise FieldError("suffix is not supported (no fill-in-the-middle here); leave it out", "suffix")
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt is empty; give a string, a list of strings or token ids", "prompt")
        return self

    @property
    def scores_only(self) -> bool:
        """echo with max_tokens=0: the prompt (and its logprobs) back, no completion (vLLM's scoring)."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, limits: Limits, logprobs: int | None) -> SamplingParams:
        """With echo and logprobs, the prompt's logprobs too (the engine's ``prompt_logprobs``)."""
        params = super().sampling_params(limits, logprobs)
        return params.model_copy(update={"prompt_logprobs": logprobs}) if self.echo and logprobs is not None else params

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

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
    tools: list | None = None
    functions: list | None = None  # OpenAI's older spelling of tools

    @model_validator(mode="after")
    def _supported(self) -> ChatRequest:
        if self.tools or self.functions:
            name = "tools" if self.tools else "functions"
            raise FieldError(f"{name} are not supported for this model", name)
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs needs logprobs: true; set logprobs to true, or leave top_logprobs out", "top_logprobs")
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize`` body: a ``prompt`` (``add_special_tokens``, default true) or chat
    ``messages`` laid out as the chat routes lay them out (with the assistant's turn to speak;
    ``tools`` and ``chat_template_kwargs`` {"thinking": bool} on a V4 checkpoint);
    ``return_token_strs`` adds each token's string. vLLM's chat options that would lay the
    messages out otherwise are a 400."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    tools: list | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("give either prompt (a string) or messages (a chat), not both or neither", "prompt")
        chat_only = {"add_generation_prompt": not self.add_generation_prompt, "continue_final_message": self.continue_final_message,
                     "chat_template": self.chat_template is not None, "chat_template_kwargs": self.chat_template_kwargs is not None,
                     "tools": self.tools is not None}
        if self.prompt is not None:
            for name, set_ in chat_only.items():
                if set_:
                    raise FieldError(f"{name} applies to messages, not to a prompt; leave it out", name)
            return self
        if self.add_special_tokens:
            raise FieldError("add_special_tokens applies to a prompt: the chat template writes the messages' special tokens; "
                             "leave it out", "add_special_tokens")
        if not self.add_generation_prompt or self.continue_final_message:
            raise FieldError("the messages are laid out as the chat routes lay them out, ending with the assistant's turn to "
                             "speak: add_generation_prompt false and continue_final_message true are not supported",
                             "add_generation_prompt" if not self.add_generation_prompt else "continue_final_message")
        if self.chat_template is not None:
            raise FieldError("chat_template is not supported: the model's own template (or DeepSeek's encoding) lays out "
                             "the messages; leave it out", "chat_template")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's ``/detokenize`` body: token ids back to text."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]


class AnthropicMessage(ChatMessage):
    role: Literal["user", "assistant"]
    content: str | list[dict]


class MessagesRequest(BaseModel):
    """Anthropic's ``/v1/messages`` body (``metadata`` and unknown fields ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)

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
    kv_transfer_params: dict | None = None  # read to be refused: prefill/decode pairs take OpenAI's routes

    @field_validator("stop_sequences")
    @classmethod
    def _stop_nonempty(cls, v):
        return _no_empty_stop(v, "stop_sequences")

    @model_validator(mode="after")
    def _supported(self) -> MessagesRequest:
        if self.tools or self.tool_choice:
            raise FieldError("tools and tool_choice are not supported for this model", "tools")
        if self.kv_transfer_params is not None:
            raise FieldError("kv_transfer_params are not read on /v1/messages for this model; route a prefill/decode pair "
                             "through /v1/completions or /v1/chat/completions", "kv_transfer_params")
        return self

    def conversation(self) -> list[dict]:
        """The system prompt and messages as {"role", "content"} dicts (ValueError: a block that is not text)."""
        messages = [{"role": m.role, "content": m.text()} for m in self.messages]
        system = _text(self.system)
        return ([{"role": "system", "content": system}] if system else []) + messages

    def sampling_params(self, limits: Limits, logprobs: int | None = None, so_args: dict | None = None) -> SamplingParams:
        if self.max_tokens > limits.max_tokens:
            raise FieldError(f"max_tokens={self.max_tokens} is more than this server allows ({limits.max_tokens})", "max_tokens")
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=self.max_tokens,
                              stop=self.stop_sequences or [])


class CountTokensRequest(MessagesRequest):
    """Anthropic's ``/v1/messages/count_tokens`` body: a Messages request without max_tokens."""

    max_tokens: int | None = Field(None, ge=1)
