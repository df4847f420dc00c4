"""Running one op case on a backend and judging it against the reference.

The backend's call runs with poisoned allocations (``poisoned_outputs``): every tensor it
allocates through torch starts as NaN (integers as a sentinel), and on accelerators the caching
allocator's free memory is filled with NaN first, so an output element the op never writes
shows up. Outputs are compared with the reference elementwise as ``specs/ops.toml`` says:
|out - ref| <= atol + rtol * |ref|; the reported error is the worst ratio of the two sides
(1.0 = exactly at the tolerance). NaN never passes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from deepinfer_core.conformance.inputs import OpCase, tensors_of
from deepinfer_core.conformance.spec import ops_spec, tolerance
from deepinfer_core.ops import REFERENCE_OPS, moe
from deepinfer_core.ops.sampling import sampling_probs

INT_POISON = -(2**31) + 7  # what unwritten integer outputs hold: outside every valid id range
STAT_CHUNK_ELEMENTS = 1 << 25  # logits elements per call of the statistical draws


@dataclass
class Outcome:
    """The verdict on one case."""

    ok: bool
    error: float = 0.0  # worst |out - ref| / (atol + rtol |ref|); inf for NaN / wrong ids
    message: str = ""


class _PoisonEmpty(TorchFunctionMode):
    """Tensors made by torch.empty / empty_like / new_empty / empty_strided start poisoned."""

    FACTORIES = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty, torch.Tensor.new_empty_strided}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.FACTORIES and isinstance(out, torch.Tensor) and out.numel():
            with torch.no_grad():
                if out.is_floating_point():
                    out.fill_(float("nan"))
                elif out.dtype not in (torch.bool, torch.uint8, torch.int8):
                    out.fill_(INT_POISON)
        return out


@contextlib.contextmanager
def poisoned_outputs(device: torch.device):
    if device.type not in ("cpu", "meta"):
        # leave NaN in the caching allocator's free blocks (allocations made outside torch's
        # Python factories, e.g. inside a C++ extension, then start as NaN too)
        module = getattr(torch, device.type)
        free = min(256 << 20, module.mem_get_info(device)[0] // 8) // 4
        torch.full((max(free, 1),), float("nan"), device=device)
    with _PoisonEmpty():
        yield


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def compare(name: str, out, ref: torch.Tensor, tol: dict[str, float], exact_dtype: bool = True) -> Outcome:
    """One output against the reference: type, shape, dtype, NaN, then the tolerance."""
    if not isinstance(out, torch.Tensor):
        return Outcome(False, float("inf"), f"{name}: expected a tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(ref.shape):
        return Outcome(False, float("inf"), f"{name}: shape {tuple(out.shape)}, reference {tuple(ref.shape)}")
    if exact_dtype and out.dtype != ref.dtype:
        return Outcome(False, float("inf"), f"{name}: dtype {out.dtype}, reference {ref.dtype}")
    if out.numel() == 0:
        return Outcome(True)
    o, r = out.detach().float().cpu(), ref.detach().float().cpu()
    nan = torch.isnan(o) & ~torch.isnan(r)
    if nan.any():
        where = tuple(nan.nonzero()[0].tolist())
        return Outcome(False, float("inf"), f"{name}: NaN at {where} ({int(nan.sum())} of {o.numel()} elements: unwritten or overflowed)")
    both_inf = torch.isinf(r) & (o == r)
    diff = (o - r).abs().masked_fill(both_inf | (torch.isnan(o) & torch.isnan(r)), 0.0)
    bound = tol["atol"] + tol["rtol"] * r.abs().nan_to_num(posinf=0.0)
    ratio = torch.where(bound > 0, diff / bound, torch.where(diff > 0, float("inf"), 0.0))
    worst = float(ratio.max())
    if worst <= 1.0:
        return Outcome(True, worst)
    idx = tuple(torch.unravel_index(ratio.argmax(), ratio.shape))
    idx = tuple(int(i) for i in idx)
    bad = int((ratio > 1.0).sum())
    return Outcome(False, worst, f"{name}: {bad} of {o.numel()} elements outside atol {tol['atol']:g} + rtol {tol['rtol']:g}; "
                   f"worst at {idx}: {float(o[idx]):.6g} vs reference {float(r[idx]):.6g}")


def _worst(outcomes: list[Outcome]) -> Outcome:
    failed = [o for o in outcomes if not o.ok]
    error = max((o.error for o in outcomes), default=0.0)
    if failed:
        return Outcome(False, error, "; ".join(o.message for o in failed))
    return Outcome(True, error)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def _inputs_untouched(before: OpCase, after: OpCase) -> Outcome:
    """Ops write only their documented in-place arguments."""
    for i, (a, b) in enumerate(zip(before.args, after.args)):
        ta, tb = tensors_of(a), tensors_of(b)  # a tuple of tensors (key pools): each of them
        if i not in before.inplace and (len(ta) != len(tb) or not all(_same(x, y) for x, y in zip(ta, tb))):
            return Outcome(False, float("inf"), f"the op modified its input argument {i} (only {list(before.inplace) or 'none'} may be written)")
    return Outcome(True)


def call_backend(fn: Callable, case: OpCase):
    with poisoned_outputs(_device_of(case)):
        return fn(*case.args, **case.kwargs)


def _call_on_copy(fn: Callable, case: OpCase) -> tuple[object, Outcome]:
    """The backend's output on a copy of ``case``'s inputs, and whether it left them untouched."""
    mine = case.clone()
    out = call_backend(fn, mine)
    return out, _inputs_untouched(case, mine)


def _device_of(case: OpCase) -> torch.device:
    for a in case.args:
        for t in tensors_of(a):
            return t.device
    return torch.device("cpu")


# ---- checkers -----------------------------------------------------------------------------------


def check_close(fn: Callable, case: OpCase) -> Outcome:
    """Default: every in-place argument and every returned tensor within the tolerance (an op
    that works in place and returns None returns nothing to compare)."""
    mine = case.clone()
    ref_case = case.clone() if case.inplace else case  # the reference leaves other inputs alone
    out = call_backend(fn, mine)
    ref = REFERENCE_OPS[case.op](*ref_case.args, **ref_case.kwargs)
    tol = tolerance(case.op, case.dtype, case.dims)
    outcomes = [_inputs_untouched(case, mine)]
    outcomes += [compare(f"argument {i} (in place)", mine.args[i], ref_case.args[i], tol) for i in case.inplace]
    if ref is not None or not case.inplace:
        outs, refs = _as_tuple(out), _as_tuple(ref)
        if len(outs) != len(refs):
            return Outcome(False, float("inf"), f"returned {len(outs)} values, the contract says {len(refs)}")
        names = ops_spec()[case.op].get("outputs", [])
        outcomes += [compare(names[i] if i < len(names) else f"output {i}", o, r, tol) for i, (o, r) in enumerate(zip(outs, refs))]
    return _worst(outcomes)


def check_moe_route(fn: Callable, case: OpCase) -> Outcome:
    """Run the backend's moe_route on ``case`` and judge it (``judge_moe_route``)."""
    out = _route_output(fn, case)
    return out if isinstance(out, Outcome) else judge_moe_route(*out, *case.args, case.kwargs, case.dtype)


