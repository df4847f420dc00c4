"""The Triton sample_tokens against the reference op.

Greedy rows must match the reference exactly (ties to the lowest id); sampled rows are checked
statistically (chi-square of token frequencies against the reference distribution, as the spec
says), for never leaving the reference support, and for being a function of (seed, step) alone.
Without CUDA the kernels run in Triton's interpreter on tiny float32 shapes; with CUDA the same
tests also run at the spec's real vocabularies, in bf16 and float32 logits.
"""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton): the NVIDIA kernels cannot run")
import triton.language as tl  # noqa: E402

from deepinfer_core.conformance.checks import chi_square_pvalue, reference_distribution  # noqa: E402
from deepinfer_core.conformance.inputs import sampling_params  # noqa: E402
from deepinfer_core.ops import REFERENCE_OPS  # noqa: E402
from deepinfer_core.ops.sampling import row_seed  # noqa: E402
from deepinfer_nvidia_sm100.kernels import sampling as kernels
from deepinfer_nvidia_sm100.kernels.sampling import sample_tokens
from tests.op_spec import assert_close, shapes, spec

OP = "sample_tokens"
REFERENCE = REFERENCE_OPS[OP]
ON_GPU = torch.cuda.is_available()
ALPHA = spec()[OP]["statistical"]["alpha"]
SPEC_DRAWS = spec()[OP]["statistical"]["draws"]  # 4000
# Interpreted, each draw is one program of ~17 ms on an idle core whatever the vocabulary (the
# Philox rounds dominate), so on the CPU one distribution below is drawn SPEC_DRAWS times (~70 s)
# and the others SMOKE_DRAWS times. The draws are the test's power: a sampler whose temperature is
# 10% off is flagged (alpha 1e-3) in ~1% of seeds at 300 draws and ~100% at 4000 for the top-p case
# (simulated, 300 multinomial runs each); 300 draws catch only gross errors.
SMOKE_DRAWS = 300
TINY_VOCAB = 4096  # spec shapes above this run on the GPU only

# Restrictions cycled over the sampled rows: (temperature, top_k, top_p, min_p).
RESTRICTIONS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.3, 0, 0.9, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.8, 50, 0.9, 0.05),
    (2.0, 1, 1.0, 0.0),
]


def params(rows, device, greedy_rows=0, restrictions=RESTRICTIONS, seeds=None, steps=None):
    """The conformance kit's (temperature, top_k, top_p, min_p, seeds, steps): the first
    greedy_rows rows greedy, the others cycling through ``restrictions``; seeds / steps as given."""
    *restricted, default_seeds, default_steps = sampling_params(rows, greedy_rows, device, restrictions)
    return (*restricted, default_seeds if seeds is None else seeds, default_steps if steps is None else steps)


def assert_in_support(tokens, logits, temperature, top_k, top_p, min_p):
    sampled = temperature > 0
    probs = reference_distribution(logits, temperature, top_k, top_p, min_p)
    chosen = probs.gather(1, tokens[:, None].clamp(0, logits.shape[1] - 1)).squeeze(1)
    outside = sampled & ((tokens < 0) | (tokens >= logits.shape[1]) | (chosen <= 0))
    assert not bool(outside.any()), f"rows {outside.nonzero().flatten().tolist()} drew tokens outside the reference support"


def spec_cases():
    return [
        pytest.param(s, marks=[pytest.mark.gpu] if s["vocab"] > TINY_VOCAB else [], id=f"rows{s['rows']}-vocab{s['vocab']}-greedy{s['greedy_rows']}")
        for s in shapes(OP)
    ]


