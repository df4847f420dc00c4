"""Grammar masks (``apply_token_bitmask``): logits of tokens a row's grammar forbids set to -inf.

One Triton program per (row, tile of BLOCK tokens). It loads the tile's BLOCK / 32 bitmask words
once, expands them in registers (bit t % 32 of word t // 32, least significant first, as
xgrammar packs them), and writes the tile's logits unchanged or -inf. It reads the logits once and
writes them once, so it is bound by memory traffic. The output is a new tensor: the contract leaves
its inputs untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.kernels.device import await_inputs, launch_options

BLOCK_V = 4096  # tokens per program (a multiple of 32)
NUM_WARPS = 4


@triton.jit
def _bitmask_kernel(logits_ptr, bitmask_ptr, out_ptr, vocab, stride_l, stride_b, stride_o,
                    BLOCK: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    words = tile * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    tokens = tile * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < vocab
    packed = tl.load(bitmask_ptr + row * stride_b + words, mask=words * 32 < vocab, other=0)
    bits = (packed[:, None] >> tl.arange(0, 32)[None, :]) & 1  # [BLOCK / 32, 32]: token 32 w + b
    allowed = tl.reshape(bits, (BLOCK,)) != 0
    x = tl.load(logits_ptr + row * stride_l + tokens, mask=inside, other=0.0)
    tl.store(out_ptr + row * stride_o + tokens, tl.where(allowed, x, float("-inf")), mask=inside)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """See deepinfer_core.ops.sampling.apply_token_bitmask (same contract)."""
    rows, vocab = logits.shape
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if rows == 0 or vocab == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if bitmask.stride(-1) != 1:
        bitmask = bitmask.contiguous()
    grid = (rows, triton.cdiv(vocab, BLOCK_V))
    _bitmask_kernel[grid](logits, bitmask, out, vocab, logits.stride(0), bitmask.stride(0), out.stride(0),
                          BLOCK=BLOCK_V, num_warps=NUM_WARPS, **launch_options(logits.device))
    return out


apply_token_bitmask.impl = "triton: one pass, bitmask words expanded in registers"


OPS = {"apply_token_bitmask": apply_token_bitmask}