def _route_output(fn: Callable, case: OpCase) -> tuple | Outcome:
    """A routing op's (weights, ids) on a copy of ``case``'s inputs, or the Outcome that fails it
    (it changed its inputs, or returned something else)."""
    out, untouched = _call_on_copy(fn, case)
    if not untouched.ok:
        return untouched
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        return Outcome(False, float("inf"), "must return (weights, ids)")
    return tuple(out)


def judge_moe_route(weights, ids, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, route_kwargs: dict,
                    dtype: torch.dtype) -> Outcome:
    """Routing output against the reference: id sets equal per token, except where the
    reference's k-th and (k+1)-th selection scores tie within the spec's tie_eps; then any valid
    top-k is accepted, its weights compared against the reference's weights of the ids chosen."""
    top_k, tokens = route_kwargs["top_k"], x.shape[0]
    for name, t, want in (("weights", weights, torch.float32), ("ids", ids, torch.int64)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (tokens, top_k) or t.dtype != want:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            return Outcome(False, float("inf"), f"{name}: expected [{tokens}, {top_k}] {want}, got {got}")
    if tokens == 0:
        return Outcome(True)
    ref_w, ref_ids = REFERENCE_OPS["moe_route"](x, gate, bias, **route_kwargs)
    selection, weights_of = moe.route_selection(x, gate, bias, **{k: v for k, v in route_kwargs.items() if k != "top_k"})
    return _judge_routing("moe_route", weights, ids, ref_w, ref_ids, selection, weights_of, top_k, gate.shape[0], x.device, dtype)


def _judge_routing(op: str, weights, ids, ref_w, ref_ids, selection, weights_of, top_k: int, num_experts: int,
                   x_device, dtype: torch.dtype) -> Outcome:
    """Routing (weights, ids) of ``op`` against the reference's (ref_w, ref_ids): ``selection``
    [T, E] is what the reference ranks, ``weights_of(ids)`` the weights it gives any id set (the
    op module's own gate, ``moe.route_selection`` / ``moe.sqrtsoftplus_selection``)."""
    tie_eps = float(ops_spec()[op].get("tie_eps", 0.0))
    tol = tolerance(op, dtype)
    ids, ref_ids, selection, weights = ids.cpu(), ref_ids.cpu(), selection.cpu(), weights.cpu()
    if ((ids < 0) | (ids >= num_experts)).any():
        return Outcome(False, float("inf"), f"ids outside [0, {num_experts}) (unwritten?): {ids[((ids < 0) | (ids >= num_experts)).any(1)][:2].tolist()}")
    out_ids, order = ids.sort(dim=1)
    out_w = weights.gather(1, order)
    ref_sorted, ref_order = ref_ids.sort(dim=1)
    ref_w = ref_w.cpu().gather(1, ref_order)
    ranked = selection.sort(dim=1, descending=True).values
    kth = ranked[:, top_k - 1]
    after = ranked[:, top_k] if top_k < ranked.shape[1] else torch.full_like(kth, float("-inf"))
    tie = (kth == after) | ((kth - after).abs() < tie_eps)
    same = (out_ids == ref_sorted).all(dim=1)
    bad = ~(same | tie)
    if bad.any():
        t = int(bad.nonzero()[0])
        return Outcome(False, float("inf"), f"ids of {int(bad.sum())} tokens differ without a tie; token {t}: {out_ids[t].tolist()} vs reference {ref_sorted[t].tolist()}")
    for t in (~same).nonzero().flatten().tolist():  # tie tokens: any valid top-k of distinct ids
        if out_ids[t].unique().numel() != top_k:
            return Outcome(False, float("inf"), f"token {t} repeats an expert: {out_ids[t].tolist()}")
        if not (selection[t, out_ids[t]] >= kth[t] - tie_eps).all():
            return Outcome(False, float("inf"), f"token {t} chose an expert ranked below the k-th")
    expected = torch.where(same[:, None], ref_w, weights_of(out_ids.to(x_device)).cpu())
    return compare("weights", out_w, expected, tol)


def _expect(name: str, t, shape: tuple, dtype: torch.dtype) -> Outcome | None:
    """None when ``t`` is a tensor of ``shape`` and ``dtype``, else the failure saying what it is."""
    if isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape) and t.dtype == dtype:
        return None
    got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
    return Outcome(False, float("inf"), f"{name}: expected [{', '.join(map(str, shape))}] {dtype}, got {got}")


