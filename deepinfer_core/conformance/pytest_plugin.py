"""pytest plugin: the op conformance checks as test items in a vendor's own test run.

Installed with deepinfer (entry point ``pytest11``); inert unless ``--deepinfer-backend`` is
given. ``pytest --deepinfer-backend NAME`` then adds one test per (op, dtype) the backend
provides, named ``deepinfer-conformance::<op>[<dtype>]``, running exactly what
``deepinfer conformance --backend NAME`` runs. Narrow with ``--deepinfer-ops``,
``--deepinfer-dtype``; ``--deepinfer-examples`` sets the hypothesis cases per check;
``--deepinfer-max-elements`` runs only the declared shapes of at most that many input values
(a simulator, an interpreter: the others are reported as not run).
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("deepinfer", "DeepInfer backend conformance")
    group.addoption("--deepinfer-backend", default=None, metavar="NAME",
                    help="add DeepInfer's op conformance checks for this installed backend")
    group.addoption("--deepinfer-ops", default=None, metavar="A,B", help="only these ops (default: every op the backend provides)")
    group.addoption("--deepinfer-dtype", default=None, metavar="D,E", help="compute dtypes, e.g. bf16,fp32 (default: the platform's)")
    group.addoption("--deepinfer-examples", default=None, type=int, metavar="N", help="hypothesis cases per op and dtype")
    group.addoption("--deepinfer-max-elements", default=None, type=int, metavar="N",
                    help="only the declared shapes whose inputs hold at most N values (default: all)")


class OpConformanceFailure(Exception):
    """An op outside the spec; carries the suite's report row."""


class OpCheckItem(pytest.Item):
    def __init__(self, *, op: str, dtype, fn, device, examples: int, backend: str, max_elements: int | None = None,
                 kv_records: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.op, self.dtype, self.fn, self.device, self.examples = op, dtype, fn, device, examples
        self.backend, self.max_elements, self.kv_records = backend, max_elements, kv_records
        self.report_row = None

    def runtest(self) -> None:
        from deepinfer_core.conformance.ops_suite import run_op

        row = run_op(self.op, self.fn, self.dtype, self.device, self.examples, max_elements=self.max_elements,
                     kv_records=self.kv_records)
        self.report_row = row
        if row.result != "PASS":
            raise OpConformanceFailure(f"{row.op} ({row.dtype}) {row.result}: {row.detail()} "
                                       f"[worst error {row.worst_error:.3g}, {row.cases} cases]\n"
                                       f"replay this case: {row.replay_command(self.backend)}")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, OpConformanceFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"deepinfer-conformance::{self.name}"


class ConformanceCollector(pytest.Collector):
    def __init__(self, *, backend: str, **kwargs):
        super().__init__(**kwargs)
        self.backend = backend

    def collect(self):
        from deepinfer_core.conformance.inputs import BUILDERS
        from deepinfer_core.conformance.ops_suite import DEFAULT_EXAMPLES, resolve_backend
        from deepinfer_core.conformance.spec import dtype_from_name, dtype_name
        from deepinfer_core.plugins import BackendError

        config = self.config
        try:
            chosen, platform, table = resolve_backend(self.backend)
            dtypes = [dtype_from_name(d) for d in (config.getoption("--deepinfer-dtype") or "").split(",") if d.strip()]
        except (BackendError, ValueError) as e:
            raise pytest.UsageError(f"--deepinfer-backend {self.backend}: {e}") from e
        wanted = [o.strip() for o in (config.getoption("--deepinfer-ops") or "").split(",") if o.strip()]
        unknown = [o for o in wanted if o not in BUILDERS]
        if unknown:
            raise pytest.UsageError(f"--deepinfer-ops: unknown ops {unknown}; the ops are: {', '.join(BUILDERS)}")
        own = [name for name in BUILDERS if table.providers.get(name) == chosen.name and (not wanted or name in wanted)]
        examples = config.getoption("--deepinfer-examples")
        for op in own:
            for dtype in dtypes or platform.supported_dtypes:
                yield OpCheckItem.from_parent(self, name=f"{op}[{dtype_name(dtype)}]", op=op, dtype=dtype, fn=table[op],
                                              device=platform.device, examples=DEFAULT_EXAMPLES if examples is None else examples,
                                              backend=chosen.name, max_elements=config.getoption("--deepinfer-max-elements"),
                                              kv_records=platform.fp8_kv_cache)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    backend = config.getoption("--deepinfer-backend")
    if backend:
        collector = ConformanceCollector.from_parent(session, name="deepinfer-conformance", backend=backend)
        items.extend(collector.collect())
