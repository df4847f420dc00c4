"""Rotary position embedding (plain RoPE and YaRN tables, interleaved or NeoX pairs)."""

from __future__ import annotations

import math

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rotary_dim: int, base: float, rope_parameters: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] (float32) and the cos/sin attention factor.

    rope_parameters follows transformers' ``config.rope_parameters`` (``rope_type`` "default"
    or "yarn" with factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
    mscale_all_dim, truncate). The YaRN correction range is computed as transformers does.
    """
    freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    params = rope_parameters or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return freq, 1.0
    if rope_type != "yarn":
        raise ValueError(f"rope_type {rope_type!r} is not supported; DeepSeek models use 'default' or 'yarn'")
    factor = float(params["factor"])
    orig = params.get("original_max_position_embeddings")
    if orig is None:
        raise ValueError("yarn rope_parameters need original_max_position_embeddings")
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(n_rot: float) -> float:
        return (rotary_dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (freq / factor) * (1 - extrapolation) + freq * extrapolation
    return inv_freq, float(attention_factor)


def rope_cos_sin_table(rotary_dim: int, base: float, rope_parameters: dict | None, max_positions: int) -> torch.Tensor:
    """[max_positions, rotary_dim] float32 table: cos in the first half, sin in the second."""
    inv_freq, attention_factor = rope_inv_freq(rotary_dim, base, rope_parameters)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    x32 = x.float()
    if interleaved:
        a, b = x32[..., 0::2], x32[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    else:
        half = x32.shape[-1] // 2
        a, b = x32[..., :half], x32[..., half:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return out.to(x.dtype)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, r] and k [T, r] by their token positions.

    positions: [T] int64; cos_sin: [max_pos, r] float32 from ``rope_cos_sin_table``.
    interleaved=True rotates pairs (2i, 2i+1) (DeepSeek layout; the output stays interleaved);
    False rotates pairs (i, i + r/2) (NeoX ``rotate_half``). Computed in float32, returned in
    the inputs' dtypes as new tensors.
    """
    half = cos_sin.shape[-1] // 2
    table = cos_sin[positions]
    cos, sin = table[:, :half], table[:, half:]
    return _rotate(q, cos[:, None, :], sin[:, None, :], interleaved), _rotate(k, cos, sin, interleaved)
