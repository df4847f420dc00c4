"""DeepSeek-V4.1's Engram ops as TileLang kernels: ``engram_hash_ids`` (the n-gram hash) and
``engram_gate`` (the per-stream gate that adds the memory row to the residual streams). No CANN
operator does either; the row gather between them is an ordinary embedding lookup.

``deepinfer_engram_hash``: per token, with v_s its n-gram column s (pad_id where -1), in int64:
roll_0 = v_0 * mult_0, roll_s = roll_{s-1} XOR (v_s * mult_s), and for s >= 1 and head h
``ids[t, (s-1) H + h] = roll_s mod primes[s-1, h] + offsets[(s-1) H + h]`` (the reference's
precondition keeps every product and roll in [0, 2^63), so ``%`` equals torch.remainder). One
SIMT thread per token of a tile of ``HASH_TILE`` tokens. int64 multiply, XOR and modulo in the
vector core's SIMT code: the lowering emits them as plain ``int64_t`` C; whether bisheng and the
950 run them at speed (or at all) is not known here.

``deepinfer_engram_gate``: per (token t, stream k), all in float32,
``dot = sum_d ((x[d] * q_w[k, d]) * k_w[k, d]) * key[d]`` with key = kv[t, k D:(k+1) D], then
``dot * rsqrt(mean(x^2) + eps) * rsqrt(mean(key^2) + eps) * D^-0.5`` (left to right, as the
reference), ``g = sigmoid(sign(dot) sqrt(max(|dot|, 1e-6)))`` and
``out[t, k] = cast(x + g * value)`` with value = kv[t, hc D:]. A token is one work item of a
persistent loop over the vector cores, its hc streams one after the other (splitting the (t, k)
pairs over the cores instead made the lowering 1.5x slower: its integer division); D is walked in chunks of ``chunk`` twice (the three sums,
then the output), each chunk one SIMT pass whose sums are block reductions started from the
previous chunks' partial sums.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func's parameter annotations
# (shapes with dynamic dims) when it is defined, from the enclosing scope.

from deepinfer_ascend_950.tilelang_ops._dialect import Dialect

HASH_NAME = "deepinfer_engram_hash"
GATE_NAME = "deepinfer_engram_gate"
HASH_TILE = 64
GATE_CHUNK = 2048
THREADS = 128
DTYPES = ("bfloat16", "float16", "float32")


def hash_supports(max_ngram: int, heads: int) -> bool:
    return 2 <= max_ngram <= 8 and 1 <= heads <= 64


def gate_chunk(hidden: int) -> int:
    """D's chunk: all of it up to GATE_CHUNK, else the largest divisor of D below it that is a multiple of 128."""
    if hidden <= GATE_CHUNK:
        return hidden
    for chunk in range(GATE_CHUNK, 127, -128):
        if hidden % chunk == 0:
            return chunk
    return 0


def gate_supports(hc: int, hidden: int, dtype: str) -> bool:
    """hidden a multiple of 128 (V4.1: 4096 / 7168) with a chunk that divides it; hc 1..8."""
    return dtype in DTYPES and 1 <= hc <= 8 and hidden % 128 == 0 and gate_chunk(hidden) > 0


def engram_hash_kernel(max_ngram: int, heads: int, target: str = "ascend", cores: int = 64):
    """Parameters (by name): ngram_ids [T, n] int64, multipliers [n] int64, primes [n-1, H] int64,
    offsets [(n-1) H] int64, ids [T, (n-1) H] int64 (written), pad_id int64; T dynamic."""
    if not hash_supports(max_ngram, heads):
        raise ValueError(f"engram_hash_ids kernel: unsupported max_ngram={max_ngram} heads={heads}")
    d = Dialect(target, threads=HASH_TILE)
    T = d.T
    n, tt = max_ngram, HASH_TILE
    width = (n - 1) * heads
    M = T.dynamic("num_tokens")

    @T.prim_func
    def deepinfer_engram_hash(
        ngram_ids: T.Tensor((M, n), "int64"),
        multipliers: T.Tensor((n,), "int64"),
        primes: T.Tensor((n - 1, heads), "int64"),
        offsets: T.Tensor((width,), "int64"),
        ids: T.Tensor((M, width), "int64"),
        pad_id: T.int64,
    ):
        with d.kernel(cores) as core:
            ngram_ub = T.alloc_shared((tt, n), "int64")
            mult_ub = T.alloc_shared((n,), "int64")
            prime_ub = T.alloc_shared((n - 1, heads), "int64")
            offset_ub = T.alloc_shared((width,), "int64")
            out_ub = T.alloc_shared((tt, width), "int64")
            T.copy(multipliers[0:n], mult_ub)
            T.copy(primes[0 : n - 1, 0:heads], prime_ub)
            T.copy(offsets[0:width], offset_ub)
            for tile in T.serial(core, T.ceildiv(M, tt), cores):
                t0 = tile * tt
                T.copy(ngram_ids[t0 : t0 + tt, 0:n], ngram_ub)
                with d.vf(tt):
                    for t in T.Parallel(tt):
                        roll = T.alloc_var("int64")
                        v0 = ngram_ub[t, 0]
                        roll = T.if_then_else(v0 < 0, pad_id, v0) * mult_ub[0]
                        for s in T.serial(1, n):
                            v = ngram_ub[t, s]
                            roll = T.bitwise_xor(roll, T.if_then_else(v < 0, pad_id, v) * mult_ub[s])
                            for h in T.serial(heads):
                                out_ub[t, (s - 1) * heads + h] = T.truncmod(roll, prime_ub[s - 1, h]) + offset_ub[(s - 1) * heads + h]
                T.copy(out_ub, ids[t0 : t0 + tt, 0:width])

    return deepinfer_engram_hash


