"""``/v1/completions`` with ``echo``: each choice shows its prompt before its completion, in the
text and, with ``logprobs``, in the logprobs (the engine's prompt logprobs; the first prompt
token has none: ``None`` in ``token_logprobs`` and ``top_logprobs``), as OpenAI's legacy API
and vLLM answer. ``max_tokens=0`` with echo scores the prompt alone: the engine runs one token,
which is dropped here, so the usage counts no completion token (vLLM runs it the same way).
A stream sends the echoed prompt in each choice's first chunk (the deltas of the echoed
choice, see ``server._stream_completion``)."""

from __future__ import annotations

import dataclasses

from deepinfer_core.engine.output import CompletionOutput, RequestOutput


class Echo:
    """How a completions request's outputs become its choices. ``prompts``: as the request gave
    them (text, or token ids, whose text is decoded here); ``ids``: their token ids."""

    def __init__(self, tokenizer, prompts: list, ids: list[list[int]], echo: bool, scores_only: bool,
                 skip_special_tokens: bool = True):
        self.tokenizer, self.echo, self.scores_only = tokenizer, echo, scores_only
        self.skipped = set(tokenizer.all_special_ids) if tokenizer is not None and skip_special_tokens else set()
        self.texts = [self._text(p, i, skip_special_tokens) for p, i in zip(prompts, ids)] if echo else []

    def _text(self, prompt, ids: list[int], skip_special_tokens: bool) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if self.tokenizer is not None else ""

    def output(self, out: RequestOutput) -> RequestOutput:
        """``out`` as the client sees it: with max_tokens=0 its samples' one generated token dropped."""
        if not self.scores_only:
            return out
        dropped = [dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                                       cumulative_logprob=None if c.cumulative_logprob is None else 0.0,
                                       finish_reason=None if c.finish_reason is None else "length", stop_reason=None)
                   for c in out.outputs]
        return dataclasses.replace(out, outputs=dropped)

    def choice(self, p: int, out: RequestOutput, c: CompletionOutput) -> CompletionOutput:
        """Sample ``c`` of prompt ``p`` with the prompt before it (as it is without echo)."""
        if not self.echo:
            return c
        logprobs = None
        if c.logprobs is not None:
            if out.prompt_logprobs is None or len(out.prompt_logprobs) != len(out.prompt_token_ids):
                raise RuntimeError(f"request {out.request_id}: the engine returned no prompt logprobs for an echo")
            logprobs = list(out.prompt_logprobs) + list(c.logprobs)
        return dataclasses.replace(c, text=self.texts[p] + c.text, token_ids=list(out.prompt_token_ids) + list(c.token_ids),
                                   logprobs=logprobs)

    def piece(self, token: int) -> str:
        """The text of a token that has no logprob (the first of an echoed prompt)."""
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    def width(self, token: int, piece: str) -> int:
        """How much of the choice's text ``token`` takes: nothing for a special token the text skips."""
        return 0 if token in self.skipped else len(piece)
