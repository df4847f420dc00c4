"""SamplingParams: how one request is sampled and when it stops (validated by pydantic)."""

from __future__ import annotations

import json

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

STRUCTURED_KINDS = ("json", "regex", "grammar", "choice", "json_object")
LOGIT_BIAS_LIMIT = 100.0  # logit_bias values are clamped into [-100, 100], as OpenAI's API and vLLM do


class StructuredOutputs(BaseModel):
    """What a constrained request's output must be: exactly one of a JSON schema (``json``: a
    dict or its JSON text), a regular expression (``regex``), an EBNF grammar in xgrammar's
    GBNF dialect (``grammar``, with a ``root`` rule), one of a list of strings (``choice``), or
    any JSON object (``json_object=True``). vLLM's field names; ``sampling.structured`` compiles it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_schema: dict | str | None = Field(None, validation_alias=AliasChoices("json", "json_schema"))
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in STRUCTURED_KINDS if self._value(k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"so_args must set exactly one of {', '.join(STRUCTURED_KINDS)} (json_object as true); "
                + (f"got {', '.join(given)}" if given else "got none")
            )
        if self.choice is not None and not self.choice:
            raise ValueError("so_args['choice'] is an empty list; give at least one string")
        for k in ("regex", "grammar"):
            if self._value(k) == "":
                raise ValueError(f"so_args[{k!r}] is empty")
        return self

    def _value(self, kind: str):
        return self.json_schema if kind == "json" else getattr(self, kind)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if self._value(k) not in (None, False))

    def text(self) -> str:
        """The constraint as the text xgrammar compiles (the cache key with ``kind``)."""
        kind = self.kind
        if kind == "json":
            return self.json_schema if isinstance(self.json_schema, str) else json.dumps(self.json_schema)
        if kind == "choice":
            return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
        return "" if kind == "json_object" else self._value(kind)


class SamplingParams(BaseModel):
    """Per-request sampling settings, shaped like vLLM's.

    temperature 0 (or below 1e-5) means greedy. top_k 0 or -1 disables top-k; a top_k beyond the
    vocabulary keeps it all. A ``seed`` makes the request's samples reproducible whatever batch
    it runs in; without one, samples derive from the engine seed (``LLM(seed=...)``). Floats
    must be finite. ``n`` is at most 4096 (checked when the request is added); samples beyond
    the engine's ``max_num_seqs`` run in waves. ``so_args`` constrains the output to a JSON
    schema, regex, grammar or list of choices (``StructuredOutputs``). As in vLLM,
    ``max_tokens=None`` generates up to the context (max_model_len less the prompt's length) and
    ``logprobs=-1`` / ``prompt_logprobs=-1`` return the whole vocabulary's logprobs; the engine
    makes them concrete when the request is added (``Engine.resolve_params``).

    Logit controls (vLLM's, applied to the raw logits before penalties and temperature, so
    greedy, sampled and speculative rows all see them; reported logprobs stay those of the raw
    logits): ``logit_bias`` {token id: bias} is added to those tokens' logits (each bias clamped
    into [-100, 100]); ``allowed_token_ids`` makes every other token impossible; ``bad_words``
    are tokenized by the engine (with and without a leading space) and a word's last token is
    impossible wherever the output so far ends with the word's other tokens (always, for a
    one-token word). Token ids are checked against the vocabulary when the request is added.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    n: int = Field(1, ge=1, description="Number of samples to return for the prompt.")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    max_tokens: int | None = Field(16, ge=1)  # None: up to the context (max_model_len - prompt length), as vLLM
    min_tokens: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary, as vLLM
    prompt_logprobs: int | None = Field(None, ge=-1)
    skip_special_tokens: bool = True
    # structured outputs (DeepSeek's name so_args; vLLM's structured_outputs / guided_decoding)
    so_args: StructuredOutputs | None = Field(None, validation_alias=AliasChoices("so_args", "structured_outputs", "guided_decoding"))
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # prefill/decode disaggregation, as vLLM's router sends it (engine/kv_transfer.py):
    # {"do_remote_decode": true} to a prefill instance, the prefill's answer to a decode instance
    kv_transfer_params: dict | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_nonnegative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_clamped(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is None:
            return None
        bad = [t for t in v if t < 0]
        if bad:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {bad[:5]}")
        return {t: min(max(b, -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT) for t, b in v.items()}

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_nonempty(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return None
        if not v:
            raise ValueError("allowed_token_ids is an empty list: no token could be generated; give at least one id or None")
        bad = [t for t in v if t < 0]
        if bad:
            raise ValueError(f"allowed_token_ids must be non-negative token ids, got {bad[:5]}")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words_nonempty(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not w.strip() for w in v):
            raise ValueError("bad_words must not hold empty or whitespace-only strings")
        return v

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self
