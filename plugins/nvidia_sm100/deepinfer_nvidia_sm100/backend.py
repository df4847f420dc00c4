"""The ``nvidia`` DeepInfer backend: NVIDIA sm_90 (Hopper) and sm_100-family (Blackwell) GPUs.

Cheap to import: nothing here imports torch at module level (the core imports this module on
every machine to probe it). The probe goes from the cheapest check to the dearest and stops at
the first that fails, so that its reason is the most basic thing missing:

1. a driver node (``/dev/nvidiactl``, ``/proc/driver/nvidia/version`` or WSL2's ``/dev/dxg``),
2. ``torch`` importable and built with CUDA (``torch.version.cuda``),
3. ``torch.cuda.is_available()``, the device this rank uses (``LOCAL_RANK``) is visible, and
   its compute capability is sm_90 or sm_100-family.

Ops: Triton kernels (``kernels/``), one module per family; each module's ``OPS`` maps op names
to callables whose ``impl`` attribute says what runs (shown by ``deepinfer backends``). Where
DeepSeek's FlashMLA is installed it provides the decode attention whose shapes it takes, the
Triton kernel the rest (``flashmla.py``; the KV blocks are then FlashMLA's 64 tokens). Every
decode-path op is free of host synchronisation, so decode steps are captured as CUDA graphs
over the batch sizes in ``GRAPH_BATCH_SIZES``. Block-FP8 checkpoints keep their FP8 weights:
on sm_90 cuBLAS's DeepSeek-scaled FP8 GEMM takes the bf16 FP8 linears that ``cublas_fp8.fits``
(activations quantised per token and 128 channels by a Triton pre-pass); otherwise the Triton
GEMMs widen FP8 weight tiles in registers (W8A16) up to 1023 rows and quantise activations
(W8A8, a pre-pass) from 1024 rows; the expert GEMMs are W8A16, except that where DeepGEMM is
installed it takes block-FP8 experts at prefill sizes on sm_90 (``deepgemm.py``, W8A8).
"""

from __future__ import annotations

import importlib.util
import logging
import os

from deepinfer_core.parallel import local_rank
from deepinfer_core.hookspecs import BackendInfo, ProbeResult, hookimpl

NAME = "nvidia"
# Any one of these shows an NVIDIA driver (Linux: /dev/nvidiactl and /proc/driver/nvidia;
# WSL2 exposes the GPU through /dev/dxg instead).
DRIVER_FILES: tuple[str, ...] = ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/dxg")
log = logging.getLogger("deepinfer")
SUPPORTED = "sm_90 and sm_100"
# Kernel modules under deepinfer_nvidia_sm100.kernels, each exporting OPS = {op name: callable}.
KERNEL_MODULES = ("elementwise", "fp8_linear", "cache", "mla_decode", "mla_prefill", "moe", "sampling", "bitmask", "hyper", "sparse",
                  "compress")
# The ops this plugin has no kernel for yet: the engine runs their reference implementations on the
# GPU (``deepinfer backends`` shows them as "reference"). Every other op of deepinfer_core.ops is a kernel here.
LEFT_TO_REFERENCE = frozenset({"indexer_block_candidates", "engram_hash_ids", "engram_gate"})
# Whether the kernels read and write DeepSeek-V4's FP8 KV records (kv_cache_dtype="fp8", ops/kv_record.py):
# write_cache quantises into record caches and sparse_attention dequantises record pools in registers
# (kernels/sparse.py). FlashMLA's sparse FP8 decode does not take them yet: the Triton kernel does.
FP8_KV_CACHE = True
# Decode batch sizes captured as CUDA graphs (capped by the engine's max_num_seqs).
# The step budget (prefill chunk) by measurement: H200, V2-Lite shape (27 layers, bf16), 128 prompts
# of 1024 tokens through LLM.generate prefill at 27.6k tokens/s with 2048, 81.2k with 8192 and
# 86.5k with 16384 (benchmarks/generate.py, benchmarks/results/h200-2026-12-01/generate/).
MAX_NUM_BATCHED_TOKENS = 16384
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
CPU_FIX = "run on a machine with an NVIDIA GPU or choose DEEPINFER_ACCELERATOR=cpu"
TORCH_CUDA_FIX = "install a CUDA build of torch (pip install torch --index-url https://download.pytorch.org/whl/cu130)"