def check_moe_route_sqrtsoftplus(fn: Callable, case: OpCase) -> Outcome:
    """As ``check_moe_route``: id sets per token (ties within tie_eps free), then the weights."""
    out = _route_output(fn, case)
    if isinstance(out, Outcome):
        return out
    weights, ids = out
    x, gate, bias, fixed_ids = case.args
    top_k, tokens = case.kwargs["top_k"], x.shape[0]
    for name, t, want in (("weights", weights, torch.float32), ("ids", ids, torch.int64)):
        wrong = _expect(name, t, (tokens, top_k), want)
        if wrong:
            return wrong
    if tokens == 0:
        return Outcome(True)
    ref_w, ref_ids = REFERENCE_OPS["moe_route_sqrtsoftplus"](*case.clone().args, **case.kwargs)
    selection, weights_of = moe.sqrtsoftplus_selection(x, gate, bias, **{k: v for k, v in case.kwargs.items() if k != "top_k"})
    if fixed_ids is not None:  # hash routing: the given ids, 1 at them and 0 elsewhere (no ties)
        selection = torch.zeros_like(selection).scatter_(1, fixed_ids.long(), 1.0)
    return _judge_routing("moe_route_sqrtsoftplus", weights, ids, ref_w, ref_ids, selection, weights_of, top_k,
                          gate.shape[0], x.device, case.dtype)