def engram_gate_kernel(hc: int, hidden: int, dtype: str = "bfloat16", target: str = "ascend", cores: int = 64):
    """Parameters (by name): x [T, hc, D] dtype, kv [T, (hc+1) D] dtype, q_weight, k_weight [hc, D]
    dtype, out [T, hc, D] dtype (written), eps float32; T dynamic."""
    if not gate_supports(hc, hidden, dtype):
        raise ValueError(f"engram_gate kernel: unsupported hc={hc} hidden={hidden} dtype={dtype}")
    d = Dialect(target, threads=THREADS)
    T = d.T
    D, ch = hidden, gate_chunk(hidden)
    chunks = D // ch
    M = T.dynamic("num_tokens")

    @T.prim_func
    def deepinfer_engram_gate(
        x: T.Tensor((M, hc, D), dtype),
        kv: T.Tensor((M, (hc + 1) * D), dtype),
        q_weight: T.Tensor((hc, D), dtype),
        k_weight: T.Tensor((hc, D), dtype),
        out: T.Tensor((M, hc, D), dtype),
        eps: T.float32,
    ):
        with d.kernel(cores) as core:
            x_ub = T.alloc_shared((ch,), dtype)
            key_ub = T.alloc_shared((ch,), dtype)  # the key chunk in pass 1, the value chunk in pass 2
            qw_ub = T.alloc_shared((ch,), dtype)
            kw_ub = T.alloc_shared((ch,), dtype)
            out_ub = T.alloc_shared((ch,), dtype)
            sums = T.alloc_shared((4,), "float32")  # dot, sum x^2, sum key^2, then the gate
            for t in T.serial(core, M, cores):  # persistent: token t on core t % cores
                for k in T.serial(hc):
                    for c in T.serial(chunks):
                        c0 = c * ch
                        T.copy(x[t, k, c0 : c0 + ch], x_ub)
                        T.copy(kv[t, k * D + c0 : k * D + c0 + ch], key_ub)
                        T.copy(q_weight[k, c0 : c0 + ch], qw_ub)
                        T.copy(k_weight[k, c0 : c0 + ch], kw_ub)
                        with d.vf(THREADS):
                            dot = T.alloc_reducer((1,), "float32", op="sum")
                            sxx = T.alloc_reducer((1,), "float32", op="sum")
                            skk = T.alloc_reducer((1,), "float32", op="sum")
                            T.reducer_init(dot, T.if_then_else(c == 0, T.float32(0), sums[0]))
                            T.reducer_init(sxx, T.if_then_else(c == 0, T.float32(0), sums[1]))
                            T.reducer_init(skk, T.if_then_else(c == 0, T.float32(0), sums[2]))
                            for i in T.Parallel(ch):
                                xf = T.cast(x_ub[i], "float32")
                                kf = T.cast(key_ub[i], "float32")
                                T.reducer_update(dot[0], xf * T.cast(qw_ub[i], "float32") * T.cast(kw_ub[i], "float32") * kf)
                                T.reducer_update(sxx[0], xf * xf)
                                T.reducer_update(skk[0], kf * kf)
                            dot_sum = T.alloc_fragment((1,), "float32")
                            sxx_sum = T.alloc_fragment((1,), "float32")
                            skk_sum = T.alloc_fragment((1,), "float32")
                            T.finalize_reducer(dot, dot_sum)
                            T.finalize_reducer(sxx, sxx_sum)
                            T.finalize_reducer(skk, skk_sum)
                            sums[0] = dot_sum[0]  # every thread holds the sums: a write of the same value
                            sums[1] = sxx_sum[0]
                            sums[2] = skk_sum[0]
                    with d.vf(THREADS):
                        for j in T.Parallel(1):
                            g = sums[0] * T.rsqrt(sums[1] / D + eps) * T.rsqrt(sums[2] / D + eps) * T.float32(D**-0.5)
                            sign = T.if_then_else(g > 0, T.float32(1), T.if_then_else(g < 0, T.float32(-1), T.float32(0)))
                            sums[3 + j] = T.sigmoid(sign * T.sqrt(T.max(T.abs(g), T.float32(1e-6))))
                    for c in T.serial(chunks):
                        c0 = c * ch
                        T.copy(x[t, k, c0 : c0 + ch], x_ub)
                        T.copy(kv[t, hc * D + c0 : hc * D + c0 + ch], key_ub)
                        with d.vf(THREADS):
                            for i in T.Parallel(ch):
                                out_ub[i] = T.cast(T.cast(x_ub[i], "float32") + sums[3] * T.cast(key_ub[i], "float32"), dtype)
                        T.copy(out_ub, out[t, k, c0 : c0 + ch])


    return deepinfer_engram_gate
