"""Speculative sampling against the draft model's cached distribution (Leviathan et al. 2023,
Chen et al. 2023): draft j ~ q_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the
first rejection a token is drawn from the normalised residual max(p_j - q_j, 0); after the
last accepted draft the target's own sample is the bonus token. Every emitted token is then
distributed exactly as plain sampling from the target would give it.

Two ways to verify sampled drafts (``SpeculativeConfig.acceptance``):

* "coupled": the draft is drawn with the very noise the target's sample at that position uses
  (same op, same seed and position), and accepted iff it equals the target's sample. The
  output is token for token what plain decoding emits, for any seed and in any batch.
* "rejection" (this module): accepts more often (1 - TV(p, q) per position, against at least
  (1 - TV) / (1 + TV) coupled), still exact in distribution, reproducible for a seed and batch
  invariant (all randomness is keyed by the sequence seed and the output position), but the
  tokens of a seeded request differ from those of plain decoding: no scheme can have both this
  acceptance and token identity (a coupling that cannot see p when it drafts cannot be maximal).
* "auto" (default): coupled for requests that give a seed (their tokens are promised), rejection
  for the others. Greedy rows are the same under all three: accepted while drafts equal the argmax.
"""

from __future__ import annotations

import torch

from deepinfer_core.ops.sampling import row_seed
from deepinfer_core.sampling.sampler import is_greedy

ACCEPTANCE_MODES = ("auto", "coupled", "rejection")
# independent random streams per (seed, output position), apart from the target's own noise
DRAFT_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM = 1, 2, 3


def uses_rejection(params, mode: str) -> bool:
    """Whether a sequence's sampled drafts are verified by rejection sampling (see the module doc)."""
    if is_greedy(params):
        return False
    return mode == "rejection" or (mode == "auto" and params.seed is None)


def _generator(seed: int, position: int, stream: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(row_seed(row_seed(seed, position), stream))


def draw(probs: torch.Tensor, seed: int, position: int, stream: int = DRAFT_STREAM) -> int:
    """One token from the distribution ``probs`` [V] (exponential race), keyed by (seed, position, stream)."""
    noise = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=_generator(seed, position, stream, probs.device))
    return int((probs.float() / noise).argmax())


def accept(p: torch.Tensor, q: torch.Tensor, drafts: list[int], seed: int, first_position: int, bonus: int) -> list[int]:
    """The tokens a verification row emits. p [n + 1, V]: the target's distribution at each of its
    positions (position j after drafts[:j]); q [n, V]: the distribution each draft was drawn from;
    first_position: the output position of drafts[0]; bonus: the target's sample after the last draft."""
    n = len(drafts)
    if n == 0:
        return [bonus]
    device = p.device
    index = torch.arange(n, device=device)
    d = torch.tensor(drafts, dtype=torch.int64, device=device)
    u = torch.stack([torch.rand((), generator=_generator(seed, first_position + j, ACCEPT_STREAM, device), device=device)
                     for j in range(n)])
    accepted = (u * q[index, d] < p[:n][index, d]).tolist()  # u < p / q, without dividing by q
    for j, ok in enumerate(accepted):
        if not ok:
            residual = (p[j] - q[j]).clamp(min=0)
            if float(residual.sum()) <= 0:  # p == q up to rounding: the rejection was of probability ~0
                residual = p[j]
            return drafts[:j] + [draw(residual, seed, first_position + j, RESIDUAL_STREAM)]
    return drafts + [bonus]
