"""cuBLAS's block-scaled FP8 GEMM as the provider of ``fp8_block_linear`` on sm_90.

cuBLAS (CUDA >= 12.9) multiplies e4m3 matrices with DeepSeek's own scaling: one float32 scale per
1 x 128 activation block and per 128 x 128 weight block, applied per K block in its Hopper
kernels; torch reaches it through ``torch.nn.functional.scaled_mm`` with the ``BlockWise1x128`` /
``BlockWise128x128`` recipes (sm_90 only: torch refuses that recipe elsewhere). This module
quantises the activations with the Triton pre-pass of ``kernels/fp8_linear.py`` (per token and
128 channels, scale = amax / 448, as DeepSeek's checkpoints expect and as the Triton W8A8 path
does) and hands both operands to cuBLAS.

Chosen per call from shapes and dtypes only (so a captured graph takes the eager call's path):
bf16 activations, 128 x 128 weight blocks, K a multiple of 128, N a multiple of 8 (16-byte output
rows), float32 weight scales, at least MIN_M rows (any number on weights of MIN_WEIGHT elements or
more), and a device of compute capability 9.0 with a torch that has the recipes. Every other call
goes to the Triton GEMM (the fallback), as does every call when ``DEEPINFER_EXTERNAL_KERNELS=0``
or in the batch-invariant table (cuBLAS picks its kernel and K split per M).

Layouts torch's recipe wants (its own tests, checked on an H200): the activation scales
K-block-major ([M, K/128] with strides (1, M)); the weight scales [ceil(N/128), L4] with L4 =
K/128 rounded up to a multiple of 4 (every DeepSeek projection already is; other shapes get a
zero-padded copy per call; unpadded ones were refused), passed transposed. M is padded to a
multiple of 4, as vLLM does for cuBLASLt with this recipe (odd M unpadded was not tried): the
pre-pass writes the padding rows as zeros and the GEMM's padding rows are dropped.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from deepinfer_nvidia_sm100.kernels.fp8_linear import empty_quantized, quantize_activations

BLOCK = (128, 128)  # the only weight block cuBLAS's DeepSeek recipe takes
M_ALIGN = 4  # rows padded to a multiple of this (see above)
# cuBLAS takes calls of at least MIN_M rows, and calls of any row count on weights of at least
# MIN_WEIGHT elements; the rest go to the Triton W8A16 GEMM, which widens the FP8 weight in
# registers and needs no quantisation pass. H200, 2026-12-03 (benchmarks/kernels.py --only
# fp8_linear, graph replays, inputs cold), the provider against the Triton GEMM on V3's
# projections: at 1-16 rows cuBLAS is 1.3-1.4x faster on o_proj (117M elements) and the dense MLP
# (132M), 1.1x on q_b (38M), but 0.9x on kv_b (17M) and 0.5-0.7x on q_a / kv_a (11M / 4M), where
# its floor of ~17 us (the pre-pass plus cuBLAS) is twice the Triton GEMM's time; at 64 rows it
# is 1.2-2.4x faster except on kv_a (0.7x); from 256 rows on every projection (1.2-5.4x).
MIN_M = 64
MIN_WEIGHT = 32 * 2**20


@functools.cache
def _device_supported(index: int) -> bool:
    if not hasattr(F, "scaled_mm") or "BlockWise128x128" not in getattr(getattr(F, "ScalingType", None), "__members__", {}):
        return False
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return cuda >= (12, 9) and torch.cuda.get_device_capability(index) == (9, 0)


def supported(device: torch.device | str) -> bool:
    """Whether cuBLAS's DeepSeek-scaled FP8 GEMM runs on ``device`` (sm_90, CUDA >= 12.9, torch's recipes)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    return _device_supported(device.index if device.index is not None else torch.cuda.current_device())


def fits(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block) -> bool:
    """Whether cuBLAS takes this call (shapes, dtypes and device only)."""
    n, k = weight.shape
    rows = x.numel() // max(k, 1)
    return (
        x.dtype == torch.bfloat16
        and tuple(int(b) for b in block) == BLOCK
        and weight.dtype == torch.float8_e4m3fn
        and weight.is_contiguous()
        and weight_scale_inv.dtype == torch.float32
        and k % BLOCK[1] == 0
        and n % 8 == 0
        and rows > 0
        and (rows >= MIN_M or n * k >= MIN_WEIGHT)
        and supported(x.device)
    )


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bf16) times a block-FP8 weight [N, K] with scales [ceil(N/128), K/128] through
    cuBLAS, activations quantised per token and 128 channels; returns [..., N] in bf16."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    k_blocks = k // BLOCK[1]
    q, scales = empty_quantized(m, k, BLOCK[1], x.device, M_ALIGN)  # scales K-block-major
    quantize_activations(x2, q, scales, BLOCK[1])
    w_scales = weight_scale_inv.contiguous()
    if k_blocks % 4:
        w_scales = F.pad(w_scales, (0, 4 - k_blocks % 4))
    out = F.scaled_mm(
        q, weight.t(),
        scale_a=scales, scale_recipe_a=F.ScalingType.BlockWise1x128,
        scale_b=w_scales.t(), scale_recipe_b=F.ScalingType.BlockWise128x128,
        output_dtype=x.dtype,
    )[:m]
    if bias is not None:
        out = out + bias
    return out.view(*lead, n)


def provide(ops: dict, device: torch.device | str | None) -> dict:
    """``ops`` with cuBLAS providing ``fp8_block_linear`` where it fits (the op there becomes the
    fallback) when ``device`` supports it; unchanged otherwise."""
    fallback = ops.get("fp8_block_linear")
    if fallback is None or device is None or not supported(device):
        return ops

    def fp8_block_linear(x, weight, weight_scale_inv, block, bias=None):
        if fits(x, weight, weight_scale_inv, block):
            return block_fp8_linear(x, weight, weight_scale_inv, bias)
        return fallback(x, weight, weight_scale_inv, block, bias)

    fp8_block_linear.impl = (
        f"cublas (torch scaled_mm, DeepSeek 1x128 / 128x128 scales, CUDA {torch.version.cuda}) for bf16 "
        f"activations with 128x128 blocks from {MIN_M} rows (any on weights of >= {MIN_WEIGHT // 2**20}M elements), "
        f"activations quantised by a Triton pre-pass; "
        f"else {getattr(fallback, 'impl', 'the fallback')}"
    )
    return {**ops, "fp8_block_linear": fp8_block_linear}
