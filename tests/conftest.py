"""Shared pytest set-up: hardware-marked tests skip cleanly where the hardware is absent."""

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
