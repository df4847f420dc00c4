"""Activation ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] = [gate | up]; returns silu(gate) * up, [..., I], in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_clamped(x: torch.Tensor, limit: float) -> torch.Tensor:
    """x: [..., 2I] = [gate | up]; returns silu(min(gate, limit)) * clamp(up, -limit, limit),
    [..., I], in x's dtype (DeepSeek-V4's clamped SwiGLU, ``swiglu_limit``)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
