"""The ``vendor_example`` DeepInfer backend: a worked example of a third-party backend.

It runs on the CPU and provides seven ops of its own (``ops.py``), each computed by a different
algorithm from the reference but to the same contract; the other ops fall back to the reference
implementations. A real chip's backend has the same shape: swap the CPU for the chip's torch
device and the torch code in ``ops.py`` for calls into the vendor's kernels.

Cheap to import: this module imports neither torch nor ``ops.py`` at module level, because the
core imports every installed backend module on every machine to probe it. Heavy imports happen
in ``deepinfer_platform`` and ``deepinfer_ops``, which run only for the selected backend.

Opt-in: the probe says "unavailable" unless ``DEEPINFER_VENDOR_EXAMPLE=1``, so installing this
package never changes which backend users get. A real backend's probe checks for its device
instead (a device node, ``importlib.util.find_spec`` of its SDK module, a driver version file),
never by importing the SDK: an SDK that is installed but not set up can break ``import torch``.
"""

from __future__ import annotations

import os

from deepinfer_core.hookspecs import BackendInfo, ProbeResult, hookimpl

NAME = "vendor_example"
PLATFORM_NAME = "vendor-example-cpu"  # keys this backend's end-to-end baselines in specs/baselines/
ENABLE_VAR = "DEEPINFER_VENDOR_EXAMPLE"
UNAVAILABLE_REASON = f"{ENABLE_VAR} is not set to 1 (this example backend is opt-in)"
UNAVAILABLE_FIX = f"export {ENABLE_VAR}=1 to use it, or `pip uninstall deepinfer-vendor-example`"


def probe() -> ProbeResult:
    """The probe of both entry points of this package: only the environment is looked at."""
    if os.environ.get(ENABLE_VAR, "").strip() != "1":
        return ProbeResult(False, reason=UNAVAILABLE_REASON, fix=UNAVAILABLE_FIX)
    return ProbeResult(True, detail=f"CPU, {ENABLE_VAR}=1")


def make_platform(backend_name: str):
    import torch

    from deepinfer_core.platform import Platform

    return Platform(
        name=PLATFORM_NAME,
        device="cpu",
        backend=backend_name,
        supported_dtypes=(torch.float32, torch.bfloat16, torch.float16),
        fp8_weights=False,  # no FP8 kernels: the loader dequantises block-FP8 checkpoints (W8A16)
        graph_capture=False,
        batch_invariant=False,  # mla_decode_attention pads to the batch's longest query row
    )


def vendor_ops() -> dict:
    from deepinfer_vendor_example import ops

    return dict(ops.OPS)


@hookimpl
def deepinfer_backend() -> BackendInfo:
    return BackendInfo(
        name=NAME,
        priority=5,  # above the reference (0) once enabled, far below the GPU/NPU backends (100)
        min_spec_version=3,  # the hookspec versions this release implements (deepinfer_core.hookspecs.SPEC_VERSION)
        max_spec_version=3,
        description="example vendor backend (CPU): 7 ops of its own, the rest from the reference; opt-in",
    )


@hookimpl
def deepinfer_probe() -> ProbeResult:
    return probe()


@hookimpl
def deepinfer_platform():
    return make_platform(NAME)


@hookimpl
def deepinfer_ops(platform, model_config):
    return vendor_ops()
