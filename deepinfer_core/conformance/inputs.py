"""Random inputs for every op, drawn as the header of ``specs/ops.toml`` says.

``make_case(op, dims, dtype, device, seed)`` turns one shape of the spec (a dict of named
dimensions) into the arguments of the op. Values are drawn on the CPU from a generator seeded
with ``seed`` and only then moved to ``device``, so every platform tests the same numbers.
Layouts follow what the models pass: strided views where the model passes views, block tables
that are non-contiguous permutations of the block pool, experts that receive no token.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from deepinfer_core.conformance.checkpoints import quantize_fp8_block
from deepinfer_core.ops.rope import rope_cos_sin_table

NORM_EPS = 1e-6
# Softmax scales of the spec's named attention cases (V3 / V2-Lite YaRN mscale folded in).
ATTENTION_SCALES = {"v3_yarn": 0.135234, "v2lite_yarn": 0.114721}
ROPE_PARAMETERS = {
    "default": None,
    "v3_yarn": {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "v2lite_yarn": {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                    "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
}
ROUTE_KEYS = ("top_k", "scoring_func", "topk_method", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")
# Sampled rows of sample_tokens cycle through these (temperature, top_k, top_p, min_p).
SAMPLING_RESTRICTIONS = ((1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.1), (0.8, 50, 0.9, 0.05))
SAMPLING_LOGIT_SCALE = 3.0  # peaked rows: the statistical check then has well-filled cells


@dataclass
class OpCase:
    """One call of an op: its positional and keyword arguments, plus what the checks need to know."""

    op: str
    dims: dict
    dtype: torch.dtype
    args: tuple
    kwargs: dict = field(default_factory=dict)
    # indices of positional arguments the op writes in place (compared after the call)
    inplace: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def clone(self) -> OpCase:
        """Fresh copies of every tensor argument (strides kept), for a second, independent call."""
        return OpCase(self.op, self.dims, self.dtype, tuple(_clone(a) for a in self.args),
                      {k: _clone(v) for k, v in self.kwargs.items()}, self.inplace, self.extra)

    def elements(self) -> int:
        """How many elements the tensor arguments hold (the case's size)."""
        values = [*self.args, *self.kwargs.values()]
        return sum(v.numel() for v in values if isinstance(v, torch.Tensor))


def _clone(value):
    if not isinstance(value, torch.Tensor):
        return value
    out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    return out.copy_(value)


class _Draw:
    """Seeded CPU draws moved to the target device."""

    def __init__(self, seed: int, device: torch.device):
        self.gen = torch.Generator().manual_seed(seed)
        self.device = device

    def randn(self, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * scale).to(device=self.device, dtype=dtype)

    def perm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.gen)

    def integers(self, low: int, high: int, *shape) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.gen)


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [..., N, K] -> (float8_e4m3fn [..., N, K], float32 scales [..., ceil(N/bn), ceil(K/bk)]),
    one scale per block as DeepSeek's checkpoints define ``weight_scale_inv`` (partial edge blocks included)."""
    if w.dim() == 2:
        return quantize_fp8_block(w, block)
    parts = [quantize_block_fp8(part, block) for part in w]
    return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])


@functools.lru_cache(maxsize=8)
def _cos_sin_cpu(rope: str, rope_dim: int, max_positions: int) -> torch.Tensor:
    return rope_cos_sin_table(rope_dim, 10000.0, ROPE_PARAMETERS[rope], max_positions)


def attention_scale(name: str, qk_dim: int) -> float:
    return qk_dim**-0.5 if name == "default" else ATTENTION_SCALES[name]


# ---- one builder per op ------------------------------------------------------------------------


def _rms_norm(d: dict, dtype, r: _Draw):
    # a strided view, as the model normalises the latent part of [latent | k_pe]
    x = r.randn(d["tokens"], d["hidden"] + 8, dtype=dtype)[:, : d["hidden"]]
    w = (1 + r.randn(d["hidden"], scale=0.1)).to(dtype)
    return (x, w, NORM_EPS), {}


def _add_rms_norm(d: dict, dtype, r: _Draw):
    x = r.randn(d["tokens"], d["hidden"], dtype=dtype)
    residual = r.randn(d["tokens"], d["hidden"], dtype=dtype)
    w = (1 + r.randn(d["hidden"], scale=0.1)).to(dtype)
    return (x, residual, w, NORM_EPS), {}


