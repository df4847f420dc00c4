"""Compute dtypes by name: the one table of the names DeepInfer accepts, and their short aliases."""

from __future__ import annotations

import torch

# Canonical names (what config.json's torch_dtype, the engine and the op spec use), in this order.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Short spellings some entry points (the conformance CLI, pytest options) accept as well.
# "half" and "float" are vLLM's --dtype spellings.
DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16",
                 "half": "float16"}


def dtype_from_name(name: str) -> torch.dtype:
    """'bf16' / 'bfloat16' / 'fp32' / ... (any case) -> torch dtype; ValueError for anything else."""
    key = DTYPE_ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)} (or bf16, fp16, fp32)")
    return DTYPES[key]
