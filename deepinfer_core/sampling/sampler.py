"""Logits -> next tokens (+ logprobs) for a batch of sequences, on the logits' device.

Logit controls (allowed_token_ids, bad_words, logit_bias), penalties and min_tokens are applied
here, batched (``apply_penalties``); the draw itself is the ``sample_tokens``
op of the backend's op table. Logprobs are those of the model's distribution (log_softmax of
the raw logits, before penalties, temperature and truncation), as vLLM reports them.

A row is a ``SampleRow``: a sequence plus what the host does not hold in its token list yet
(draft tokens before a verification row's position; tokens still on the device in overlapped
mode). ``launch`` leaves the sampled ids on the device (the next step may read them there) and
starts their copy to the host; ``SampledBatch.resolve`` waits for that copy only.

Randomness is keyed by (sequence seed, output position): the token a row samples is the token
plain decoding would sample at that position from the same logits, which is what makes
speculative verification exact (``verify``).

Any valid SamplingParams is safe here: a temperature below ``GREEDY_TEMPERATURE`` samples
greedily (dividing by it would overflow), temperatures and repetition penalties are clamped
into ``FLOAT32_SAFE``, top_k is capped at the vocabulary, and logits divided by a repetition
penalty are capped at ``MAX_LOGIT``, so no parameter can produce an infinity or a NaN. A row
whose raw logits are not finite (NaN or inf: the model or a kernel is broken) raises
``NonFiniteLogitsError`` naming its request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer_core.ops.sampling import apply_token_bitmask, sampling_probs
from deepinfer_core.platform import to_device

if TYPE_CHECKING:  # the engine's sequences, as the rows it samples (an annotation: sampling sits below the engine)
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


class Logprob(float):
    """A token's log-probability: a float, and, as vLLM's ``Logprob``, ``.logprob`` (the same
    value), ``.rank`` (1 for the most likely token) and ``.decoded_token`` (its text; filled
    once the output reaches the tokenizer, None without one)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, value: float, rank: int | None = None, decoded_token: str | None = None):
        obj = super().__new__(cls, value)
        obj.rank, obj.decoded_token = rank, decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank}, decoded_token={self.decoded_token!r})"


def ranked(ids: list[int], values: list[float], token: int, token_value: float, token_rank: int) -> dict[int, Logprob]:
    """{id: Logprob} of the top ``ids`` (ranks 1, 2, ... in order) and of ``token`` (``token_rank``)."""
    out = {i: Logprob(v, r) for r, (i, v) in enumerate(zip(ids, values), start=1)}
    if token not in out:
        out[token] = Logprob(token_value, token_rank)
    return out


