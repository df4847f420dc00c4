"""Shared pytest set-up: hardware-marked tests skip cleanly where the hardware is absent; modules of
tiny-model tests run torch on one thread (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""

from __future__ import annotations

import pytest
import torch


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def _npu_missing() -> str | None:
    """Why the ``npu`` tests cannot run here (None: they can): the Ascend backend's own probe, which
    looks for torch_npu, a sourced CANN and /dev/davinci* without importing torch_npu."""
    try:
        from deepinfer_ascend_950.backend import deepinfer_probe
    except ImportError:
        return "the deepinfer-ascend-950 plugin is not installed"
    probe = deepinfer_probe()
    return None if probe.available else probe.reason


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    has_cuda = _has_cuda()
    npu_missing = _npu_missing() if any("npu" in item.keywords for item in items) else None
    skip_npu = pytest.mark.skip(reason=f"needs an Ascend NPU ({npu_missing})")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "npu" in item.keywords and npu_missing:
            item.add_marker(skip_npu)


def pytest_runtest_logreport(report):
    """With DEEPINFER_FAILURES_FILE set, each failure's id and the end of its traceback are
    appended to that file as it happens (once, by xdist's controller). A GPU call that a timeout cuts off
    before pytest's summary still brings back why its tests failed (tools/gpu_session.sh)."""
    import os

    path = os.environ.get("DEEPINFER_FAILURES_FILE")
    # under xdist the controller hears every worker's report again: only it (or a run without
    # workers) writes, so each failure is recorded once
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}\n\n")


@pytest.fixture
def llm_arguments(monkeypatch) -> dict:
    """What the command line hands ``LLM()``: ``deepinfer_core.LLM`` becomes a recorder of its
    keyword arguments that stops there (a ConfigError, which the commands report as one line)."""
    import deepinfer_core
    from deepinfer_core.config import ConfigError

    seen: dict = {}

    def llm(**kwargs):
        seen.update(kwargs)
        raise ConfigError("stop here")

    monkeypatch.setattr(deepinfer_core, "LLM", llm)
    return seen


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module: tiny matmuls, where on CI's two cores torch's thread pool
    costs far more than the work."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
