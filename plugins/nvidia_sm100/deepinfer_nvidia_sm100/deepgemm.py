"""DeepGEMM (DeepSeek's FP8 GEMM library) as the provider of ``moe_experts`` for block-FP8 experts
at prefill sizes on sm_90.

Chosen when ``deep_gemm`` imports and a call fits: bf16 activations, float8_e4m3fn expert weights
with float32 scales per 128 x 128 block, hidden and intermediate sizes multiples of 128, an sm_90
device, and at least MIN_PAIRS_PER_EXPERT (token, slot) pairs per expert on average (below that
the experts' weights, not the MMAs, bound the call, and the Triton W8A16 GEMM reads them as fast
without the extra passes). Every other call goes to the Triton kernels (``kernels/moe.py``), as
does every call when ``DEEPINFER_EXTERNAL_KERNELS=0`` or in the batch-invariant table.

A call, all on the device (no host synchronisation; the buffers have the shape-derived bound of
``moe.align_pairs``):

1. ``moe.align_pairs`` groups the pairs by expert, each expert's rows padded to DeepGEMM's M
   alignment (128); the row -> expert map DeepGEMM reads (``grouped_layout``) is -1 on padding
   (rows up to the align's shape-derived bound, so DeepGEMM's row count follows T * k).
2. The Triton pre-pass gathers each row's token and quantises it per 128 channels (scale =
   amax / 448, the scales in the M-major layout DeepGEMM's TMA loads), then
   ``m_grouped_fp8_gemm_nt_contiguous`` multiplies by w13 (FP8 x FP8 -> bf16 gate | up).
3. One pass computes silu(gate) * up (rounded as ``silu_and_mul``) and quantises it, then the
   grouped GEMM by w2.
4. ``moe.sum_slots`` sums each token's k rows in slot order in float32, each times its routing
   weight and rounded to bf16 first (the reference's order of roundings).

Numerics: W8A8 with DeepSeek's 1 x 128 activation blocks, as DeepSeek's own inference and
DeepGEMM compute V3's experts; the Triton path keeps the activations in bf16 (W8A16). The op's
FP8 tolerance (``specs/ops.toml``, ``tolerance_fp8``) admits both.

DeepGEMM compiles its kernels on first use (nvcc, 3-13 s each on an H200; cached on disk in
``~/.deep_gemm`` or ``DG_JIT_CACHE_DIR``). It picks its tiles per (M, N, K) from a fixed set of
candidates, so a new prefill size compiles a variant only where its choice differs. The engine's
start-up compiles those its memory-profile prefill (``max_num_batched_tokens`` tokens) and its
warm-up reach. Rounding M up to a power of two of M-blocks, to visit fewer variants, cost up to
33% of the op's time (H200: 17.9 against 13.5 ms at 16384 V3 tokens), so the row count is the
align's bound. Calls inside CUDA-graph capture take the same path as eager ones (shapes decide);
the decode graphs reach the threshold only at large batches (V3: 512 rows, e.g. 256 sequences
verifying one draft each).

Install: ``pip install sgl-deep-gemm`` where its prebuilt ``_C`` matches the installed torch;
otherwise build DeepGEMM's source against it (``tools/build_deepgemm.sh``). The ``sgl-deep-gemm``
0.2.2 wheel needs a newer torch than 2.11: its ``_C.so`` imports symbols torch 2.11 does not
export (``c10::cuda::CUDAErrorLogCapture`` and three more); bound lazily, the import succeeds,
and then every tensor's dimension count reads wrong (``layout.hpp: dim == 2 or dim == 3``).
``host_code_works`` catches that once per device, and the Triton experts run.
"""

from __future__ import annotations

import functools
import logging

import torch

from deepinfer_nvidia_sm100.kernels import moe
from deepinfer_nvidia_sm100.kernels.fp8_linear import empty_quantized, quantize_activations

log = logging.getLogger("deepinfer")

BLOCK = (128, 128)  # DeepGEMM's sm_90 FP8 recipe: 1 x 128 activation and 128 x 128 weight blocks
SCALE_ALIGN = 4  # float32 scales in M-major rows padded to 16 bytes (TMA)
# DeepGEMM takes calls with at least this many pairs per expert on average. H200, 2026-12-04,
# V3 experts (E=256, k=8, FP8): the grouped GEMMs alone took 3.5 ms from 256 to 1024 tokens (the
# weights' read: every expert is padded to 128 rows), where the Triton experts took 3.6 ms at 256
# tokens (8 pairs per expert) and 6.4 ms at 1024 (32 per expert); the whole op took 0.79x the Triton
# op's time at 512 tokens (16 per expert), 1.05x at 256 (benchmarks/results/h200-2026-12-04-deepgemm/).
MIN_PAIRS_PER_EXPERT = 16


@functools.cache
def module():
    """``deep_gemm`` when it imports, else None (whether its host code reads tensors right is
    checked per device, ``host_code_works``)."""
    try:
        import deep_gemm

        deep_gemm.get_mk_alignment_for_contiguous_layout()
    except Exception as e:  # noqa: BLE001 - a wheel built for another torch fails in many ways
        log.debug("deep_gemm does not import: %s", e)
        return None
    return deep_gemm


@functools.cache
def version() -> str | None:
    """The imported DeepGEMM's own version when it imports, else None. (Both the sgl wheel and a
    source build say it; an installed wheel's metadata may describe another copy than the one
    imported, as when a source build comes first on the path.)"""
    dg = module()
    return None if dg is None else f"deep_gemm {getattr(dg, '__version__', '(version unknown)')}"