@pytest.mark.parametrize("shape", spec_cases())
def test_spec_shapes_greedy_exact_and_sampled_in_support(shape, device, dtype):
    rows, vocab, greedy_rows = shape["rows"], shape["vocab"], shape["greedy_rows"]
    gen = torch.Generator(device=device).manual_seed(rows * 1000 + vocab)
    model_logits = torch.randn(rows, vocab, device=device, generator=gen).to(dtype)
    for r in range(0, greedy_rows, 2):  # ties for greedy rows: the max repeated half a row away
        top = int(model_logits[r].float().argmax())
        model_logits[r, (top + vocab // 2) % vocab] = model_logits[r, top]
    logits = model_logits.float()  # the op's input: float32 logits of a `dtype` model
    args = params(rows, device, greedy_rows)
    out = sample_tokens(logits, *args)
    ref = REFERENCE(logits, *args)
    assert out.dtype == torch.int64 and out.shape == (rows,) and out.device == logits.device
    greedy = args[0] <= 0
    assert_close(out[greedy], ref[greedy], OP, dtype, what=" (greedy rows)")
    assert_in_support(out, logits, *args[:4])
    # logits in the model dtype itself: the same tokens (the kernel upcasts exactly)
    assert torch.equal(sample_tokens(model_logits, *args), out)
    # the host's copies of the parameters choose the same way as the device read would
    assert torch.equal(sample_tokens(logits, *args, host_params=tuple(a.cpu() for a in args[:4])), out)


@pytest.mark.parametrize("block,programs_per_sm", [(None, None), (16, 64), (16, 1)], ids=["default", "split-per-tile", "one-split"])
def test_greedy_ties_and_infinities_match_the_reference(device, monkeypatch, block, programs_per_sm):
    inf = float("-inf")
    vocab = 40
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(1)).to(device)
    logits[0, [3, 17, 33]] = 5.0  # ties in three tiles of 16: the lowest id wins
    logits[1] = inf  # nothing finite: id 0 like torch.argmax
    logits[2] = inf
    logits[2, 37] = -3.0  # the only finite logit, in the last (partial) tile
    logits[3, [16, 31]] = 9.0  # tie inside one tile (not the first)
    logits[4] = 0.0  # all equal
    logits[5, 0] = inf
    logits[6, [37, 5, 21]] = 7.0  # ties in the same slot of three tiles of 16
    if block is not None:
        monkeypatch.setattr(kernels, "BLOCK_V", block)
        monkeypatch.setattr(kernels, "PROGRAMS_PER_SM", programs_per_sm)
    args = params(7, device, greedy_rows=7)
    assert torch.equal(sample_tokens(logits, *args), REFERENCE(logits, *args))


@triton.jit
def _row_seed_probe(seeds_ptr, steps_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, kernels._row_seed(tl.load(seeds_ptr + i), tl.load(steps_ptr + i)))


def test_row_seed_is_the_references_mixing(device):
    pairs = [(0, 0), (1, 0), (0, 1), (12345, 678), (2**62 + 11, 3), (2**63 - 1, 2**40), (-3, 7), (-(2**63), 5)]
    seeds = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device)
    steps = torch.tensor([t for _, t in pairs], dtype=torch.int64, device=device)
    out = torch.empty(len(pairs), dtype=torch.int64, device=device)
    _row_seed_probe[(1,)](seeds, steps, out, N=len(pairs))
    assert out.tolist() == [row_seed(s, t) for s, t in pairs]


