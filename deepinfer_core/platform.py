"""What the core needs to know about the machine a backend runs on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch


class GraphBackend(Protocol):
    """A platform's graph capture and replay (CUDA graphs on NVIDIA, NPU graphs on Ascend).

    ``capture(fn)`` warms ``fn`` up, records it once and returns (graph, outputs): the outputs
    are static tensors that every ``replay(graph)`` overwrites. All graphs of one GraphBackend may
    share one memory pool (they never run concurrently).
    """

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Any]: ...

    def replay(self, graph: Any) -> None: ...


class StreamGraphs:
    """A GraphBackend over a torch device module with CUDA's graph API (``torch.cuda``,
    ``torch.npu``): captures on a side stream after one warm-up run there (kernels compile,
    autotune or pick their tiling outside the capture); every graph shares the memory pool of
    the first. Subclasses name the module (``module()``, looked up at capture) and its graph class."""

    graph_class = "CUDAGraph"

    def __init__(self):
        self.pool = None

    def module(self) -> Any:
        raise NotImplementedError

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        m = self.module()
        stream = m.Stream()
        stream.wait_stream(m.current_stream())
        with m.stream(stream):
            fn()
        m.current_stream().wait_stream(stream)
        graph = getattr(m, self.graph_class)()
        with m.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def replay(self, graph: Any) -> None:
        graph.replay()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device``, copied through pinned memory without waiting for the
    work already queued there (a copy from pageable memory may wait for it)."""
    if device.type == "cpu":
        return t
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)


class HostCopy:
    """Tensors being copied to the host; ``wait()`` returns the host copies once they landed."""

    def __init__(self, tensors: list[torch.Tensor], device: torch.device):
        if device.type == "cpu":
            self.tensors, self.event = tensors, None
            return
        self.tensors = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, t in zip(self.tensors, tensors):
            host.copy_(t, non_blocking=True)
        self.event = torch.Event(device=device)
        self.event.record()

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.tensors


@dataclass
class Platform:
    """Returned by a backend's ``deepinfer_platform`` hook.

    name: platform name used to key numeric baselines, e.g. ``cpu-reference``, ``nvidia-sm90``.
    device: the torch device the model runs on (``cpu``, ``cuda:0``, ``npu:0``).
    backend: the name of the backend that made it.
    supported_dtypes: compute dtypes the backend's ops accept.
    fp8_weights: keep block-FP8 weights quantised (the op table has fast FP8 ops); when False the
        loader dequantises FP8 checkpoints to the compute dtype (W8A16).
    fp4_experts: keep MXFP4 routed experts packed (DeepSeek-V4's ``expert_dtype: fp4``: uint8
        codes two a byte and UE8M0 scales, 0.53 bytes a weight; the op table's
        ``moe_experts_clamped`` / ``moe_experts`` take them as their MXFP4 convention says);
        when False the loader dequantises them to the compute dtype (4x their bytes in bf16).
    fp8_kv_cache: the op table's ``write_cache`` and ``sparse_attention`` take DeepSeek-V4's FP8 KV
        records (uint8 caches / pools of 584-byte rows, ``ops/kv_record.py``), so the engine may
        run ``kv_cache_dtype="fp8"``; the conformance kit runs their ``kv_record`` shapes only then.
    graph_capture: decode steps can be captured as graphs (every decode-path op is free of host
        synchronisation); ``graphs`` must then be set.
    graphs: a factory of the platform's GraphBackend (None: no graphs).
    async_scheduling: the engine may launch step N+1 before step N's tokens reach the host
        (overlapped scheduling); the device runs launched work in order.
    batch_invariant: the backend can build a batch-invariant op table (``deepinfer_ops`` with
        ``batch_invariant=True``); the engine refuses ``LLM(batch_invariant=True)`` otherwise.
    """

    name: str
    device: str = "cpu"
    backend: str = "reference"
    supported_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    fp8_weights: bool = False
    fp4_experts: bool = False
    fp8_kv_cache: bool = False
    graph_capture: bool = False
    batch_invariant: bool = False
    graphs: Callable[[], GraphBackend] | None = None
    async_scheduling: bool = False
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

    def activate(self) -> None:
        """Make this platform's device the current one (kernel launches and graph captures use it)."""
        dev = self.torch_device
        if dev.type != "cpu" and dev.index is not None:
            torch.accelerator.set_device_index(dev.index)

    def copy_to_host(self, tensors: list[torch.Tensor]) -> HostCopy:
        """Start copying ``tensors`` to the host without waiting for the device."""
        return HostCopy(tensors, self.torch_device)

    def peak_memory(self, run: Callable[[], Any]) -> int:
        """Bytes of device memory ``run()`` allocated at its peak beyond what was allocated before."""
        dev = self.torch_device
        if dev.type == "cpu":
            run()
            return 0
        self.synchronize()
        torch.accelerator.reset_peak_memory_stats(dev)
        before = torch.accelerator.memory_allocated(dev)
        run()
        self.synchronize()
        return torch.accelerator.max_memory_allocated(dev) - before

    def memory_held(self) -> int:
        """Bytes of device memory this process's allocator holds (0 on the CPU)."""
        dev = self.torch_device
        return 0 if dev.type == "cpu" else torch.accelerator.memory_reserved(dev)

    def empty_cache(self) -> None:
        """Hand the allocator's cached free blocks back (before measuring free memory)."""
        if self.torch_device.type != "cpu":
            self.synchronize()
            torch.accelerator.empty_cache()