def _rotary_embedding(d: dict, dtype, r: _Draw):
    t, h, rd = d["tokens"], d["heads"], d["rope_dim"]
    # q as the model passes it: the rope part of a wider per-head projection (a strided view)
    q = r.randn(t, h, rd + 16, dtype=dtype)[..., 16:]
    k = r.randn(t, rd, dtype=dtype)
    positions = r.integers(0, d["max_positions"], t).to(r.device)
    cos_sin = _cos_sin_cpu(d["rope"], rd, d["max_positions"]).to(r.device)
    return (q, k, positions, cos_sin, bool(d["interleaved"])), {}


def _linear(d: dict, dtype, r: _Draw):
    x = r.randn(d["tokens"], d["in_features"], dtype=dtype)
    w = r.randn(d["out_features"], d["in_features"], dtype=dtype, scale=d["in_features"] ** -0.5)
    bias = r.randn(d["out_features"], dtype=dtype) if d["bias"] else None
    return (x, w, bias), {}


def _fp8_block_linear(d: dict, dtype, r: _Draw):
    block = tuple(d["block"])
    x = r.randn(d["tokens"], d["in_features"], dtype=dtype)
    q, scale = quantize_block_fp8(torch.randn(d["out_features"], d["in_features"], generator=r.gen) / math.sqrt(d["in_features"]), block)
    return (x, q.to(r.device), scale.to(r.device), block), {}


def _silu_and_mul(d: dict, dtype, r: _Draw):
    return (r.randn(d["tokens"], 2 * d["intermediate"], dtype=dtype),), {}


def _moe_route(d: dict, dtype, r: _Draw):
    x = r.randn(d["tokens"], d["hidden"], dtype=dtype)
    gate = r.randn(d["experts"], d["hidden"], scale=d["hidden"] ** -0.5)
    bias = r.randn(d["experts"], scale=0.1) if d.get("bias", True) else None
    return (x, gate, bias), {k: d[k] for k in ROUTE_KEYS}


