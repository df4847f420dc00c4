"""Activation ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] = [gate | up]; returns silu(gate) * up, [..., I], in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