def most_likely(top: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    """The ``n`` most likely entries of a position's logprobs, by rank (the sampled token is
    among them only when its rank is within ``n``)."""
    return sorted(((t, v) for t, v in top.items() if v.rank is not None and v.rank <= n), key=lambda tv: tv[1].rank)


def top_logprobs(logprobs_row: torch.Tensor, k: int, token: int | None = None) -> dict[int, Logprob]:
    """{token id: Logprob} for the k most likely tokens, plus ``token`` if given."""
    out: dict[int, Logprob] = {}
    if k > 0:
        values, ids = logprobs_row.topk(min(k, logprobs_row.shape[-1]))
        out = {i: Logprob(v, r) for r, (i, v) in enumerate(zip(ids.tolist(), values.tolist()), start=1)}
    if token is not None and token not in out:
        value = logprobs_row[token]
        out[token] = Logprob(float(value), int((logprobs_row > value).sum()) + 1)
    return out


@dataclass(eq=False)
class SampleRow:
    """One row of logits to sample for ``seq``: ``drafts`` are tokens the row's position comes
    after that the sequence holds only as drafts; ``pending`` outputs before it are on the device."""

    seq: Sequence
    drafts: list[int] = field(default_factory=list)
    pending: int = 0

    @property
    def params(self):
        return self.seq.params

    @property
    def num_outputs(self) -> int:
        """Output tokens before this row's: its sampling step (seed position) and min_tokens count."""
        return len(self.seq.output_token_ids) + self.pending + len(self.drafts)

    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.drafts

    def token_ids(self) -> list[int]:
        return self.seq.token_ids() + self.drafts


def _rows(seqs) -> list[SampleRow]:
    return [s if isinstance(s, SampleRow) else SampleRow(s) for s in seqs]


def _token_mask(rows: list[list[int]], vocab: int, device: torch.device, counts: bool) -> torch.Tensor:
    """[len(rows), vocab]: how often (counts) or whether each token occurs in each row's list."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.tensor([r + [vocab] * (width - len(r)) for r in rows], dtype=torch.int64).to(device)
    out = torch.zeros(len(rows), vocab + 1, device=device)  # column `vocab` absorbs the padding
    out.scatter_add_(1, ids, torch.ones_like(ids, dtype=out.dtype))
    out = out[:, :vocab]
    return out if counts else out > 0


def needs_history(params) -> bool:
    """Whether sampling for these params reads the token ids generated so far (penalties, bad_words)."""
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty or params.frequency_penalty or params.bad_words)


def _banned_words(row: SampleRow) -> list[int]:
    """The last tokens of ``row``'s bad words whose other tokens end its output so far (vLLM's rule)."""
    words = row.seq.bad_words_token_ids
    if not words:
        return []
    out = row.output_token_ids()
    return [w[-1] for w in words if len(w) - 1 <= len(out) and (len(w) == 1 or out[len(out) - len(w) + 1:] == w[:-1])]


def _apply_logit_controls(logits: torch.Tensor, seqs: list[SampleRow]) -> None:
    """In place: allowed_token_ids (every other token -inf), bad_words (``_banned_words`` -inf) and
    logit_bias (added), in vLLM's order, before penalties and temperature."""
    vocab, device = logits.shape[-1], logits.device
    allowed = [i for i, s in enumerate(seqs) if s.params.allowed_token_ids is not None]
    if allowed:
        keep = _token_mask([list(seqs[i].params.allowed_token_ids) for i in allowed], vocab, device, counts=False)
        index = to_device(torch.tensor(allowed, dtype=torch.int64), device)
        logits[index] = logits[index].masked_fill(~keep, NEG_INF)
    rows, cols, bias = [], [], []
    for i, s in enumerate(seqs):
        banned = _banned_words(s)
        rows += [i] * len(banned)
        cols += banned
    if rows:
        logits[to_device(torch.tensor(rows, dtype=torch.int64), device), to_device(torch.tensor(cols, dtype=torch.int64), device)] = NEG_INF
    rows, cols = [], []
    for i, s in enumerate(seqs):
        if s.params.logit_bias:
            rows += [i] * len(s.params.logit_bias)
            cols += list(s.params.logit_bias)
            bias += list(s.params.logit_bias.values())
    if rows:
        index = (to_device(torch.tensor(rows, dtype=torch.int64), device), to_device(torch.tensor(cols, dtype=torch.int64), device))
        logits.index_put_(index, to_device(torch.tensor(bias, dtype=logits.dtype), device), accumulate=True)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence | SampleRow], eos_ids: tuple[int, ...]) -> torch.Tensor:
    """A processed copy of ``logits`` [N, V]: the logit controls (``_apply_logit_controls``),
    repetition / presence / frequency penalties (vLLM's definitions) and, before min_tokens
    outputs, EOS and stop tokens made impossible."""
    seqs = _rows(seqs)
    logits = logits.float().clone()
    vocab, device = logits.shape[-1], logits.device
    _apply_logit_controls(logits, seqs)
    rep = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if rep:
        seen = _token_mask([seqs[i].token_ids() for i in rep], vocab, device, counts=False)
        penalty = torch.tensor([_float32_safe(seqs[i].params.repetition_penalty) for i in rep], device=device)[:, None]
        rows = logits[rep]
        # dividing by a tiny penalty is the one way a penalty can overflow: capped right here
        scaled = torch.where(rows > 0, (rows / penalty).clamp(max=MAX_LOGIT), rows * penalty)
        logits[rep] = torch.where(seen, scaled, rows)
    freq = [i for i, s in enumerate(seqs) if (s.params.presence_penalty or s.params.frequency_penalty) and s.num_outputs]
    if freq:
        counts = _token_mask([seqs[i].output_token_ids() for i in freq], vocab, device, counts=True)
        fp = torch.tensor([seqs[i].params.frequency_penalty for i in freq], device=device)[:, None]
        pp = torch.tensor([seqs[i].params.presence_penalty for i in freq], device=device)[:, None]
        logits[freq] -= fp * counts + pp * (counts > 0).float()
    rows, cols = [], []
    for i, s in enumerate(seqs):
        if s.num_outputs < s.params.min_tokens:
            # a grammar decides when a constrained output may end (its mask allows EOS exactly then)
            banned = list(s.params.stop_token_ids) + ([] if s.params.ignore_eos or s.seq.grammar is not None else list(eos_ids))
            rows += [i] * len(banned)
            cols += banned
    if rows:
        logits[to_device(torch.tensor(rows, dtype=torch.int64), device), to_device(torch.tensor(cols, dtype=torch.int64), device)] = NEG_INF
    return logits


