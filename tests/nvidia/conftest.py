"""Set-up for the NVIDIA kernel tests.

On a machine without CUDA the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
float32 CPU tensors, tiny shapes). The variable must be set before any kernel module is
imported (``triton.jit`` reads it when it decorates), hence here, at conftest import time.
With CUDA the same tests run compiled on the GPU, in bf16 and float32, at the spec's shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")



def _interpreter_loop_bounds_fix() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and gives them ``__index__`` as
    int(array), which numpy >= 2.4 refuses for arrays of ndim > 0: a ``range`` over a loaded
    bound (every data-dependent loop) then fails. Convert through ``.item()`` instead.
    Interpreter only."""
    import os

    import numpy as np

    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        int(np.ones(1))
        return
    except TypeError:
        pass
    try:
        from triton.runtime import interpreter
    except ModuleNotFoundError:  # no triton: the kernel test modules skip themselves
        return

    original = interpreter._patch_lang_tensor
    if getattr(original, "_index_fixed", False):
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch._index_fixed = True
    interpreter._patch_lang_tensor = patch


_interpreter_loop_bounds_fix()


@pytest.fixture
def device() -> torch.device:
    """cuda:0 where a GPU is present, else the CPU (the kernels then run in the interpreter)."""
    return torch.device("cuda:0" if HAS_CUDA else "cpu")


@pytest.fixture(params=[torch.bfloat16, torch.float32] if HAS_CUDA else [torch.float32], ids=lambda d: str(d).removeprefix("torch."))
def dtype(request) -> torch.dtype:
    """The compute dtypes under test: the interpreter handles float32 only."""
    return request.param
