"""Logits -> next tokens (+ logprobs), per sequence settings, on the logits' device.

Logprobs are those of the model's distribution (log_softmax of the raw logits, before
penalties, temperature and truncation), as vLLM reports them by default.
"""

from __future__ import annotations

import torch

from deepinfer_core.engine.sequence import Sequence


def top_logprobs(logprobs_row: torch.Tensor, k: int, token: int | None = None) -> dict[int, float]:
    """{token id: logprob} for the k most likely tokens, plus ``token`` if given."""
    out: dict[int, float] = {}
    if k > 0:
        values, ids = logprobs_row.topk(min(k, logprobs_row.shape[-1]))
        out = dict(zip(ids.tolist(), values.tolist()))
    if token is not None and token not in out:
        out[token] = float(logprobs_row[token])
    return out


def _apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids())), dtype=torch.int64, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        out_ids = torch.tensor(seq.output_token_ids, dtype=torch.int64, device=logits.device)
        counts = torch.zeros_like(logits).index_add_(0, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _truncate(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already cover top_p
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def _suppress_stop_tokens(logits: torch.Tensor, seq: Sequence, eos_ids: tuple[int, ...]) -> None:
    """Before min_tokens outputs, EOS and stop tokens cannot be chosen."""
    if len(seq.output_token_ids) < seq.params.min_tokens:
        banned = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else list(eos_ids))
        if banned:
            logits[torch.tensor(banned, device=logits.device)] = float("-inf")


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...] = ()) -> list[tuple[int, float, dict[int, float] | None]]:
    """For each row of ``logits`` [N, V] (float32) and its sequence: (token, logprob, top logprobs or None)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    results = []
    for row, seq in enumerate(seqs):
        p = seq.params
        scores = _apply_penalties(logits[row].float().clone(), seq)
        _suppress_stop_tokens(scores, seq, eos_ids)
        if p.greedy:
            token = int(scores.argmax())
        else:
            scores = _truncate(scores / p.temperature, p.top_k, p.top_p, p.min_p)
            token = int(torch.multinomial(scores.softmax(-1), 1, generator=seq.generator))
        lp = float(logprobs[row, token])
        top = top_logprobs(logprobs[row], p.logprobs, token) if p.logprobs is not None else None
        results.append((token, lp, top))
    return results
