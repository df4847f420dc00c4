"""Op conformance: every op a backend provides, against the reference, on the spec's shapes.

For each (op, dtype): every shape declared in ``specs/ops.toml`` is run once with seed 0, then
hypothesis draws ``examples`` more cases (a declared shape with its counts redrawn, and a fresh
seed for the values) and, when one fails, shrinks it to the smallest failing case it can find.
The verdict per (op, dtype) is PASS, FAIL (an output outside the tolerance, NaN, a wrong shape
or dtype, a modified input, an exception) or ERROR (the inputs could not be built). Where only
small cases can run (a simulator, Triton's interpreter), ``max_elements`` leaves out the
declared shapes whose inputs are larger: the report counts them (``skipped``), and an op none of
whose declared shapes fits is an ERROR, never a PASS of nothing.

A FAIL or ERROR names its one failing case as a ``ReplayCase`` (op, dtype, dims, value seed):
everything its inputs are built from, so ``replay`` re-runs exactly that case, nothing else
(``deepinfer conformance --replay CASE``; the report prints the command).
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

import torch

from deepinfer_core.conformance import jsonsafe
from deepinfer_core.conformance.checks import Outcome, check
from deepinfer_core.conformance.inputs import BUILDERS, CaseTooLarge, make_case, shape_strategy
from deepinfer_core.conformance.spec import dtype_from_name, dtype_name, shapes

DEFAULT_EXAMPLES = 8
# Hypothesis explores around the declared shapes whose inputs hold at most this many elements;
# larger (real-model) shapes run once each. Raise it on fast devices (--explore-max-elements).
DEFAULT_EXPLORE_MAX_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class ReplayCase:
    """One case of the suite, as a failing report row names it: its inputs are
    ``make_case(op, dims, dtype, device, seed)``, judged with the statistical checks of the
    declared shapes when ``statistical`` (only sample_tokens has any). ``seed`` is the seed of the
    input values; it is not ``--seed``, which seeds hypothesis' search for cases."""

    op: str
    dtype: str  # a name of deepinfer_core.dtypes.DTYPES
    dims: dict
    seed: int
    statistical: bool = False

    def text(self) -> str:
        """One line of JSON: what ``parse`` reads back (and ``--replay`` takes)."""
        return json.dumps(asdict(self), allow_nan=False)

    def command(self, backend: str) -> str:
        """The shell command that replays this case on ``backend``."""
        return f"deepinfer conformance --backend {shlex.quote(backend)} --replay {shlex.quote(self.text())}"

    @classmethod
    def parse(cls, text: str) -> ReplayCase:
        """The case ``text`` (a JSON object as ``text()`` writes it); ValueError saying what is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the case is not JSON ({e}); pass the object a failing report prints") from e
        if not isinstance(data, dict):
            raise ValueError(f"the case must be a JSON object with {', '.join(_REQUIRED)}, got {type(data).__name__}")
        _check_names(f"the case needs {', '.join(_REQUIRED)} (and optionally statistical)", _REQUIRED,
                     [f.name for f in fields(cls)], data)
        op, dims, seed, statistical = data["op"], data["dims"], data["seed"], data.get("statistical", False)
        if op not in BUILDERS:
            raise ValueError(f"unknown op {op!r}; the ops are: {', '.join(BUILDERS)}")
        if not isinstance(data["dtype"], str):
            raise ValueError(f"dtype must be a name such as \"bfloat16\", got {data['dtype']!r}")
        dtype = dtype_name(dtype_from_name(data["dtype"]))
        _check_dims(op, dims)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        if not isinstance(statistical, bool):
            raise ValueError(f"statistical must be true or false, got {statistical!r}")
        return cls(op, dtype, dims, seed, statistical)


_REQUIRED = ("op", "dtype", "dims", "seed")  # of a ReplayCase's JSON; statistical defaults to false


def _check_names(what: str, required, allowed, given: dict) -> None:
    """ValueError starting with ``what`` unless ``given`` has every ``required`` key and only ``allowed`` ones."""
    missing = [k for k in required if k not in given]
    unknown = sorted(k for k in given if k not in allowed)
    if missing or unknown:
        found = [f"missing: {', '.join(missing)}"] * bool(missing) + [f"unknown: {', '.join(unknown)}"] * bool(unknown)
        raise ValueError(f"{what}; {'; '.join(found)}")


def _check_dims(op: str, dims) -> None:
    """``dims`` names the dimensions of ``op``'s declared shapes: those every shape names, and
    only ones some shape names (an optional dimension such as mla_decode_attention's
    ``query_lens`` has a default). Values are the builder's to judge."""
    if not isinstance(dims, dict):
        raise ValueError(f"dims must be a JSON object of {op}'s dimensions, got {type(dims).__name__}")
    declared = [set(s) for s in shapes(op)]
    required, allowed = sorted(set.intersection(*declared)), sorted(set.union(*declared))
    optional = [n for n in allowed if n not in required]
    what = f"the dims of {op} are {', '.join(required)}" + (f" (optionally {', '.join(optional)})" if optional else "")
    _check_names(what, required, allowed, dims)


