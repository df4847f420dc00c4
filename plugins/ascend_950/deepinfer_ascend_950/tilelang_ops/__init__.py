"""TileLang kernels for the DeepInfer ops that CANN has no fused operator for (issue 50, item 3).

Written for mainline TileLang's Ascend 950 backend (``tilelang==0.1.15``, package
``tilelang/ascend/``, arch ``dav-3510``): TileLang -> TIR -> the Ascend pass pipeline -> AscendC
source, which ``bisheng`` (CANN) compiles on an Ascend machine. The same sources lower for CUDA
too (``_dialect``: the launch and the vector-function frames are the only per-target spellings).

| kernel (prim_func)          | DeepInfer op              | module      |
|-----------------------------|---------------------------|-------------|
| ``deepinfer_compress_pool`` | ``compress_pool``         | compress    |
| ``deepinfer_route_topk``    | ``moe_route_sqrtsoftplus``| route       |
| ``deepinfer_route_fixed``   | ``moe_route_sqrtsoftplus`` (hash layers) | route |
| ``deepinfer_engram_hash``   | ``engram_hash_ids``       | engram      |
| ``deepinfer_engram_gate``   | ``engram_gate``           | engram      |
| ``deepinfer_write_records`` | ``write_cache`` (V4 FP8 record caches) | records |

Not here, on purpose: the hyper-connection Sinkhorn (``mhc_pre``): torch_npu has
``npu_mhc_pre`` / ``npu_mhc_sinkhorn`` on the 950 (950-only stock ops), mapped with the other
CANN operators in the plugin's torch_npu op table.

What is checked where: CI lowers every kernel to AscendC on the CPU (no CANN: lowering never
calls bisheng) and checks the entry points and their parameters (``tests/test_ascend_tilelang.py``);
a GPU run checks the CUDA lowering's numerics against the reference; an Ascend machine runs the
``npu``-marked tests (JIT through bisheng + torch_npu, against the reference). Nothing here has
run on an Ascend chip yet.

Nothing in this package imports ``tilelang`` at import time: the kernel modules do, and they are
imported only by ``lower_source``, the op glue (``ops``) and the tests.
"""

import importlib
import importlib.util
from dataclasses import dataclass

from deepinfer_ascend_950.tilelang_ops._dialect import TARGETS, target_dict

TILELANG_VERSION = "0.1.15"  # the version the kernels were written and lowered against (plugins/ascend_950's extra "tilelang")


@dataclass(frozen=True)
class Kernel:
    """One TileLang kernel: its prim_func ``name`` (AscendC entry point ``name + "_kernel"``), the
    DeepInfer op it provides, its factory (``module:function``, the module under this package), and
    the ops the reference composes around it (``composes``: e.g. V4's ``compress_entries``, the
    reference's gather and RoPE around this pooling kernel)."""

    name: str
    op: str
    factory: str
    composes: tuple[str, ...] = ()

    @property
    def entry(self) -> str:
        return self.name + "_kernel"

    def build(self, *args, **kwargs):
        """The prim_func for these shapes (the factory's arguments; ``target=`` "ascend" or "cuda")."""
        module, function = self.factory.split(":")
        return getattr(importlib.import_module(f"{__name__}.{module}"), function)(*args, **kwargs)


KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel("deepinfer_compress_pool", "compress_pool", "compress:compress_pool_kernel", ("compress_entries",)),
        Kernel("deepinfer_route_topk", "moe_route_sqrtsoftplus", "route:route_topk_kernel"),
        Kernel("deepinfer_route_fixed", "moe_route_sqrtsoftplus", "route:route_fixed_kernel"),
        Kernel("deepinfer_engram_hash", "engram_hash_ids", "engram:engram_hash_kernel"),
        Kernel("deepinfer_engram_gate", "engram_gate", "engram:engram_gate_kernel"),
        Kernel("deepinfer_write_records", "write_cache", "records:write_records_kernel"),
    )
}


def unavailable_reason() -> str | None:
    """Why TileLang's Ascend backend cannot lower here (None: it can). Looks for the package without
    importing it (importing takes ~4 s and pulls torch)."""
    if importlib.util.find_spec("tilelang") is None:
        return f"tilelang is not installed (pip install -e 'plugins/ascend_950[tilelang]', which pins tilelang=={TILELANG_VERSION})"
    return None


def lower_source(prim_func, target: str = "ascend") -> str:
    """The generated kernel source of ``prim_func`` for ``target``: AscendC for "ascend", CUDA C++
    for "cuda". Lowering only (``tilelang.lower``, device compilation off): never runs bisheng or
    nvcc, so it works on a CPU machine without CANN. (``@tilelang.jit`` / ``tilelang.compile``
    would compile, which needs the toolchain.)"""
    import tilelang
    from tilelang import tvm

    with tvm.target.Target(target_dict(target)) as tgt:
        return tilelang.lower(prim_func, target=tgt).kernel_source


__all__ = ["KERNELS", "Kernel", "TARGETS", "TILELANG_VERSION", "lower_source", "target_dict", "unavailable_reason"]
