"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the ``hc`` residual streams of a
token are collapsed into one block input, and the block's output is expanded back and mixed
with the streams (see deepseek_architectures.md §3.2).

Streams are [T, hc, D] in the model dtype; the mixing coefficients are float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _mixes(x: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    flat = x.flatten(1).float()
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + rms_eps)
    return F.linear(flat, fn.float())


def _coefficients(x, fn, base, scale, hc_eps: float, rms_eps: float, sinkhorn_iters: int):
    """(pre [T, hc], post [T, hc], comb [T, hc, hc]) float32, as ``mhc_pre`` documents."""
    hc = x.shape[1]
    m = _mixes(x, fn, rms_eps)
    b = base.float()
    s = scale.float()
    pre = torch.sigmoid(m[:, :hc] * s[0] + b[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[:, hc : 2 * hc] * s[1] + b[hc : 2 * hc])
    comb = torch.softmax(m[:, 2 * hc :].view(-1, hc, hc) * s[2] + b[2 * hc :].view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def mhc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_eps: float,
    rms_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coefficients of one sublayer's hyper-connection and the collapsed block input.

    x: [T, hc, D] streams; fn: [(2 + hc) * hc, hc * D], base: [(2 + hc) * hc], scale: [3] (float32).
    M = rmsnorm_unweighted(flatten(x) in float32) @ fn^T, split [pre hc | post hc | comb hc*hc]:
    pre = sigmoid(M_pre * scale[0] + base_pre) + hc_eps; post = 2 sigmoid(M_post * scale[1] + base_post);
    comb = softmax over the last axis of (M_comb * scale[2] + base_comb) viewed [hc, hc], + hc_eps,
    then divided by its column sums (+hc_eps), then (sinkhorn_iters - 1) times by its row sums and
    its column sums (+hc_eps each). Returns (post [T, hc] float32, comb [T, hc, hc] float32 with
    comb[t, j, k] = weight of input stream j in output stream k, collapsed = sum_j pre_j x_j
    [T, D] in x's dtype, summed in float32).
    """
    pre, post, comb = _coefficients(x, fn, base, scale, hc_eps, rms_eps, sinkhorn_iters)
    return post, comb, mhc_collapse(x, pre)


def mhc_pre_delayed(
    x: torch.Tensor,
    pre_in: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_eps: float,
    rms_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V4.1's delayed hyper-connection (§4.2): this sublayer's coefficients from the
    streams, the block input collapsed with the previous sublayer's ``pre``.

    x: [T, hc, D]; pre_in: [T, hc] float32 (the previous sublayer's pre; one-hot stream 0 for the
    first layer); fn, base, scale as ``mhc_pre``. Returns (pre, post, comb as ``mhc_pre`` defines
    them, float32; collapsed = sum_j pre_in_j x_j [T, D] in x's dtype, summed in float32).
    """
    pre, post, comb = _coefficients(x, fn, base, scale, hc_eps, rms_eps, sinkhorn_iters)
    return pre, post, comb, mhc_collapse(x, pre_in)


def mhc_collapse(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * x[t, j]: x [T, hc, D], weights [T, hc] float32 -> [T, D] in x's
    dtype, summed in float32 (V4.1's final collapse with the last sublayer's pre)."""
    return (weights.float()[:, :, None] * x.float()).sum(dim=1).to(x.dtype)


def mhc_post(out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams after a block: new[t, k] = post[t, k] * out[t] + sum_j comb[t, j, k] * x[t, j].

    out: [T, D] block output; x: [T, hc, D] streams; post [T, hc], comb [T, hc, hc] float32 (from
    ``mhc_pre``). Computed in float32, returned [T, hc, D] in x's dtype.
    """
    mixed = torch.matmul(comb.float().transpose(-1, -2), x.float())
    return (post.float()[:, :, None] * out.float()[:, None, :] + mixed).to(x.dtype)


def mhc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_eps: float, rms_eps: float) -> torch.Tensor:
    """Final learned collapse of the streams: w = sigmoid(M * scale + base) + hc_eps with
    M = rmsnorm_unweighted(flatten(x) in float32) @ fn^T; returns sum_j w_j x_j [T, D] in x's dtype.

    x: [T, hc, D]; fn: [hc, hc * D], base: [hc], scale: [1] (float32).
    """
    w = torch.sigmoid(_mixes(x, fn, rms_eps) * scale.float() + base.float()) + hc_eps
    return (w[:, :, None] * x.float()).sum(dim=1).to(x.dtype)