@dataclass
class SampledBatch:
    """Tokens sampled on the device, their copy to the host under way."""

    rows: list[SampleRow]
    tokens: torch.Tensor  # [N] int64, on the device
    host: object  # Platform.copy_to_host handle: tokens, finite flags, logprob data
    wanted: list[int]  # rows that asked for logprobs
    bitmask: torch.Tensor | None = None  # the grammar masks the rows were sampled under (host int32 [N, W])

    def resolve(self) -> list[tuple[int, float | None, dict[int, Logprob] | None]]:
        """(token, logprob, top logprobs) per row, the last two None unless its sequence asked for them."""
        copied = self.host.wait()
        tokens, finite = copied[0].tolist()
        rows = self.rows
        broken = [i for i, ok in enumerate(finite) if not ok]
        if broken:
            names = ", ".join(f"{rows[i].seq.request_id} (sample {rows[i].seq.index}, {rows[i].num_outputs} tokens generated)" for i in broken)
            raise NonFiniteLogitsError(
                f"the model produced NaN or inf logits for request(s) {names}: no token can be chosen. The weights are "
                f"finite (checked at load), so an activation overflowed or a kernel is wrong; a float32 run "
                f"(LLM(dtype='float32')) or the reference backend (accelerator='cpu') tells which"
            )
        results: list[tuple[int, float | None, dict[int, Logprob] | None]] = [(t, None, None) for t in tokens]
        if self.wanted:
            chosen, values, ids, ranks = copied[1].tolist(), copied[2].tolist(), copied[3].tolist(), copied[4].tolist()
            for row, i in enumerate(self.wanted):
                k = rows[i].params.logprobs
                top = ranked(ids[row][:k], values[row][:k], tokens[i], chosen[row], ranks[row])
                results[i] = (tokens[i], chosen[row], top)
        return results


class _HostNow:
    """copy_to_host for callers without a platform: the tensors, moved now."""

    def __init__(self, tensors):
        self.tensors = [t.cpu() for t in tensors]

    def wait(self):
        return self.tensors


def is_greedy(params) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def _row_tensors(rows: list[SampleRow], vocab: int, device: torch.device):
    """The rows' sampling parameters on ``device`` in two copies, whatever the batch size:
    floats [3, N] (temperature, 0 for greedy; top_p; min_p), ints [3, N] (top_k; seed; output
    position), and host copies of (temperature, top_k, top_p, min_p)."""
    params = [r.params for r in rows]
    temperatures = [0.0 if is_greedy(p) else _float32_safe(p.temperature) for p in params]
    floats = torch.tensor([temperatures, [p.top_p for p in params], [p.min_p for p in params]], dtype=torch.float32)
    ints = torch.tensor(
        [[min(max(p.top_k, 0), vocab) for p in params], [r.seq.seed for r in rows], [r.num_outputs for r in rows]],
        dtype=torch.int64,
    )
    host_params = (floats[0], ints[0], floats[1], floats[2])
    return to_device(floats, device), to_device(ints, device), host_params


