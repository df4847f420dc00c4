"""``compress_pool`` (DeepSeek-V4's compressors: CSA, its indexer's, HCA) as a TileLang kernel.

One compressed entry per window n: ``entries[n] = RMSNorm(sum_s softmax_s(score[n, s, c]) *
kv[n, s, c])`` with the softmax over the S slots of each channel independently, then V4's
float32-weight RMSNorm (``ops.norm.rms_norm_f32``). No CANN operator does this (vllm-ascend runs
a custom ``compressor`` op of its own), so it is written here.

Rounding follows the reference (``deepinfer_core.ops.sparse.compress_pool``) step by step: the
softmax in float32, each weight rounded to kv's dtype, each product ``kv * weight`` in kv's
dtype, their sum over the slots accumulated in float32 and rounded once to kv's dtype (as
torch sums a bf16 tensor), then the norm in float32 (``w * (x * rsqrt(mean(x^2) + eps))``) and
one cast.

Work split: a persistent loop of ``cores`` vector cores over the windows; a window's channels
are processed in tiles of ``channel_tile`` (all S slots of a tile in UB at once: score float32
+ kv, at most ``UB_TILE_BYTES``), one SIMT thread per channel of a tile, the slots walked
serially (max, sum of exponentials, weighted sum). The pooled float32 row of the window stays in
UB for the norm, whose sum of squares is a block reduction over the channels.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func's parameter annotations
# (shapes with dynamic dims) when it is defined, from the enclosing scope.

from deepinfer_ascend_950.tilelang_ops._dialect import Dialect

NAME = "deepinfer_compress_pool"
UB_TILE_BYTES = 64 * 1024  # score (float32) + kv tile of one window; the whole kernel stays under ~80 KB of UB
THREADS = 128
DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


def channel_tile(slots: int, channels: int, dtype: str) -> int:
    """The channels of one tile: all of them when the [slots, channels] score and kv fit
    ``UB_TILE_BYTES``, else the largest halving of ``channels`` that does (and stays a multiple of 32)."""
    tile = channels
    while slots * tile * (4 + DTYPES[dtype]) > UB_TILE_BYTES and tile % 2 == 0 and (tile // 2) % 32 == 0:
        tile //= 2
    return tile


def supports(slots: int, channels: int, dtype: str) -> bool:
    """Whether the kernel takes these shapes: channels a multiple of 32 (whole SIMT warps per tile) and
    a tile that fits UB. The real compressors (S 8 / 128, C 128 / 512) do; the conformance kit's small
    awkward shapes go to the reference."""
    if dtype not in DTYPES or slots < 1 or channels < 32 or channels % 32:
        return False
    return slots * channel_tile(slots, channels, dtype) * (4 + DTYPES[dtype]) <= UB_TILE_BYTES


def compress_pool_kernel(slots: int, channels: int, dtype: str = "bfloat16", target: str = "ascend", cores: int = 64):
    """The prim_func for windows of ``slots`` rows of ``channels`` values in ``dtype``; the number of
    windows is dynamic. Parameters (by name): kv [N, S, C] dtype, score [N, S, C] float32,
    norm_weight [C] float32, entries [N, C] dtype (written), eps float32."""
    if not supports(slots, channels, dtype):
        raise ValueError(f"compress_pool kernel: unsupported shape slots={slots} channels={channels} dtype={dtype}")
    d = Dialect(target, threads=THREADS)
    T = d.T
    ct = channel_tile(slots, channels, dtype)
    tiles = channels // ct
    threads = min(THREADS, ct)
    N = T.dynamic("num_windows")

    @T.prim_func
    def deepinfer_compress_pool(
        kv: T.Tensor((N, slots, channels), dtype),
        score: T.Tensor((N, slots, channels), "float32"),
        norm_weight: T.Tensor((channels,), "float32"),
        entries: T.Tensor((N, channels), dtype),
        eps: T.float32,
    ):
        with d.kernel(cores) as core:
            kv_ub = T.alloc_shared((slots, ct), dtype)
            score_ub = T.alloc_shared((slots, ct), "float32")
            weight_ub = T.alloc_shared((channels,), "float32")
            pooled = T.alloc_shared((channels,), "float32")
            out_ub = T.alloc_shared((channels,), dtype)
            T.copy(norm_weight[0:channels], weight_ub)
            for n in T.serial(core, N, cores):  # persistent: window n on core n % cores
                for tile in T.serial(tiles):
                    c0 = tile * ct
                    T.copy(kv[n, 0:slots, c0 : c0 + ct], kv_ub)
                    T.copy(score[n, 0:slots, c0 : c0 + ct], score_ub)
                    with d.vf(threads):
                        for c in T.Parallel(ct):
                            top = T.alloc_var("float32")
                            top = score_ub[0, c]
                            for s in T.serial(1, slots):
                                top = T.max(top, score_ub[s, c])
                            denom = T.alloc_var("float32")
                            denom = 0.0
                            for s in T.serial(slots):
                                denom += T.exp(score_ub[s, c] - top)
                            acc = T.alloc_var("float32")
                            acc = 0.0
                            for s in T.serial(slots):
                                weight = T.cast(T.exp(score_ub[s, c] - top) / denom, dtype)
                                acc += T.cast(T.cast(kv_ub[s, c] * weight, dtype), "float32")
                            pooled[c0 + c] = T.cast(T.cast(acc, dtype), "float32")
                with d.vf(THREADS):
                    sum_sq = T.alloc_reducer((1,), "float32", op="sum")
                    T.reducer_init(sum_sq)
                    for c in T.Parallel(channels):
                        T.reducer_update(sum_sq[0], pooled[c] * pooled[c])
                    total = T.alloc_fragment((1,), "float32")
                    T.finalize_reducer(sum_sq, total)
                    rstd = T.rsqrt(total[0] / channels + eps)
                    for c in T.Parallel(channels):
                        out_ub[c] = T.cast(weight_ub[c] * (pooled[c] * rstd), dtype)
                T.copy(out_ub, entries[n, 0:channels])

    return deepinfer_compress_pool
