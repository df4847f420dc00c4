"""Where the shared numeric contract lives and how to read it.

``specs/`` at the repository root holds it: ``ops.toml`` (per-op tolerances and shapes),
``workloads/`` (prompt sets the end-to-end baselines are measured on) and
``baselines/offline_decode_ppl.json``. A source checkout (or an editable install) reads it in
place; a wheel installs a copy under ``<prefix>/share/deepinfer/specs``; ``DEEPINFER_SPECS_DIR``
points anywhere else (a vendor's fork of the baselines, for example).
"""

from __future__ import annotations

import functools
import os
import sys
import tomllib
from pathlib import Path

import torch

from deepinfer_core.dtypes import DTYPE_ALIASES, DTYPES, dtype_from_name  # noqa: F401 (re-exported)

DTYPE_NAMES = DTYPES  # the op spec's compute dtypes (its tolerance tables are keyed by these names)


class SpecError(RuntimeError):
    """The specs directory is missing or malformed."""


def specs_dir() -> Path:
    """The directory holding ops.toml, workloads/ and baselines/."""
    env = os.environ.get("DEEPINFER_SPECS_DIR")
    if env:  # asked for explicitly: no silent fallback to another copy
        if not (Path(env) / "ops.toml").is_file():
            raise SpecError(f"DEEPINFER_SPECS_DIR={env} has no ops.toml; point it at a specs/ directory or unset it")
        return Path(env)
    candidates = [
        Path(__file__).resolve().parents[2] / "specs",  # source checkout / editable install
        Path(sys.prefix) / "share" / "deepinfer" / "specs",  # wheel install (data files)
    ]
    for path in candidates:
        if (path / "ops.toml").is_file():
            return path
    tried = ", ".join(str(p) for p in candidates)
    raise SpecError(
        f"cannot find the DeepInfer specs (ops.toml); looked in {tried}. Set DEEPINFER_SPECS_DIR to a "
        f"checkout's specs/ directory, or reinstall deepinfer."
    )


@functools.cache
def _ops_spec(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())["ops"]
    except (OSError, tomllib.TOMLDecodeError, KeyError) as e:
        raise SpecError(f"{path} is not a valid op spec: {e}") from e


def ops_spec() -> dict:
    """``[ops.<name>]`` tables of specs/ops.toml, by op name."""
    return _ops_spec(specs_dir() / "ops.toml")


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPE_NAMES.items():
        if value == dtype:
            return name
    raise ValueError(f"{dtype} is not a compute dtype of the op spec ({', '.join(DTYPE_NAMES)})")


def tolerance(op: str, dtype: torch.dtype, dims: dict | None = None) -> dict[str, float]:
    """{'atol': .., 'rtol': ..} of ``op`` for inputs of ``dtype`` (torch.testing.assert_close's
    meaning). A case of block-FP8 weights (``dims`` names a non-empty ``fp8_block``) gets the op's
    ``tolerance_fp8`` for that dtype where the spec has one (W8A8 admitted)."""
    name = dtype_name(dtype)
    try:
        spec = ops_spec()[op]
        fp8 = bool(dims and dims.get("fp8_block")) and name in spec.get("tolerance_fp8", {})
        tol = spec["tolerance_fp8" if fp8 else "tolerance"][name]
    except KeyError as e:
        raise SpecError(f"specs/ops.toml has no {dtype_name(dtype)} tolerance for op {op!r}") from e
    return {"atol": float(tol["atol"]), "rtol": float(tol["rtol"])}


def shapes(op: str) -> list[dict]:
    """The shapes the spec lists for ``op`` (each a dict of its named dimensions)."""
    return [dict(s) for s in ops_spec()[op]["shapes"]]
