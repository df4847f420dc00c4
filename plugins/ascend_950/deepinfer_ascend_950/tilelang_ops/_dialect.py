"""One kernel source for two targets: mainline TileLang's Ascend 950 dialect and its CUDA one.

TileLang 0.1.15's Ascend dialect (``tilelang.ascend.language``) differs from the generic one
(``tilelang.language``, which lowers for CUDA) in two places that matter to these kernels:

* the launch: ``T.Kernel(blocks)`` is a 1-D grid of AI cores with no thread domain (passing
  ``threads=`` is an error), where CUDA's takes ``threads=``;
* vector code: every ``T.Parallel`` must sit inside a vector-function block, ``T.SimtVF(threads=n)``
  (SIMT threads on the vector core) or ``T.SimdVF()``; 0.1.15 has no pass that adds one (newer
  upstream examples rely on an "AutoSimtVF" pass), and on CUDA there is no such block.

``Dialect(target)`` hides both: ``d.kernel(blocks)`` and ``with d.vf():`` give the Ascend forms on
``"ascend"`` and the CUDA forms (a launch with ``threads``, and ``contextlib.nullcontext()``, which
TileLang's parser accepts as an empty ``with``) on ``"cuda"``. Everything else the kernels use
(``alloc_shared``: UB on Ascend, shared memory on CUDA; ``copy``; reducers; math) is spelt the
same in both.
"""

from __future__ import annotations

import contextlib

TARGETS = ("ascend", "cuda")


def target_dict(target: str) -> dict:
    """The TVM target for ``tilelang.lower``: the Ascend 950 (``dav-3510``, the backend's default
    arch) or an sm_90 GPU (any sm_90+ lowers the same generic code)."""
    if target == "ascend":
        return {"kind": "ascend"}
    if target == "cuda":
        return {"kind": "cuda", "arch": "sm_90"}
    raise ValueError(f"unknown TileLang target {target!r} (one of {TARGETS})")


class Dialect:
    """The TileLang language module and the two target-specific frames of ``target``."""

    def __init__(self, target: str, threads: int = 128):
        if target not in TARGETS:
            raise ValueError(f"unknown TileLang target {target!r} (one of {TARGETS})")
        self.target, self.threads = target, threads
        if target == "ascend":
            import tilelang.ascend.language as T
        else:
            import tilelang.language as T
        self.T = T

    def kernel(self, blocks):
        """The launch frame: ``blocks`` AI cores (Ascend) or thread blocks of ``threads`` (CUDA)."""
        if self.target == "ascend":
            return self.T.Kernel(blocks)
        return self.T.Kernel(blocks, threads=self.threads)

    def vf(self, threads: int | None = None):
        """The frame around vector code: ``T.SimtVF(threads=...)`` on Ascend, nothing on CUDA (the
        block's threads run the ``T.Parallel`` loops there)."""
        if self.target == "ascend":
            return self.T.SimtVF(threads=threads or self.threads)
        return contextlib.nullcontext()
