"""The Ascend backend's op table and its plan, on any machine: every op a provider or a reason,
the plan equal to what deepinfer_ops returns, ops taken back to the reference by name, the TileLang
kernels plugging in where their package is, and ``deepinfer backends --plan ascend``."""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types

import pytest

from deepinfer_ascend_950 import backend, npu_ops, op_plan, op_table
from deepinfer_core import hook_checks
from deepinfer_core.cli import main
from deepinfer_core.ops import OP_NAMES, OPTIONAL_OPS, V4_OP_NAMES

HAS_CANN = bool(os.environ.get("ASCEND_HOME_PATH")) or any(os.path.isdir(os.path.expanduser(p)) for p in backend.CANN_LOCATIONS)


def test_the_plan_covers_every_op_once_and_matches_the_table(monkeypatch):
    monkeypatch.delenv(op_table.REFERENCE_OPS_ENV, raising=False)
    plan = backend.deepinfer_op_plan()
    assert hook_checks.op_plan_problems(plan, OP_NAMES) == []
    assert set(plan.provides) | set(plan.left_out) == set(OP_NAMES)  # every V2/V3/V4/V4.1 op: a provider or a reason
    assert set(V4_OP_NAMES) <= set(plan.provides) | set(plan.left_out)
    ops = backend.deepinfer_ops(platform=None, model_config=None)
    assert set(ops) == set(plan.provides)  # the plan is what deepinfer_ops returns
    assert not (set(op_plan.PROVIDES) & set(op_plan.LEFT_OUT)) and set(op_plan.PROVIDES) | set(op_plan.LEFT_OUT) == set(OP_NAMES)
    assert op_plan.TILELANG_PLANNED <= set(op_plan.LEFT_OUT)  # TileLang only where no stock operator fits
    for name in OPTIONAL_OPS - set(plan.provides):
        assert plan.left_out[name]
    assert "656-byte" in plan.left_out["sparse_attention"] and "584-byte" in plan.left_out["sparse_attention"]
    assert "[blocks, bs, 576]" in plan.left_out["mla_decode_attention"]


def test_without_the_tilelang_package_its_ops_are_planned_on_the_reference(monkeypatch):
    monkeypatch.setattr(op_table, "TILELANG_PACKAGE", "deepinfer_ascend_950.no_such_package")
    monkeypatch.delenv(op_table.REFERENCE_OPS_ENV, raising=False)
    plan = backend.deepinfer_op_plan()
    assert set(plan.provides) == set(op_plan.PROVIDES) == set(backend.deepinfer_ops(platform=None, model_config=None))
    for name in op_plan.TILELANG_PLANNED:
        assert plan.left_out[name] == (f"{op_plan.LEFT_OUT[name]}; planned: TileLang kernel (tilelang_ops), off here: "
                                       f"deepinfer_ascend_950.no_such_package is not in this installation")


def test_ops_can_be_left_to_the_reference_by_name(monkeypatch):
    monkeypatch.setenv(op_table.REFERENCE_OPS_ENV, "rms_norm, mhc_pre")
    ops = backend.deepinfer_ops(platform=None, model_config=None)
    assert "rms_norm" not in ops and "mhc_pre" not in ops and "add_rms_norm" in ops
    plan = backend.deepinfer_op_plan()
    assert plan.left_out["rms_norm"].startswith(f"left to the reference by {op_table.REFERENCE_OPS_ENV} (would be: torch_npu.npu_rms_norm")
    monkeypatch.setenv(op_table.REFERENCE_OPS_ENV, "all")
    assert backend.deepinfer_ops(platform=None, model_config=None) == {} and not backend.deepinfer_op_plan().provides
    monkeypatch.setenv(op_table.REFERENCE_OPS_ENV, "rms_nrom")
    with pytest.raises(ValueError, match="unknown ops \\['rms_nrom'\\]"):
        backend.deepinfer_ops(platform=None, model_config=None)
    plan = backend.deepinfer_op_plan()  # the plan still shows, with the error beside each reason
    assert "unknown ops ['rms_nrom']" in plan.left_out["linear"] and "rms_norm" in plan.provides