def host_code_works(dg, device: torch.device) -> bool:
    """Whether ``dg``'s host module reads a tensor right. One built for another torch imports,
    then misreads every tensor (sgl-deep-gemm 0.2.2 on torch 2.11: "dim == 2 or dim == 3"). It
    gets scales already in its layout (no kernel, nothing compiled): a working build returns them."""
    sf = torch.ones((2, 8), dtype=torch.float32, device=device).t()
    try:
        ok = tuple(dg.get_mn_major_tma_aligned_tensor(sf).shape) == (8, 2)
        why = "it returned a wrong shape"
    except Exception as e:  # noqa: BLE001 - whatever a mismatched build raises
        ok, why = False, e
    if not ok:
        log.warning("deep_gemm imports but fails on a tensor (%s): it was built for another torch; the Triton "
                    "experts run (rebuild it against this torch: tools/build_deepgemm.sh)", why)
    return ok


@functools.cache
def _device_supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0) and host_code_works(module(), torch.device("cuda", index))


def supported(device: torch.device | str) -> bool:
    """Whether DeepGEMM runs here: it imports, ``device`` is an sm_90 GPU (its sm_100 kernels
    want UE8M0 scales, a recipe not wired or tested here) and its host code reads a tensor right."""
    device = torch.device(device)
    if device.type != "cuda" or module() is None:
        return False
    return _device_supported(device.index if device.index is not None else torch.cuda.current_device())


def fits(x, w13, w2, topk_ids, w13_scale, w2_scale, block) -> bool:
    """Whether DeepGEMM takes this ``moe_experts`` call (shapes, dtypes and device only)."""
    if w13_scale is None or block is None or tuple(int(b) for b in block) != BLOCK:
        return False
    num_experts, hidden = w13.shape[0], x.shape[-1]
    inter = w2.shape[-1]
    return (
        x.dtype == torch.bfloat16
        and w13.dtype == w2.dtype == torch.float8_e4m3fn
        and w13_scale.dtype == w2_scale.dtype == torch.float32
        and w13.is_contiguous() and w2.is_contiguous()
        and hidden % BLOCK[1] == 0 and inter % BLOCK[1] == 0
        and topk_ids.numel() >= MIN_PAIRS_PER_EXPERT * num_experts
        and supported(x.device)
    )


def grouped_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale) -> torch.Tensor:
    """``moe_experts`` of block-FP8 experts through DeepGEMM's m-grouped contiguous GEMMs (see the
    module doc); the caller has checked ``fits``."""
    dg = module()
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w2.shape[-1]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    layout = moe.align_pairs(topk_ids, num_experts, dg.get_mk_alignment_for_contiguous_layout())
    rows = layout.sorted_pairs.numel()
    block_m = rows // layout.max_blocks
    index = torch.arange(rows, dtype=torch.int32, device=x.device)
    # The pair of each row, num_pairs on padding (rows past num_padded are not written by the align).
    pairs = torch.where(index < layout.num_padded, layout.sorted_pairs, num_pairs)
    grouped = torch.where(pairs < num_pairs, layout.block_expert.repeat_interleave(block_m), -1)
    a, a_scales = empty_quantized(rows, hidden, BLOCK[1], x.device, SCALE_ALIGN)
    quantize_activations(x, a, a_scales, BLOCK[1], rows=pairs, num_valid=num_pairs, row_div=top_k)
    gate_up = torch.empty((rows, 2 * inter), dtype=x.dtype, device=x.device)
    dg.m_grouped_fp8_gemm_nt_contiguous((a, a_scales), (w13, w13_scale), gate_up, grouped)
    h, h_scales = empty_quantized(rows, inter, BLOCK[1], x.device, SCALE_ALIGN)
    quantize_activations(gate_up, h, h_scales, BLOCK[1], gated=True)
    y = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    dg.m_grouped_fp8_gemm_nt_contiguous((h, h_scales), (w2, w2_scale), y, grouped)
    # Each pair's row: sorted_pairs inverted (padding rows all land on the dropped entry num_pairs).
    pair_row = torch.zeros(num_pairs + 1, dtype=torch.int32, device=x.device)
    pair_row.scatter_(0, pairs.long(), index)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    moe.sum_slots(y, out, top_k, rows=pair_row, weights=topk_weights.reshape(-1).float())
    return out


def provide(ops: dict, device: torch.device | str | None) -> dict:
    """``ops`` with DeepGEMM providing ``moe_experts`` where it fits (the op there becomes the
    fallback) when ``device`` supports it; unchanged otherwise."""
    fallback = ops.get("moe_experts")
    if fallback is None or device is None or not supported(device):
        return ops

    def moe_experts(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, block=None):
        if x.shape[0] and fits(x, w13, w2, topk_ids, w13_scale, w2_scale, block):
            return grouped_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
        return fallback(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block)

    for name in ("shared_expert_max_tokens",):  # the fallback's hints hold for the calls it keeps
        if hasattr(fallback, name):
            setattr(moe_experts, name, getattr(fallback, name))
    moe_experts.impl = (
        f"deepgemm ({version()}: m-grouped FP8 GEMMs, W8A8 with 1x128 activation blocks) for bf16 block-FP8 "
        f"experts from {MIN_PAIRS_PER_EXPERT} pairs per expert; else {getattr(fallback, 'impl', 'the fallback')}"
    )
    return {**ops, "moe_experts": moe_experts}