def indexer_scores(q, weights, keys, candidates, scale) -> torch.Tensor:
    """[T, C] float32: each candidate's indexer score, -inf where the candidate is -1 (written
    independently of the reference: one head at a time)."""
    valid = candidates >= 0
    if keys.shape[0] == 0:
        return torch.full(candidates.shape, float("-inf"), device=candidates.device)
    cand = keys.float()[candidates.clamp(min=0)]  # [T, C, Di]
    total = torch.zeros(candidates.shape, dtype=torch.float32, device=candidates.device)
    for h in range(q.shape[1]):
        dots = torch.bmm(cand, q[:, h].float()[:, :, None])[..., 0]  # [T, C]
        total = total + weights[:, h, None].float() * (dots.clamp(min=0) * scale)
    return total.masked_fill(~valid, float("-inf"))


def _earlier_tie_dropped(cols: torch.Tensor, score: torch.Tensor, valid: torch.Tensor) -> str | None:
    """The tie rule of ``indexer_topk``: of candidates with exactly equal scores (-0.0 equal to
    +0.0) the earlier columns are chosen. ``cols``: the chosen columns of one query; ``score``
    [C] its scores; ``valid`` [C] bool. None when no dropped valid column ties a chosen later one."""
    dropped = valid.clone()
    dropped[cols] = False
    left = dropped.nonzero().flatten()
    if not cols.numel() or not left.numel():
        return None
    same = (score[cols][:, None] == score[left][None, :]) & (left[None, :] < cols[:, None])
    if not same.any():
        return None
    a, b = (int(i) for i in same.nonzero()[0])
    return (f"chose column {int(cols[a])} but left out column {int(left[b])} of exactly the same score "
            f"{float(score[cols[a]]):.6g}: ties go to the earlier candidate")


