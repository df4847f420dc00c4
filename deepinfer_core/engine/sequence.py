"""A sequence: one sample of one request, with its tokens, cache blocks and sampling state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.engine.spec_decode.stats import AcceptanceStats


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens are the prompt followed by the outputs so far; ``num_computed_tokens`` of them
    have their entries in the KV cache (the scheduler advances it when it schedules them; a
    rollback lowers it again). After a preemption that count drops to 0 and the whole token list
    is prefilled again (recompute), so no output is lost.

    block_tables: {cache group: blocks}; block_hashes: chain hashes of the full blocks of the
    known tokens (prefix caching); num_cached_tokens: prompt tokens the prefix cache spared
    computing at first admission (the hit less its bounded replay), num_cached_tokens_by_tier the
    same by the tier ("gpu", "host", "disk") their blocks came from (``KVCacheManager.tokens_by_tier``); loaded_from: block index ->
    the lower tier that gave it back to the pool, until admission; draft_token_ids: tokens proposed for the next step to verify;
    num_pending: tokens sampled on the device whose ids the host has not seen yet (overlapped
    scheduling); paged_write_from: positions below it are already in shared paged blocks (a
    bounded replay recomputes them without writing); table_version: changes whenever a block
    table loses blocks (preemption, rollback), for the graphs' incremental tables.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling stream of this sequence (see ops.sampling.sample_tokens)
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int | None = None
    num_cached_tokens_by_tier: dict[str, int] | None = None
    loaded_from: dict[int, str] = field(default_factory=dict)
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: list = field(default_factory=list)  # per draft, the distribution it was drawn from (rejection sampling)
    num_pending: int = 0
    paged_write_from: int = 0
    table_version: int = 0
    prefix_leader: Sequence | None = None  # the request's first sample, whose prompt blocks this one reuses
    num_computed_tokens: int = 0
    output_logprobs: list[dict[int, float]] | None = None  # Logprob values (sampling.sampler)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    text: str = ""
    stop_scanned_chars: int = 0  # detokenised characters already searched for stop strings
    # incremental detokenisation (OutputProcessor.text_so_far): the text of output tokens [0, read),
    # and where the window decoded for the next tokens starts
    decoded_text: str = ""
    decoded_from: int = 0
    decoded_read: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    spec_stats: AcceptanceStats = field(default_factory=AcceptanceStats)  # drafts verified / accepted (speculative decoding)
    grammar: object | None = None  # xgrammar matcher of a constrained sequence (sampling.structured), fed its outputs
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # params.bad_words tokenized (Engine.add_request)
    # prefill/decode disaggregation (engine/kv_transfer.py): on a decode instance, where the blocks of
    # its first tokens are (kv_transfer.RemoteKV) until they arrive, and since when it waits for them;
    # on a prefill instance, whether its blocks are parked for a decode instance when it finishes,
    # and the kv_transfer_params that say where
    remote: object | None = None
    remote_since: float = 0.0
    exports: bool = False
    num_transferred_tokens: int = 0  # prompt tokens whose cache came from a prefill instance (a decode instance's)
    kv_transfer_params: dict | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

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
