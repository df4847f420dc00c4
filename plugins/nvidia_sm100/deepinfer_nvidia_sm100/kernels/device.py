"""Facts about the device the kernels' launch heuristics size their grids by, and how they launch.

Programmatic dependent launch (PDL, sm_90 and later): every Triton kernel of this plugin is
launched with ``launch_options(device)`` and begins with ``await_inputs(PDL)``. Launched so, a
kernel's programs may be scheduled while the kernel before it in the stream still runs; the first
thing each program does is wait (``griddepcontrol.wait``) until that kernel has finished and its
writes are visible, then allow the kernel after it to be scheduled in turn. Nothing is read or
written before the wait, so results are those of plain serial launches; what is saved is the gap
between a kernel's end and the next one's start (H100, a CUDA graph of 200 dependent one-program
Triton kernels: 0.74 against 1.22 us per kernel; ``benchmarks/pdl_chain.py``). Every program
waits, so a kernel never completes before the one it follows: a kernel after it that waits on it
also sees everything before. Kernels of other libraries (cuBLAS, FlashMLA, torch's own) launch as
they always do and wait for the whole of the kernel before them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Launch with PDL where the device has it (sm_90+). A module constant, so that one process can
# time the kernels with and without (benchmarks/constants_ab.py --set device.PDL=False).
PDL = True


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms(device: torch.device, interpreter_sms: int) -> int:
    """The SM count of a CUDA ``device`` (cached per device index); ``interpreter_sms`` for anything
    else (TRITON_INTERPRET runs on CPU tensors; each kernel picks a count that exercises its splits)."""
    if device.type == "cuda":
        return _cuda_sms(_index(device))
    return interpreter_sms


def launch_options(device: torch.device) -> dict[str, bool]:
    """The keyword arguments every kernel launch of this plugin passes: ``PDL`` (the constexpr that
    ``await_inputs`` reads) and Triton's ``launch_pdl``, both True on a CUDA device of compute
    capability 9.0 or more while ``PDL`` is on, False elsewhere (the interpreter included)."""
    on = PDL and device.type == "cuda" and _cuda_capability(_index(device)) >= (9, 0)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def await_inputs(PDL: tl.constexpr):
    """The first statement of every kernel: with PDL, wait until the kernel before this one has
    finished and its writes are visible, then let the next kernel be scheduled. Without, nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
