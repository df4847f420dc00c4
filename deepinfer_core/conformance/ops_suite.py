"""Op conformance: every op a backend provides, against the reference, on the spec's shapes.

For each (op, dtype): every shape declared in ``specs/ops.toml`` is run once with seed 0, then
hypothesis draws ``examples`` more cases (a declared shape with its counts redrawn, and a fresh
seed for the values) and, when one fails, shrinks it to the smallest failing case it can find.
The verdict per (op, dtype) is PASS, FAIL (an output outside the tolerance, NaN, a wrong shape
or dtype, a modified input, an exception) or ERROR (the inputs could not be built).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from deepinfer_core.conformance.checks import Outcome, check
from deepinfer_core.conformance.inputs import BUILDERS, make_case, shape_strategy
from deepinfer_core.conformance.spec import dtype_name, shapes

DEFAULT_EXAMPLES = 8
# Hypothesis explores around the declared shapes whose inputs hold at most this many elements;
# larger (real-model) shapes run once each. Raise it on fast devices (--explore-max-elements).
DEFAULT_EXPLORE_MAX_ELEMENTS = 1 << 24


@dataclass
class OpReport:
    """The verdict on one (op, dtype)."""

    op: str
    dtype: str
    result: str  # PASS | FAIL | ERROR
    cases: int = 0
    worst_error: float = 0.0  # worst error / tolerance over the cases run (<= 1 passes)
    failing_shape: dict | None = None
    failing_seed: int | None = None
    message: str = ""
    seconds: float = 0.0

    def detail(self) -> str:
        if self.result == "PASS":
            return ""
        where = ", ".join(f"{k}={v}" for k, v in (self.failing_shape or {}).items())
        return f"[{where}; seed {self.failing_seed}] {self.message}" if where else self.message


@dataclass
class SuiteReport:
    backend: str
    platform: str
    device: str
    ops: list[OpReport] = field(default_factory=list)
    not_provided: list[str] = field(default_factory=list)  # ops the backend leaves to the reference

    @property
    def passed(self) -> bool:
        return bool(self.ops) and all(r.result == "PASS" for r in self.ops)

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}


class _CaseFailed(Exception):
    def __init__(self, dims: dict, seed: int, outcome: Outcome):
        super().__init__(outcome.message)
        self.dims, self.seed, self.outcome = dims, seed, outcome


def run_op(op: str, fn: Callable, dtype: torch.dtype, device: torch.device | str, examples: int = DEFAULT_EXAMPLES,
           seed: int | None = None, explore_max_elements: int = DEFAULT_EXPLORE_MAX_ELEMENTS) -> OpReport:
    """Check one op implementation ``fn`` in ``dtype`` on ``device``."""
    started = time.perf_counter()
    report = OpReport(op, dtype_name(dtype), "PASS")

    def run(dims: dict, case_seed: int, declared: bool = False) -> int:
        try:
            case = make_case(op, dims, dtype, device, case_seed)
            case.extra["statistical"] = declared  # the expensive statistical checks run on declared shapes
        except Exception as e:
            raise _CaseFailed(dims, case_seed, Outcome(False, float("inf"), f"could not build inputs: {type(e).__name__}: {e}")) from e
        elements = case.elements()
        outcome = check(fn, case)
        del case
        report.cases += 1
        report.worst_error = max(report.worst_error, outcome.error)
        if not outcome.ok:
            raise _CaseFailed(dims, case_seed, outcome)
        return elements

    declared = shapes(op)
    try:
        sizes = [run(dims, 0, declared=True) for dims in declared]  # every declared shape, always
        small = [dims for dims, size in zip(declared, sizes) if size <= explore_max_elements]
        if examples > 0 and small:
            _explore(op, small, run, examples, seed)
    except _CaseFailed as failed:
        building = failed.outcome.message.startswith("could not build inputs")
        report.result = "ERROR" if building else "FAIL"
        report.failing_shape, report.failing_seed, report.message = failed.dims, failed.seed, failed.outcome.message
        report.worst_error = max(report.worst_error, failed.outcome.error)
    report.seconds = time.perf_counter() - started
    return report


def _explore(op: str, declared: list[dict], run: Callable[[dict, int], None], examples: int, seed: int | None) -> None:
    """Hypothesis over the declared shapes: raises the smallest failing case it finds."""
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is None,
              suppress_health_check=list(HealthCheck), phases=(Phase.generate, Phase.shrink),
              verbosity=Verbosity.quiet, report_multiple_bugs=False, print_blob=False)
    @given(dims=shape_strategy(op, declared), case_seed=st.integers(0, 2**31 - 1))
    def explore(dims: dict, case_seed: int) -> None:
        run(dims, case_seed)

    if seed is not None:
        explore = hypothesis_seed(seed)(explore)
    explore()


def resolve_backend(backend: str | None):
    """(Backend, Platform, OpTable) of the named (or auto-selected) backend, loaded as the engine loads it."""
    from deepinfer_core.plugins import PluginManager

    manager = PluginManager()
    manager.discover()
    chosen = manager.select(backend)
    platform, table, _, _ = manager.load(chosen, model_config=None)
    return chosen, platform, table


def run_suite(backend: str | None, ops: list[str] | None = None, dtypes: list[torch.dtype] | None = None,
              examples: int = DEFAULT_EXAMPLES, seed: int | None = None, progress: bool = True,
              explore_max_elements: int = DEFAULT_EXPLORE_MAX_ELEMENTS) -> SuiteReport:
    """Check the ops ``backend`` provides itself (every op for the reference backend).

    ``ops`` narrows the set (an op the backend does not provide is an error: it would only test the
    reference); ``dtypes`` defaults to every dtype the platform supports.
    """
    from tqdm import tqdm

    from deepinfer_core.plugins import REFERENCE_BACKEND

    chosen, platform, table = resolve_backend(backend)
    own = [name for name in BUILDERS if table.providers.get(name) == chosen.name]
    not_provided = [name for name in BUILDERS if name not in own]
    if ops:
        unknown = [o for o in ops if o not in BUILDERS]
        if unknown:
            raise ValueError(f"unknown ops {unknown}; the ops are: {', '.join(BUILDERS)}")
        fallback = [o for o in ops if o not in own]
        if fallback:
            raise ValueError(f"backend {chosen.name!r} does not provide {fallback} (they fall back to the {REFERENCE_BACKEND} "
                             f"implementation, so there is nothing of its own to check); it provides: {', '.join(own) or 'none'}")
        own = [o for o in own if o in ops]
    dtypes = list(dtypes or platform.supported_dtypes)
    unsupported = [d for d in dtypes if d not in platform.supported_dtypes]
    if unsupported:
        raise ValueError(f"platform {platform.name} does not support {[dtype_name(d) for d in unsupported]}; "
                         f"it supports {[dtype_name(d) for d in platform.supported_dtypes]}")
    report = SuiteReport(chosen.name, platform.name, str(platform.device), not_provided=not_provided)
    jobs = [(op, dtype) for op in own for dtype in dtypes]
    with tqdm(jobs, desc=f"conformance {chosen.name}", unit="check", disable=not progress) as bar:
        for op, dtype in bar:
            bar.set_postfix_str(f"{op} {dtype_name(dtype)}")
            report.ops.append(run_op(op, table[op], dtype, platform.device, examples, seed, explore_max_elements))
            if platform.torch_device.type == "cuda":
                torch.cuda.empty_cache()
    return report


def format_report(report: SuiteReport) -> str:
    rows = [("OP", "DTYPE", "RESULT", "CASES", "WORST ERROR", "DETAIL")]
    for r in report.ops:
        worst = "inf" if r.worst_error == float("inf") else f"{r.worst_error:.3f}"
        rows.append((r.op, r.dtype, r.result, str(r.cases), worst, r.detail()))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = [f"Op conformance of backend {report.backend!r} on platform {report.platform} ({report.device})",
             "WORST ERROR: the largest |out - ref| / (atol + rtol |ref|) over the cases run; <= 1 passes (specs/ops.toml)."]
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
    return "\n".join(lines)


def write_json(report: SuiteReport, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=2, default=str)
