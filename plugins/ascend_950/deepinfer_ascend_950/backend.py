"""The ``ascend`` DeepInfer backend: Huawei Ascend 950 NPUs through CANN and torch_npu.

Cheap to import, and the probe NEVER imports ``torch_npu``: installed without a sourced CANN
toolkit, importing it fails in a way that breaks ``import torch`` for the whole process. The
probe only looks: is there a ``torch_npu`` spec (``importlib.util.find_spec``, which does not
execute it), is the CANN environment set, are there ``/dev/davinci*`` devices. ``torch_npu``
is imported in ``deepinfer_platform`` alone, which runs only for the selected backend.

Ops: none yet. ``deepinfer_ops`` returns ``{}``, so every op falls back to the reference
implementation, which runs on the ``npu`` device like on any torch device. The NPU kernels
are tracked separately; no stub kernels live here.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
from importlib.metadata import PackageNotFoundError, version

from deepinfer_core.parallel import local_rank
from deepinfer_core.hookspecs import BackendInfo, ProbeResult, hookimpl

NAME = "ascend"
CANN_ENV_VARS: tuple[str, ...] = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
CANN_DEFAULT = "/usr/local/Ascend/ascend-toolkit"
DEVICE_GLOB = "/dev/davinci[0-9]*"
CANN_FIX = "install CANN and source set_env.sh (source /usr/local/Ascend/ascend-toolkit/set_env.sh)"

log = logging.getLogger("deepinfer")


def _torch_npu_fix() -> str:
    try:
        major, minor = version("torch").split(".")[:2]
        pin = f" 'torch-npu=={major}.{minor}.*'"
    except (PackageNotFoundError, ValueError):
        pin = " torch-npu"
    return f"install torch_npu matching your torch and CANN: pip install deepinfer[ascend]{pin} on a machine with CANN"


@hookimpl
def deepinfer_backend() -> BackendInfo:
    return BackendInfo(
        name=NAME,
        priority=100,
        min_spec_version=3,
        max_spec_version=3,
        description="Huawei Ascend 950 NPUs (CANN + torch_npu); ops fall back to the reference for now",
    )


@hookimpl
def deepinfer_probe() -> ProbeResult:
    # 1. torch_npu installed? find_spec locates the package without executing it.
    if importlib.util.find_spec("torch_npu") is None:
        return ProbeResult(False, reason="torch_npu is not installed", fix=_torch_npu_fix())

    # 2. The CANN toolkit, with its environment sourced (torch_npu needs its libraries).
    cann = None
    for var in CANN_ENV_VARS:
        value = os.environ.get(var)
        if value:
            if not os.path.isdir(value):
                return ProbeResult(False, reason=f"CANN toolkit not found ({var}={value} does not exist)", fix=CANN_FIX)
            cann = value
            break
    if cann is None:
        if os.path.isdir(CANN_DEFAULT):
            return ProbeResult(
                False,
                reason=f"CANN toolkit found at {CANN_DEFAULT} but its environment is not set (ASCEND_HOME_PATH unset)",
                fix=f"source {CANN_DEFAULT}/set_env.sh before starting deepinfer",
            )
        return ProbeResult(
            False,
            reason=f"CANN toolkit not found (ASCEND_HOME_PATH unset, {os.path.dirname(CANN_DEFAULT)} missing)",
            fix=CANN_FIX,
        )

    # 3. NPU devices.
    devices = sorted(glob.glob(DEVICE_GLOB))
    if not devices:
        return ProbeResult(
            False,
            reason=f"no Ascend NPU device found ({DEVICE_GLOB.replace('[0-9]', '')} missing)",
            fix="run on a machine with an Ascend NPU (check `npu-smi info`) or choose DEEPINFER_ACCELERATOR=cpu",
        )
    try:
        index = local_rank()
    except ValueError as e:
        return ProbeResult(False, reason=str(e), fix="set LOCAL_RANK to this process's local NPU index (0, 1, ...)")
    if index >= len(devices):
        return ProbeResult(
            False,
            reason=f"LOCAL_RANK={index} but only {len(devices)} NPU device(s) are present",
            fix="start at most one process per NPU",
        )
    try:
        npu_version = version("torch_npu")
    except PackageNotFoundError:
        npu_version = "unknown version"
    return ProbeResult(
        True, detail=f"{len(devices)} NPU device(s), npu:{index}, CANN at {cann}, torch_npu {npu_version}"
    )


@hookimpl
def deepinfer_platform():
    import torch
    import torch_npu  # noqa: F401  (registers the "npu" device with torch) -- only ever here

    from deepinfer_core.platform import Platform

    index = local_rank()
    try:
        device_name = torch.npu.get_device_name(index)
    except Exception as e:  # the name is informative only
        device_name = f"unknown ({type(e).__name__}: {e})"
    if "950" not in device_name:
        log.warning("npu:%d is %s, not an Ascend 950; numeric baselines are keyed ascend-950", index, device_name)
    return Platform(
        name="ascend-950",
        device=f"npu:{index}",
        backend=NAME,
        supported_dtypes=(torch.bfloat16, torch.float16, torch.float32),
        fp8_weights=False,  # FP8 kernels are a separate issue; the loader dequantises FP8 checkpoints
        graph_capture=False,  # NPU graph mode comes with the kernels
        batch_invariant=False,
        extra={"device_name": device_name},
    )


@hookimpl
def deepinfer_ops(platform, model_config):
    # No kernels yet (a separate issue): every op falls back to the reference implementation,
    # which runs on npu:N like on any torch device. `deepinfer backends` shows each as a fallback.
    return {}


@hookimpl
def deepinfer_scheduler_limits(platform, model_config):
    return None  # the engine's defaults
