"""Facts about the device the kernels' launch heuristics size their grids by."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device, interpreter_sms: int) -> int:
    """The SM count of a CUDA ``device`` (cached per device index); ``interpreter_sms`` for anything
    else (TRITON_INTERPRET runs on CPU tensors; each kernel picks a count that exercises its splits)."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return interpreter_sms
