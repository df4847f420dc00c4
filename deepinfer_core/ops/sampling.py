"""Token sampling from processed logits (temperature, top-k, top-p, min-p), seeded per row."""

from __future__ import annotations

import torch

_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) pairs over the generator's seed space


def row_seed(seed: int, step: int) -> int:
    """The generator seed of a row that samples its ``step``-th token under request seed ``seed``."""
    return (seed * _MIX + step) % 2**63


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    *,
    host_params: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """One token per row of ``logits`` [N, V] (float32, penalties already applied). Returns [N] int64.

    host_params: None, or CPU copies of (temperature, top_k, top_p, min_p): a backend decides
    from them on the host whatever it would otherwise read back from the device (which kind of
    restriction any row uses), so sampling never waits for the device. Results must not depend
    on whether it is given.

    temperature [N] float32: 0 means greedy (argmax of logits; ties go to the lowest id). Other
    rows sample from softmax(logits / temperature) restricted to the top_k [N] int64 (0: off)
    largest, then to the smallest set whose probability reaches top_p [N] float32 (1: off), then
    to tokens with probability >= min_p [N] float32 (0: off) times the largest; tokens whose logit
    equals that of the last token kept are kept too (ties never depend on sort order). Randomness is a
    function of (seeds[i], steps[i]) [N] int64 alone, so a row's draw does not depend on the
    batch it runs in; backends may use their own generator (conformance of sampled rows is
    statistical, greedy rows must match exactly). Inputs are not modified.
    """
    greedy = temperature <= 0
    tokens = logits.argmax(dim=-1)
    if bool((host_params[0] <= 0).all() if host_params is not None else greedy.all()):
        return tokens
    rows = (~greedy).nonzero().flatten()
    scaled = logits[rows] / temperature[rows, None]
    scaled = _restrict(scaled, top_k[rows], top_p[rows], min_p[rows])
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for i, (seed, step) in enumerate(zip(seeds[rows].tolist(), steps[rows].tolist())):
        gen = torch.Generator(device=probs.device).manual_seed(row_seed(seed, step))
        noise[i].exponential_(generator=gen)
    # argmax(p / E) with E ~ Exp(1) draws from the categorical p (the exponential race).
    tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """float32 [N, V]: the distribution ``sample_tokens`` draws each row from (its arguments'
    meaning); greedy rows (temperature 0) are a point mass on their argmax."""
    t = torch.where(temperature > 0, temperature, 1.0)[:, None]
    probs = _restrict(logits.float() / t, top_k, top_p, min_p).softmax(dim=-1)
    greedy = (temperature <= 0).nonzero().flatten()
    if greedy.numel():
        probs[greedy] = torch.nn.functional.one_hot(logits[greedy].argmax(dim=-1), logits.shape[-1]).to(probs.dtype)
    return probs


def _restrict(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    keep &= torch.arange(vocab, device=scaled.device)[None, :] < k[:, None]
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    # drop a token when the tokens ranked above it already reach top_p
    keep &= ((probs.cumsum(dim=-1) - probs) < top_p[:, None]) | (top_p[:, None] >= 1)
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    # Each restriction keeps a prefix of the ranking, so the support is "logit >= the last kept
    # logit": tokens tied with it are kept too, whatever order the sort left equal logits in.
    last = (keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    return scaled.masked_fill(scaled < sorted_logits.gather(1, last), float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [N, V] (float32) with every token a row's grammar forbids set to -inf; returns a
    new [N, V] float32 tensor (inputs are not modified).

    bitmask [N, W] int32, W >= ceil(V / 32) (xgrammar's layout): token t of row i is allowed when
    bit t % 32 (least significant first) of word bitmask[i, t // 32] is set; a row of -1 words
    allows every token. Words past the vocabulary are ignored. Allowed logits are unchanged
    (bit for bit), whatever they are.
    """
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).flatten(1)[:, :vocab].bool()
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
