"""The ``ascend`` DeepInfer backend: Huawei Ascend 950 NPUs through CANN and torch_npu.

Cheap to import, and the probe NEVER imports ``torch_npu``: installed without a sourced CANN
toolkit, importing it fails in a way that breaks ``import torch`` for the whole process. The
probe only looks: is there a ``torch_npu`` spec (``importlib.util.find_spec``, which does not
execute it) built for the installed torch (their versions, from package metadata), is the CANN
toolkit installed and its environment sourced (``ASCEND_HOME_PATH``; CANN >= 8.5 installs under
``/usr/local/Ascend/cann``, older releases under ``/usr/local/Ascend/ascend-toolkit``), are there
``/dev/davinci*`` devices (those ``ASCEND_RT_VISIBLE_DEVICES`` lists, where it is set).
``torch_npu`` is imported in ``deepinfer_platform`` and inside the op calls alone, which run only
for the selected backend.

Ops: stock torch_npu fused operators (CANN) where their documented layouts take DeepInfer's
(``npu_ops.OPS``; each callable's ``impl`` and ``op_plan.PROVIDES`` say what runs), the TileLang
kernels of ``tilelang_ops`` where that package is installed, and the reference implementation, on
the NPU, for the rest, each with its reason (``op_plan.LEFT_OUT``); ``op_table`` puts them together.
``deepinfer backends --plan ascend`` prints that table on any machine. None of it has run on an
Ascend chip yet (README.md).
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
from importlib.metadata import PackageNotFoundError, version

from deepinfer_core.parallel import local_rank
from deepinfer_core.hookspecs import BackendInfo, OpPlan, ProbeResult, hookimpl

NAME = "ascend"
CANN_ENV_VARS: tuple[str, ...] = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")  # exported by CANN's set_env.sh
# Where CANN installs when its environment is not sourced: CANN >= 8.5 (9.x included) under cann/,
# CANN <= 8.3 under ascend-toolkit/; root installs under /usr/local/Ascend, others under ~/Ascend
# (hiascend.com environment-variable reference, CANN 8.5.0 - 9.2.0-beta).
CANN_LOCATIONS: tuple[str, ...] = (
    "/usr/local/Ascend/cann", "/usr/local/Ascend/ascend-toolkit", "~/Ascend/cann", "~/Ascend/ascend-toolkit",
)
CANN_VERSION = "9.2"  # what the Ascend 950 backend is written for (CANN >= 9.0 supports the 950PR, 9.1 the 950DT)
DEVICE_GLOB = "/dev/davinci[0-9]*"  # one node per NPU (davinci_manager and the like do not match)
VISIBLE_DEVICES = "ASCEND_RT_VISIBLE_DEVICES"  # physical NPU ids this process may use (logical 0, 1, ...)
CANN_FIX = (f"install CANN {CANN_VERSION} (the toolkit and its Ascend 950 operator package) and source its set_env.sh "
            f"before starting deepinfer (source /usr/local/Ascend/cann/set_env.sh)")

log = logging.getLogger("deepinfer")


def _torch_npu_fix() -> str:
    try:
        major, minor = version("torch").split(".")[:2]
        pin = f" 'torch-npu=={major}.{minor}.*'"
    except (PackageNotFoundError, ValueError):
        pin = " torch-npu"
    return (f"install torch_npu matching your torch and CANN: pip install deepinfer[ascend]{pin} on a machine with "
            f"CANN {CANN_VERSION} sourced (or DEEPINFER_ACCELERATOR=ascend ./build.sh there)")


def _minor(v: str) -> tuple[str, ...]:
    return tuple(v.split("+")[0].split(".")[:2])


def _version_mismatch() -> str | None:
    """Why the installed torch_npu cannot run with the installed torch (each torch_npu release is
    built for one torch release: torch-npu 2.13.0 requires torch 2.13.0), from package metadata."""
    try:
        npu, torch = version("torch_npu"), version("torch")
    except PackageNotFoundError:
        return None  # unknown: importing it will tell
    if _minor(npu) != _minor(torch):
        return f"torch_npu {npu} is built for torch {'.'.join(_minor(npu))}, but torch {torch} is installed"
    return None


def _cann_home() -> tuple[str | None, ProbeResult | None]:
    """(the sourced CANN toolkit's path, None) or (None, why not)."""
    for var in CANN_ENV_VARS:
        value = os.environ.get(var)
        if value:
            if not os.path.isdir(value):
                return None, ProbeResult(False, reason=f"CANN toolkit not found ({var}={value} does not exist)", fix=CANN_FIX)
            return value, None
    for location in CANN_LOCATIONS:
        path = os.path.expanduser(location)
        if os.path.isdir(path):
            return None, ProbeResult(
                False,
                reason=f"CANN toolkit found at {path} but its environment is not set (ASCEND_HOME_PATH unset)",
                fix=f"source {path}/set_env.sh before starting deepinfer",
            )
    places = ", ".join(CANN_LOCATIONS)
    return None, ProbeResult(False, reason=f"CANN toolkit not found (ASCEND_HOME_PATH unset; none of {places} exists)",
                             fix=CANN_FIX)


def _visible_devices() -> tuple[list[str], ProbeResult | None]:
    """The /dev/davinci nodes this process may use, in logical order, or why there are none."""
    devices = {os.path.basename(path)[len("davinci"):]: path for path in glob.glob(DEVICE_GLOB)}
    devices = {k: v for k, v in devices.items() if k.isdigit()}
    none_found = ProbeResult(
        False,
        reason=f"no Ascend NPU device found ({DEVICE_GLOB.replace('[0-9]', '')} missing)",
        fix="run on a machine with an Ascend NPU (check `npu-smi info`) or choose DEEPINFER_ACCELERATOR=cpu",
    )
    visible = os.environ.get(VISIBLE_DEVICES)
    if visible is None:
        if not devices:
            return [], none_found
        return [devices[k] for k in sorted(devices, key=int)], None
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    if not wanted:
        return [], ProbeResult(False, reason=f"no NPU visible ({VISIBLE_DEVICES}={visible!r})",
                               fix=f"unset {VISIBLE_DEVICES} or list an NPU in it, or choose DEEPINFER_ACCELERATOR=cpu")
    if not devices:
        return [], none_found
    missing = [w for w in wanted if w not in devices]
    if missing:
        return [], ProbeResult(
            False,
            reason=f"{VISIBLE_DEVICES}={visible!r} names NPUs this machine does not have ({', '.join(missing)}; present: "
                   f"{', '.join(sorted(devices, key=int))})",
            fix=f"list present NPU ids in {VISIBLE_DEVICES} (`npu-smi info`), or unset it",
        )
    return [devices[w] for w in wanted], None


@hookimpl
def deepinfer_backend() -> BackendInfo:
    return BackendInfo(
        name=NAME,
        priority=100,
        min_spec_version=3,
        max_spec_version=3,
        description="Huawei Ascend 950 NPUs (CANN + torch_npu): stock CANN fused ops where they fit, the reference elsewhere; never run on a chip",
    )


@hookimpl
def deepinfer_probe() -> ProbeResult:
    # 1. torch_npu installed? find_spec locates the package without executing it.
    if importlib.util.find_spec("torch_npu") is None:
        return ProbeResult(False, reason="torch_npu is not installed", fix=_torch_npu_fix())
    # 2. built for this torch? (metadata only)
    mismatch = _version_mismatch()
    if mismatch:
        return ProbeResult(False, reason=mismatch, fix=_torch_npu_fix())
    # 3. The CANN toolkit, with its environment sourced (torch_npu needs its libraries).
    cann, why_not = _cann_home()
    if why_not is not None:
        return why_not
    # 4. NPU devices, as ASCEND_RT_VISIBLE_DEVICES maps them.
    devices, why_not = _visible_devices()
    if why_not is not None:
        return why_not
    try:
        index = local_rank()
    except ValueError as e:
        return ProbeResult(False, reason=str(e), fix="set LOCAL_RANK to this process's local NPU index (0, 1, ...)")
    if index >= len(devices):
        return ProbeResult(
            False,
            reason=f"LOCAL_RANK={index} but only {len(devices)} NPU device(s) are visible",
            fix=f"start at most one process per NPU, or widen {VISIBLE_DEVICES}",
        )
    try:
        npu_version = version("torch_npu")
    except PackageNotFoundError:
        npu_version = "unknown version"
    return ProbeResult(
        True, detail=f"{len(devices)} NPU device(s) visible, npu:{index} ({devices[index]}), CANN at {cann}, "
                     f"torch_npu {npu_version}"
    )


@hookimpl
def deepinfer_platform():
    import torch
    import torch_npu  # noqa: F401  (registers the "npu" device with torch) -- only ever here

    from deepinfer_ascend_950.graphs import NpuGraphs
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
        fp8_weights=False,  # no stock block-FP8 GEMM for the 950 (op_plan.LEFT_OUT): the loader dequantises FP8
        fp4_experts=False,  # CANN's MX grouped matmul wants load-time weight preparation (op_plan.NOT_MAPPED)
        # NPU graphs are offered, not used: mla_decode_attention and sample_tokens run the reference on
        # the NPU, which reads lengths on the host (graphs.py)
        graph_capture=False,
        graphs=NpuGraphs,
        batch_invariant=False,
        extra={"device_name": device_name},
    )


@hookimpl
def deepinfer_ops(platform, model_config):
    """npu_ops' stock-operator callables, then the TileLang kernels for what they leave out, less
    DEEPINFER_ASCEND_REFERENCE_OPS (op_table). The rest fall back to the reference (op_plan.LEFT_OUT)."""
    from deepinfer_ascend_950 import op_table

    return op_table.ops()


@hookimpl
def deepinfer_op_plan() -> OpPlan:
    """What deepinfer_ops returns on a 950 with this installation (op_table.plan). Imports no torch."""
    from deepinfer_ascend_950 import op_table

    provides, left_out = op_table.plan()
    return OpPlan(provides=provides, left_out=left_out)


@hookimpl
def deepinfer_communicator(platform, group):
    """Collectives over HCCL, with the dtypes HCCL lacks carried as bytes (hccl.py)."""
    from deepinfer_ascend_950.hccl import HcclCommunicator

    return HcclCommunicator(group)


@hookimpl
def deepinfer_scheduler_limits(platform, model_config):
    return None  # the engine's defaults
