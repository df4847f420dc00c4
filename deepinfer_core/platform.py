"""What the core needs to know about the machine a backend runs on."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Platform:
    """Returned by a backend's ``deepinfer_platform`` hook.

    name: platform name used to key numeric baselines, e.g. ``cpu-reference``, ``nvidia-sm90``.
    device: the torch device the model runs on (``cpu``, ``cuda:0``, ``npu:0``).
    backend: the name of the backend that made it.
    supported_dtypes: compute dtypes the backend's ops accept.
    fp8_weights: keep block-FP8 weights quantised (the op table has fast FP8 ops); when False the
        loader dequantises FP8 checkpoints to the compute dtype (W8A16).
    graph_capture: decode steps can be captured as graphs.
    batch_invariant: ops give the same per-row result whatever the batch they run in.
    """

    name: str
    device: str = "cpu"
    backend: str = "reference"
    supported_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    fp8_weights: bool = False
    graph_capture: bool = False
    batch_invariant: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory; host memory for the CPU."""
        dev = self.torch_device
        if dev.type == "cuda":
            return torch.cuda.mem_get_info(dev)
        if dev.type == "cpu":
            import os

            pages = os.sysconf("SC_PHYS_PAGES")
            free_pages = os.sysconf("SC_AVPHYS_PAGES")
            page = os.sysconf("SC_PAGE_SIZE")
            return free_pages * page, pages * page
        module = getattr(torch, dev.type)
        return module.mem_get_info(dev)

    def synchronize(self) -> None:
        dev = self.torch_device
        if dev.type != "cpu":
            getattr(torch, dev.type).synchronize(dev)
