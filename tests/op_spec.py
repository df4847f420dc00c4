"""specs/ops.toml for tests of any backend's ops: the conformance kit's reader plus an assert."""

from __future__ import annotations

import torch

from deepinfer_core.conformance.spec import ops_spec as spec  # noqa: F401  (re-exported for the kernel tests)
from deepinfer_core.conformance.spec import shapes, tolerance  # noqa: F401


def assert_close(out: torch.Tensor, ref: torch.Tensor, op: str, dtype: torch.dtype, what: str = "") -> None:
    """Compare as the spec says (both cast to float32); NaN never passes."""
    out32, ref32 = out.float().cpu(), ref.float().cpu()
    assert not torch.isnan(out32).any(), f"{op}{what}: NaN in the output"
    torch.testing.assert_close(out32, ref32, **tolerance(op, dtype), msg=lambda m: f"{op}{what}: {m}")
