"""DeepSeek's chat protocol for V4 and V4.1 checkpoints, through deepseek-recipe.

deepseek-recipe (DeepSeek's own library) turns an OpenAI Chat Completions or Anthropic Messages
request into a conversation, the conversation into prompt token ids (``DeepseekV4Encoding`` /
``DeepseekV41Encoding``: thinking mode, tools, response formats), and the generated tokens back
into the API's chunks and responses (reasoning content, content, tool calls, usage), exactly as
DeepSeek's API does. This module is the one place that talks to it: ``Recipe`` for a model
directory, used by ``LLM.chat`` and by the server's chat routes (``serving.deepseek``).

What is ours: the sampling parameters (``Recipe.sampling_params``), and ``Answer``, which feeds a
request's outputs to the library's stream processor. Stop sequences are the library's (they end
the content, never the reasoning); the output constraint of ``response_format`` (json_object,
json_schema, regex) becomes ``so_args`` when thinking is off -- with thinking on the model
reasons first, so the schema reaches it through the prompt only. Tool calls are parsed, not
constrained.
"""

from __future__ import annotations

from pathlib import Path

from deepinfer_core.config import ConfigError
from deepinfer_core.models.registry import Generation, generation
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import most_likely


class ProtocolError(ValueError):
    """A request deepseek-recipe refused; ``status`` is the HTTP status DeepSeek's API answers."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _library():
    try:
        import deepseek_recipe
    except ImportError as e:
        raise ConfigError(f"V4 / V4.1 chat needs deepseek-recipe (pip install deepseek-recipe==0.2.0): {e}") from None
    return deepseek_recipe


def recipe_for(model_dir: Path, gen: Generation, served_name: str | None = None) -> Recipe | None:
    """The Recipe of a V4 / V4.1 checkpoint (its generation's ``chat``); None for the others (their
    tokenizer's chat template)."""
    return Recipe(model_dir, gen.model_types[0], served_name) if gen.chat else None


class Recipe:
    """deepseek-recipe set up for one checkpoint: its tokenizer, its encoding, and the served
    model name accepted in requests (besides DeepSeek's own names)."""

    def __init__(self, model_dir: Path, model_type: str, served_name: str | None = None):
        dr = self.dr = _library()
        version, encoding, official = generation(model_type).chat  # its deepseek-recipe names (models/registry.py)
        self.version = getattr(dr.ModelVersion, version)
        self.name = served_name or official
        path = Path(model_dir) / "tokenizer.json"
        if not path.exists():
            raise ConfigError(f"{model_dir}: no tokenizer.json; DeepSeek's chat encoding (deepseek-recipe) reads that file")
        self.tokenizer = dr.Tokenizer.from_file(str(path))
        self.encoding = getattr(dr, encoding)().with_tokenizer(self.tokenizer)
        self.options = dr.ConversionOptions().with_model_alias(self.name, self.version)
        self._check_special_tokens(model_dir)

    def _check_special_tokens(self, model_dir: Path) -> None:
        """A tokenizer without DeepSeek's special tokens fails at start-up, not on the first request."""
        probe = {"model": self.name, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                 "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
        try:
            self.prompt(self.convert(self.dr.ChatCompletionRequest(probe)))
        except (RuntimeError, ProtocolError) as e:
            raise ConfigError(f"{model_dir}/tokenizer.json cannot encode DeepSeek's chat format: {e}") from None

    # ---- request -> prompt ------------------------------------------------------------------------
    def request(self, body: bytes | str | dict, anthropic: bool = False):
        """The library's request object; ProtocolError for a body it cannot read (bad JSON, wrong types)."""
        try:
            return (self.dr.MessagesRequest if anthropic else self.dr.ChatCompletionRequest)(body)
        except ValueError as e:
            raise ProtocolError(str(e)) from None

    def convert(self, request):
        """The ConversationRequest (conversation, inference and parsing options); consumes ``request``."""
        try:
            return request.convert(self.options)
        except self.dr.ConversionError as e:
            raise ProtocolError(str(e), e.status_code) from None

    def prompt(self, conversation_request) -> list[int]:
        """The prompt's token ids, as DeepSeek's encoding lays out the conversation."""
        return list(self.encoding.encode(conversation_request.conversation))

    def chat_prompt(self, messages: list[dict], tools: list | None = None, thinking: bool | None = None) -> list[int]:
        """``LLM.chat``'s prompt: OpenAI-style messages (and tools) through the encoding."""
        return self.render_chat(messages, tools, thinking)[1]

    def render_chat(self, messages: list[dict], tools: list | None = None, thinking: bool | None = None,
                    continue_final_message: bool = False) -> tuple[str, list[int]]:
        """The rendered text and token ids of ``chat_prompt``. ``continue_final_message``: the
        final (assistant) message is continued instead of a new turn opened, DeepSeek's prefix
        completion (``"prefix": true`` on that message)."""
        if continue_final_message:
            if not messages or not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant":
                raise ValueError("continue_final_message=True: the conversation must end with an assistant message "
                                 "(DeepSeek's prefix completion continues it)")
            messages = [*messages[:-1], {**messages[-1], "prefix": True}]
        body: dict = {"model": self.name, "messages": messages}
        if tools:
            body["tools"] = tools
        if thinking is not None:
            body["thinking"] = {"type": "enabled" if thinking else "disabled"}
        conversation = self.convert(self.request(body))
        text = self.encoding.render_conversation(conversation.conversation).prompt
        return text, self.prompt(conversation)

    def sampling_params(self, cr, prompt_len: int, max_model_len: int, max_tokens_cap: int) -> SamplingParams:
        """What the request asks of the sampler. max_tokens: the request's (ProtocolError above
        ``max_tokens_cap``), else DeepSeek's default cut to the cap and to the context left."""
        io = cr.inference_options
        if io.max_tokens is not None and io.max_tokens > max_tokens_cap:
            raise ProtocolError(f"max_tokens={io.max_tokens} is more than this server allows ({max_tokens_cap})")
        try:
            max_tokens = min(cr.resolve_max_tokens(prompt_len, max_model_len), max_tokens_cap)
        except self.dr.ConversionError as e:
            raise ProtocolError(str(e), e.status_code) from None
        so_args = None
        constraint = io.output_constraint
        if constraint is not None and cr.parsing_options.thinking_initial_stage is None:
            if constraint.kind == "json":
                so_args = {"json": constraint.schema} if constraint.schema else {"json_object": True}
            elif constraint.kind == "regex":
                so_args = {"regex": constraint.schema}
        logprobs = (io.top_logprobs or 0) if io.logprobs else None
        return SamplingParams(temperature=io.temperature if io.temperature is not None else 1.0,
                              top_p=io.top_p if io.top_p is not None else 1.0, seed=io.seed, max_tokens=max_tokens,
                              logprobs=logprobs, so_args=so_args)

    # ---- outputs -> chunks ------------------------------------------------------------------------
    def answer(self, cr, response_id: str, model: str, eos_ids, anthropic: bool = False) -> Answer:
        generator = (self.dr.MessagesRequest if anthropic else self.dr.ChatCompletionRequest).chunk_generator(cr, response_id, model)
        top = cr.inference_options.top_logprobs or 0
        return Answer(self.dr, self.dr.StreamProcessor(generator, cr.parsing_options, self.tokenizer), eos_ids, top)

    def response(self, response_id: str, model: str, created: int, anthropic: bool = False):
        """The non-streamed response that ``accumulate``s an Answer's chunks."""
        return (self.dr.MessagesResponse if anthropic else self.dr.ChatCompletionResponse)(response_id, model, created, 0, 0)


class Answer:
    """One request's outputs (``RequestOutput``s as generation goes) through deepseek-recipe's
    stream processor: each ``update`` returns the protocol chunks the new tokens make.
    ``finished``: the answer is complete (the request ended, or a stop sequence ended the
    content: the caller then stops generating)."""

    def __init__(self, dr, processor, eos_ids, top_logprobs: int):
        self.dr, self.processor, self.eos_ids, self.top = dr, processor, set(eos_ids), top_logprobs
        self.sent = None  # output tokens pushed; None before the prompt's usage went in

    @property
    def finished(self) -> bool:
        return self.processor.finished

    def update(self, out) -> list:
        dr, chunks = self.dr, []
        if self.sent is None:  # the prompt usage goes first; the cache hits are known once it started
            usage = dr.PromptUsage(prompt_tokens=len(out.prompt_token_ids), prompt_cache_hit_tokens=out.num_cached_tokens or 0)
            chunks += self.processor.push(dr.InferenceChunk.ready(prompt_usage=usage))
            self.sent = 0
        c = out.outputs[0]
        end = len(c.token_ids)
        if c.finish_reason == "stop" and end and c.token_ids[-1] in self.eos_ids:
            end -= 1  # the end-of-sentence token is not text (the processor would show it)
        if end > self.sent and not self.finished:
            ids = c.token_ids[self.sent:end]
            chunks += self.processor.push(dr.InferenceChunk.tokens(ids, self._logprobs(c, ids)))
            self.sent = end
        if c.finish_reason is not None and not self.finished:
            reason = dr.InferenceFinishReason.Length if c.finish_reason == "length" else dr.InferenceFinishReason.Stop
            chunks += self.processor.push(dr.InferenceChunk.finish(reason))
        return chunks

    def _logprobs(self, c, ids: list[int]):
        if c.logprobs is None:
            return None
        rows = c.logprobs[self.sent:self.sent + len(ids)]
        return [(float(row[t]), [(k, float(v)) for k, v in most_likely(row, self.top)]) for t, row in zip(ids, rows)]

    def close(self) -> None:
        if not self.finished:
            self.processor.close()