@dataclass
class OpReport:
    """The verdict on one (op, dtype)."""

    op: str
    dtype: str
    result: str  # PASS | FAIL | ERROR
    cases: int = 0
    worst_error: float = 0.0  # worst error / tolerance over the cases run (<= 1 passes)
    failing_shape: dict | None = None
    failing_seed: int | None = None  # the value seed of the failing case (ReplayCase.seed)
    failing_case: ReplayCase | None = None  # all of it: what ``replay`` takes
    message: str = ""
    seconds: float = 0.0
    skipped: int = 0  # declared shapes left out: inputs larger than max_elements
    records_not_run: int = 0  # kv_record shapes left out: the platform takes no FP8 KV records

    def detail(self) -> str:
        if self.result == "PASS":
            notes = [f"{self.skipped} declared shapes over max_elements not run"] if self.skipped else []
            notes += [f"{self.records_not_run} FP8 KV record shapes not run (platform without fp8_kv_cache)"] if self.records_not_run else []
            return "; ".join(notes)
        where = ", ".join(f"{k}={v}" for k, v in (self.failing_shape or {}).items())
        return f"[{where}; value seed {self.failing_seed}] {self.message}" if where else self.message

    def replay_command(self, backend: str) -> str:
        """The command that re-runs exactly the failing case on ``backend`` ("" when none failed)."""
        return self.failing_case.command(backend) if self.failing_case else ""


@dataclass
class SuiteReport:
    backend: str
    platform: str
    device: str
    ops: list[OpReport] = field(default_factory=list)
    not_provided: list[str] = field(default_factory=list)  # ops the backend leaves to the reference
    replayed: ReplayCase | None = None  # set when the report is of one replayed case (``replay``)
    batch_invariant: bool = False  # the backend's batch-invariant op table was checked

    @property
    def passed(self) -> bool:
        return bool(self.ops) and all(r.result == "PASS" for r in self.ops)

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}


class _CaseFailed(Exception):
    def __init__(self, case: ReplayCase | None, outcome: Outcome):
        super().__init__(outcome.message)
        self.case, self.outcome = case, outcome


def _run_case(report: OpReport, fn: Callable, device: torch.device | str, case: ReplayCase,
              max_elements: int | None = None) -> int:
    """Build ``case``'s inputs and judge ``fn`` on them, counted in ``report``. Returns how many
    elements the inputs held; raises _CaseFailed (carrying ``case`` itself, so a failure names
    exactly the inputs that failed) on a failure or when the inputs cannot be built, and
    CaseTooLarge, before anything is run, when they would be larger than ``max_elements``."""
    try:
        inputs = make_case(case.op, case.dims, dtype_from_name(case.dtype), device, case.seed, max_elements)
        inputs.extra["statistical"] = case.statistical  # the expensive statistical checks run on declared shapes
    except CaseTooLarge:
        raise
    except Exception as e:
        raise _CaseFailed(case, Outcome(False, float("inf"), f"could not build inputs: {type(e).__name__}: {e}")) from e
    elements = inputs.elements()
    outcome = check(fn, inputs)
    del inputs
    report.cases += 1
    report.worst_error = max(report.worst_error, outcome.error)
    if not outcome.ok:
        raise _CaseFailed(case, outcome)
    return elements


def _judge(report: OpReport, cases: Callable[[], object]) -> OpReport:
    """Run ``cases`` (which raise _CaseFailed at the first failure) and record the verdict in ``report``."""
    started = time.perf_counter()
    try:
        cases()
    except _CaseFailed as failed:
        building = failed.outcome.message.startswith("could not build inputs")
        report.result = "ERROR" if building else "FAIL"
        report.failing_case, report.message = failed.case, failed.outcome.message
        if failed.case is not None:
            report.failing_shape, report.failing_seed = failed.case.dims, failed.case.seed
        report.worst_error = max(report.worst_error, failed.outcome.error)
    report.seconds = time.perf_counter() - started
    return report


