"""Read ``specs/ops.toml``: per-op tolerances and shapes, for tests of any backend's ops."""

from __future__ import annotations

import functools
import tomllib
from pathlib import Path

import torch

SPEC_PATH = Path(__file__).resolve().parent.parent / "specs" / "ops.toml"
_DTYPE_KEYS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@functools.cache
def spec() -> dict:
    return tomllib.loads(SPEC_PATH.read_text())["ops"]


def tolerance(op: str, dtype: torch.dtype) -> dict[str, float]:
    """{'atol': .., 'rtol': ..} of ``op`` for inputs of ``dtype``, as torch.testing.assert_close takes them."""
    tol = spec()[op]["tolerance"][_DTYPE_KEYS[dtype]]
    return {"atol": float(tol["atol"]), "rtol": float(tol["rtol"])}


def shapes(op: str) -> list[dict]:
    """The shapes the spec lists for ``op`` (each a dict of its named dimensions)."""
    return list(spec()[op]["shapes"])


def assert_close(out: torch.Tensor, ref: torch.Tensor, op: str, dtype: torch.dtype, what: str = "") -> None:
    """Compare as the spec says (both cast to float32); NaN never passes."""
    out32, ref32 = out.float().cpu(), ref.float().cpu()
    assert not torch.isnan(out32).any(), f"{op}{what}: NaN in the output"
    torch.testing.assert_close(out32, ref32, **tolerance(op, dtype), msg=lambda m: f"{op}{what}: {m}")
