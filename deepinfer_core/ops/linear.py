"""Linear layers: plain, per-head (MLA's absorbed projections) and DeepSeek block-FP8
(float8_e4m3fn weights, one scale per block); the dequantisers of DeepSeek's weight formats
(block FP8, and MXFP4: V4's routed experts, which ``moe_experts`` accepts packed)."""

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


MXFP4_GROUP = 32  # inputs per e8m0 scale of an MXFP4 weight
# E2M1 code -> value: codes 0-7 as listed, 8-15 their negatives (8 is -0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu (or its bytes as uint8) -> float32 2^(byte - 127), bit-exact on any device
    (byte 0 is 2^-127, a float32 subnormal; 255 is NaN); other dtypes: ``scale.float()``."""
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        return scale.float()
    byte = scale.view(torch.uint8).to(torch.int32)
    bits = torch.where(byte == 0, torch.full_like(byte, 0x00400000), byte << 23)
    bits = torch.where(byte == 255, torch.full_like(byte, 0x7FC00000), bits)
    return bits.view(torch.float32)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 [..., N, K/2] (int8, uint8 or float4_e2m1fn_x2; byte k holds element 2k in its low
    nibble and 2k+1 in its high nibble) with scales [..., N, ceil(K/32)] (e8m0, its uint8 bytes,
    or float) -> [..., N, K] in ``dtype``: W[i, j] = E2M1(code[i, j]) * scale[i, j // 32]."""
    byte = packed.view(torch.uint8)
    codes = torch.stack((byte & 0x0F, byte >> 4), dim=-1).flatten(-2).int()  # int: an index, not a mask
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)[codes]
    k, s = values.shape[-1], e8m0_to_float(scale)
    if k % MXFP4_GROUP == 0:  # one multiply per group, no [N, K] copy of the scales
        return (values.unflatten(-1, (-1, MXFP4_GROUP)) * s.unsqueeze(-1)).flatten(-2).to(dtype)
    return (values * s.repeat_interleave(MXFP4_GROUP, dim=-1)[..., :k]).to(dtype)


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
