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
from deepinfer_core.dtypes import dtype_from_name
from deepinfer_core.models.v41.engram_tables import engram_multipliers, engram_offsets, engram_primes
from deepinfer_core.ops.kv_record import ROW_DIM, quantize_v4_records
from deepinfer_core.ops.rope import rope_cos_sin_table
from deepinfer_core.ops.sparse import MAX_KEY_POOLS

NORM_EPS = 1e-6
HEAD_ROW_EXTRA = 24  # columns past the heads in a per-head input's rows (the model's kv_a part, shrunk)
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
        """How many elements the tensor arguments hold (the case's size; a tuple of tensors, as
        sparse_attention's key pools, counts its tensors)."""
        values = [*self.args, *self.kwargs.values()]
        return sum(t.numel() for v in values for t in tensors_of(v))


def tensors_of(value) -> tuple[torch.Tensor, ...]:
    """The tensors an argument holds: itself, or a tuple / list's tensors (sparse_attention's key pools)."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)):
        return tuple(v for v in value if isinstance(v, torch.Tensor))
    return ()


def _clone(value):
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_clone(v) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    return out.copy_(value)


class CaseTooLarge(ValueError):
    """A case's inputs would hold, or take to draw, more values than ``make_case``'s ``max_elements``."""


class _Draw:
    """Seeded CPU draws moved to the target device. With ``max_elements``, a draw that would take
    the values drawn past it raises CaseTooLarge instead, so a real-model case is refused before
    its weights are drawn."""

    def __init__(self, seed: int, device: torch.device, max_elements: int | None = None):
        self.gen = torch.Generator().manual_seed(seed)
        self.device = device
        self.left = max_elements

    def normal(self, *shape) -> torch.Tensor:
        """N(0, 1) float32 on the CPU (values a builder computes with before moving them)."""
        if self.left is not None:
            self.left -= math.prod(shape)
            if self.left < 0:
                raise CaseTooLarge("too many values drawn")
        return torch.randn(*shape, generator=self.gen)

    def randn(self, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
        return (self.normal(*shape) * scale).to(device=self.device, dtype=dtype)

    def bytes(self, *shape, low: int = 0, high: int = 256) -> torch.Tensor:
        """uint8 in [low, high) on the CPU, counted against ``max_elements`` as ``normal``'s values."""
        if self.left is not None:
            self.left -= math.prod(shape)
            if self.left < 0:
                raise CaseTooLarge("too many values drawn")
        return torch.randint(low, high, shape, generator=self.gen, dtype=torch.uint8)

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


def _head_rows(r: _Draw, tokens: int, heads: int, width: int, dtype) -> torch.Tensor:
    """[tokens, heads, width], each token's heads the head part of a wider row (the model's q is
    the first columns of [q | latent | k_pe]): stride(0) = heads * width + HEAD_ROW_EXTRA."""
    return r.randn(tokens, heads * width + HEAD_ROW_EXTRA, dtype=dtype)[:, : heads * width].view(tokens, heads, width)


def _rotary_embedding(d: dict, dtype, r: _Draw):
    t, h, rd = d["tokens"], d["heads"], d["rope_dim"]
    # q as the model passes it: the rope part of a wider per-head projection, whose rows are
    # wider still (the stacked q | kv_a output): a strided view with stride(0) != H * stride(1)
    q = _head_rows(r, t, h, rd + 16, dtype)[..., 16:]
    k = r.randn(t, rd, dtype=dtype)
    positions = r.integers(0, d["max_positions"], t).to(r.device)
    cos_sin = _cos_sin_cpu(d["rope"], rd, d["max_positions"]).to(r.device)
    return (q, k, positions, cos_sin, bool(d["interleaved"])), {}


def _linear(d: dict, dtype, r: _Draw):
    x = r.randn(d["tokens"], d["in_features"], dtype=dtype)
    w = r.randn(d["out_features"], d["in_features"], dtype=dtype, scale=d["in_features"] ** -0.5)
    bias = r.randn(d["out_features"], dtype=dtype) if d["bias"] else None
    return (x, w, bias), {}


def _head_linear(d: dict, dtype, r: _Draw):
    t, h, k, n = d["tokens"], d["heads"], d["in_features"], d["out_features"]
    x = _head_rows(r, t, h, k + 8, dtype)[..., :k]  # a strided view, as the model's q_nope
    if d["transposed_weight"]:  # W_UK^T: a transposed view of [H, K, N]
        weight = r.randn(h, k, n, dtype=dtype, scale=k ** -0.5).transpose(1, 2)
    else:
        weight = r.randn(h, n, k, dtype=dtype, scale=k ** -0.5)
    return (x, weight), {}


