"""Linear layers: plain, per-head (MLA's absorbed projections) and DeepSeek block-FP8
(float8_e4m3fn weights, one scale per block)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias[N]) -> [..., N] in x's dtype."""
    return F.linear(x, weight, bias)


def head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-head linear: out[t, h] = weight[h] @ x[t, h]. x [T, H, K], weight [H, N, K] (either may
    be a strided view) -> [T, H, N] in x's dtype.

    MLA's absorbed attention multiplies each head's query by W_UK (q_nope [T, H, d_n] by
    W_UK^T [H, d_c, d_n]) and each head's latent output by W_UV ([T, H, d_c] by [H, d_v, d_c]).
    """
    return torch.einsum("thk,hnk->thn", x, weight)


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """W[i, j] = q[i, j] * s[i // bn, j // bk] for a [..., N, K] float8 weight and [..., ceil(N/bn), ceil(K/bk)] scales."""
    bn, bk = block
    n, k = weight.shape[-2:]
    s = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (weight.float() * s).to(dtype)


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) times a block-FP8 weight [N, K] with scales [ceil(N/bn), ceil(K/bk)].

    Returns [..., N] in x's dtype. The reference dequantises the weight and multiplies in
    float32; fast backends quantise activations per token and per ``bk`` channels dynamically,
    hence the looser tolerance in specs/ops.toml.
    """
    return dequantized_linear(x, weight, weight_scale_inv, block, bias, F.linear)


def dequantized_linear(x, weight, weight_scale_inv, block, bias, matmul) -> torch.Tensor:
    """``fp8_block_linear``'s reference body with the float32 product done by ``matmul`` (F.linear's
    signature: the batch-invariant reference passes its own)."""
    w = dequantize_fp8_block(weight, weight_scale_inv, block, torch.float32)
    return matmul(x.float(), w, None if bias is None else bias.float()).to(x.dtype)
