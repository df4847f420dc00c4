"""A sequence: one sample of one request, with its tokens, cache blocks and sampling state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from deepinfer_core.sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens are the prompt followed by the outputs so far; ``num_computed_tokens`` of them
    have their latents in the KV cache. After a preemption that count drops to 0 and the whole
    token list is prefilled again (recompute), so no output is lost.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling stream of this sequence (see ops.sampling.sample_tokens)
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    output_logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    text: str = ""
    stop_scanned_chars: int = 0  # detokenised characters already searched for stop strings
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # nothing predicts the first prompt token
        if self.params.logprobs is not None:
            self.output_logprobs = []

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute (each is recorded once, even across a preemption)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