def _fp8_block_linear(d: dict, dtype, r: _Draw):
    block = tuple(d["block"])
    x = r.randn(d["tokens"], d["in_features"], dtype=dtype)
    q, scale = quantize_block_fp8(r.normal(d["out_features"], d["in_features"]) / math.sqrt(d["in_features"]), block)
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
    if d.get("mxfp4"):
        (w13, s13), (w2, s2) = _mxfp4(r, (e, 2 * inter, hidden), hidden**-0.5), _mxfp4(r, (e, hidden, inter), inter**-0.5)
    else:
        w13 = r.normal(e, 2 * inter, hidden) / math.sqrt(hidden)
        w2 = r.normal(e, hidden, inter) / math.sqrt(inter)
        w13, w2, s13, s2 = _expert_weights(d, w13, w2, dtype, r)
    weights, ids = _expert_routes(t, e, k, r)
    return (x, w13, w2, weights, ids, s13, s2, tuple(d["fp8_block"]) or None), {}


def _expert_weights(d: dict, w13: torch.Tensor, w2: torch.Tensor, dtype, r: _Draw):
    """(w13, w2, their scales or None) on the device: block-FP8 when the shape names a block."""
    block = tuple(d["fp8_block"]) or None
    if block:
        (w13, s13), (w2, s2) = quantize_block_fp8(w13, block), quantize_block_fp8(w2, block)
        s13, s2 = s13.to(r.device), s2.to(r.device)
    else:
        w13, w2, s13, s2 = w13.to(dtype), w2.to(dtype), None, None
    return w13.to(r.device), w2.to(r.device), s13, s2


# E2M1 codes drawn uniformly: their values' root mean square (sqrt of the mean of 0, 0.25, 1,
# 2.25, 4, 9, 16, 36) is 2.93, so a block's scale 2^e puts its weights' rms at 2.93 * 2^e.
E2M1_UNIFORM_RMS = 2.93