@triton.jit
def _noise_probe(seeds_ptr, out_ptr, TILES: tl.constexpr, BLOCK: tl.constexpr, N_ROUNDS: tl.constexpr, FAST_LOG: tl.constexpr):
    """Program p: tile p % TILES of a row whose seed is seeds[p]."""
    pid = tl.program_id(0)
    ids = 4 * tl.arange(0, BLOCK // 4)[:, None] + tl.arange(0, 4)[None, :]
    g = kernels._gumbel_noise(tl.load(seeds_ptr + pid), (pid % TILES) * BLOCK, BLOCK // 4, N_ROUNDS, FAST_LOG)
    tl.store(out_ptr + pid * BLOCK + ids, g)


def test_noise_is_exponential_and_independent(device):
    """The race's noise G = -log2(E / ln 2) is made from E ~ Exp(1): 1 - exp(-E) must be uniform,
    down to the series branch near E = 0, neighbouring tokens (one Philox call) uncorrelated, and
    the tiles of a row must not repeat each other's noise."""
    tiles, block = 4, 4096
    programs = 2 * tiles  # two rows of four tiles
    seeds = torch.tensor([row_seed(7, 100)] * tiles + [row_seed(7, 101)] * tiles, device=device)
    g = torch.empty(programs * block, device=device)
    _noise_probe[(programs,)](seeds, g, TILES=tiles, BLOCK=block, N_ROUNDS=kernels.PHILOX_ROUNDS, FAST_LOG=device.type == "cuda")
    g = g.double().cpu()
    assert torch.isfinite(g).all()
    # 2^23 possible values: about n^2 / 2^24 = 64 equal pairs by chance, far more if streams overlap
    assert g.numel() - g.unique().numel() < 200
    e = math.log(2) * torch.exp2(-g)
    assert float(e.min()) > 0
    f = 1 - torch.exp(-e)  # uniform on (0, 1) if E ~ Exp(1)
    n, bins = f.numel(), 64
    counts = torch.bincount((f * bins).long().clamp(0, bins - 1), minlength=bins)
    assert chi_square_pvalue(counts, torch.full((bins,), 1 / bins)) > ALPHA
    near_zero = int((e < 1 / 256).sum())  # the series branch: P(E < 1/256) = 1 - exp(-1/256)
    expected = n * (1 - math.exp(-1 / 256))
    assert abs(near_zero - expected) < 5 * math.sqrt(expected)
    assert abs(float(e.mean()) - 1) < 5 / math.sqrt(n)
    x = e.view(-1, 4)
    for a, b in ((0, 1), (1, 2), (2, 3), (3, 0)):  # components of one Philox call, and across calls
        other = x[:, b] if b else x[1:, 0]
        corr = torch.corrcoef(torch.stack([x[: other.numel(), a], other]))[0, 1]
        assert abs(float(corr)) < 5 / math.sqrt(other.numel())


CHI_SQUARE_CASES = [  # (vocab, temperature, top_k, top_p, min_p, logit scale, the spec's draws on the CPU too)
    (16, 0.7, 0, 1.0, 0.0, 1.0, False),
    (32, 1.2, 5, 1.0, 0.0, 1.5, False),
    (16, 1.0, 0, 0.8, 0.0, 1.5, True),
    (16, 1.5, 0, 1.0, 0.2, 1.0, False),
    (64, 0.9, 12, 0.9, 0.05, 1.5, False),
]


@pytest.mark.parametrize("vocab,temperature,top_k,top_p,min_p,scale,full", CHI_SQUARE_CASES)
def test_sampled_frequencies_follow_the_reference_distribution(device, vocab, temperature, top_k, top_p, min_p, scale, full):
    draws = SPEC_DRAWS if ON_GPU or full else SMOKE_DRAWS
    gen = torch.Generator().manual_seed(vocab * 31 + top_k)
    row = (torch.randn(1, vocab, generator=gen) * scale).to(device)
    row[0, vocab // 3] = float("-inf")  # a banned token (min_tokens / penalties do this)
    logits = row.expand(draws, vocab)  # one row drawn `draws` times, at steps 0..draws-1
    args = params(
        draws, device, restrictions=[(temperature, top_k, top_p, min_p)],
        seeds=torch.full((draws,), 1234, dtype=torch.int64, device=device),
        steps=torch.arange(draws, dtype=torch.int64, device=device),
    )
    tokens = sample_tokens(logits, *args)
    probs = reference_distribution(row, *[a[:1] for a in args[:4]])[0].cpu()
    counts = torch.bincount(tokens.cpu(), minlength=vocab)
    assert counts[probs == 0].sum() == 0, "tokens outside the reference support were drawn"
    pvalue = chi_square_pvalue(counts, probs)
    assert pvalue > ALPHA, f"chi-square p-value {pvalue:.2e} <= {ALPHA}: frequencies {counts.tolist()} vs {(probs * draws).tolist()}"


@pytest.mark.gpu
def test_sampled_frequencies_at_the_real_vocabulary(device):
    vocab, draws = 129280, spec()[OP]["statistical"]["draws"]
    row = torch.randn(1, vocab, device=device, generator=torch.Generator(device=device).manual_seed(5)) * 3
    for restriction in [(0.8, 50, 0.9, 0.0), (1.0, 40, 1.0, 0.02)]:
        args = params(
            draws, device, restrictions=[restriction],
            seeds=torch.full((draws,), 99, dtype=torch.int64, device=device),
            steps=torch.arange(draws, dtype=torch.int64, device=device),
        )
        tokens = sample_tokens(row.expand(draws, vocab), *args)
        probs = reference_distribution(row, *[a[:1] for a in args[:4]])[0].cpu()
        counts = torch.bincount(tokens.cpu(), minlength=vocab)
        assert counts[probs == 0].sum() == 0
        assert chi_square_pvalue(counts, probs) > ALPHA


def test_support_is_never_left(device):
    """Restricted, -inf and near-threshold tokens are never drawn, whatever the noise."""
    vocab, n = 24, 240
    base = torch.linspace(2.0, -2.0, vocab)
    base[5] = base[4] - 1e-6  # just below the top-k = 5 cut: must never be drawn
    base[[7, 11]] = float("-inf")
    restrictions = [
        (100.0, 5, 1.0, 0.0),  # almost uniform over the top 5
        (5.0, 1, 1.0, 0.0),  # top_k = 1: always the argmax
        (50.0, 0, 0.3, 0.0),  # top-p keeps a few tokens out of a flat distribution
        (30.0, 0, 1.0, 0.999),  # min-p keeps only (near) the top token
        (1e-3, 0, 1.0, 0.0),  # very cold
        (1000.0, 0, 1.0, 0.0),  # very hot: only the -inf logits are out
    ]
    logits = base.to(device).expand(n, vocab)
    args = params(n, device, restrictions=restrictions, seeds=torch.full((n,), 77, dtype=torch.int64, device=device),
                  steps=torch.arange(n, dtype=torch.int64, device=device))
    tokens = sample_tokens(logits, *args)
    assert_in_support(tokens, logits, *args[:4])
    assert bool((tokens[1::len(restrictions)] == 0).all())
    hot = tokens[5::len(restrictions)]
    assert len(set(hot.tolist())) > 10  # the hot rows do spread over the vocab


def test_draws_depend_on_seed_and_step_only(device, monkeypatch):
    vocab = 50
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, vocab, generator=gen).to(device)
    args = params(9, device, greedy_rows=2, seeds=torch.tensor([5, 5, 6, 2**62 + 11, 0, -3, 8, 9, 10], device=device))
    out = sample_tokens(logits, *args)
    assert torch.equal(sample_tokens(logits, *args), out)  # same (seed, step): same token
    # rows in another order, in a batch of another size (so another vocab split), beside other rows
    perm = torch.tensor([4, 8, 0, 3, 7, 2, 6, 1, 5], device=device)
    extra = torch.randn(7, vocab, generator=gen).to(device)
    extra_args = params(7, device, seeds=torch.arange(100, 107, device=device))
    batch_logits = torch.cat([extra[:3], logits[perm], extra[3:]])
    batch_args = [torch.cat([e[:3], a[perm], e[3:]]) for a, e in zip(args, extra_args)]
    assert torch.equal(sample_tokens(batch_logits, *batch_args)[3:12], out[perm])
    # other tiles and splits draw the same noise for each token id
    monkeypatch.setattr(kernels, "BLOCK_V", 16)
    monkeypatch.setattr(kernels, "PROGRAMS_PER_SM", 64)
    assert torch.equal(sample_tokens(logits, *args), out)
    # another step (or seed) gives, over many rows, other tokens
    moved = sample_tokens(logits, *args[:5], args[5] + 1)
    assert not torch.equal(moved[2:], out[2:])


def test_host_read_and_capture_paths_agree(device):
    """Eager calls rank with topk / skip ranking after one host read; under graph capture the
    general path (full sort) runs. Both give the same thresholds' support, hence tokens."""
    vocab, rows = 64, 12
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(8)).to(device) * 2
    for restrictions in (RESTRICTIONS, [(1.0, 0, 1.0, 0.0)], [(1.0, 3, 0.8, 0.0), (0.5, 7, 1.0, 0.2)], [(1.0, 0, 1.0, 0.3)]):
        args = params(rows, device, greedy_rows=3, restrictions=restrictions)
        tokens = []
        for host_read in (True, False):
            threshold = kernels._thresholds(logits, *args[:4], host_read=host_read)
            out = torch.empty(rows, dtype=torch.int64, device=device)
            tokens.append(kernels._race(logits, args[0], threshold, args[4], args[5], out))
        assert torch.equal(tokens[0], tokens[1])
        assert torch.equal(tokens[0], sample_tokens(logits, *args))


def test_every_row_is_written(device, monkeypatch):
    monkeypatch.setattr(kernels, "BLOCK_V", 16)
    for rows, vocab in ((1, 16), (3, 50), (5, 100)):
        logits = torch.randn(rows, vocab, device=device)
        args = params(rows, device, greedy_rows=1)
        out = torch.full((rows,), -1, dtype=torch.int64, device=device)  # poison
        kernels._race(logits, args[0], kernels._thresholds(logits, *args[:4], host_read=True), args[4], args[5], out)
        assert bool(((out >= 0) & (out < vocab)).all())


def test_empty_batch_and_untouched_inputs(device):
    args = params(0, device)
    out = sample_tokens(torch.empty(0, 32, device=device), *args)
    assert out.shape == (0,) and out.dtype == torch.int64
    logits = torch.randn(4, 32, device=device)
    args = params(4, device, greedy_rows=1)
    copies = [a.clone() for a in (logits, *args)]
    sample_tokens(logits, *args)
    assert all(torch.equal(a, c) for a, c in zip((logits, *args), copies))


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager(device):
    rows, vocab = 64, 129280
    logits = torch.randn(rows, vocab, device=device)
    args = params(rows, device, greedy_rows=32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up both paths outside the capture
        sample_tokens(logits, *args)
        kernels._race(logits, args[0], kernels._thresholds(logits, *args[:4], host_read=False), args[4], args[5],
                      torch.empty(rows, dtype=torch.int64, device=device))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sample_tokens(logits, *args)
    for trial in range(2):
        logits.copy_(torch.randn(rows, vocab, device=device))
        args[5].add_(1)  # next step
        graph.replay()
        torch.cuda.synchronize()
        eager = sample_tokens(logits, *args)
        assert torch.equal(captured, eager)
        assert torch.equal(captured[:32], logits[:32].argmax(-1))