def _supported(capability: tuple[int, int]) -> bool:
    major, minor = capability
    return (major, minor) == (9, 0) or major == 10  # sm_90; sm_100 family (sm_100, sm_103)


def _platform_name(capability: tuple[int, int]) -> str:
    return "nvidia-sm90" if capability[0] == 9 else "nvidia-sm100"


@hookimpl
def deepinfer_backend() -> BackendInfo:
    return BackendInfo(
        name=NAME,
        priority=100,
        min_spec_version=3,
        max_spec_version=3,  # 3: deepinfer_ops builds a batch-invariant table when asked
        description="NVIDIA Hopper sm_90 / Blackwell sm_100 GPUs (CUDA): Triton kernels, FP8 GEMMs, CUDA graphs",
    )


@hookimpl
def deepinfer_probe() -> ProbeResult:
    # 1. A driver, from the file system alone.
    if not any(os.path.exists(path) for path in DRIVER_FILES):
        return ProbeResult(False, reason="no NVIDIA driver/device found (/dev/nvidiactl missing)", fix=CPU_FIX)

    # 2. A CUDA build of torch. torch is the core's own dependency, so importing it is safe.
    if importlib.util.find_spec("torch") is None:
        return ProbeResult(False, reason="torch is not installed", fix=TORCH_CUDA_FIX)
    import torch

    if torch.version.cuda is None:
        if getattr(torch.version, "hip", None):
            kind = f"a ROCm build (torch {torch.__version__})"
        else:
            kind = f"a CPU-only build (torch {torch.__version__})"
        return ProbeResult(False, reason=f"torch is {kind}", fix=TORCH_CUDA_FIX)

    # 3. A visible device of a supported architecture.
    try:
        index = local_rank()
    except ValueError as e:
        return ProbeResult(False, reason=str(e), fix="set LOCAL_RANK to this process's local GPU index (0, 1, ...)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        if not torch.cuda.is_available():
            if visible is not None and visible.strip() in ("", "-1"):
                return ProbeResult(
                    False,
                    reason=f"no CUDA device visible (CUDA_VISIBLE_DEVICES={visible!r})",
                    fix="unset CUDA_VISIBLE_DEVICES or list a GPU in it, or choose DEEPINFER_ACCELERATOR=cpu",
                )
            return ProbeResult(
                False,
                reason=f"an NVIDIA driver is present but torch (CUDA {torch.version.cuda}) sees no usable GPU",
                fix="check `nvidia-smi`, and that the driver supports CUDA "
                f"{torch.version.cuda} (or install a torch built for an older CUDA)",
            )
        count = torch.cuda.device_count()
        if index >= count:
            return ProbeResult(
                False,
                reason=f"LOCAL_RANK={index} but only {count} CUDA device(s) are visible",
                fix="start at most one process per visible GPU, or widen CUDA_VISIBLE_DEVICES",
            )
        capability = tuple(torch.cuda.get_device_capability(index))
        device_name = torch.cuda.get_device_name(index)
    except Exception as e:  # a driver/runtime mismatch surfaces here; it is "not here", not a bug
        return ProbeResult(
            False,
            reason=f"CUDA initialisation failed: {type(e).__name__}: {e}",
            fix=f"check `nvidia-smi` and that the driver supports CUDA {torch.version.cuda}",
        )
    if not _supported(capability):  # type: ignore[arg-type]
        return ProbeResult(
            False,
            reason=f"found sm_{capability[0]}{capability[1]}; this backend supports {SUPPORTED}",
            fix="run on an H100/H200 (sm_90) or B200/B300/GB200 (sm_100) GPU, or choose DEEPINFER_ACCELERATOR=cpu",
        )
    return ProbeResult(
        True,
        detail=f"{device_name}, sm_{capability[0]}{capability[1]}, cuda:{index}, CUDA {torch.version.cuda}",
    )


@hookimpl
def deepinfer_platform():
    import torch

    from deepinfer_core.platform import Platform
    from deepinfer_nvidia_sm100.graphs import CudaGraphs

    index = local_rank()
    capability = tuple(torch.cuda.get_device_capability(index))
    if not _supported(capability):  # type: ignore[arg-type]
        raise RuntimeError(f"cuda:{index} is sm_{capability[0]}{capability[1]}; this backend supports {SUPPORTED}")
    return Platform(
        name=_platform_name(capability),  # type: ignore[arg-type]
        device=f"cuda:{index}",
        backend=NAME,
        supported_dtypes=(torch.bfloat16, torch.float16, torch.float32),
        fp8_weights=True,  # block-FP8 checkpoints stay FP8 (fp8_block_linear and the FP8 expert GEMMs)
        fp4_experts=True,  # V4's MXFP4 routed experts stay packed (kernels/moe_mxfp4.py, W4A16)
        fp8_kv_cache=FP8_KV_CACHE,
        graph_capture=True,  # every decode-path op below is free of host synchronisation
        graphs=CudaGraphs,
        async_scheduling=True,  # one stream: launched work runs in order
        batch_invariant=True,  # deepinfer_ops(batch_invariant=True): the kernels' INVARIANT_OPS
        extra={"capability": capability, "device_name": torch.cuda.get_device_name(index)},
    )


@hookimpl
def deepinfer_ops(platform, model_config, batch_invariant):
    """Every kernel module's OPS; with ``batch_invariant``, its INVARIANT_OPS replace them (the ops
    whose tiles or splits would follow the batch: GEMMs, expert GEMMs and routing logits, decode
    attention's KV splits, sampling's ranking). Norms, RoPE, activations, cache writes and masks
    already work one row per program."""
    import importlib

    block = getattr(model_config, "fp8_block", None) if model_config is not None else None
    if block and platform.fp8_weights and (block[1] < 32 or block[1] & (block[1] - 1)):
        # The FP8 GEMMs step through K one weight block at a time: an e4m3 tl.dot needs K >= 32, a
        # power of two (a 16-wide block failed to compile on the H200).
        log.warning(
            "FP8 weight block %s: the NVIDIA FP8 kernels need a power-of-two block width >= 32, so the "
            "weights are dequantised to the compute dtype at load instead", list(block),
        )
        platform.fp8_weights = False
    ops = {}
    for name in KERNEL_MODULES:
        try:
            module = importlib.import_module(f"deepinfer_nvidia_sm100.kernels.{name}")
        except ImportError as e:
            raise RuntimeError(
                f"the NVIDIA kernels need Triton (it ships with the CUDA builds of torch): importing kernels.{name} "
                f"failed with {e}; install torch's CUDA build or `pip install triton`"
            ) from e
        ops.update(module.OPS)
        if batch_invariant:
            ops.update(getattr(module, "INVARIANT_OPS", {}))
    if _peers_wanted(batch_invariant):
        from deepinfer_nvidia_sm100 import cublas_fp8, deepgemm, flashmla

        device = getattr(platform, "device", None)
        ops = flashmla.provide(ops)  # FlashMLA decodes where installed and the shapes fit
        ops = cublas_fp8.provide(ops, device)  # cuBLAS's DeepSeek-scaled FP8 GEMM on sm_90
        ops = deepgemm.provide(ops, device)  # DeepGEMM's grouped FP8 GEMMs for prefill-sized FP8 experts
    from deepinfer_nvidia_sm100.kernels import moe_mxfp4

    # packed MXFP4 experts (uint8: the ops' convention) to the W4A16 kernel, every other call as above
    ops.update(moe_mxfp4.with_mxfp4(ops["moe_experts_clamped"], ops["moe_experts"]))
    return ops


def _peers_wanted(batch_invariant: bool) -> bool:
    """Whether peer kernel libraries (DeepSeek's FlashMLA and DeepGEMM, cuBLAS's block-scaled FP8 GEMM) may
    provide ops: not in the batch-invariant table (they have no such mode), not when
    DEEPINFER_EXTERNAL_KERNELS=0."""
    from deepinfer_core.config import settings

    return not batch_invariant and settings().external_kernels


@hookimpl
def deepinfer_scheduler_limits(platform, model_config):
    from deepinfer_core.hookspecs import SchedulerLimits

    block = None
    if _peers_wanted(batch_invariant=False):
        from deepinfer_nvidia_sm100 import flashmla

        block = flashmla.block_size_for(model_config)  # FlashMLA's page size (the Triton kernel takes any)
    return SchedulerLimits(max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, graph_batch_sizes=GRAPH_BATCH_SIZES,
                           block_size=block)