def probabilities(logits: torch.Tensor, rows: list[Sequence | SampleRow], eos_ids: tuple[int, ...] = (),
                  bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """[N, V] float32: the distribution ``launch`` samples each row of ``logits`` from (penalties,
    min_tokens, the grammar ``bitmask``, temperature, top-k / top-p / min-p); a greedy row is a
    point mass on its token."""
    rows = _rows(rows)
    floats, ints, _ = _row_tensors(rows, logits.shape[-1], logits.device)
    processed = apply_penalties(logits, rows, eos_ids)
    if bitmask is not None:
        processed = apply_token_bitmask(processed, bitmask)
    return sampling_probs(processed, floats[0], ints[0], floats[1], floats[2])


def launch(ops, logits: torch.Tensor, rows: list[Sequence | SampleRow], eos_ids: tuple[int, ...] = (), copy_to_host=_HostNow,
           bitmask: torch.Tensor | None = None) -> SampledBatch:
    """Sample one token per row of ``logits`` [N, V] (float32) on its device; the copy of the
    tokens (and of the logprobs rows asked for) to the host is started with ``copy_to_host``.
    ``bitmask`` (host int32 [N, W], ``sampling.structured``): the tokens each row's grammar allows."""
    rows = _rows(rows)
    device, vocab = logits.device, logits.shape[-1]
    processed = apply_penalties(logits, rows, eos_ids)
    if bitmask is not None:
        processed = ops.apply_token_bitmask(processed, to_device(bitmask, device))
    params = [r.params for r in rows]
    # a row whose controls (and grammar) allow no token at all ends: EOS gets a chance. Only
    # allowed_token_ids, bad_words and grammars can forbid every token; other steps skip the check.
    if eos_ids and (bitmask is not None or any(p.allowed_token_ids is not None or p.bad_words for p in params)):
        nothing = torch.isneginf(processed).all(dim=-1)
        processed[:, eos_ids[0]] = torch.where(nothing, 0.0, processed[:, eos_ids[0]])
    floats, ints, host_params = _row_tensors(rows, vocab, device)
    tokens = ops.sample_tokens(processed, floats[0], ints[0], floats[1], floats[2], ints[1], ints[2], host_params=host_params)
    # the tokens and, per row, whether its logits were finite: one copy
    out = [torch.stack([tokens, torch.isfinite(logits).all(dim=-1).to(tokens.dtype)])]
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        index = to_device(torch.tensor(wanted, dtype=torch.int64), device)
        logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
        k = min(max(params[i].logprobs for i in wanted), vocab)
        values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        chosen = logprobs.gather(1, tokens.index_select(0, index)[:, None])
        out += [chosen[:, 0], values, ids, (logprobs > chosen).sum(dim=-1) + 1]  # the sampled token's rank last
    return SampledBatch(rows, tokens, copy_to_host(out), wanted, bitmask)


def sample(ops, logits: torch.Tensor, seqs: list[Sequence | SampleRow], eos_ids: tuple[int, ...] = ()) -> list[tuple[int, float | None, dict[int, Logprob] | None]]:
    """For each row of ``logits`` [N, V] and its sequence: (token, logprob, top logprobs), the last
    two None unless the sequence asked for logprobs."""
    return launch(ops, logits, seqs, eos_ids).resolve()


def verify(sampled: list[int], drafts: list[int]) -> list[int]:
    """The tokens a sequence accepts from a verification row: ``sampled`` holds the token sampled
    at each of its 1 + len(drafts) positions (each as plain decoding would sample it there, given
    the drafts before it). Drafts are accepted while they equal what was sampled; then the sampled
    token at the first mismatch (or after the last draft) is added."""
    for i, d in enumerate(drafts):
        if sampled[i] != d:
            return drafts[:i] + [sampled[i]]
    return drafts + [sampled[len(drafts)]]
