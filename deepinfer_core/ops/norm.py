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


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = cast_in(weight_f32 * x_f32 * rsqrt(mean(x_f32^2, -1) + eps)) (the DeepSeek-V4 variant:
    the weight multiplies in float32 and the result is cast once).

    x: [..., D] any float dtype; weight: [D] (any float dtype, used in float32). Returns a new
    tensor of x's shape and dtype.
    """
    x32 = x.float()
    return (weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMSNorm over the last axis: y = x * cast_in(rsqrt(mean(x_f32^2, -1) + eps)); the
    factor is computed in float32, rounded to x's dtype and multiplied in x's dtype (V4's
    per-head query norm). x: [..., D]; returns a new tensor of x's shape and dtype."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)