def _moe_experts(d: dict, dtype, r: _Draw):
    t, hidden, inter, e, k = (d[n] for n in ("tokens", "hidden", "intermediate", "experts", "top_k"))
    x = r.randn(t, hidden, dtype=dtype)
    w13 = torch.randn(e, 2 * inter, hidden, generator=r.gen) / math.sqrt(hidden)
    w2 = torch.randn(e, hidden, inter, generator=r.gen) / math.sqrt(inter)
    block = tuple(d["fp8_block"]) or None
    if block:
        (w13, s13), (w2, s2) = quantize_block_fp8(w13, block), quantize_block_fp8(w2, block)
        s13, s2 = s13.to(r.device), s2.to(r.device)
    else:
        w13, w2, s13, s2 = w13.to(dtype), w2.to(dtype), None, None
    # Some experts receive no token: ids come from a random subset of about 3/4 of them.
    allowed = r.perm(e)[: max(k, e - max(1, e // 4))]
    rows = [allowed[r.perm(len(allowed))[:k]] for _ in range(t)]
    ids = torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.int64)
    weights = torch.randn(t, k, generator=r.gen).softmax(dim=-1)
    return (x, w13.to(r.device), w2.to(r.device), weights.to(r.device), ids.to(r.device), s13, s2, block), {}


def _write_latent_cache(d: dict, dtype, r: _Draw):
    t, entry = d["tokens"], d["kv_lora_rank"] + d["rope_dim"]
    slots_total = d["num_blocks"] * d["block_size"]
    if t > slots_total:
        raise ValueError(f"write_latent_cache: {t} tokens do not fit {slots_total} slots")
    # the cache starts with N(0, 1) entries: rows the op must not touch keep them
    kv_cache = r.randn(d["num_blocks"], d["block_size"], entry, dtype=dtype)
    latent = r.randn(t, d["kv_lora_rank"], dtype=dtype)
    k_pe = r.randn(t, d["rope_dim"], dtype=dtype)
    slots = r.perm(slots_total)[:t]
    padding = r.perm(t)[: min(d["padding_tokens"], t)]
    slots[padding] = -1
    return (kv_cache, latent, k_pe, slots.to(r.device)), {}


def _gather_latent_cache(d: dict, dtype, r: _Draw):
    kv_cache = r.randn(d["num_blocks"], d["block_size"], d["entry_dim"], dtype=dtype)
    slots = r.integers(0, d["num_blocks"] * d["block_size"], d["slots"]).to(r.device)
    return (kv_cache, slots), {}


def _cu_seqlens(lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _mla_prefill_attention(d: dict, dtype, r: _Draw):
    lens_q, lens_k, h, d_qk, d_v = d["seq_lens_q"], d["seq_lens_k"], d["heads"], d["qk_dim"], d["v_dim"]
    if len(lens_q) != len(lens_k) or any(q > k for q, k in zip(lens_q, lens_k)):
        raise ValueError(f"mla_prefill_attention: need len(seq_lens_q) == len(seq_lens_k) and q <= k, got {lens_q} / {lens_k}")
    d_rope = d_qk // 3
    d_nope = d_qk - d_rope
    tq, tk = sum(lens_q), sum(lens_k)
    # As the model makes them: q a view of a wider tensor, k = [k_nope | shared k_pe broadcast
    # over heads], v a view into the [S, H, nope + v] up-projection.
    q = r.randn(tq, h, d_qk + 5, dtype=dtype)[..., :d_qk]
    kv = r.randn(tk, h, d_nope + d_v, dtype=dtype)
    k_pe = r.randn(tk, 1, d_rope, dtype=dtype)
    k = torch.cat([kv[..., :d_nope], k_pe.expand(tk, h, d_rope)], dim=-1)
    v = kv[..., d_nope:]
    return (q, k, v, _cu_seqlens(lens_q, r.device), _cu_seqlens(lens_k, r.device), attention_scale(d["scale"], d_qk)), {}


def _mla_decode_attention(d: dict, dtype, r: _Draw):
    lens, h, d_c, d_r, bs = d["seq_lens"], d["heads"], d["kv_lora_rank"], d["rope_dim"], d["block_size"]
    batch = len(lens)
    # query rows per sequence: 1 (plain decode) unless the shape says otherwise (speculative
    # decoding's 1 + k); each sequence's rows are its newest entries, already in the cache (a
    # row with more rows after it than entries before it, e.g. seq_len 0, attends to nothing)
    query_lens = d.get("query_lens", [1] * batch)
    if len(query_lens) != batch or any(q < 0 for q in query_lens):
        raise ValueError(f"mla_decode_attention: need one query_lens entry >= 0 per sequence, got {query_lens} for seq_lens {lens}")
    rows = sum(query_lens)
    max_blocks = max(1, -(-max(lens, default=1) // bs)) + 1
    num_blocks = 2 * batch * max_blocks + 3
    kv_cache = r.randn(num_blocks, bs, d_c + d_r, dtype=dtype)
    # every other column of a random permutation of the pool: a non-contiguous block table
    pool = r.perm(num_blocks)[: 2 * batch * max_blocks].to(torch.int32)
    block_tables = pool.view(batch, 2 * max_blocks).to(r.device)[:, ::2]
    q_latent = r.randn(rows, h, d_c, dtype=dtype)
    q_pe = r.randn(rows, h, d_r + 3, dtype=dtype)[..., :d_r]  # strided, as the rope output is
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=r.device)
    query_start_loc = _cu_seqlens(query_lens, r.device)
    return (q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, attention_scale(d["scale"], d_c)), {}


def sampling_params(rows: int, greedy_rows: int, device, restrictions=SAMPLING_RESTRICTIONS) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p, seeds, steps): the first greedy_rows rows greedy, the
    others cycling through ``restrictions``."""
    cyc = [restrictions[i % len(restrictions)] for i in range(rows)]
    temperature = torch.tensor([0.0 if i < greedy_rows else c[0] for i, c in enumerate(cyc)], dtype=torch.float32)
    top_k = torch.tensor([c[1] for c in cyc], dtype=torch.int64)
    top_p = torch.tensor([c[2] for c in cyc], dtype=torch.float32)
    min_p = torch.tensor([c[3] for c in cyc], dtype=torch.float32)
    seeds = torch.arange(rows, dtype=torch.int64) * 7919 + 3
    steps = torch.arange(rows, dtype=torch.int64) % 5
    return tuple(t.to(device) for t in (temperature, top_k, top_p, min_p, seeds, steps))


def _sample_tokens(d: dict, dtype, r: _Draw):
    rows, vocab, greedy_rows = d["rows"], d["vocab"], d["greedy_rows"]
    # float32 logits of a `dtype` model: drawn, rounded to the model dtype, upcast
    logits = (torch.randn(rows, vocab, generator=r.gen) * SAMPLING_LOGIT_SCALE).to(dtype).float()
    for row in range(0, greedy_rows, 2):  # ties in greedy rows: the maximum repeated half a row away
        top = int(logits[row].argmax())
        logits[row, (top + vocab // 2) % vocab] = logits[row, top]
    if rows > greedy_rows and vocab > 3:
        logits[greedy_rows:, vocab // 3] = float("-inf")  # a banned token (penalties, min_tokens)
    return (logits.to(r.device), *sampling_params(rows, greedy_rows, r.device)), {}


BUILDERS: dict[str, Callable[[dict, torch.dtype, _Draw], tuple[tuple, dict]]] = {
    "rms_norm": _rms_norm,
    "add_rms_norm": _add_rms_norm,
    "rotary_embedding": _rotary_embedding,
    "linear": _linear,
    "fp8_block_linear": _fp8_block_linear,
    "silu_and_mul": _silu_and_mul,
    "moe_route": _moe_route,
    "moe_experts": _moe_experts,
    "write_latent_cache": _write_latent_cache,
    "gather_latent_cache": _gather_latent_cache,
    "mla_prefill_attention": _mla_prefill_attention,
    "mla_decode_attention": _mla_decode_attention,
    "sample_tokens": _sample_tokens,
}
INPLACE = {"write_latent_cache": (0,)}


def make_case(op: str, dims: dict, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> OpCase:
    """The inputs of one call of ``op`` for the spec shape ``dims``."""
    if op not in BUILDERS:
        raise KeyError(f"no input generator for op {op!r}; the conformance kit knows {', '.join(BUILDERS)}")
    args, kwargs = BUILDERS[op](dims, dtype, _Draw(seed, torch.device(device)))
    return OpCase(op, dict(dims), dtype, args, kwargs, INPLACE.get(op, ()))


# ---- how hypothesis varies a declared shape -----------------------------------------------------
# Only "how many" dimensions vary (tokens, rows, sequence lengths), within the range the spec's
# shapes declare for the op (down to 0 only where the spec has an empty case); the model's
# structural dimensions (hidden sizes, heads, blocks) stay as declared.

COUNT_DIMS = {
    "rms_norm": ("tokens",), "add_rms_norm": ("tokens",), "rotary_embedding": ("tokens",),
    "linear": ("tokens",), "fp8_block_linear": ("tokens",), "silu_and_mul": ("tokens",),
    "moe_route": ("tokens",), "moe_experts": ("tokens",), "write_latent_cache": ("tokens", "padding_tokens"),
    "gather_latent_cache": ("slots",), "sample_tokens": ("rows", "greedy_rows"),
}


def shape_strategy(op: str, declared: list[dict]):
    """A hypothesis strategy over shapes of ``op``: a declared shape with its counts redrawn."""
    from hypothesis import strategies as st

    lowest = {dim: min(s[dim] for s in declared if dim in s) for dim in COUNT_DIMS.get(op, ())}

    def vary(dims: dict):
        if op == "mla_prefill_attention":
            pairs = [
                st.integers(1, q).flatmap(lambda qq, extra=k - q: st.tuples(st.just(qq), st.integers(qq, qq + extra)))
                for q, k in zip(dims["seq_lens_q"], dims["seq_lens_k"])
            ]
            return st.tuples(*pairs).map(lambda ps: {**dims, "seq_lens_q": [p[0] for p in ps], "seq_lens_k": [p[1] for p in ps]})
        if op == "mla_decode_attention":  # query rows 1..declared (0 stays 0), then seq_lens >= query rows
            declared_q = dims.get("query_lens", [1] * len(dims["seq_lens"]))
            pairs = [
                st.integers(min(1, q), q).flatmap(lambda qq, n=n: st.tuples(st.just(qq), st.integers(max(qq, 1), max(qq, n, 1))))
                for q, n in zip(declared_q, dims["seq_lens"])
            ]

            def redrawn(ps):
                out = {**dims, "seq_lens": [p[1] for p in ps]}
                if "query_lens" in dims:
                    out["query_lens"] = [p[0] for p in ps]
                return out

            return st.tuples(*pairs).map(redrawn)
        counts = {dim: st.integers(min(lowest[dim], dims[dim]), dims[dim]) for dim in COUNT_DIMS.get(op, ()) if dim in dims}
        if op == "sample_tokens":  # greedy rows cannot exceed rows
            return st.fixed_dictionaries(counts).map(lambda c: {**dims, **c, "greedy_rows": min(c["greedy_rows"], c["rows"])})
        if op == "write_latent_cache":
            return st.fixed_dictionaries(counts).map(lambda c: {**dims, **c, "padding_tokens": min(c["padding_tokens"], c["tokens"])})
        return st.fixed_dictionaries(counts).map(lambda c: {**dims, **c})

    return st.sampled_from(declared).flatmap(vary)
