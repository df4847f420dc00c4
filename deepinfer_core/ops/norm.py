"""RMSNorm ops (DeepSeek V2/V3 variant: normalise in float32, cast to the input dtype, then scale)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * cast_in(x_f32 * rsqrt(mean(x_f32^2, -1) + eps)).

    x: [..., D] any float dtype; weight: [D]. Returns a new tensor of x's shape and dtype.
    """
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual (in x's dtype); returns (rms_norm(residual', weight, eps), residual').

    x, residual: [..., D] same dtype. Inputs are not modified.
    """
    summed = x + residual
    return rms_norm(summed, weight, eps), summed