def _mxfp4(r: _Draw, shape: tuple[int, ...], std: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 expert weights of logical ``shape`` [..., N, K] on the device, as DeepSeek-V4 stores
    them (ops.moe.moe_experts' packed convention): random codes two a byte (uint8 [..., N, K/2]),
    and UE8M0 scales (uint8 [..., N, ceil(K/32)]) spread over +-1 binade around the scale
    that gives the weights a root mean square of ``std`` (a weight ~ N(0, std^2)'s scale)."""
    *lead, n, k = shape
    centre = 127 + round(math.log2(std / E2M1_UNIFORM_RMS))
    codes = r.bytes(*lead, n, k // 2)
    scales = r.bytes(*lead, n, -(-k // 32), low=centre - 1, high=centre + 2)
    return codes.to(r.device), scales.to(r.device)


def _expert_routes(t: int, e: int, k: int, r: _Draw) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [t, k], ids [t, k]) on the device. Some experts receive no token: ids come from a
    random subset of about 3/4 of them."""
    allowed = r.perm(e)[: max(k, e - max(1, e // 4))]
    rows = [allowed[r.perm(len(allowed))[:k]] for _ in range(t)]
    ids = torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.int64)
    weights = r.normal(t, k).softmax(dim=-1)
    return weights.to(r.device), ids.to(r.device)


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


def _norm_rope_write_latent(d: dict, dtype, r: _Draw):
    t, h, d_c, rd = d["tokens"], d["heads"], d["kv_lora_rank"], d["rope_dim"]
    (kv_cache, _, _, slots), _ = _write_latent_cache(d, dtype, r)
    kv = r.randn(t, 16 + d_c + rd, dtype=dtype)[:, 16:]  # [latent | k_pe] of the stacked projection's rows
    w = (1 + r.randn(d_c, scale=0.1)).to(dtype)
    q_pe = _head_rows(r, t, h, rd + 16, dtype)[..., 16:]
    positions = r.integers(0, d["max_positions"], t).to(r.device)
    cos_sin = _cos_sin_cpu(d["rope"], rd, d["max_positions"]).to(r.device)
    return (kv_cache, kv, w, NORM_EPS, q_pe, positions, cos_sin, bool(d["interleaved"]), slots), {}


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
    logits = (r.normal(rows, vocab) * SAMPLING_LOGIT_SCALE).to(dtype).float()
    for row in range(0, greedy_rows, 2):  # ties in greedy rows: the maximum repeated half a row away
        top = int(logits[row].argmax())
        logits[row, (top + vocab // 2) % vocab] = logits[row, top]
    if rows > greedy_rows and vocab > 3:
        logits[greedy_rows:, vocab // 3] = float("-inf")  # a banned token (penalties, min_tokens)
    return (logits.to(r.device), *sampling_params(rows, greedy_rows, r.device)), {}


def _apply_token_bitmask(d: dict, dtype, r: _Draw):
    rows, vocab, words, free, single = d["rows"], d["vocab"], d["words"], d["free_rows"], d["single_rows"]
    if words * 32 < vocab:
        raise ValueError(f"apply_token_bitmask {d}: {words} words of 32 bits do not cover the vocabulary")
    free = min(free, rows)  # (hypothesis redraws the counts independently)
    single = min(single, rows - free)
    logits = (r.normal(rows, vocab) * SAMPLING_LOGIT_SCALE).to(dtype).float()
    if vocab > 3:
        logits[:, vocab // 3] = float("-inf")  # already banned (penalties, min_tokens)
    allowed = r.normal(rows, words * 32) > 0
    allowed[:free] = True
    for row in range(free, free + single):
        allowed[row] = False
        allowed[row, (row * 7919) % vocab] = True
    # pack 32 booleans per word, least significant bit first, as int32 (bit 31 is the sign)
    weights = torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int64)
    bitmask = (allowed.view(rows, words, 32).long() * weights).sum(-1).to(torch.int32)
    return (logits.to(r.device), bitmask.to(r.device)), {}


# ---- DeepSeek-V4 ops ----------------------------------------------------------------------------

HC_EPS = 1e-6  # mHC's hc_eps (V4-Flash / V4-Pro)
V4_ROUTE_KEYS = ("top_k", "norm_topk_prob", "routed_scaling_factor")


def _v4_norm_weight(n: int, r: _Draw) -> torch.Tensor:
    """A V4 norm weight as transformers holds it: float32 of a bf16 checkpoint value (~1 + 0.1 N(0, 1))."""
    return (1 + r.randn(n, scale=0.1)).to(torch.bfloat16).float()


def _rms_norm_f32(d: dict, dtype, r: _Draw):
    # a strided view, as rms_norm's case (the kernel must not assume a contiguous row stride)
    x = r.randn(d["tokens"], d["hidden"] + 8, dtype=dtype)[:, : d["hidden"]]
    return (x, _v4_norm_weight(d["hidden"], r), NORM_EPS), {}


def _rms_normalize(d: dict, dtype, r: _Draw):
    return (r.randn(d["tokens"], d["heads"], d["head_dim"], dtype=dtype), NORM_EPS), {}


def _silu_and_mul_clamped(d: dict, dtype, r: _Draw):
    # input_std > limit: a good part of gate and up lies beyond the clamp
    return (r.randn(d["tokens"], 2 * d["intermediate"], dtype=dtype, scale=d["input_std"]), float(d["limit"])), {}


def _distinct_rows(r: _Draw, rows: int, pool: int, k: int) -> torch.Tensor:
    """[rows, k] int64: each row k distinct values of [0, pool)."""
    if rows == 0:
        return torch.empty(0, k, dtype=torch.int64)
    return torch.stack([r.perm(pool)[:k] for _ in range(rows)])


def _moe_route_sqrtsoftplus(d: dict, dtype, r: _Draw):
    t, hidden, e, k = d["tokens"], d["hidden"], d["experts"], d["top_k"]
    x = r.randn(t, hidden, dtype=dtype)
    # the gate weight in the compute dtype (V4 checkpoints store it bf16; the op upcasts it), the
    # correction bias float32
    gate = r.randn(e, hidden, dtype=dtype, scale=hidden**-0.5)
    bias = r.randn(e, scale=0.1) if d["bias"] else None
    fixed = _distinct_rows(r, t, e, k).to(r.device) if d["hash"] else None
    return (x, gate, bias, fixed), {key: d[key] for key in V4_ROUTE_KEYS}


def _moe_experts_clamped(d: dict, dtype, r: _Draw):
    t, hidden, inter, e, k = (d[n] for n in ("tokens", "hidden", "intermediate", "experts", "top_k"))
    std = float(d["gate_up_std"])
    x = r.randn(t, hidden, dtype=dtype)
    # gate and up ~ N(0, gate_up_std^2): beyond the limit where gate_up_std is large; the down
    # projection scaled by 1 / gate_up_std^2 keeps the outputs O(1)
    if d.get("mxfp4"):
        w13, s13 = _mxfp4(r, (e, 2 * inter, hidden), std / math.sqrt(hidden))
        w2, s2 = _mxfp4(r, (e, hidden, inter), 1 / (math.sqrt(inter) * max(1.0, std) ** 2))
    else:
        w13 = r.normal(e, 2 * inter, hidden) * (std / math.sqrt(hidden))
        w2 = r.normal(e, hidden, inter) / (math.sqrt(inter) * max(1.0, std) ** 2)
        w13, w2, s13, s2 = _expert_weights(d, w13, w2, dtype, r)
    weights, ids = _expert_routes(t, e, k, r)
    return (x, w13, w2, weights, ids, float(d["limit"]), s13, s2, tuple(d["fp8_block"]) or None), {}


def _mhc_params(r: _Draw, outputs: int, fan_in: int, scales: int):
    """fn ~ N(0, 1) / sqrt(hc D) (the mixes M come out ~N(0, 1)), base ~ 0.1 N(0, 1), scale ~ 1 + 0.1 N(0, 1); float32."""
    fn = r.randn(outputs, fan_in, scale=fan_in**-0.5)
    return fn, r.randn(outputs, scale=0.1), 1 + r.randn(scales, scale=0.1)


def _mhc_pre(d: dict, dtype, r: _Draw):
    t, hc, hidden = d["tokens"], d["hc"], d["hidden"]
    x = r.randn(t, hc, hidden, dtype=dtype)
    fn, base, scale = _mhc_params(r, (2 + hc) * hc, hc * hidden, 3)
    return (x, fn, base, scale), {"hc_eps": HC_EPS, "rms_eps": NORM_EPS, "sinkhorn_iters": d["sinkhorn_iters"]}


def _mhc_post(d: dict, dtype, r: _Draw):
    t, hc, hidden = d["tokens"], d["hc"], d["hidden"]
    out = r.randn(t, hidden, dtype=dtype)
    x = r.randn(t, hc, hidden, dtype=dtype)
    # coefficients as mhc_pre makes them: post in (0, 2), comb close to doubly stochastic
    post = 2 * torch.sigmoid(r.normal(t, hc))
    comb = r.normal(t, hc, hc).softmax(dim=-1)
    for _ in range(3):
        comb = comb / comb.sum(dim=-2, keepdim=True)
        comb = comb / comb.sum(dim=-1, keepdim=True)
    return (out, x, post.to(r.device), comb.to(r.device)), {}


def _mhc_head(d: dict, dtype, r: _Draw):
    t, hc, hidden = d["tokens"], d["hc"], d["hidden"]
    x = r.randn(t, hc, hidden, dtype=dtype)
    fn, base, scale = _mhc_params(r, hc, hc * hidden, 1)
    return (x, fn, base, scale), {"hc_eps": HC_EPS, "rms_eps": NORM_EPS}


def _write_cache(d: dict, dtype, r: _Draw):
    t = d["tokens"]
    slots_total = d["num_blocks"] * d["block_size"]
    if t > slots_total:
        raise ValueError(f"write_cache: {t} tokens do not fit {slots_total} slots")
    cache_dtype = dtype if d.get("cache_dtype", "model") == "model" else dtype_from_name(d["cache_dtype"])
    # the cache starts with N(0, 1) entries: rows the op must not touch keep them
    cache = r.randn(d["num_blocks"], d["block_size"], d["entry_dim"], dtype=cache_dtype)
    if d.get("kv_record", False):  # V4 FP8 records of such rows (kv_cache_dtype="fp8"): the write quantises
        if d["entry_dim"] != ROW_DIM:
            raise ValueError(f"write_cache: kv_record caches hold {ROW_DIM}-wide rows, got entry_dim {d['entry_dim']}")
        cache = quantize_v4_records(cache.view(-1, ROW_DIM))  # [N, 584] in whole pages of 64 rows (padding rows after N)
    values = r.randn(t, d["entry_dim"], dtype=dtype)
    slots = r.perm(slots_total)[:t]
    slots[r.perm(t)[: min(d["padding_tokens"], t)]] = -1
    return (cache, values, slots.to(r.device)), {}


def _compress_pool(d: dict, dtype, r: _Draw):
    n, s, c = d["windows"], d["slots"], d["channels"]
    if d["empty_windows"] > n:
        raise ValueError(f"compress_pool: {d['empty_windows']} empty windows of {n}")
    kv = r.randn(n, s, c, dtype=dtype)
    # gate logits ~ N(0, 1) plus a learned per-(slot, channel) position bias ~ N(0, 1), float32
    score = r.normal(n, s, c) + r.normal(s, c)
    # a sequence's first CSA window has no previous window: its first half of slots is empty
    # (-inf), the kv there arbitrary (here N(0, 1): weight 0 must make it irrelevant)
    score[r.perm(n)[: d["empty_windows"]], : s // 2] = float("-inf")
    return (kv, score.to(r.device), _v4_norm_weight(c, r).to(r.device), NORM_EPS), {}


def _compress_entries(d: dict, dtype, r: _Draw):
    n, t, s, m, dim, rd = (d[k] for k in ("entries", "tokens", "state_rows", "ratio", "dim", "rope_dim"))
    overlap = bool(d["overlap"])
    span, width = (2 * m, 4 * dim) if overlap else (m, 2 * dim)  # width: [kv | gate] of the op's rows
    off, row = d["col_offset"], d["row_width"]
    if t + s < span or off + width > row or d["first_windows"] > n:
        raise ValueError(f"compress_entries: need tokens + state_rows >= span ({span}), col_offset + {width} <= "
                         f"row_width and first_windows <= entries, got {d}")

    def pool(count: int) -> torch.Tensor:
        """[count, R] float32 rows as the model keeps them: kv values of the compute dtype (its
        projection's output), gate logits + position bias float32; a column slice of wider rows
        (the CSA layers' compressor and indexer parts share one row)."""
        wide = r.normal(count, row)
        wide[:, off : off + width // 2] = wide[:, off : off + width // 2].to(dtype).float()
        wide[:, off + width // 2 : off + width] += r.normal(count, width // 2)
        return wide.to(r.device)[:, off : off + width]

    rows, state = pool(t), pool(s)
    # each window names span distinct rows of the concatenation; a sequence's first window has
    # no previous one (its first half empty), gappy windows lose random slots (never the last:
    # the closing token's own row)
    windows = torch.stack([r.perm(t + s)[:span] for _ in range(n)]) if n else torch.empty(0, span, dtype=torch.int64)
    order = r.perm(n)
    first, rest = order[: d["first_windows"]], order[d["first_windows"] :][: d["gappy_windows"]]
    windows[first, : span // 2] = -1
    if rest.numel():
        gaps = r.integers(0, 2, rest.numel(), span).bool()
        gaps[:, -1] = False
        windows[rest] = windows[rest].masked_fill(gaps, -1)
    positions = r.integers(0, d["max_positions"] // m, n) * m  # an entry's first position
    cos_sin = _cos_sin_cpu(d["rope"], rd, d["max_positions"]).to(r.device)
    return (rows, state, windows.to(r.device), positions.to(r.device), _v4_norm_weight(dim, r).to(r.device), NORM_EPS,
            cos_sin, overlap, dtype), {}


def _padded_rows(r: _Draw, counts: list[int], width: int, pool: int) -> torch.Tensor:
    """[len(counts), width] int64: row i has counts[i] distinct rows of [0, pool) at random
    positions, -1 elsewhere."""
    out = torch.full((len(counts), width), -1, dtype=torch.int64)
    for i, n in enumerate(counts):
        out[i, r.perm(width)[:n]] = r.perm(pool)[:n]
    return out


def _indexer_topk(d: dict, dtype, r: _Draw):
    t, h, di, pool, c, k = (d[n] for n in ("tokens", "heads", "head_dim", "pool", "candidates", "top_k"))
    short = d["short_queries"]
    if c > pool or short > t:
        raise ValueError(f"indexer_topk: need candidates <= pool and short_queries <= tokens, got {d}")
    width = min(k, c)
    # short queries have fewer valid candidates than the output is wide (their output has -1s;
    # one of them none at all), the others between that width and all C
    counts = [int(r.integers(width, c + 1)) for _ in range(t)]
    for j, i in enumerate(r.perm(t)[:short].tolist()):
        counts[i] = 0 if j == 0 else int(r.integers(0, max(width, 1)))
    q = r.randn(t, h, di, dtype=dtype)
    weights = r.randn(t, h, scale=h**-0.5)  # weights_proj(x) * n_heads^-0.5, float32
    # exact ties: tied queries weigh every head negatively, so a candidate whose dot products the
    # ReLU zeroes in every head scores 0 (-0.0 where a sum starts from its first term) and those
    # are its best; duplicate key rows tie at any score
    tied = r.perm(t)[: min(d["tied_queries"], t)]
    weights[tied] = -weights[tied].abs()
    keys = r.randn(pool, di, dtype=dtype)
    dup = min(d["duplicate_keys"], pool // 2)
    if dup:
        rows = r.perm(pool)
        keys[rows[:dup]] = keys[rows[dup : 2 * dup]]
    candidates = _padded_rows(r, counts, c, pool)
    return (q, weights, keys, candidates.to(r.device), k, di**-0.5), {}


def _sparse_attention(d: dict, dtype, r: _Draw):
    t, h, dim, pool, k, empty = (d[n] for n in ("tokens", "heads", "head_dim", "pool", "keys", "empty_queries"))
    if k > pool or empty > t:
        raise ValueError(f"sparse_attention: need keys <= pool and empty_queries <= tokens, got {d}")
    if not 1 <= d.get("pools", 1) <= MAX_KEY_POOLS:
        raise ValueError(f"sparse_attention: pools must be 1 to {MAX_KEY_POOLS}, got {d}")
    sizes = d.get("pool_sizes")
    if sizes is not None and (len(sizes) != d.get("pools", 1) or sum(sizes) != pool or min(sizes) < 0):
        raise ValueError(f"sparse_attention: pool_sizes must be pools counts >= 0 summing to pool, got {d}")
    # queries name 1..K keys each (the first non-empty one all K), empty_queries none at all
    counts = [int(r.integers(1, k + 1)) if k else 0 for _ in range(t)]
    empty_rows = set(r.perm(t)[:empty].tolist())
    full = [i for i in range(t) if i not in empty_rows][:1]
    for i in range(t):
        counts[i] = 0 if i in empty_rows else (k if i in full else counts[i])
    q = r.randn(t, h, dim, dtype=dtype)
    kv = r.randn(pool, dim, dtype=dtype)
    sinks = r.randn(h)
    indices = _padded_rows(r, counts, k, pool)
    records = d.get("kv_record", False)  # V4 FP8 record caches of the same rows (kv_cache_dtype="fp8")
    if records and dim != ROW_DIM:
        raise ValueError(f"sparse_attention: kv_record pools hold {ROW_DIM}-wide rows, got head_dim {dim}")
    # drawn after everything else: the same q, pool rows and (remapped) indices as with one pool
    bounds = _split_bounds(r, pool, d.get("pools", 1), d.get("pool_sizes"))
    if records:  # each pool a record cache of whole pages: a row's index moves past the pages' padding rows
        parts = [quantize_v4_records(kv[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
        shift = torch.zeros(pool + 1, dtype=torch.int64)
        start = 0
        for (lo, hi), p in zip(zip(bounds, bounds[1:]), parts):
            shift[lo:hi] = start - lo
            start += p.shape[0]
        indices = torch.where(indices >= 0, indices + shift[indices.clamp(min=0)], indices)
        kv = parts[0] if len(parts) == 1 else tuple(parts)
    elif len(bounds) > 2:
        kv = _split_pool(kv, bounds)
    return (q, kv, indices.to(r.device), sinks, dim**-0.5), {}


def _split_bounds(r: _Draw, n: int, parts: int, sizes: list[int] | None = None) -> list[int]:
    """Row bounds [0, ..., n] of ``parts`` consecutive pools of ``sizes`` rows, or of random
    sizes with one of them forced empty in most draws (an SWA layer has no compressed entries;
    a middle pool may be empty). One pool draws nothing."""
    if parts == 1:
        return [0, n]
    bounds = [0, *sorted(int(c) for c in r.integers(0, n + 1, parts - 1)), n]
    empty = int(r.integers(0, 2 * parts))  # >= parts (half the draws): none forced empty
    if empty == parts - 1:
        bounds[empty] = n
    elif empty < parts:
        bounds[empty + 1] = bounds[empty]
    if sizes is not None:
        bounds = [sum(sizes[:i]) for i in range(parts + 1)]
    return bounds


def _split_pool(kv: torch.Tensor, bounds: list[int]) -> tuple[torch.Tensor, ...]:
    """``kv`` [N, d] cut at ``bounds`` as the model passes its pools: pool 0 contiguous (the new
    rows), the others row-strided views of wider rows (row stride d + HEAD_ROW_EXTRA)."""
    dim = kv.shape[1]
    out = []
    for i in range(len(bounds) - 1):
        rows = kv[bounds[i] : bounds[i + 1]]
        if i:
            wide = torch.zeros(rows.shape[0], dim + HEAD_ROW_EXTRA, dtype=kv.dtype, device=kv.device)
            wide[:, :dim] = rows
            out.append(wide[:, :dim])
        else:
            out.append(rows.clone())
    return tuple(out)


# ---- DeepSeek-V4.1 ops --------------------------------------------------------------------------

V41_RMS_EPS = 1e-20  # V4.1-Flash's rms_norm_eps: mHC's mixes and the Engram gate use it
ENGRAM_TINY = 2.0**-22  # the one shared channel of a tiny-dot stream: x 1, key +-2^-22 (exact in every dtype)


def _pre_weights(r: _Draw, t: int, hc: int, one_hot: int) -> torch.Tensor:
    """[t, hc] float32 collapse weights as a sublayer's pre comes out of mHC (sigmoid(N(0, 1)) +
    hc_eps), ``one_hot`` random tokens one-hot on stream 0 (what the first layer collapses with)."""
    if one_hot > t:
        raise ValueError(f"{one_hot} one-hot tokens of {t}")
    w = torch.sigmoid(r.normal(t, hc)) + HC_EPS
    rows = r.perm(t)[:one_hot]
    w[rows] = 0.0
    w[rows, 0] = 1.0
    return w.to(r.device)


def _mhc_pre_delayed(d: dict, dtype, r: _Draw):
    t, hc, hidden = d["tokens"], d["hc"], d["hidden"]
    x = r.randn(t, hc, hidden, dtype=dtype)
    pre_in = _pre_weights(r, t, hc, d["one_hot_tokens"])
    fn, base, scale = _mhc_params(r, (2 + hc) * hc, hc * hidden, 3)
    return (x, pre_in, fn, base, scale), {"hc_eps": HC_EPS, "rms_eps": V41_RMS_EPS, "sinkhorn_iters": d["sinkhorn_iters"]}


def _mhc_collapse(d: dict, dtype, r: _Draw):
    t, hc, hidden = d["tokens"], d["hc"], d["hidden"]
    x = r.randn(t, hc, hidden, dtype=dtype)
    return (x, _pre_weights(r, t, hc, d["one_hot_tokens"])), {}


def _visible_prefixes(r: _Draw, t: int, empty: int, c: int, bs: int, top: int) -> list[int]:
    """How many entries each of t queries sees (a prefix of the C columns): ``empty`` random
    queries none, the others first the lengths where the block rule changes (all C; exactly
    ``top`` blocks; one entry past them; a random block boundary; one entry; each once, those
    within C), then uniform in [1, C]."""
    nb = -(-c // bs)
    special = [c, top * bs, top * bs + 1, bs * int(r.integers(1, nb + 1)), 1]
    special = list(dict.fromkeys(min(max(n, 1), c) for n in special))  # in order, once each
    lengths = [0] * t
    order = r.perm(t).tolist()
    for j, i in enumerate(order[empty:]):
        lengths[i] = special[j] if j < len(special) else int(r.integers(1, c + 1))
    return lengths


def _indexer_block_candidates(d: dict, dtype, r: _Draw):
    t, h, di, pool, c = (d[n] for n in ("tokens", "heads", "head_dim", "pool", "candidates"))
    bs, top, empty = d["candidate_block_size"], d["candidate_topk_blocks"], d["empty_queries"]
    if not 0 < c <= pool or empty > t or bs < 1 or top < 1:
        raise ValueError(f"indexer_block_candidates: need 0 < candidates <= pool, empty_queries <= tokens and block size, top blocks >= 1, got {d}")
    lengths = _visible_prefixes(r, t, empty, c, bs, top)
    q = r.randn(t, h, di, dtype=dtype)
    weights = r.randn(t, h, scale=h**-0.5)  # as indexer_topk's: both signs (one head: many exact-0 block scores)
    keys = r.randn(pool, di, dtype=dtype)
    # column j = the query's entry j, held at a random row of the pool (its own sequence's
    # layout); the query sees its first lengths[i] entries, -1 after them
    candidates = torch.full((t, c), -1, dtype=torch.int64)
    for i, n in enumerate(lengths):
        candidates[i, :n] = r.perm(pool)[:n]
    return (q, weights, keys, candidates.to(r.device), di**-0.5, bs, top), {}


@functools.lru_cache(maxsize=8)
def _engram_tables(engram_vocab: int, layers: tuple[int, ...], layer: int, max_ngram: int, heads: int,
                   compressed_vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(multipliers [n], primes [n-1, H], offsets [(n-1) H]) int64 of one Engram layer, as the model builds them."""
    if layer not in layers:
        raise ValueError(f"engram layer {layer} is not one of the engram layers {list(layers)}")
    primes = engram_primes(engram_vocab, layers, max_ngram, heads)[layer]
    return (torch.tensor(engram_multipliers(layer, compressed_vocab, max_ngram), dtype=torch.int64),
            torch.tensor(primes, dtype=torch.int64), torch.tensor(engram_offsets(primes), dtype=torch.int64))


def _engram_hash_ids(d: dict, dtype, r: _Draw):
    t, n, vocab, pad, blocked = d["tokens"], d["max_ngram"], d["compressed_vocab"], d["pad_id"], d["blocked_tokens"]
    if n < 2 or not 0 <= pad < vocab or blocked > t:
        raise ValueError(f"engram_hash_ids: need max_ngram >= 2, 0 <= pad_id < compressed_vocab, blocked_tokens <= tokens, got {d}")
    mult, primes, offsets = _engram_tables(d["engram_vocab"], tuple(d["layers"]), d["layer"], n, d["heads"], vocab)
    # ids < the compressed vocabulary (the multipliers' precondition), the extremes included: one
    # token of the largest id throughout (products just below 2^63), one of id 0
    ids = r.integers(0, vocab, t, n)
    rows = r.perm(t)
    ids[rows[:1]] = vocab - 1
    ids[rows[1:2]] = 0
    # blocked tokens keep their first `depth` columns, -1 after (first a token at position 0:
    # depth 1, then a dead token: depth 0, then any depth < n)
    for j, i in enumerate(r.perm(t)[:blocked].tolist()):
        depth = (1, 0)[j] if j < 2 else int(r.integers(0, n))
        ids[i, depth:] = -1
    dev = r.device  # copies: the cached tables are never handed out themselves
    return (ids.to(dev), *(table.clone().to(dev) for table in (mult, primes, offsets)), pad), {}


def _engram_gate(d: dict, dtype, r: _Draw):
    t, hc, hidden, tiny = d["tokens"], d["hc"], d["hidden"], d["tiny_streams"]
    if tiny > t * hc or (tiny and hidden < 3):
        raise ValueError(f"engram_gate: {tiny} tiny streams of {t} tokens x {hc} streams (hidden >= 3 for them)")
    x = r.normal(t, hc, hidden)
    kv = r.normal(t, (hc + 1) * hidden)  # W_ekv's output: hc keys | the value
    q_weight, k_weight = (1 + r.normal(hc, hidden) * 0.1 for _ in range(2))
    # Tiny streams: x_k and key_k share one channel (x 1, key +-2^-22 or 0) and are exactly 0
    # on each other's other channels, so dot_k is exact in any summation order: below the 1e-6
    # floor with a sure sign, or exactly 0 (gate 1/2)
    for j, p in enumerate(r.perm(t * hc)[:tiny].tolist()):
        i, k = divmod(p, hc)
        ch = r.perm(hidden)
        key = kv[i, k * hidden : (k + 1) * hidden]
        x[i, k, ch[1::2]] = 0.0
        key[ch[2::2]] = 0.0
        x[i, k, ch[0]] = 1.0
        key[ch[0]] = (ENGRAM_TINY, -ENGRAM_TINY, 0.0)[j % 3]
    dev = r.device
    return (x.to(dev, dtype), kv.to(dev, dtype), q_weight.to(dev, dtype), k_weight.to(dev, dtype), V41_RMS_EPS), {}


BUILDERS: dict[str, Callable[[dict, torch.dtype, _Draw], tuple[tuple, dict]]] = {
    "rms_norm": _rms_norm,
    "add_rms_norm": _add_rms_norm,
    "rotary_embedding": _rotary_embedding,
    "linear": _linear,
    "fp8_block_linear": _fp8_block_linear,
    "head_linear": _head_linear,
    "silu_and_mul": _silu_and_mul,
    "moe_route": _moe_route,
    "moe_experts": _moe_experts,
    "write_latent_cache": _write_latent_cache,
    "norm_rope_write_latent": _norm_rope_write_latent,
    "gather_latent_cache": _gather_latent_cache,
    "mla_prefill_attention": _mla_prefill_attention,
    "mla_decode_attention": _mla_decode_attention,
    "sample_tokens": _sample_tokens,
    "apply_token_bitmask": _apply_token_bitmask,
    "rms_norm_f32": _rms_norm_f32,
    "rms_normalize": _rms_normalize,
    "silu_and_mul_clamped": _silu_and_mul_clamped,
    "moe_route_sqrtsoftplus": _moe_route_sqrtsoftplus,
    "moe_experts_clamped": _moe_experts_clamped,
    "mhc_pre": _mhc_pre,
    "mhc_post": _mhc_post,
    "mhc_head": _mhc_head,
    "write_cache": _write_cache,
    "compress_pool": _compress_pool,
    "compress_entries": _compress_entries,
    "indexer_topk": _indexer_topk,
    "sparse_attention": _sparse_attention,
    "mhc_pre_delayed": _mhc_pre_delayed,
    "mhc_collapse": _mhc_collapse,
    "indexer_block_candidates": _indexer_block_candidates,
    "engram_hash_ids": _engram_hash_ids,
    "engram_gate": _engram_gate,
}
INPLACE = {"write_latent_cache": (0,), "norm_rope_write_latent": (0,), "write_cache": (0,)}


def make_case(op: str, dims: dict, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
              max_elements: int | None = None) -> OpCase:
    """The inputs of one call of ``op`` for the spec shape ``dims``. CaseTooLarge when building
    them would draw, or they would hold, more than ``max_elements`` values (None: no limit; a
    strided view is drawn whole, so it may draw more values than it holds)."""
    if op not in BUILDERS:
        raise KeyError(f"no input generator for op {op!r}; the conformance kit knows {', '.join(BUILDERS)}")
    too_large = f"{op} {dims}: inputs of more than max_elements = {max_elements} values"
    try:
        args, kwargs = BUILDERS[op](dims, dtype, _Draw(seed, torch.device(device), max_elements))
    except CaseTooLarge as e:
        raise CaseTooLarge(too_large) from e
    case = OpCase(op, dict(dims), dtype, args, kwargs, INPLACE.get(op, ()))
    if max_elements is not None and case.elements() > max_elements:
        raise CaseTooLarge(f"{too_large} ({case.elements()})")
    return case


# ---- how hypothesis varies a declared shape -----------------------------------------------------
# Only "how many" dimensions vary (tokens, rows, sequence lengths), within the range the spec's
# shapes declare for the op (down to 0 only where the spec has an empty case); the model's
# structural dimensions (hidden sizes, heads, blocks) stay as declared.

COUNT_DIMS = {
    "rms_norm": ("tokens",), "add_rms_norm": ("tokens",), "rotary_embedding": ("tokens",),
    "linear": ("tokens",), "fp8_block_linear": ("tokens",), "head_linear": ("tokens",), "silu_and_mul": ("tokens",),
    "moe_route": ("tokens",), "moe_experts": ("tokens",), "write_latent_cache": ("tokens", "padding_tokens"),
    "norm_rope_write_latent": ("tokens", "padding_tokens"),
    "gather_latent_cache": ("slots",), "sample_tokens": ("rows", "greedy_rows"),
    "apply_token_bitmask": ("rows", "free_rows", "single_rows"),
    "rms_norm_f32": ("tokens",), "rms_normalize": ("tokens",), "silu_and_mul_clamped": ("tokens",),
    "moe_route_sqrtsoftplus": ("tokens",), "moe_experts_clamped": ("tokens",), "mhc_pre": ("tokens",),
    "mhc_post": ("tokens",), "mhc_head": ("tokens",), "write_cache": ("tokens", "padding_tokens"),
    "compress_pool": ("windows", "empty_windows"), "compress_entries": ("entries", "first_windows"),
    "indexer_topk": ("tokens", "short_queries"),
    "sparse_attention": ("tokens", "empty_queries"),
    "mhc_pre_delayed": ("tokens", "one_hot_tokens"), "mhc_collapse": ("tokens", "one_hot_tokens"),
    "indexer_block_candidates": ("tokens", "empty_queries"), "engram_hash_ids": ("tokens", "blocked_tokens"),
    "engram_gate": ("tokens", "tiny_streams"),
}
# a count that may not exceed another (both redrawn): the smaller one is cut to the larger
BOUNDED_COUNTS = {"sample_tokens": ("greedy_rows", "rows"), "write_latent_cache": ("padding_tokens", "tokens"),
                  "norm_rope_write_latent": ("padding_tokens", "tokens"),
                  "write_cache": ("padding_tokens", "tokens"), "compress_pool": ("empty_windows", "windows"),
                  "compress_entries": ("first_windows", "entries"),
                  "indexer_topk": ("short_queries", "tokens"), "sparse_attention": ("empty_queries", "tokens"),
                  "mhc_pre_delayed": ("one_hot_tokens", "tokens"), "mhc_collapse": ("one_hot_tokens", "tokens"),
                  "indexer_block_candidates": ("empty_queries", "tokens"), "engram_hash_ids": ("blocked_tokens", "tokens"),
                  "engram_gate": ("tiny_streams", "tokens")}


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
        if op in BOUNDED_COUNTS:  # greedy rows cannot exceed rows, padding tokens tokens, ...
            small, large = BOUNDED_COUNTS[op]
            return st.fixed_dictionaries(counts).map(lambda c: {**dims, **c, small: min(c[small], c[large])})
        return st.fixed_dictionaries(counts).map(lambda c: {**dims, **c})

    return st.sampled_from(declared).flatmap(vary)