def run_op(op: str, fn: Callable, dtype: torch.dtype, device: torch.device | str, examples: int = DEFAULT_EXAMPLES,
           seed: int | None = None, explore_max_elements: int = DEFAULT_EXPLORE_MAX_ELEMENTS,
           max_elements: int | None = None, kv_records: bool = True) -> OpReport:
    """Check one op implementation ``fn`` in ``dtype`` on ``device``. ``max_elements``: run only
    the declared shapes whose inputs hold (and take to draw) at most this many values, and explore
    around those (None: every declared shape); the others are counted in the report's ``skipped``.
    ``kv_records`` False (a platform without ``fp8_kv_cache``): the ``kv_record`` shapes (V4 FP8
    KV record caches / pools) are not run, and counted in ``records_not_run``."""
    report = OpReport(op, dtype_name(dtype), "PASS")

    def run(dims: dict, case_seed: int, declared: bool = False) -> int:
        # explored cases only shrink the counts of a declared shape that fitted: no limit needed
        limit = max_elements if declared else None
        return _run_case(report, fn, device, ReplayCase(op, report.dtype, dims, case_seed, statistical=declared), limit)

    def fitting(dims: dict) -> int | None:
        """The declared shape's size once run (every declared shape that fits runs), None when too large."""
        try:
            return run(dims, 0, declared=True)
        except CaseTooLarge:
            report.skipped += 1
            return None

    def cases() -> None:
        declared = [d for d in shapes(op) if kv_records or not d.get("kv_record", False)]
        report.records_not_run = len(shapes(op)) - len(declared)
        sizes = [fitting(dims) for dims in declared]
        if report.skipped == len(declared):
            raise _CaseFailed(None, Outcome(False, float("inf"), f"could not build inputs: every declared shape of {op} "
                                            f"holds more than max_elements = {max_elements} values"))
        small = [dims for dims, size in zip(declared, sizes) if size is not None and size <= explore_max_elements]
        if examples > 0 and small:
            _explore(op, small, run, examples, seed)

    return _judge(report, cases)


def replay_case(case: ReplayCase, fn: Callable, device: torch.device | str) -> OpReport:
    """Check ``fn`` on exactly ``case`` (one case, no search): the verdict the suite gave it."""
    report = OpReport(case.op, case.dtype, "PASS")
    return _judge(report, lambda: _run_case(report, fn, device, case))


def _flaky_case(error: BaseException) -> _CaseFailed | None:
    """The failure a hypothesis Flaky error is about (a sub-exception; the cause in older versions)."""
    for e in [*getattr(error, "exceptions", ()), error.__cause__, error.__context__]:
        if isinstance(e, _CaseFailed):
            return e
    return None


