"""Shared pytest set-up: hardware-marked tests skip cleanly where the hardware is absent; modules of
tiny-model tests run torch on one thread (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""

from __future__ import annotations

import pytest
import torch


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    skip_npu = pytest.mark.skip(reason="needs an Ascend NPU")
    has_cuda = _has_cuda()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "npu" in item.keywords:
            item.add_marker(skip_npu)  # no NPU test runs anywhere yet: the Ascend ops are another issue


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module: tiny matmuls, where on CI's two cores torch's thread pool
    costs far more than the work."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
