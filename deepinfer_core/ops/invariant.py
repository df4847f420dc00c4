"""The reference ops in batch-invariant form: each row's result depends on that row alone, not on
how many rows share the call or what they hold (``LLM(batch_invariant=True)``).

Matrix products break this in the plain reference: a BLAS picks its kernel, its blocking and
its split of the reduction from the shape of the whole product, so a token's projection changes
in its last bits with the number of tokens beside it (measured on this project's CPU with MKL:
float32 rows differ between 1, 2..7 and 8+ rows; bfloat16 between 1 and more). Here every
product runs in calls of exactly ``ROWS`` rows, the last call padded with zeros, each call on a
freshly allocated (equally aligned) buffer, so every call a row takes part in is the same call.
With MKL (torch's x86 builds) a fixed-shape GEMM computes each of its rows the same way wherever
the row sits and whatever the other rows hold (float32 and bfloat16, checked over the model
shapes by tests/test_batch_invariant.py), so ROWS is 16. Other BLAS libraries need not:
OpenBLAS (numpy's, for one) gives a row different bits at different positions of the same
product. Without MKL, ROWS is 1: a one-row product has no position.

Elementwise transcendentals can break it too: torch's vectorised loop (SLEEF) and its scalar
tail round exp or sigmoid differently, and whether an element lands in one or the other follows
its place in the flattened tensor, that is, the rows before it (measured: sigmoid over a [40, 8]
tensor gave 11 of 40 rows other bits than each row alone). On more than one thread it is
worse: torch cuts a large elementwise op into ranges of the flattened tensor, and a range may
end mid-row. The routing gate and SwiGLU therefore run one token per call. The rest of what the
MLA models call is already row by row: norms (exact arithmetic), RoPE (precomputed tables);
``mla_decode_attention`` loops over query rows, each one's products shaped by its own
position; ``sample_tokens`` draws per row from (seed, position). ``mla_prefill_attention`` is
left as it is: a batch-invariant engine computes prompt tokens through ``mla_decode_attention``
(rows of any length), so that a prompt token, a token recomputed after a preemption and a
decoded token go through the same arithmetic.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from deepinfer_core.ops import linear as _linear
from deepinfer_core.ops import moe as _moe
from deepinfer_core.ops.activation import silu_and_mul as _silu_and_mul

ROWS = 16 if torch.backends.mkl.is_available() else 1  # rows per matrix-product call (see above)


def in_fixed_calls(fn: Callable, x: torch.Tensor, rows: int = ROWS):
    """``fn`` over the rows of ``x`` (dim 0) ``rows`` at a time, each call on a new [rows, ...]
    buffer (the last one zero-padded); the results (a tensor, or a tuple of them) concatenated
    and cut to x's rows."""
    if x.shape[0] == 0:
        return fn(x)
    outs = []
    for start in range(0, x.shape[0], rows):
        chunk = x[start : start + rows]
        buffer = x.new_zeros((rows, *x.shape[1:]))
        buffer[: chunk.shape[0]] = chunk
        out = fn(buffer)
        outs.append(tuple(t[: chunk.shape[0]] for t in out) if isinstance(out, tuple) else out[: chunk.shape[0]])
    return tuple(map(torch.cat, zip(*outs))) if isinstance(outs[0], tuple) else torch.cat(outs)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """ops.linear.linear, batch-invariant."""
    flat = x.reshape(-1, x.shape[-1])
    return in_fixed_calls(lambda rows: F.linear(rows, weight, bias), flat).view(*x.shape[:-1], weight.shape[0])


def head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ops.linear.head_linear, batch-invariant."""
    return in_fixed_calls(lambda rows: _linear.head_linear(rows, weight), x)


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """ops.linear.fp8_block_linear, batch-invariant."""
    return _linear.dequantized_linear(x, weight, weight_scale_inv, block, bias, linear)


def moe_route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.moe.moe_route, batch-invariant: the gate logits by ``linear``, then one token per call
    (the scoring function's vectorised loop and its scalar tail round differently, and which one
    an element gets follows its place in the whole tensor)."""
    def route(token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate = _moe.route_selection(token, gate_weight, correction_bias, scoring_func=scoring_func, topk_method=topk_method,
                                    n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                                    routed_scaling_factor=routed_scaling_factor, matmul=linear)
        return _moe.top_k_route(gate, top_k)

    return in_fixed_calls(route, x, rows=1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """ops.activation.silu_and_mul, batch-invariant: one token per call."""
    flat = x.reshape(-1, x.shape[-1])
    return in_fixed_calls(_silu_and_mul, flat, rows=1).view(*x.shape[:-1], x.shape[-1] // 2)


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """ops.moe.moe_experts, batch-invariant (each token's experts are summed in ascending id, as
    the reference does, whatever other tokens chose them)."""
    return _moe.routed_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, silu_and_mul, linear)


# The ops the batch-invariant reference table replaces (the MLA models' matrix products and
# transcendental elementwise ops).
OVERRIDES: dict[str, Callable] = {
    "linear": linear,
    "head_linear": head_linear,
    "fp8_block_linear": fp8_block_linear,
    "moe_route": moe_route,
    "moe_experts": moe_experts,
    "silu_and_mul": silu_and_mul,
}
_CALLS = f"in calls of {ROWS} row{'s' if ROWS > 1 else ''}"
linear.impl = head_linear.impl = fp8_block_linear.impl = f"reference, batch-invariant: products {_CALLS}"
silu_and_mul.impl = "reference, batch-invariant: one token per call"
moe_route.impl = f"reference, batch-invariant: gate logits {_CALLS}, scoring one token per call"
moe_experts.impl = f"reference, batch-invariant: expert products {_CALLS}, SwiGLU one token per call"
