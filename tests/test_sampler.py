"""The sampler's penalties and the reference sample_tokens op, on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.engine.sequence import Sequence
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.sampling import sample_tokens
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import apply_penalties, sample

VOCAB = 8


def seq(prompt, output=(), seed=0, **params) -> Sequence:
    s = Sequence(0, "r", 0, list(prompt), SamplingParams(**params), seed)
    s.output_token_ids = list(output)
    return s


def draw(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=(0,), steps=(0,)):
    n = logits.shape[0]
    return sample_tokens(
        logits,
        torch.full((n,), temperature),
        torch.full((n,), top_k, dtype=torch.int64),
        torch.full((n,), top_p),
        torch.full((n,), min_p),
        torch.tensor(seeds, dtype=torch.int64),
        torch.tensor(steps, dtype=torch.int64),
    )


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 1.5]])
    s = seq([0, 1], [2, 2, 3], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [s], eos_ids=())[0]
    expected = logits[0].clone()
    for t in (0, 1, 2, 3):  # seen in prompt or output: positive logits divided, negative multiplied
        expected[t] = expected[t] / 2 if expected[t] > 0 else expected[t] * 2
    expected[2] -= 0.25 * 2 + 0.5  # output counts only
    expected[3] -= 0.25 * 1 + 0.5
    assert torch.allclose(out, expected)
    assert torch.equal(logits, torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 1.5]]))  # input untouched


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(3, VOCAB)
    early = seq([0], [5], min_tokens=3, stop_token_ids=[4])
    last = seq([0], [5, 5], min_tokens=3, stop_token_ids=[4])  # the third output is the last one banned
    done = seq([0], [5, 5, 5], min_tokens=3, stop_token_ids=[4])
    out = apply_penalties(logits, [early, last, done], eos_ids=(1,))
    for row in (0, 1):
        assert out[row, 1] == -math.inf and out[row, 4] == -math.inf, row
    assert torch.isfinite(out[2]).all()
    ignoring = seq([0], [], min_tokens=3, ignore_eos=True)
    assert torch.isfinite(apply_penalties(logits[:1], [ignoring], eos_ids=(1,))).all()


def test_greedy_rows_take_the_argmax_and_top_k_1_equals_greedy():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    greedy = draw(logits, temperature=0.0, seeds=range(6), steps=range(6))
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.equal(draw(logits, temperature=1.3, top_k=1, seeds=range(6), steps=range(6)), greedy)


def frequencies(logits, n=6000, **kw):
    rows = logits.expand(n, -1).contiguous()
    tokens = draw(rows, seeds=[7] * n, steps=range(n), **kw)
    return torch.bincount(tokens, minlength=logits.shape[-1]).float() / n


def test_sampling_follows_the_distribution_and_its_restrictions():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    plain = frequencies(logits)
    assert torch.allclose(plain, torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]), atol=0.03)
    topk = frequencies(logits, top_k=2)
    assert topk[2:].sum() == 0 and torch.allclose(topk[:2], torch.tensor([4 / 7, 3 / 7]), atol=0.03)
    topp = frequencies(logits, top_p=0.8)  # 0.4 + 0.3 < 0.8, so the third token is still needed
    assert topp[3:].sum() == 0 and torch.allclose(topp[:3], torch.tensor([0.4, 0.3, 0.15]) / 0.85, atol=0.03)
    minp = frequencies(logits, min_p=0.5)  # keeps probabilities >= 0.2
    assert minp[2:].sum() == 0
    hot = frequencies(logits, temperature=0.5)
    sharpened = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]) ** 2
    assert torch.allclose(hot, sharpened / sharpened.sum(), atol=0.03)


def test_draws_depend_on_seed_and_step_only():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    a = draw(logits, seeds=[1, 2, 3, 4], steps=[0, 0, 5, 9])
    b = draw(logits[[2]], seeds=[3], steps=[5])
    assert a[2] == b[0]
    assert torch.equal(a, draw(logits, seeds=[1, 2, 3, 4], steps=[0, 0, 5, 9]))
    many = draw(logits[[0]].expand(64, -1), seeds=range(64), steps=[0] * 64)
    assert len(set(many.tolist())) > 1


@pytest.mark.parametrize("k", [0, 3])
def test_sample_reports_raw_logprobs(k):
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(2))
    seqs = [seq([1], temperature=0, logprobs=k, repetition_penalty=5.0), seq([1], temperature=0)]
    (tok, lp, top), (tok2, lp2, top2) = sample(OpTable.reference(), logits, seqs)
    raw = torch.log_softmax(logits, -1)
    assert lp == pytest.approx(float(raw[0, tok])) and tok in top and len(top) in (k, k + 1)
    assert set(top) >= set(raw[0].topk(k).indices.tolist()) if k else top == {tok: lp}
    assert lp2 is None and top2 is None and tok2 == int(logits[1].argmax())
    order = raw[0].argsort(descending=True).tolist()  # ranks are the raw distribution's: 1 = most likely
    assert all(v.rank == order.index(t) + 1 for t, v in top.items())


def test_a_sampled_token_outside_the_top_k_gets_its_true_rank():
    logits = torch.zeros(1, 10)
    logits[0, 1], logits[0, 2], logits[0, 3] = 5.0, 4.0, 3.0  # token 1 first, but the prompt's repetition penalty ...
    (tok, lp, top), = sample(OpTable.reference(), logits, [seq([1, 2], temperature=0, logprobs=1, repetition_penalty=100.0)])
    assert tok == 3  # ... pushes 1 and 2 down: the greedy pick is the raw third
    assert top[1].rank == 1 and top[3].rank == 3 and len(top) == 2 and top[3].logprob == lp