def _explore(op: str, declared: list[dict], run: Callable[[dict, int], None], examples: int, seed: int | None) -> None:
    """Hypothesis over the declared shapes: raises the smallest failing case it finds (_CaseFailed)."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st
    from hypothesis.errors import Flaky

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is None,
              suppress_health_check=list(HealthCheck), phases=(Phase.generate, Phase.shrink),
              verbosity=Verbosity.quiet, report_multiple_bugs=False, print_blob=False)
    @given(dims=shape_strategy(op, declared), case_seed=st.integers(0, 2**31 - 1))
    def explore(dims: dict, case_seed: int) -> None:
        run(dims, case_seed)

    if seed is not None:
        explore = hypothesis_seed(seed)(explore)
    try:
        explore()
    except Flaky as e:  # the case failed, then passed when hypothesis ran it again: still a FAIL, not a crash
        failed = _flaky_case(e)
        if failed is None:
            raise
        note = "flaky: this case failed once, then passed on the same inputs (a race? uninitialised memory?): "
        raise _CaseFailed(failed.case, Outcome(False, failed.outcome.error, note + failed.outcome.message)) from e


def resolve_backend(backend: str | None, batch_invariant: bool = False):
    """(Backend, Platform, OpTable) of the named (or auto-selected) backend, loaded as the engine
    loads it (its batch-invariant table with ``batch_invariant``)."""
    from deepinfer_core.plugins import PluginManager

    manager = PluginManager()
    manager.discover()
    chosen = manager.select(backend)
    platform, table, _, _ = manager.load(chosen, model_config=None, batch_invariant=batch_invariant)
    return chosen, platform, table


def run_suite(backend: str | None, ops: list[str] | None = None, dtypes: list[torch.dtype] | None = None,
              examples: int = DEFAULT_EXAMPLES, seed: int | None = None, progress: bool = True,
              explore_max_elements: int = DEFAULT_EXPLORE_MAX_ELEMENTS, max_elements: int | None = None,
              batch_invariant: bool = False) -> SuiteReport:
    """Check the ops ``backend`` provides itself (every op for the reference backend).

    ``ops`` narrows the set (an op the backend does not provide is an error: it would only test the
    reference); ``dtypes`` defaults to every dtype the platform supports; ``max_elements`` as ``run_op``;
    ``batch_invariant``: the backend's batch-invariant table (against the same reference and tolerances).
    """
    from tqdm import tqdm

    chosen, platform, table = resolve_backend(backend, batch_invariant)
    own, dtypes = _selection(chosen, platform, table, ops, dtypes)
    report = SuiteReport(chosen.name, platform.name, str(platform.device), not_provided=[o for o in BUILDERS if o not in own],
                         batch_invariant=batch_invariant)
    if ops:
        own = [o for o in own if o in ops]
    jobs = [(op, dtype) for op in own for dtype in dtypes]
    with tqdm(jobs, desc=f"conformance {chosen.name}", unit="check", disable=not progress) as bar:
        for op, dtype in bar:
            bar.set_postfix_str(f"{op} {dtype_name(dtype)}")
            report.ops.append(run_op(op, table[op], dtype, platform.device, examples, seed, explore_max_elements, max_elements,
                                     kv_records=platform.fp8_kv_cache))
            if platform.torch_device.type == "cuda":
                torch.cuda.empty_cache()
    return report


def replay(backend: str | None, case: ReplayCase, batch_invariant: bool = False) -> SuiteReport:
    """Re-run exactly ``case`` (as a failing report row names it) on ``backend``'s own op: a report
    of one row and one case. ValueError as ``run_suite`` for an op the backend does not provide or
    a dtype its platform does not support."""
    chosen, platform, table = resolve_backend(backend, batch_invariant)
    _selection(chosen, platform, table, [case.op], [dtype_from_name(case.dtype)])
    report = SuiteReport(chosen.name, platform.name, str(platform.device), replayed=case, batch_invariant=batch_invariant)
    report.ops.append(replay_case(case, table[case.op], platform.device))
    return report


def _selection(chosen, platform, table, ops: list[str] | None, dtypes: list[torch.dtype] | None) -> tuple[list[str], list[torch.dtype]]:
    """(the ops ``chosen`` provides itself, the dtypes to check); ValueError for a requested op it
    does not provide (checking it would only test the reference) or a dtype its platform lacks."""
    from deepinfer_core.plugins import REFERENCE_BACKEND

    own = [name for name in BUILDERS if table.providers.get(name) == chosen.name]
    if ops:
        unknown = [o for o in ops if o not in BUILDERS]
        if unknown:
            raise ValueError(f"unknown ops {unknown}; the ops are: {', '.join(BUILDERS)}")
        fallback = [o for o in ops if o not in own]
        if fallback:
            raise ValueError(f"backend {chosen.name!r} does not provide {fallback} (they fall back to the {REFERENCE_BACKEND} "
                             f"implementation, so there is nothing of its own to check); it provides: {', '.join(own) or 'none'}")
    dtypes = list(dtypes or platform.supported_dtypes)
    unsupported = [d for d in dtypes if d not in platform.supported_dtypes]
    if unsupported:
        raise ValueError(f"platform {platform.name} does not support {[dtype_name(d) for d in unsupported]}; "
                         f"it supports {[dtype_name(d) for d in platform.supported_dtypes]}")
    return own, dtypes


def format_report(report: SuiteReport) -> str:
    rows = [("OP", "DTYPE", "RESULT", "CASES", "WORST ERROR", "DETAIL")]
    for r in report.ops:
        worst = "inf" if r.worst_error == float("inf") else f"{r.worst_error:.3f}"
        rows.append((r.op, r.dtype, r.result, str(r.cases), worst, r.detail()))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    table = " (its batch-invariant table)" if report.batch_invariant else ""
    lines = [f"Op conformance of backend {report.backend!r}{table} on platform {report.platform} ({report.device})",
             "WORST ERROR: the largest |out - ref| / (atol + rtol |ref|) over the cases run; <= 1 passes (specs/ops.toml)."]
    if report.replayed:
        lines.append(f"Replayed one case: {report.replayed.text()}")
    lines += [("  " + "  ".join(c.ljust(w) for c, w in zip(row[:5], widths)) + "  " + row[5]).rstrip() for row in rows]
    failed = [r for r in report.ops if r.result != "PASS"]
    if report.not_provided and report.backend != "reference":
        lines.append(f"Not checked (fall back to the reference): {', '.join(report.not_provided)}")
    if not report.ops:
        lines.append("FAILED: nothing to check: the backend provides none of the selected ops.")
    elif failed:
        lines.append(f"FAILED: {len(failed)} of {len(report.ops)} checks: " + ", ".join(f"{r.op} ({r.dtype})" for r in failed))
    else:
        lines.append(f"PASSED: all {len(report.ops)} checks ({sum(r.cases for r in report.ops)} cases).")
    replayable = [r for r in failed if r.failing_case and not report.replayed]
    if replayable:  # last, to copy: exactly the failing case again, without the search that found it
        lines.append("Replay a failing case (its op, dtype, dims and value seed) with:")
        lines += [f"  {r.replay_command(report.backend)}" for r in replayable]
    return "\n".join(lines)


def write_json(report: SuiteReport, path: str) -> None:
    """The report as strict JSON (a failed op's inf worst error as "inf", not a bare Infinity)."""
    jsonsafe.write(report.to_json(), path)