def check_indexer_topk(fn: Callable, case: OpCase) -> Outcome:
    """Per query, the chosen rows as a set: the reference's, except where its k-th and (k+1)-th
    scores tie within the spec's tie_eps (then any k distinct candidates whose scores reach the
    k-th, such that of exactly equal scores the earlier columns are chosen); as many -1 as the
    query has fewer valid candidates than the output is wide."""
    out, untouched = _call_on_copy(fn, case)
    if not untouched.ok:
        return untouched
    q, weights, keys, candidates, top_k, scale = case.args
    tokens, c = candidates.shape
    width = min(top_k, c)
    wrong = _expect("ids", out, (tokens, width), torch.int64)
    if wrong:
        return wrong
    if tokens == 0 or width == 0:
        return Outcome(True)
    tie_eps = float(ops_spec()["indexer_topk"].get("tie_eps", 0.0))
    ref = REFERENCE_OPS["indexer_topk"](*case.clone().args).cpu()
    scores = indexer_scores(q, weights, keys, candidates, scale).cpu()
    ids, cand, pool = out.cpu(), candidates.cpu(), keys.shape[0]
    bad = (ids < -1) | (ids >= pool)
    if bad.any():
        t = int(bad.any(1).nonzero()[0])
        return Outcome(False, float("inf"), f"ids outside [-1, {pool}) (unwritten?): query {t}: {ids[t].tolist()}")
    ranked = scores.sort(dim=1, descending=True).values
    for t in range(tokens):
        valid = cand[t] >= 0
        want = min(width, int(valid.sum()))
        where = f"query {t} ({int(valid.sum())} valid candidates)"
        # score and column of every pool row this query may pick (NaN / -1: not its candidate)
        row_score = torch.full((pool + 1,), float("nan"))
        row_score[cand[t][valid]] = scores[t][valid]
        row_col = torch.full((pool + 1,), -1, dtype=torch.int64)
        row_col[cand[t][valid]] = valid.nonzero().flatten()
        kth = ranked[t, want - 1] if want else torch.tensor(float("inf"))
        after = ranked[t, want] if want < c else torch.tensor(float("-inf"))
        tie = bool(kth == after) or bool((kth - after).abs() < tie_eps)
        ref_set = ref[t][ref[t] >= 0].sort().values
        # the kit's scores stand in for the reference's at ties: they must agree with its choice
        if (ref_set.numel() != want or not (row_score[ref_set] >= kth - tie_eps).all()
                or _earlier_tie_dropped(row_col[ref_set], scores[t], valid)):
            return Outcome(False, float("inf"), f"conformance kit error, not the backend's: the reference's rows for {where} are not a top-{want} of the kit's scores")
        chosen = ids[t][ids[t] >= 0].sort().values
        if chosen.numel() != want:
            return Outcome(False, float("inf"), f"{where}: {chosen.numel()} rows chosen, expected {want} (and {width - want} times -1): {ids[t].tolist()}")
        if chosen.unique().numel() != want:
            return Outcome(False, float("inf"), f"{where} repeats a row: {chosen.tolist()}")
        if torch.equal(chosen, ref_set):
            continue
        if not tie:
            return Outcome(False, float("inf"), f"{where}: rows differ without a tie: {chosen.tolist()} vs reference {ref_set.tolist()}")
        picked = row_score[chosen]
        if picked.isnan().any():
            return Outcome(False, float("inf"), f"{where} chose rows that are not its candidates: {chosen[picked.isnan()].tolist()}")
        if not (picked >= kth - tie_eps).all():
            return Outcome(False, float("inf"), f"{where} chose a row ranked below the {want}-th")
        error = _earlier_tie_dropped(row_col[chosen], scores[t], valid)
        if error:
            return Outcome(False, float("inf"), f"{where} {error}")
    return Outcome(True)