@pytest.fixture
def tilelang_ops(monkeypatch):
    """A stand-in of the ascend-tilelang branch's ``tilelang_ops`` package with its interface:
    KERNELS {kernel name: Kernel(name, op, ...)}, unavailable_reason(), ops.op_table()."""
    def module(name):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    package, glue = module(op_table.TILELANG_PACKAGE), module(op_table.TILELANG_PACKAGE + ".ops")
    kernel = types.SimpleNamespace
    package.KERNELS = {k.name: k for k in (kernel(name="deepinfer_compress_pool", op="compress_pool"),
                                           kernel(name="deepinfer_route_topk", op="moe_route_sqrtsoftplus"),
                                           kernel(name="deepinfer_route_fixed", op="moe_route_sqrtsoftplus"),
                                           kernel(name="deepinfer_rms_norm", op="rms_norm"))}
    package.unavailable_reason = lambda: None
    stub = lambda kv, score, norm_weight, eps: kv  # noqa: E731
    glue.op_table = lambda: {"compress_pool": stub, "moe_route_sqrtsoftplus": stub, "rms_norm": stub}
    monkeypatch.delenv(op_table.REFERENCE_OPS_ENV, raising=False)
    return package, stub


def test_the_tilelang_kernels_fill_what_the_stock_operators_leave(tilelang_ops):
    _, stub = tilelang_ops
    plan = backend.deepinfer_op_plan()
    assert plan.provides["compress_pool"] == "TileLang: deepinfer_compress_pool (tilelang_ops, AscendC through bisheng)"
    assert plan.provides["moe_route_sqrtsoftplus"].startswith("TileLang: deepinfer_route_topk + deepinfer_route_fixed (")
    assert plan.provides["rms_norm"] == op_plan.PROVIDES["rms_norm"]  # a stock operator keeps its op
    assert plan.left_out["engram_gate"].endswith("; planned: TileLang kernel (tilelang_ops), off here: it has none for this op")
    ops = backend.deepinfer_ops(platform=None, model_config=None)
    assert ops["compress_pool"] is stub and ops["rms_norm"] is npu_ops.rms_norm
    assert set(ops) == set(plan.provides)


def test_without_tilelang_installed_the_plan_says_so(tilelang_ops):
    package, _ = tilelang_ops
    package.unavailable_reason = lambda: "tilelang is not installed (pip install -e 'plugins/ascend_950[tilelang]')"
    plan = backend.deepinfer_op_plan()
    assert "compress_pool" not in plan.provides
    assert plan.left_out["compress_pool"].endswith("off here: tilelang is not installed (pip install -e 'plugins/ascend_950[tilelang]')")


def test_backends_plan_ascend_prints_the_table_here(capsys, monkeypatch):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    monkeypatch.delenv(op_table.REFERENCE_OPS_ENV, raising=False)
    assert main(["backends", "--plan", "ascend"]) == 0
    out = capsys.readouterr().out
    listing = next(line for line in out.splitlines() if line.split()[:1] == ["ascend"])
    assert "unavailable: " in listing or HAS_CANN
    assert "Plan: ascend (" in out and "nothing was loaded" in out
    rows = {line.split()[0]: line for line in out.split("Plan: ascend")[1].splitlines()[3:]}
    assert set(rows) == set(OP_NAMES)
    plan = backend.deepinfer_op_plan()  # with or without the TileLang kernels installed
    for op in OP_NAMES:
        if op in plan.provides:
            assert rows[op].split()[1] == "ascend" and plan.provides[op] in rows[op]
        else:
            assert "why not: " in rows[op] and plan.left_out[op] in rows[op] and op_plan.LEFT_OUT[op] in rows[op]
    assert set(op_plan.PROVIDES) <= set(plan.provides)
    n_out = len(OP_NAMES) - len(plan.provides) - len(OPTIONAL_OPS - set(plan.provides))
    assert f"Ops: {len(plan.provides)} of {len(OP_NAMES)} from ascend, {n_out} fall back to the reference" in out
    assert main(["backends", "--plan", "ascend", "--accelerator", "cpu"]) == 2
    assert main(["backends", "--plan", "nosuch"]) == 1
    assert "'nosuch' is not installed" in capsys.readouterr().err
