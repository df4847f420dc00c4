"""``write_cache`` into DeepSeek-V4's FP8 KV records (``deepinfer_core.ops.kv_record``) as a
TileLang kernel: no CANN operator writes that 584-byte layout (CANN's own quantized KV caches are
656-byte V3.2-style rows).

For each token t with slot r = slot_mapping[t] >= 0 (negative: nothing stored), its row
values[t] [512] is quantised into page r // 64, slot j = r % 64 of the record cache, viewed as
[pages, 37376] uint8:

* data bytes [576 j, 576 j + 448): the NoPE values, tile i (values 64 i .. 64 i + 63) divided by
  2^e_i and cast to float8_e4m3fn, after a clamp to +-448;
* data bytes [576 j + 448, 576 j + 576): the RoPE values as bfloat16, little-endian;
* scale bytes [36864 + 8 j, 36864 + 8 j + 8): the seven e_i + 127 (UE8M0), then a zero byte.

e_i is the smallest e with 2^e >= max(amax_i, 1e-4) / 448, taken from the float32 bits of that
quotient (its exponent field, plus one when the mantissa is not zero): exact, no log2. The
division by 2^e_i is a multiplication by 2^-e_i, built from its exponent bits: the same rounded
value as the reference's division, since both are exact scalings by a power of two.

Not known without the chip: the rounding of the vector core's float32 -> e4m3 conversion (the
reference uses round-to-nearest-even, as torch does), and the cost of the 8-byte stores of the
scale plane (a UB -> GM copy of 8 bytes at an 8-byte offset).
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func's parameter annotations
# (shapes with dynamic dims) when it is defined, from the enclosing scope.

from deepinfer_ascend_950.tilelang_ops._dialect import Dialect

NAME = "deepinfer_write_records"
ROW_DIM, NOPE_DIM, ROPE_DIM, TILE, TILES = 512, 448, 64, 64, 7
DATA_BYTES, SCALE_BYTES, PAGE_ROWS = 576, 8, 64
PAGE_BYTES = PAGE_ROWS * (DATA_BYTES + SCALE_BYTES)  # 37376
SCALE_PLANE = PAGE_ROWS * DATA_BYTES  # 36864
E4M3_MAX, AMAX_FLOOR = 448.0, 1e-4
DTYPES = ("bfloat16", "float16", "float32")


def write_records_kernel(dtype: str = "bfloat16", target: str = "ascend", cores: int = 64):
    """Parameters (by name): values [T, 512] dtype, slot_mapping [T] int32, cache [pages, 37376]
    uint8 (written in place); T and pages dynamic."""
    if dtype not in DTYPES:
        raise ValueError(f"write_cache record kernel: unsupported dtype {dtype}")
    d = Dialect(target, threads=TILE)
    T = d.T
    M = T.dynamic("num_tokens")
    P = T.dynamic("num_pages")

    @T.prim_func
    def deepinfer_write_records(
        values: T.Tensor((M, ROW_DIM), dtype),
        slot_mapping: T.Tensor((M,), "int32"),
        cache: T.Tensor((P, PAGE_BYTES), "uint8"),
    ):
        with d.kernel(cores) as core:
            row_ub = T.alloc_shared((ROW_DIM,), dtype)
            data_ub = T.alloc_shared((DATA_BYTES,), "uint8")
            scale_ub = T.alloc_shared((SCALE_BYTES,), "uint8")
            inv_ub = T.alloc_shared((TILES + 1,), "float32")  # 2^-e of each NoPE tile
            for t in T.serial(core, M, cores):  # persistent: token t on core t % cores
                slot = slot_mapping[t]
                if slot >= 0:
                    page = slot // PAGE_ROWS
                    j = slot % PAGE_ROWS
                    T.copy(values[t, 0:ROW_DIM], row_ub)
                    with d.vf(TILE):
                        for i in T.Parallel(TILES + 1):
                            if i < TILES:
                                amax = T.alloc_var("float32")
                                amax = 0.0
                                for v in T.serial(TILE):
                                    amax = T.max(amax, T.abs(T.cast(row_ub[i * TILE + v], "float32")))
                                ratio = T.max(amax, T.float32(AMAX_FLOOR)) / T.float32(E4M3_MAX)
                                bits = T.reinterpret(ratio, "int32")
                                biased = T.shift_right(bits, 23) + T.if_then_else(T.bitwise_and(bits, 0x7FFFFF) != 0, 1, 0)
                                scale_ub[i] = T.cast(biased, "uint8")
                                inv_ub[i] = T.reinterpret(T.shift_left(254 - biased, 23), "float32")
                            else:
                                scale_ub[i] = T.uint8(0)
                    with d.vf(TILE):
                        for v in T.Parallel(NOPE_DIM):
                            scaled = T.cast(row_ub[v], "float32") * inv_ub[v // TILE]
                            clamped = T.min(T.max(scaled, T.float32(-E4M3_MAX)), T.float32(E4M3_MAX))
                            data_ub[v] = T.reinterpret(T.cast(clamped, "float8_e4m3fn"), "uint8")
                        for r in T.Parallel(ROPE_DIM):
                            half = T.reinterpret(T.cast(row_ub[NOPE_DIM + r], "bfloat16"), "uint16")
                            data_ub[NOPE_DIM + 2 * r] = T.cast(T.bitwise_and(half, T.uint16(0xFF)), "uint8")
                            data_ub[NOPE_DIM + 2 * r + 1] = T.cast(T.shift_right(half, T.uint16(8)), "uint8")
                    T.copy(data_ub, cache[page, j * DATA_BYTES : j * DATA_BYTES + DATA_BYTES])
                    T.copy(scale_ub, cache[page, SCALE_PLANE + j * SCALE_BYTES : SCALE_PLANE + j * SCALE_BYTES + SCALE_BYTES])

    return deepinfer_write_records