def block_scores(q, weights, keys, candidates, scale, block_size: int) -> torch.Tensor:
    """[T, ceil(C / block_size)] float32: each candidate block's score, the highest indexer score
    of its valid columns (-inf for a block with none); the kit's ``indexer_scores`` per column."""
    scores = indexer_scores(q, weights, keys, candidates, scale)
    t, c = scores.shape
    nb = -(-c // block_size)
    padded = torch.full((t, nb * block_size), float("-inf"), device=scores.device)
    padded[:, :c] = scores
    return padded.view(t, nb, block_size).amax(dim=-1)


def _block_choice_error(kept: torch.Tensor, score: torch.Tensor, forced: int, top_blocks: int, tie_eps: float) -> str | None:
    """What is wrong with one query's kept blocks ``kept`` [nb] bool under the block rule (None:
    nothing): ``score`` [nb] the block scores (-inf: no valid column), ``forced`` the block of
    the newest valid column (-1: none). Blocks without a valid column are never kept; the forced
    one always is; min(top_blocks, blocks with a valid column) are kept; no dropped block scores
    more than tie_eps above a kept one (the forced block aside); at exactly equal scores the lower
    block is kept."""
    nonempty = score > float("-inf")
    extra = (kept & ~nonempty).nonzero().flatten()
    if extra.numel():
        return f"keeps block {int(extra[0])}, which has no valid column (never kept)"
    if forced >= 0 and not bool(kept[forced]):
        return f"drops block {forced}, which holds the query's newest valid column (always kept)"
    want = min(top_blocks, int(nonempty.sum()))
    if int(kept.sum()) != want:
        return f"keeps {int(kept.sum())} blocks, expected {want} (of {int(nonempty.sum())} with a valid column, top {top_blocks})"
    free = nonempty.clone()
    if forced >= 0:
        free[forced] = False
    chosen, left = (kept & free).nonzero().flatten(), (free & ~kept).nonzero().flatten()
    if not chosen.numel() or not left.numel():
        return None
    worst, best = int(chosen[score[chosen].argmin()]), int(left[score[left].argmax()])
    if float(score[best]) > float(score[worst]) + tie_eps:
        return (f"drops block {best} (score {float(score[best]):.6g}) but keeps block {worst} (score "
                f"{float(score[worst]):.6g}), without a tie")
    same = (score[chosen][:, None] == score[left][None, :]) & (left[None, :] < chosen[:, None])
    if same.any():
        a, b = (int(i) for i in same.nonzero()[0])
        return (f"keeps block {int(chosen[a])} but drops block {int(left[b])} of exactly the same score "
                f"{float(score[chosen[a]]):.6g}: ties go to the lower block")
    return None


def check_indexer_block_candidates(fn: Callable, case: OpCase) -> Outcome:
    """Per query, the kept blocks under the rule ``_block_choice_error`` states, on the kit's block
    scores: the reference's choice, up to near ties (scores within the spec's tie_eps are free,
    exactly equal ones go to the lower block). All blocks kept where there are at most top_blocks."""
    out, untouched = _call_on_copy(fn, case)
    if not untouched.ok:
        return untouched
    q, weights, keys, candidates, scale, block_size, top_blocks = case.args
    tokens, c = candidates.shape
    nb = -(-c // block_size)
    wrong = _expect("blocks", out, (tokens, nb), torch.bool)
    if wrong:
        return wrong
    kept = out.cpu()
    if tokens == 0 or nb == 0:
        return Outcome(True)
    if nb <= top_blocks:
        if not kept.all():
            t = int((~kept).any(1).nonzero()[0])
            return Outcome(False, float("inf"), f"query {t}: {nb} blocks, at most top_blocks {top_blocks}: all must be kept, "
                           f"got {kept[t].int().tolist()[:32]}")
        return Outcome(True)
    tie_eps = float(ops_spec()["indexer_block_candidates"].get("tie_eps", 0.0))
    ref = REFERENCE_OPS["indexer_block_candidates"](*case.clone().args).cpu()
    score = block_scores(q, weights, keys, candidates, scale, block_size).cpu()
    cand = candidates.cpu()
    newest = torch.where(cand >= 0, torch.arange(c), torch.full_like(cand, -1)).amax(dim=1)
    for t in range(tokens):
        forced = int(newest[t]) // block_size if int(newest[t]) >= 0 else -1
        where = f"query {t} (newest valid column {int(newest[t])}, {int((score[t] > float('-inf')).sum())} of {nb} blocks with one)"
        # the kit's block scores stand in for the reference's: its choice must pass them
        kit_error = _block_choice_error(ref[t], score[t], forced, top_blocks, tie_eps)
        if kit_error:
            return Outcome(False, float("inf"), f"conformance kit error, not the backend's: the reference's blocks for {where} "
                           f"fail the kit's rule: {kit_error}")
        if torch.equal(kept[t], ref[t]):
            continue
        error = _block_choice_error(kept[t], score[t], forced, top_blocks, tie_eps)
        if error:
            return Outcome(False, float("inf"), f"{where} {error}")
    return Outcome(True)


def check_engram_hash_ids(fn: Callable, case: OpCase) -> Outcome:
    """Integer ids: exactly the reference's, int64 (compared as integers: float32 would merge ids
    above 2^24)."""
    out, untouched = _call_on_copy(fn, case)
    if not untouched.ok:
        return untouched
    ngram_ids, multipliers, primes, offsets, pad_id = case.args
    ref = REFERENCE_OPS["engram_hash_ids"](*case.clone().args)
    wrong = _expect("ids", out, tuple(ref.shape), torch.int64)
    if wrong:
        return wrong
    got, ref = out.cpu(), ref.cpu()
    if torch.equal(got, ref):
        return Outcome(True)
    bad = got != ref
    t, col = (int(i) for i in bad.nonzero()[0])
    lo, size = int(offsets.cpu()[col]), int(primes.cpu().flatten()[col])
    inside = "inside" if lo <= int(got[t, col]) < lo + size else "outside"
    return Outcome(False, float("inf"), f"ids: {int(bad.sum())} of {got.numel()} differ; first at token {t}, column {col} "
                   f"(n-gram size {col // primes.shape[1] + 2}, head {col % primes.shape[1]}): {int(got[t, col])} ({inside} "
                   f"its segment [{lo}, {lo + size})) vs reference {int(ref[t, col])}; the token's n-gram ids "
                   f"{ngram_ids[t].tolist()}")


def reference_distribution(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """float64 probabilities the reference samples each row from (temperature > 0 rows)."""
    return sampling_probs(logits, temperature, top_k, top_p, min_p).double()


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``probs`` over the support; cells
    expected fewer than 5 times are pooled (with the smallest other cell if still under 5)."""
    draws = float(counts.sum())
    expected = probs.double() * draws
    support = expected > 0
    observed, expected = counts[support].double(), expected[support]
    order = expected.argsort(descending=True)
    observed, expected = observed[order], expected[order]
    big = expected >= 5
    o = observed[big].tolist() + [float(observed[~big].sum())]
    e = expected[big].tolist() + [float(expected[~big].sum())]
    if e[-1] < 5 and len(e) > 1:  # the pooled cell is still small: merge it into the next smallest
        o_last, e_last = o.pop(), e.pop()
        o[-1] += o_last
        e[-1] += e_last
    if len(e) < 2:
        return 1.0
    o_t, e_t = torch.tensor(o, dtype=torch.float64), torch.tensor(e, dtype=torch.float64)
    stat = ((o_t - e_t) ** 2 / e_t).sum()
    return float(torch.special.gammaincc(torch.tensor((len(e) - 1) / 2, dtype=torch.float64), stat / 2))


def check_sample_tokens(fn: Callable, case: OpCase) -> Outcome:
    """Greedy rows exactly as the reference (ties to the lowest id); sampled rows never outside
    the reference support; on the declared shapes (``case.extra["statistical"]``) also drawn from
    the reference distribution: a few rows are each drawn many times at steps 0.. and their token
    counts tested by chi-square (``statistical`` in specs/ops.toml)."""
    tokens, untouched = _call_on_copy(fn, case)
    if not untouched.ok:
        return untouched
    logits, temperature, top_k, top_p, min_p, seeds, steps = case.args
    rows, vocab = logits.shape
    if not isinstance(tokens, torch.Tensor) or tuple(tokens.shape) != (rows,) or tokens.dtype != torch.int64:
        got = f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        return Outcome(False, float("inf"), f"tokens: expected [{rows}] int64, got {got}")
    if rows == 0:
        return Outcome(True)
    tokens = tokens.cpu()
    if ((tokens < 0) | (tokens >= vocab)).any():
        return Outcome(False, float("inf"), f"tokens outside [0, {vocab}) (unwritten?): rows {((tokens < 0) | (tokens >= vocab)).nonzero().flatten().tolist()[:5]}")
    greedy = (temperature <= 0).cpu()
    ref = REFERENCE_OPS["sample_tokens"](*case.clone().args).cpu()
    if not torch.equal(tokens[greedy], ref[greedy]):
        r = int((tokens != ref)[greedy].nonzero()[0]) if greedy.any() else 0
        row = int(greedy.nonzero().flatten()[r])
        return Outcome(False, float("inf"), f"greedy row {row}: token {int(tokens[row])}, reference {int(ref[row])} (argmax, ties to the lowest id)")
    sampled = (~greedy).nonzero().flatten()
    if sampled.numel() == 0:
        return Outcome(True)
    probs = reference_distribution(logits, temperature, top_k, top_p, min_p).cpu()
    outside = probs[sampled, tokens[sampled]] <= 0
    if outside.any():
        row = int(sampled[outside.nonzero()[0]])
        return Outcome(False, float("inf"), f"sampled row {row} drew token {int(tokens[row])}, outside the reference support")
    if not case.extra.get("statistical"):
        return Outcome(True)
    stat = ops_spec()["sample_tokens"]["statistical"]
    alpha = float(stat["alpha"])
    draws = max(1, min(int(stat["draws"]), int(stat["max_elements"]) // vocab))
    checked = sampled[: int(stat["rows"]) if vocab <= int(stat["small_vocab"]) else 1].tolist()
    worst_p = 1.0
    for row in checked:
        counts = torch.zeros(vocab, dtype=torch.int64)
        chunk = max(1, min(draws, STAT_CHUNK_ELEMENTS // vocab))
        for start in range(0, draws, chunk):
            n = min(chunk, draws - start)
            args = [logits[row : row + 1].expand(n, vocab).contiguous()]
            args += [a[row : row + 1].expand(n).contiguous() for a in (temperature, top_k, top_p, min_p, seeds)]
            args.append(torch.arange(start, start + n, dtype=torch.int64, device=logits.device))
            with poisoned_outputs(logits.device):
                drawn = fn(*args).cpu()
            if ((drawn < 0) | (drawn >= vocab)).any():
                return Outcome(False, float("inf"), f"row {row} drew tokens outside [0, {vocab})")
            counts += torch.bincount(drawn, minlength=vocab)
        if counts[probs[row] <= 0].sum():
            return Outcome(False, float("inf"), f"row {row}: draws outside the reference support")
        pvalue = chi_square_pvalue(counts, probs[row])
        worst_p = min(worst_p, pvalue)
        if pvalue <= alpha:
            return Outcome(False, alpha / max(pvalue, 1e-300), f"row {row}: {draws} draws do not follow the reference distribution (chi-square p = {pvalue:.2e} <= alpha {alpha:g})")
    return Outcome(True, alpha / worst_p if worst_p > 0 else float("inf"))


CHECKERS: dict[str, Callable[[Callable, OpCase], Outcome]] = {
    "moe_route": check_moe_route,
    "sample_tokens": check_sample_tokens,
    "moe_route_sqrtsoftplus": check_moe_route_sqrtsoftplus,
    "indexer_topk": check_indexer_topk,
    "indexer_block_candidates": check_indexer_block_candidates,
    "engram_hash_ids": check_engram_hash_ids,
}


def check(fn: Callable, case: OpCase) -> Outcome:
    """Run ``fn`` on ``case`` and judge it; an exception is a failure that names it."""
    try:
        return CHECKERS.get(case.op, check_close)(fn, case)
    except Exception as e:  # a crash is a verdict, not an abort of the whole suite
        return Outcome(False, float("inf"), f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
