"""Output processing: what the sampled tokens mean for each sequence.

``Scheduler.update`` hands each sequence's accepted tokens to ``OutputProcessor.process``, which
appends them in order: records their logprobs, detokenises when a stop string needs it, and
finishes the sequence at EOS, a stop token, a stop string, ``max_tokens`` or ``max_model_len``,
or when a constrained sequence's grammar has accepted EOS (``ignore_eos`` cannot extend it).
Tokens after the one that finished it (accepted drafts beyond a stop) are dropped: they were
never the sequence's output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.engine.spec_decode.stats import AcceptanceStats
from deepinfer_core.sampling.sampler import Logprob, top_logprobs

if TYPE_CHECKING:
    from deepinfer_core.engine.engine import Request

log = logging.getLogger("deepinfer")


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len

    def process(self, seq: Sequence, tokens: list[int], logprobs: list[tuple[float, dict[int, Logprob]]] | None) -> bool:
        """Append ``tokens`` to ``seq`` (``logprobs``: (logprob, top logprobs) of each, when the
        sequence asked for them) until one finishes it. Returns True when it finished."""
        for i, token in enumerate(tokens):
            seq.output_token_ids.append(token)
            if seq.grammar is not None and not seq.grammar.accept_token(token):
                # the mask allowed only tokens the matcher accepts: a kernel or matcher bug, this sequence alone ends
                log.error("request %s: token %d is not allowed by its grammar; the sequence ends here", seq.request_id, token)
                seq.finish_reason, seq.stop_reason = "abort", None
                seq.text = self.detokenize(seq, len(seq.output_token_ids))
                return True
            if seq.output_logprobs is not None:
                logprob, top = logprobs[i]
                seq.cumulative_logprob += logprob
                seq.output_logprobs.append(self.named(top))
            if self._check_stop(seq, token, len(seq.output_token_ids)):
                return True
        return False

    def _check_stop(self, seq: Sequence, token: int, num_outputs: int) -> bool:
        """Whether output number ``num_outputs`` (``token``) ends the sequence; sets its finish reason."""
        p = seq.params
        reason, stop = None, None
        if not p.ignore_eos and token in self.eos_ids:
            reason = "stop"
        elif seq.grammar is not None and seq.grammar.is_terminated():  # the grammar took EOS: nothing may follow
            reason = "stop"
        elif token in p.stop_token_ids:
            reason, stop = "stop", token
        elif p.stop:
            hit = self._stop_string(seq, num_outputs)
            if hit is not None:
                reason, stop = "stop", hit
        if reason is None and (num_outputs >= p.max_tokens or seq.num_prompt_tokens + num_outputs >= self.max_model_len):
            reason = "length"
        if reason is None:
            return False
        seq.finish_reason, seq.stop_reason = reason, stop
        if not isinstance(stop, str):  # a stop string already trimmed seq.text
            seq.text = self.detokenize(seq, num_outputs)
        return True

    def _stop_string(self, seq: Sequence, num_outputs: int) -> str | None:
        """The stop string that output ``num_outputs`` completed, if any: one that ends in the text
        this output added (as vLLM's search, each string from ``len(s) - 1`` characters before the
        new text), the earliest-starting where several do. Text before min_tokens outputs is
        scanned but cannot stop the sequence, and a string it completed does not stop it later.
        Trims seq.text at the stop string."""
        text = self.text_so_far(seq)
        scanned, seq.stop_scanned_chars = seq.stop_scanned_chars, len(text)
        if num_outputs < seq.params.min_tokens:
            return None
        earliest = None
        for s in seq.params.stop:
            idx = text.find(s, max(0, scanned - len(s) + 1))
            if idx >= 0 and (earliest is None or idx < earliest[0]):
                earliest = (idx, s)
        if earliest is None:
            return None
        idx, s = earliest
        seq.text = text[: idx + len(s)] if seq.params.include_stop_str_in_output else text[:idx]
        return s

    def text_so_far(self, seq: Sequence) -> str:
        """The output text through the last complete character, decoded incrementally: only the
        tokens since the last complete character are decoded again (a small window), so a long
        output costs O(new tokens) per call, not O(all its tokens). The same text as
        ``detokenize`` for byte-level tokenizers (DeepSeek's), less an incomplete UTF-8
        character at the end (it waits for the tokens that complete it)."""
        if self.tokenizer is None:
            return ""
        ids = seq.output_token_ids
        if len(ids) < seq.decoded_read:  # the outputs were cut back: start again
            seq.decoded_text, seq.decoded_from, seq.decoded_read = "", 0, 0
        if len(ids) > seq.decoded_read:
            skip = seq.params.skip_special_tokens
            head = self.tokenizer.decode(ids[seq.decoded_from:seq.decoded_read], skip_special_tokens=skip)
            window = self.tokenizer.decode(ids[seq.decoded_from:], skip_special_tokens=skip)
            new = window[len(head):]
            if not new or new.endswith("\ufffd"):  # an incomplete character: decoded again with the next tokens
                return seq.decoded_text + new.rstrip("\ufffd")
            seq.decoded_text += new
            seq.decoded_from, seq.decoded_read = seq.decoded_read, len(ids)
        return seq.decoded_text

    def detokenize(self, seq: Sequence, num_outputs: int | None = None) -> str:
        if self.tokenizer is None:
            return ""
        ids = seq.output_token_ids if num_outputs is None else seq.output_token_ids[:num_outputs]
        return self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)

    def named(self, top: dict[int, Logprob]) -> dict[int, Logprob]:
        """``top`` with each Logprob's decoded_token set (the token's own text)."""
        if self.tokenizer is not None:
            for token, value in top.items():
                value.decoded_token = self.tokenizer.decode([token])
        return top

    def record_prompt_logprobs(self, seq: Sequence, first: int, logits: torch.Tensor) -> None:
        """Rows of ``logits`` predict prompt positions first, first+1, ...; positions already
        recorded (a recompute after preemption, maybe chunked differently) are skipped."""
        have = len(seq.prompt_logprobs)
        if not first <= have < first + logits.shape[0]:
            return
        lps = torch.log_softmax(logits[have - first :].float(), dim=-1)
        k = seq.params.prompt_logprobs
        for i in range(lps.shape[0]):
            seq.prompt_logprobs.append(self.named(top_logprobs(lps[i], k, seq.prompt_token_ids[have + i])))


# ---- what a request gives its caller (the API's RequestOutput, vLLM-shaped) -------------------
@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per output token: {token id: Logprob (a float, with .rank, .decoded_token)}
    finish_reason: str | None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class RequestMetrics:
    """What the engine measured for a request, as vLLM's: wall-clock times (``time.time()``)
    when it was added, when its first output token reached the host, and when it ended (None
    while it runs). ``speculative``: drafts verified and accepted, by draft position, over all
    its samples (None when speculative decoding is off)."""

    arrival_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    speculative: AcceptanceStats | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None or self.arrival_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None  # prompt tokens not computed thanks to the prefix cache (first sample's, at admission)
    metrics: RequestMetrics | None = None
    # num_cached_tokens by where their blocks were found: {"gpu": the device's pool, "host": the
    # host-memory tier, "disk": the disk tier} ("gpu" whatever the device is)
    num_cached_tokens_by_tier: dict[str, int] | None = None
    # a prefill instance's answer for its decode instance (engine/kv_transfer.py): where the prompt's KV is
    kv_transfer_params: dict | None = None
    num_transferred_tokens: int = 0  # a decode instance's: prompt tokens whose KV came from the prefill instance
    error: str | None = None  # why the engine ended the request (its samples' finish_reason is "abort")


class GenerationError(RuntimeError):
    """The engine failed mid-run. ``outputs`` holds every request's result, in prompt order:
    finished ones complete, the others with what they had produced and finish_reason "abort".
    """

    def __init__(self, message: str, outputs: list[RequestOutput]):
        super().__init__(message)
        self.outputs = outputs


class KVTransferFailed(GenerationError):
    """A decode instance could not bring a request's KV cache from its prefill instance
    (``RequestOutput.error`` says why); the instance goes on (engine/kv_transfer.py)."""


def to_output(req: Request, speculative: bool) -> RequestOutput:
    """The user's view of an engine request (finished or not: its samples as they stand)."""
    first = req.seqs[0]
    spec = None
    if speculative:  # the request's samples together
        spec = AcceptanceStats()
        for s in req.seqs:
            spec = spec.merge(s.spec_stats)
    outputs = [
        CompletionOutput(
            index=s.index,
            text=s.text,
            token_ids=list(s.output_token_ids),
            cumulative_logprob=s.cumulative_logprob if s.output_logprobs is not None else None,
            logprobs=None if s.output_logprobs is None else list(s.output_logprobs),  # a copy, as token_ids: the engine goes on
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )
        for s in req.seqs
    ]
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=list(req.prompt_token_ids),
        prompt_logprobs=first.prompt_logprobs,
        outputs=outputs,
        finished=req.finished,
        num_cached_tokens=first.num_cached_tokens,
        metrics=RequestMetrics(req.arrival_time, req.first_token_time, req.finished_time, spec),
        num_cached_tokens_by_tier=None if first.num_cached_tokens_by_tier is None else dict(first.num_cached_tokens_by_tier),
        kv_transfer_params=first.kv_transfer_params,
        num_transferred_tokens=first.num_transferred_tokens,
        error=req.error,
    )
