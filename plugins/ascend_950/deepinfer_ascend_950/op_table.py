"""Which callable the Ascend backend gives each op, and the plan of it (``deepinfer_ops`` and
``deepinfer_op_plan`` in ``backend``).

Three sources, in order: the stock torch_npu operators (``npu_ops.OPS``; ``op_plan.PROVIDES``
says what each runs), then the TileLang kernels of ``tilelang_ops`` for the ops CANN does not
fuse (where that package is installed; its contract: ``KERNELS`` = {kernel name: Kernel with
``.name`` and ``.op``} and ``unavailable_reason()``, both cheap, and ``tilelang_ops.ops.op_table()``
= {op: callable}), and the reference on the NPU for the rest (``op_plan.LEFT_OUT`` says why).
``DEEPINFER_ASCEND_REFERENCE_OPS`` takes ops back to the reference by name, to bisect a wrong
result on the chip. ``plan()`` imports no torch: it runs on any machine.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

TILELANG_PACKAGE = "deepinfer_ascend_950.tilelang_ops"
# Ops to leave to the reference whatever the plan says (comma-separated op names, or "all").
REFERENCE_OPS_ENV = "DEEPINFER_ASCEND_REFERENCE_OPS"


def reference_only() -> set[str]:
    """The ops DEEPINFER_ASCEND_REFERENCE_OPS leaves to the reference ("all": every one)."""
    from deepinfer_core.ops import OP_NAMES

    raw = os.environ.get(REFERENCE_OPS_ENV, "")
    names = {n.strip() for n in raw.split(",") if n.strip()}
    if "all" in names:
        return set(OP_NAMES)
    unknown = sorted(names - set(OP_NAMES))
    if unknown:
        raise ValueError(f"{REFERENCE_OPS_ENV}={raw!r} names unknown ops {unknown}; known ops: {', '.join(OP_NAMES)}")
    return names


def tilelang_package():
    """The ``tilelang_ops`` package, or None where this installation has none (its import errors
    are raised: a broken package is not an absent one)."""
    try:
        if importlib.util.find_spec(TILELANG_PACKAGE) is None:
            return None
    except ModuleNotFoundError:
        return None
    return importlib.import_module(TILELANG_PACKAGE)


def ops() -> dict:
    """{op: callable}: the stock operators, the TileLang kernels for ops they leave, less
    DEEPINFER_ASCEND_REFERENCE_OPS."""
    from deepinfer_ascend_950 import npu_ops

    table = dict(npu_ops.OPS)
    if tilelang_package() is not None:
        for name, fn in importlib.import_module(TILELANG_PACKAGE + ".ops").op_table().items():
            table.setdefault(name, fn)
    off = reference_only()
    return {name: fn for name, fn in table.items() if name not in off}


def _tilelang_plan() -> tuple[dict[str, str], str | None]:
    """({op: the TileLang kernels that provide it}, None) where tilelang_ops can run its kernels,
    else ({}, why not)."""
    try:
        package = tilelang_package()
    except Exception as e:  # shown in the plan; ops() raises it
        return {}, f"importing {TILELANG_PACKAGE} failed: {type(e).__name__}: {e}"
    if package is None:
        return {}, f"{TILELANG_PACKAGE} is not in this installation"
    reason = package.unavailable_reason()
    if reason is not None:
        return {}, reason
    kernels: dict[str, list[str]] = {}
    around: dict[str, list[str]] = {}  # ops the reference composes around a kernel
    for kernel in package.KERNELS.values():
        kernels.setdefault(kernel.op, []).append(kernel.name)
        for op in getattr(kernel, "composes", ()):
            around.setdefault(op, []).append(kernel.name)
    planned = {op: f"TileLang: {' + '.join(names)} (tilelang_ops, AscendC through bisheng)" for op, names in kernels.items()}
    for op, names in around.items():
        planned.setdefault(op, f"the reference around TileLang's {' + '.join(names)} (tilelang_ops, AscendC through bisheng)")
    return planned, None


def plan() -> tuple[dict[str, str], dict[str, str]]:
    """(provides, left_out) as ``ops()`` builds them on a 950 with this installation."""
    from deepinfer_ascend_950.op_plan import LEFT_OUT, PROVIDES, TILELANG_PLANNED

    provides, left_out = dict(PROVIDES), dict(LEFT_OUT)
    kernels, why_not = _tilelang_plan()
    for name, line in kernels.items():
        if name not in provides and name in left_out:
            provides[name] = line
            del left_out[name]
    for name in TILELANG_PLANNED & set(left_out):
        left_out[name] += f"; planned: TileLang kernel (tilelang_ops), off here: {why_not or 'it has none for this op'}"
    try:
        off = reference_only()
    except ValueError as e:
        off, left_out = set(), {k: f"{v} [{e}]" for k, v in left_out.items()}
    for name in off & set(provides):
        left_out[name] = f"left to the reference by {REFERENCE_OPS_ENV} (would be: {provides.pop(name)})"
    return provides, left_out
