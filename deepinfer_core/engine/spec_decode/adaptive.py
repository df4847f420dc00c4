"""Adaptive verification (DeepSeek's ``DEEPINFER_ENABLE_MTP_VARLEN``; deepseek_architectures.md
§4.6): how many of its drafts each request has verified, from the draft head's confidences and
the step's cost.

The survival of request r's draft i is S_ri = c_r0 * ... * c_ri (c: the confidence head's
estimate that draft i is accepted given the ones before it), the expected number of drafts
accepted up to it. A global budget B of draft tokens is chosen to maximise the expected tokens
per second of the next step,

    (requests + sum of the B largest survivals) / (draft_cost(requests) + verify_cost(other tokens + B)),

with both costs measured at start-up (``CostCurve``: seconds by requests, by tokens). Each request
then gets its drafts among the global top B: a prefix, since its survivals never increase.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass
class CostCurve:
    """Seconds as a function of a count, measured at some counts: linear between them, and
    beyond the last two points along their line (never below the last measured value)."""

    points: list[tuple[int, float]]

    def __post_init__(self) -> None:
        self.points = sorted(self.points)
        if not self.points:
            raise ValueError("a cost curve needs at least one measured point")

    def __call__(self, x: float) -> float:
        xs = [p[0] for p in self.points]
        if x <= xs[0] or len(xs) == 1:
            return self.points[0][1] if x <= xs[0] else self.points[-1][1] * x / xs[-1]
        i = min(bisect.bisect_left(xs, x), len(xs) - 1)
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return y if x <= xs[-1] else max(y, self.points[-1][1])


def survivals(confidences: list[list[float]]) -> list[list[float]]:
    """Per request, the running products of its confidences."""
    out = []
    for row in confidences:
        acc, s = 1.0, []
        for c in row:
            acc *= min(max(c, 0.0), 1.0)
            s.append(acc)
        out.append(s)
    return out


def choose_budget(surv: list[list[float]], other_tokens: int, draft_cost: float, verify_cost: CostCurve) -> int:
    """The number of draft tokens B (0 .. all) that maximises the expected tokens per second."""
    ranked = sorted((s for row in surv for s in row), reverse=True)
    requests = len(surv)
    best_rate, best = requests / (draft_cost + verify_cost(other_tokens)), 0
    gain = 0.0
    for b, s in enumerate(ranked, 1):
        gain += s
        rate = (requests + gain) / (draft_cost + verify_cost(other_tokens + b))
        if rate > best_rate * (1 + 1e-9):
            best_rate, best = rate, b
    return best


def admit(surv: list[list[float]], budget: int) -> list[int]:
    """Per request, how many of its drafts are among the global top ``budget`` survivals (ties:
    earlier requests, then earlier positions; a prefix of each request's drafts)."""
    ranked = sorted(((-s, r, i) for r, row in enumerate(surv) for i, s in enumerate(row)))[:budget]
    counts = [0] * len(surv)
    for _, r, i in ranked:
        counts[r] = max(counts[r], i + 1)
    return counts
