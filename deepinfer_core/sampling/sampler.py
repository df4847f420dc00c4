"""Logits -> next tokens (+ logprobs) for a batch of sequences, on the logits' device.

Penalties and min_tokens are applied here, batched; the draw itself is the ``sample_tokens``
op of the backend's op table. Logprobs are those of the model's distribution (log_softmax of
the raw logits, before penalties, temperature and truncation), as vLLM reports them.

Any valid SamplingParams is safe here: a temperature below ``GREEDY_TEMPERATURE`` samples
greedily (dividing by it would overflow), temperatures and repetition penalties are clamped
into ``FLOAT32_SAFE``, top_k is capped at the vocabulary, and logits divided by a repetition
penalty are capped at ``MAX_LOGIT``, so no parameter can produce an infinity or a NaN. A row
whose raw logits are not finite (NaN or inf: the model or a kernel is broken) raises
``NonFiniteLogitsError`` naming its request.
"""

from __future__ import annotations

import torch

from deepinfer_core.engine.sequence import Sequence

NEG_INF = float("-inf")
GREEDY_TEMPERATURE = 1e-5  # below this, temperature sampling is greedy (vLLM's threshold)
MAX_LOGIT = 1e6  # logits raised by a repetition penalty are capped here: / GREEDY_TEMPERATURE stays finite
# Python floats beyond float32's range would become inf on the device (and -inf / inf is NaN):
# temperatures and repetition penalties are clamped into this range first, which changes nothing
# a float32 distribution can show (a temperature of 1e30 is already uniform).
FLOAT32_SAFE = (1e-30, 1e30)


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or inf logits: no token can be chosen from them."""


def _float32_safe(value: float) -> float:
    return min(max(value, FLOAT32_SAFE[0]), FLOAT32_SAFE[1])


def top_logprobs(logprobs_row: torch.Tensor, k: int, token: int | None = None) -> dict[int, float]:
    """{token id: logprob} for the k most likely tokens, plus ``token`` if given."""
    out: dict[int, float] = {}
    if k > 0:
        values, ids = logprobs_row.topk(min(k, logprobs_row.shape[-1]))
        out = dict(zip(ids.tolist(), values.tolist()))
    if token is not None and token not in out:
        out[token] = float(logprobs_row[token])
    return out


def _token_mask(rows: list[list[int]], vocab: int, device: torch.device, counts: bool) -> torch.Tensor:
    """[len(rows), vocab]: how often (counts) or whether each token occurs in each row's list."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.tensor([r + [vocab] * (width - len(r)) for r in rows], dtype=torch.int64).to(device)
    out = torch.zeros(len(rows), vocab + 1, device=device)  # column `vocab` absorbs the padding
    out.scatter_add_(1, ids, torch.ones_like(ids, dtype=out.dtype))
    out = out[:, :vocab]
    return out if counts else out > 0


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> torch.Tensor:
    """A processed copy of ``logits`` [N, V]: repetition / presence / frequency penalties (vLLM's
    definitions) and, before min_tokens outputs, EOS and stop tokens made impossible."""
    logits = logits.float().clone()
    vocab, device = logits.shape[-1], logits.device
    rep = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if rep:
        seen = _token_mask([seqs[i].token_ids() for i in rep], vocab, device, counts=False)
        penalty = torch.tensor([_float32_safe(seqs[i].params.repetition_penalty) for i in rep], device=device)[:, None]
        rows = logits[rep]
        # dividing by a tiny penalty is the one way a penalty can overflow: capped right here
        scaled = torch.where(rows > 0, (rows / penalty).clamp(max=MAX_LOGIT), rows * penalty)
        logits[rep] = torch.where(seen, scaled, rows)
    freq = [i for i, s in enumerate(seqs) if (s.params.presence_penalty or s.params.frequency_penalty) and s.output_token_ids]
    if freq:
        counts = _token_mask([seqs[i].output_token_ids for i in freq], vocab, device, counts=True)
        fp = torch.tensor([seqs[i].params.frequency_penalty for i in freq], device=device)[:, None]
        pp = torch.tensor([seqs[i].params.presence_penalty for i in freq], device=device)[:, None]
        logits[freq] -= fp * counts + pp * (counts > 0).float()
    for i, s in enumerate(seqs):
        if len(s.output_token_ids) < s.params.min_tokens:
            banned = list(s.params.stop_token_ids) + ([] if s.params.ignore_eos else list(eos_ids))
            if banned:
                logits[i, torch.tensor(banned, device=device)] = NEG_INF
    return logits


def sample(ops, logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...] = ()) -> list[tuple[int, float | None, dict[int, float] | None]]:
    """For each row of ``logits`` [N, V] and its sequence: (token, logprob, top logprobs), the last
    two None unless the sequence asked for logprobs."""
    device, vocab = logits.device, logits.shape[-1]
    processed = apply_penalties(logits, seqs, eos_ids)
    params = [s.params for s in seqs]
    temperatures = [_float32_safe(p.temperature) if p.temperature >= GREEDY_TEMPERATURE else 0.0 for p in params]
    # two host-to-device copies per step, whatever the batch size
    floats = torch.tensor([temperatures, [p.top_p for p in params], [p.min_p for p in params]], dtype=torch.float32).to(device)
    ints = torch.tensor(
        [[min(max(p.top_k, 0), vocab) for p in params], [s.seed for s in seqs], [len(s.output_token_ids) for s in seqs]],
        dtype=torch.int64,
    ).to(device)
    tokens = ops.sample_tokens(processed, floats[0], ints[0], floats[1], floats[2], ints[1], ints[2])
    # one device-to-host copy: the tokens and, per row, whether its logits were finite
    tokens, finite = torch.stack([tokens, torch.isfinite(logits).all(dim=-1).to(tokens.dtype)]).tolist()
    broken = [i for i, ok in enumerate(finite) if not ok]
    if broken:
        rows = ", ".join(f"{seqs[i].request_id} (sample {seqs[i].index}, {len(seqs[i].output_token_ids)} tokens generated)" for i in broken)
        raise NonFiniteLogitsError(
            f"the model produced NaN or inf logits for request(s) {rows}: no token can be chosen. The weights are "
            f"finite (checked at load), so an activation overflowed or a kernel is wrong; a float32 run "
            f"(LLM(dtype='float32')) or the reference backend (accelerator='cpu') tells which"
        )
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    results: list[tuple[int, float | None, dict[int, float] | None]] = [(t, None, None) for t in tokens]
    if wanted:
        logprobs = torch.log_softmax(logits[wanted].float(), dim=-1)
        for row, i in enumerate(wanted):
            top = top_logprobs(logprobs[row], params[i].logprobs, tokens[i])
            results[i] = (tokens[i], top[tokens[i]], top)
    return results
