"""Op contracts and their reference implementations.

Every op has a name, a documented signature (the docstring of its reference implementation is
the contract), a reference implementation in plain PyTorch with float32 accumulation, and
per-dtype tolerances in ``specs/ops.toml``. Backends supply their own callables under the same
names; models only ever call ops through an ``OpTable``.
"""

from __future__ import annotations

from typing import Callable

from deepinfer_core.ops import activation, attention, engram, hyper, linear, moe, norm, rope, sampling, sparse

# name -> reference implementation. The order is the order ``deepinfer backends`` prints.
REFERENCE_OPS: dict[str, Callable] = {
    "rms_norm": norm.rms_norm,
    "add_rms_norm": norm.add_rms_norm,
    "rotary_embedding": rope.rotary_embedding,
    "linear": linear.linear,
    "fp8_block_linear": linear.fp8_block_linear,
    "head_linear": linear.head_linear,
    "silu_and_mul": activation.silu_and_mul,
    "moe_route": moe.moe_route,
    "moe_experts": moe.moe_experts,
    "write_latent_cache": attention.write_latent_cache,
    "norm_rope_write_latent": attention.norm_rope_write_latent,
    "gather_latent_cache": attention.gather_latent_cache,
    "mla_prefill_attention": attention.mla_prefill_attention,
    "mla_decode_attention": attention.mla_decode_attention,
    "sample_tokens": sampling.sample_tokens,
    "apply_token_bitmask": sampling.apply_token_bitmask,
    # DeepSeek-V4
    "rms_norm_f32": norm.rms_norm_f32,
    "rms_normalize": norm.rms_normalize,
    "silu_and_mul_clamped": activation.silu_and_mul_clamped,
    "moe_route_sqrtsoftplus": moe.moe_route_sqrtsoftplus,
    "moe_experts_clamped": moe.moe_experts_clamped,
    "mhc_pre": hyper.mhc_pre,
    "mhc_post": hyper.mhc_post,
    "mhc_head": hyper.mhc_head,
    "write_cache": sparse.write_cache,
    "compress_pool": sparse.compress_pool,
    "compress_entries": sparse.compress_entries,
    "indexer_topk": sparse.indexer_topk,
    "sparse_attention": sparse.sparse_attention,
    # DeepSeek-V4.1
    "mhc_pre_delayed": hyper.mhc_pre_delayed,
    "mhc_collapse": hyper.mhc_collapse,
    "indexer_block_candidates": sparse.indexer_block_candidates,
    "engram_hash_ids": engram.engram_hash_ids,
    "engram_gate": engram.engram_gate,
}

OP_NAMES: tuple[str, ...] = tuple(REFERENCE_OPS)
# The ops only DeepSeek-V4 and V4.1 use (a V2/V3-only backend may leave them to the reference).
V4_OP_NAMES: tuple[str, ...] = OP_NAMES[OP_NAMES.index("rms_norm_f32"):]
V41_OP_NAMES: tuple[str, ...] = OP_NAMES[OP_NAMES.index("mhc_pre_delayed"):]  # V4.1's own
# Fusions a model calls only where the backend provides them (the ops they fuse otherwise): left
# out, they cost nothing and their reference never runs.
OPTIONAL_OPS: frozenset[str] = frozenset({"norm_rope_write_latent"})


def reference_ops(batch_invariant: bool = False) -> dict[str, Callable]:
    """The reference implementations, in their batch-invariant form when asked (``ops.invariant``)."""
    if not batch_invariant:
        return dict(REFERENCE_OPS)
    from deepinfer_core.ops import invariant

    return {**REFERENCE_OPS, **invariant.OVERRIDES}


class OpTable:
    """The ops a model calls, resolved once at start-up.

    Attribute access gives the plain callable (``ops.rms_norm(x, w, eps)``); ``providers`` maps
    each op name to the backend that supplied it, ``implementations`` to the callable's ``impl``
    attribute (a backend's one-line description of the kernel behind it), or "" when it has none.
    ``batch_invariant``: the table was built for batch-invariant inference (each op's result for
    a row depends on that row alone; hookspecs.BackendSpec.deepinfer_ops), and the models compute
    every token the way they compute a decoded one.
    """

    def __init__(self, impls: dict[str, Callable], providers: dict[str, str], batch_invariant: bool = False):
        unknown = set(impls) - set(OP_NAMES)
        if unknown:
            raise ValueError(f"unknown op names {sorted(unknown)}; known ops: {', '.join(OP_NAMES)}")
        missing = set(OP_NAMES) - set(impls)
        if missing:
            raise ValueError(f"op table lacks {sorted(missing)}")
        self.__dict__.update(impls)
        self.providers = dict(providers)
        # op -> what implements it, from the callable's ``impl`` attribute ("triton: ...", "cublas")
        self.implementations = {name: getattr(fn, "impl", None) or "" for name, fn in impls.items()}
        self.batch_invariant = batch_invariant

    @classmethod
    def reference(cls, batch_invariant: bool = False) -> OpTable:
        return cls(reference_ops(batch_invariant), {name: "reference" for name in OP_NAMES}, batch_invariant)

    def __getitem__(self, name: str) -> Callable:
        return self.__dict__[name]

    def backend_provides(self, name: str) -> bool:
        """Whether ``name`` is a backend's own callable, not the reference's: the models call an
        optional fusion (``OPTIONAL_OPS``) only then, and the ops it fuses otherwise."""
        return self.providers.get(name, "reference") != "reference"
