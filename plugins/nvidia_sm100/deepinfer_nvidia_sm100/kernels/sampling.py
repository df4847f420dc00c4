"""Token sampling (``sample_tokens``) on the GPU: one pass over the logits per row, in Triton.

Every row is drawn by the exponential race: the token is ``argmax_i p_i / E_i`` with independent
``E_i ~ Exp(1)``, i.e. ``argmax_i (logit_i / T - log E_i)`` (the softmax normaliser is the same for
every token, so it drops out and no max or sum pass is needed); the kernel works in base 2
(``logit_i log2(e) / T - log2(E_i / ln 2)``, the same argmax). Greedy rows (T <= 0) take
``argmax_i logit_i`` in the same kernel, ties to the lowest id like ``torch.argmax``.

* The noise is made on the fly per vocab tile by Triton's counter-based Philox generator
  (``tl.randint4x``: one Philox evaluation gives the noise of 4 consecutive tokens) and never
  stored. Its key is the row's 63-bit seed, mixed in the kernel from ``(seeds[i], steps[i])``
  exactly like ``deepinfer_core.ops.sampling.row_seed``; its counter is the token id // 4. The
  noise of a token is therefore a function of (seed, step, token id) alone: independent of the
  batch the row runs in, of the tile sizes and of the vocab split. The stream differs from the
  reference's ``torch.Generator`` (the contract allows it: sampled rows are checked statistically).
* E = -log(U) with U = (2k + 1) 2^-24 strictly inside (0, 1); for U close to 1 (E < 1/64) E comes
  from the series of -log(1 - w), w = 1 - U exact, so the fast ``lg2.approx`` (FAST_LOG) is never
  asked for a log of a number near 1, where its absolute error would be of the order of E itself:
  E > 0 always, every key of an allowed token is finite, and tokens that are not allowed get key
  -inf. Hence a token outside the support (p = 0: -inf logit, cut by top-k / top-p / min-p) is
  never drawn.
* top-k / top-p / min-p all keep a prefix of the tokens ranked by logit (top-p's exclusive
  cumulative sum and min-p's ratio to the top token are monotone along the ranking), so their
  intersection is "logit >= a per-row threshold". The threshold is computed with torch as the
  reference defines it (same sort, softmax and cumulative sum, on the scaled logits) and passed
  in RAW logit units (the logit of the last kept token, or ``max + T log(min_p)``): the kernel
  compares raw logits with it, no rounding of ``logit / T`` can move a token across it, and the
  top token always passes (a row with top_k = 1 is exactly greedy).
  Cost: the ranking needs a sort of the whole row only for rows with top-p and no (small) top-k.
  Deciding which case applies needs the values of the parameter tensors, so eager calls make ONE
  host read of a 4-element summary (the sampler runs outside CUDA graphs): with no restriction
  on any sampled row nothing is sorted; with top-k <= TOPK_CAP on every top-p row, ``torch.topk``
  over max(top_k) columns replaces the sort; min-p alone needs only the row max. Under CUDA-graph
  capture there is no host read: the general path (a full sort) runs, with the same results.
  Tokens tied with the threshold logit are all kept (the reference keeps whichever of them its
  unstable sort puts first).
* Grid = rows x vocab splits, so that few rows still fill the GPU. A program walks its split in
  tiles of BLOCK tokens held as [BLOCK / 4, 4] (4 consecutive tokens per Philox call and per
  vector load), keeps the best (key, id) per tile slot in registers, and reduces across the
  program once at the end (no barrier per tile). Each split writes its best (key, id) and a
  second tiny kernel picks the best split per row (ties to the lower split, so the lowest id
  overall); with one split the first kernel writes the token.

Degenerate parameters the reference turns into NaN probabilities (top_p <= 0, min_p > 1, every
logit -inf) give the row's greedy token (or id 0 when every logit is -inf) here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from deepinfer_nvidia_sm100.kernels.device import await_inputs, launch_options, num_sms

# Tunables (sweep on the GPU). Logits per tile (a power of two >= 16); warps per program.
BLOCK_V = 2048
NUM_WARPS = 8
# Philox rounds per 4 noise values (Triton's default 10; 7 is the smallest count the Philox
# authors found to pass BigCrush).
PHILOX_ROUNDS = 10
# lg2.approx for the two logs of the noise (the precise log2 costs ~30 instructions); the
# interpreter always takes tl.log2 (it cannot run libdevice).
FAST_LOG = True
# Vocab splits are added until rows x splits reaches this many programs per SM ...
PROGRAMS_PER_SM = 4
# ... but a split covers at least this many tiles.
MIN_SPLIT_TILES = 1
# Rows with top-p whose top_k is in 1..TOPK_CAP are ranked with torch.topk(max top_k) instead of
# a full sort (eager calls only).
TOPK_CAP = 1024
# SMs assumed under the interpreter (no GPU there); small so tests exercise the vocab split.
INTERPRETER_SMS = 2

LOG2E = tl.constexpr(1.4426950408889634)
_MIX_SIGNED = tl.constexpr(0x9E3779B97F4A7C15 - 2**64)  # deepinfer_core.ops.sampling._MIX as an int64
_SEED_MASK = tl.constexpr(2**63 - 1)


@triton.jit
def _row_seed(seed, step):
    """deepinfer_core.ops.sampling.row_seed in int64 arithmetic (the product wraps mod 2^64)."""
    return (seed.to(tl.int64) * _MIX_SIGNED + step.to(tl.int64)) & _SEED_MASK


@triton.jit
def _log2(x, FAST: tl.constexpr):
    if FAST:
        return libdevice.fast_log2f(x)  # lg2.approx.ftz.f32, one MUFU op
    else:
        return tl.log2(x)


@triton.jit
def _gumbel_noise(seed, tile_start, BLOCK_Q: tl.constexpr, N_ROUNDS: tl.constexpr, FAST_LOG: tl.constexpr):
    """-log2(E / ln 2), E ~ Exp(1), for tokens tile_start + 4 q + c (q < BLOCK_Q, c < 4), as a
    [BLOCK_Q, 4] tile: the noise of the race in base 2 (a constant offset does not matter)."""
    counter = tile_start // 4 + tl.arange(0, BLOCK_Q)
    r0, r1, r2, r3 = tl.randint4x(seed, counter, N_ROUNDS)
    c = tl.arange(0, 4)[None, :]
    r = tl.where(c == 0, r0[:, None], tl.where(c == 1, r1[:, None], tl.where(c == 2, r2[:, None], r3[:, None])))
    # 24 random bits, forced odd: U = (2k + 1) 2^-24 in [2^-24, 1 - 2^-24], exact in float32.
    odd = ((r.to(tl.uint32, bitcast=True) >> 8) | 1).to(tl.int32)
    u = odd.to(tl.float32) * 5.9604644775390625e-08
    w = 1.0 - u  # exact (Sterbenz) where it is used, u >= 63/64
    series = w * (1.0 + w * (0.5 + w * (0.3333333333333333 + w * 0.25))) * LOG2E  # -log2(1 - w), w < 1/64
    e2 = tl.where(w < 0.015625, series, -_log2(u, FAST_LOG))  # E / ln 2 > 0
    return -_log2(e2, FAST_LOG)


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    threshold_ptr,
    seeds_ptr,
    steps_ptr,
    part_key_ptr,
    part_id_ptr,
    out_ptr,
    vocab,
    num_splits,
    TILES: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
    DIRECT: tl.constexpr,
    BLOCK: tl.constexpr,
    N_ROUNDS: tl.constexpr,
    FAST_LOG: tl.constexpr, PDL: tl.constexpr,
):
    await_inputs(PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    start = split * (TILES * BLOCK)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row

    BLOCK_Q: tl.constexpr = BLOCK // 4
    # token id of tile element [q, c] relative to the tile start
    rel = 4 * tl.arange(0, BLOCK_Q)[:, None] + tl.arange(0, 4)[None, :]
    # Running best per tile slot, reduced across the program once at the end. A slot keeps its
    # earliest id on equal keys (strict >); untouched slots keep the first tile's ids.
    acc_key = tl.full((BLOCK_Q, 4), -float("inf"), tl.float32)
    acc_id = start + rel
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    if temperature > 0:
        scale = LOG2E / temperature  # keys in base 2
        seed = _row_seed(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
        if HAS_THRESHOLD:
            threshold = tl.load(threshold_ptr + row)
        for i in range(TILES):
            tile = start + i * BLOCK
            ids = tile + rel
            logit = tl.load(row_ptr + ids, mask=ids < vocab, other=-float("inf")).to(tl.float32)
            key = logit * scale + _gumbel_noise(seed, tile, BLOCK_Q, N_ROUNDS, FAST_LOG)
            if HAS_THRESHOLD:  # a masked or -inf logit already has key -inf
                key = tl.where(logit >= threshold, key, -float("inf"))
            better = key > acc_key
            acc_key = tl.where(better, key, acc_key)
            acc_id = tl.where(better, ids, acc_id)
    else:
        for i in range(TILES):
            ids = start + i * BLOCK + rel
            logit = tl.load(row_ptr + ids, mask=ids < vocab, other=-float("inf")).to(tl.float32)
            better = logit > acc_key
            acc_key = tl.where(better, logit, acc_key)
            acc_id = tl.where(better, ids, acc_id)
    best_key = tl.max(acc_key)
    best_id = tl.min(tl.where(acc_key == best_key, acc_id, vocab + TILES * BLOCK))  # lowest id on ties

    if DIRECT:
        tl.store(out_ptr + row, best_id.to(tl.int64))
    else:
        tl.store(part_key_ptr + row * num_splits + split, best_key)
        tl.store(part_id_ptr + row * num_splits + split, best_id)


@triton.jit
def _combine_kernel(part_key_ptr, part_id_ptr, out_ptr, num_splits, SPLITS: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    row = tl.program_id(0)
    s = tl.arange(0, SPLITS)
    valid = s < num_splits
    key = tl.load(part_key_ptr + row * num_splits + s, mask=valid, other=-float("inf"))
    ids = tl.load(part_id_ptr + row * num_splits + s, mask=valid, other=0)
    best = tl.max(key)
    first = tl.min(tl.where(valid & (key == best), s, SPLITS))
    tl.store(out_ptr + row, tl.sum(tl.where(s == first, ids, 0)).to(tl.int64))


def _launch_config(rows: int, vocab: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK, tiles per split, splits) from the shapes alone."""
    block = max(16, min(BLOCK_V, triton.next_power_of_2(vocab)))
    tiles = triton.cdiv(vocab, block)
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms(device, INTERPRETER_SMS), rows)
    splits = max(1, min(wanted, tiles // MIN_SPLIT_TILES))
    # a power of two: the trip count is a compile-time constant, so few variants get compiled
    per_split = triton.next_power_of_2(triton.cdiv(tiles, splits))
    return block, per_split, triton.cdiv(tiles, per_split)


def _race(logits, temperature, threshold, seeds, steps, out):
    """Write into ``out`` [N] int64 each row's token given its raw-logit threshold (None: none)."""
    rows, vocab = logits.shape
    block, tiles, splits = _launch_config(rows, vocab, logits.device)
    direct = splits == 1
    if direct:
        part_key = part_id = out  # unused
    else:
        part_key = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
        part_id = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    _sample_kernel[(rows, splits)](
        logits,
        logits.stride(0),
        temperature,
        temperature if threshold is None else threshold,
        seeds,
        steps,
        part_key,
        part_id,
        out,
        vocab,
        splits,
        TILES=tiles,
        HAS_THRESHOLD=threshold is not None,
        DIRECT=direct,
        BLOCK=block,
        N_ROUNDS=PHILOX_ROUNDS,
        FAST_LOG=FAST_LOG and logits.is_cuda,  # the interpreter has no libdevice
        num_warps=NUM_WARPS, **launch_options(logits.device),
    )
    if not direct:
        _combine_kernel[(rows,)](part_key, part_id, out, splits, SPLITS=max(16, triton.next_power_of_2(splits)), num_warps=1,
                                 **launch_options(part_key.device))
    return out


def _restrictions(temperature, top_k, top_p, min_p, vocab: int):
    """(sampled, has_k, has_p, ranked, minp) row masks, on the tensors' device."""
    sampled = temperature > 0
    has_k = (top_k > 0) & (top_k < vocab)
    has_p = top_p < 1
    ranked = sampled & (has_k | has_p)  # rows whose support needs the tokens' ranking
    return sampled, has_k, has_p, ranked, sampled & (min_p > 0)


def _summary(temperature, top_k, top_p, min_p, vocab: int) -> list[int]:
    """[any ranked row, any min-p row, any top-p row without a small top-k, largest top-k]: what
    picks the cheapest threshold computation. A host read when the tensors are on the device."""
    _, has_k, has_p, ranked, minp = _restrictions(temperature, top_k, top_p, min_p, vocab)
    unbounded = ranked & has_p & ~(has_k & (top_k <= TOPK_CAP))
    flags = torch.stack([ranked.any(), minp.any(), unbounded.any()]).long()
    return torch.cat([flags, torch.where(ranked & has_k, top_k, 0).amax(dim=0, keepdim=True)]).tolist()


def _thresholds(logits, temperature, top_k, top_p, min_p, host_read: bool, host_params=None, full_sort: bool = False):
    """Per-row raw-logit threshold [N] float32 of the top-k / top-p / min-p support, or None when
    no sampled row restricts. ``host_params`` (CPU copies of temperature, top_k, top_p, min_p), or
    else ``host_read`` (one device-to-host read), pick the cheapest way; ``full_sort``: rows are
    ranked by a sort of the whole vocabulary, never by a top-k as wide as the batch's largest
    (whose softmax and cumulative sum would follow the other rows: batch-invariant sampling)."""
    rows, vocab = logits.shape
    sampled, has_k, has_p, ranked, minp = _restrictions(temperature, top_k, top_p, min_p, vocab)
    width = vocab
    if host_params is not None or host_read:
        any_ranked, any_minp, any_unbounded, max_k = _summary(*(host_params or (temperature, top_k, top_p, min_p)), vocab)
        if not (any_ranked or any_minp):
            return None
        width = 0 if not any_ranked else vocab if any_unbounded or full_sort else max_k
    t = torch.where(sampled, temperature.float(), 1.0)[:, None]
    threshold = torch.full((rows,), float("-inf"), device=logits.device)
    if width:
        if width == vocab:
            raw = logits.sort(dim=-1, descending=True).values
        else:
            raw = logits.topk(width, dim=-1).values
        raw = raw.float()
        scaled = raw / t
        keep = torch.arange(width, device=logits.device)[None, :] < torch.where(has_k, top_k, vocab)[:, None]
        probs = scaled.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        p = top_p.float()[:, None]
        keep &= ((probs.cumsum(dim=-1) - probs) < p) | (p >= 1)
        last = (keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
        threshold = torch.where(ranked, raw.gather(1, last).squeeze(1), threshold)
        row_max = raw[:, 0]
    else:
        row_max = logits.amax(dim=-1).float()
    # min-p: p_i >= min_p p_max  <=>  logit_i >= logit_max + T log(min_p), whatever was cut before
    floor = row_max + t[:, 0] * torch.log(min_p.float().clamp(min=1e-30, max=1.0))
    return torch.where(minp, torch.maximum(threshold, floor), threshold)


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
    """See deepinfer_core.ops.sampling.sample_tokens (same contract). With ``host_params`` the
    choice of threshold computation is made on the host: no device-to-host read."""
    return _sample(logits, temperature, top_k, top_p, min_p, seeds, steps, host_params, full_sort=False)


def invariant_sample_tokens(
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
    """``sample_tokens``, batch-invariant: a row's noise and race never depend on the batch; its
    top-k / top-p threshold comes from a sort of its whole row whenever any row is ranked."""
    return _sample(logits, temperature, top_k, top_p, min_p, seeds, steps, host_params, full_sort=True)


def _sample(logits, temperature, top_k, top_p, min_p, seeds, steps, host_params, full_sort: bool) -> torch.Tensor:
    rows = logits.shape[0]
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    capturing = logits.is_cuda and torch.cuda.is_current_stream_capturing()
    threshold = _thresholds(logits, temperature, top_k, top_p, min_p, host_read=not capturing, host_params=host_params,
                            full_sort=full_sort)
    return _race(logits, temperature.contiguous(), threshold, seeds.contiguous(), steps.contiguous(), out)


sample_tokens.impl = "triton: fused greedy argmax + exponential race with on-the-fly Philox noise, split-vocab; top-k/top-p/min-p as a per-row logit threshold"


invariant_sample_tokens.impl = "triton, batch-invariant: " + sample_tokens.impl.removeprefix("triton: ") + ", ranked by a full sort"

OPS = {"sample_tokens": sample_tokens}
INVARIANT_OPS = {"sample_tokens": invariant_sample_tokens}
