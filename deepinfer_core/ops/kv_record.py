"""DeepSeek-V4's FP8 KV records: 512-wide key rows in 584 bytes each, laid out in pages as
FlashMLA's sparse kernels read them (its "MODEL1" FP8 format, ``tests/quant.py`` there).

A record cache is a contiguous uint8 tensor [N, 584] (any leading shape flattening to N rows)
with N a multiple of PAGE_ROWS = 64. Rows [64 k, 64 k + 64) form page k, the bytes
[37376 k, 37376 (k + 1)) of the tensor, and a page is a data plane then a scale plane:

    page bytes [576 j, 576 j + 576)           row 64 k + j's data:
        [0, 448)    the row's first 448 values (the NoPE part) as float8_e4m3fn, tile i
                    (values [64 i, 64 i + 64), i < 7) divided by its scale 2^e_i
        [448, 576)  the last 64 values (the RoPE part) as bfloat16, little-endian
    page bytes [36864 + 8 j, 36864 + 8 j + 8)  row 64 k + j's scales: the 7 tiles' e_i as
                    UE8M0 bytes (byte b means 2^(b - 127)), then one byte of padding, 0

So row r lives at page r // 64, slot r % 64, and FlashMLA reads a record cache viewed as
``[N / 64, 64, 1, 584]`` (``flashmla_view``): its page_block_size is 64 whatever the engine's
block size, and a row index is a FlashMLA token index.

Tile i's scale is the smallest power of two 2^e >= max(amax_i, AMAX_FLOOR) / 448 (amax_i: the
tile's largest |value|, as float32; the floor gives an all-zero tile a valid small scale,
2^-22), then q = e4m3(clamp(x / 2^e, -448, 448)) with torch's round-to-nearest-even cast.
Quantisation reads the rows' values as given (float32 rows are not rounded to bf16 first).
Dequantisation is exact in float32 and bfloat16: a row whose NoPE tiles are e4m3 values times
their scale and whose RoPE part is bf16 round-trips bit for bit.
"""

from __future__ import annotations

import math

import torch

ROW_DIM = 512
NOPE_DIM = 448
ROPE_DIM = ROW_DIM - NOPE_DIM
TILE = 64
TILES = NOPE_DIM // TILE
DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576: a row's e4m3 NoPE values and bf16 RoPE values
SCALE_BYTES = TILES + 1  # 8: 7 UE8M0 scales and one byte of padding
RECORD_BYTES = DATA_BYTES + SCALE_BYTES  # 584 bytes a row
PAGE_ROWS = 64
PAGE_BYTES = PAGE_ROWS * RECORD_BYTES  # 37376
SCALE_PLANE = PAGE_ROWS * DATA_BYTES  # 36864: where a page's scale plane starts
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
UE8M0_BIAS = 127


def record_rows(rows: int) -> int:
    """The rows a record cache for ``rows`` rows has: whole pages."""
    return math.ceil(rows / PAGE_ROWS) * PAGE_ROWS


def is_record_cache(t: torch.Tensor) -> bool:
    """True for a uint8 tensor whose last dimension is RECORD_BYTES (a record cache or pool);
    ``planes`` checks the rest (contiguous whole pages)."""
    return t.dtype == torch.uint8 and t.dim() >= 1 and t.shape[-1] == RECORD_BYTES


def planes(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a record cache's pages: (data [pages, 64, 576], scales [pages, 64, 8]), uint8.
    ValueError unless ``cache`` is a contiguous uint8 [..., 584] of whole pages."""
    if not is_record_cache(cache) or not cache.is_contiguous() or cache.numel() % PAGE_BYTES:
        raise ValueError(f"a V4 FP8 record cache is a contiguous uint8 [N, {RECORD_BYTES}] with N a multiple of {PAGE_ROWS} "
                         f"(pages of {PAGE_ROWS} rows), got {cache.dtype} {tuple(cache.shape)}"
                         f"{'' if cache.is_contiguous() else ' (not contiguous)'}")
    pages = cache.view(-1, PAGE_BYTES)
    data = pages[:, :SCALE_PLANE].view(-1, PAGE_ROWS, DATA_BYTES)
    scales = pages[:, SCALE_PLANE:].view(-1, PAGE_ROWS, SCALE_BYTES)
    return data, scales


def flashmla_view(cache: torch.Tensor) -> torch.Tensor:
    """A record cache as FlashMLA's ``k_cache`` [pages, 64, 1, 584] (page_block_size 64)."""
    planes(cache)  # checked
    return cache.view(-1, PAGE_ROWS, 1, RECORD_BYTES)


def check_rows(rows: torch.Tensor) -> None:
    """ValueError unless ``rows`` is a float [T, 512]: what records are quantised from."""
    if rows.dim() != 2 or rows.shape[-1] != ROW_DIM or not rows.is_floating_point():
        raise ValueError(f"V4 FP8 records hold float rows [T, {ROW_DIM}], got {rows.dtype} {tuple(rows.shape)}")


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [T, 512] (any float dtype) -> (data [T, 576], scales [T, 8]) uint8: each row's bytes
    in its page's data and scale planes (module docstring)."""
    check_rows(rows)
    tiles = rows[:, :NOPE_DIM].float().view(-1, TILES, TILE)
    amax = tiles.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    mant, exp = torch.frexp(amax / E4M3_MAX)  # amax / 448 = mant * 2^exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)  # the smallest e with 2^e >= amax / 448
    q = (tiles / torch.exp2(e.float())[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    data = torch.empty(rows.shape[0], DATA_BYTES, dtype=torch.uint8, device=rows.device)
    data[:, :NOPE_DIM] = q.view(torch.uint8).view(-1, NOPE_DIM)
    data[:, NOPE_DIM:] = rows[:, NOPE_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8)
    scales = torch.zeros(rows.shape[0], SCALE_BYTES, dtype=torch.uint8, device=rows.device)
    scales[:, :TILES] = (e + UE8M0_BIAS).to(torch.uint8)
    return data, scales


def dequantize_bytes(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(data [..., 576], scales [..., 8]) uint8 -> rows [..., 512] in ``dtype`` (exact in float32 / bfloat16)."""
    lead = data.shape[:-1]
    q = data[..., :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, TILES, TILE)
    scale = torch.exp2(scales[..., :TILES].float() - UE8M0_BIAS).reshape(-1, TILES)
    nope = (q * scale[..., None]).view(-1, NOPE_DIM)
    rope = data[..., NOPE_DIM:].contiguous().view(torch.bfloat16).float().reshape(-1, ROPE_DIM)
    return torch.cat([nope, rope], dim=-1).to(dtype).view(*lead, ROW_DIM)


def write_records(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantise rows [T, 512] into ``cache``'s rows ``slots`` [T] (all >= 0), in place."""
    data, scales = planes(cache)
    d, s = quantize_rows(rows)
    page, slot = slots // PAGE_ROWS, slots % PAGE_ROWS
    data[page, slot] = d
    scales[page, slot] = s


def read_records(cache: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``idx`` (any shape, all in range) of a record cache, dequantised: [*idx.shape, 512]."""
    data, scales = planes(cache)
    page, slot = idx // PAGE_ROWS, idx % PAGE_ROWS
    return dequantize_bytes(data[page, slot], scales[page, slot], dtype)


def quantize_v4_records(rows: torch.Tensor) -> torch.Tensor:
    """A record cache holding rows [T, 512] as its rows 0..T-1: uint8 [record_rows(T), 584]
    (the rows of its last page past T are zero bytes: zero rows)."""
    if rows.dim() != 2:
        raise ValueError(f"V4 FP8 records hold float rows [T, {ROW_DIM}], got {rows.dtype} {tuple(rows.shape)}")
    cache = torch.zeros(record_rows(rows.shape[0]), RECORD_BYTES, dtype=torch.uint8, device=rows.device)
    write_records(cache, rows, torch.arange(rows.shape[0], device=rows.device))
    return cache


def dequantize_v4_records(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every row of a record cache, dequantised: [N, 512] in ``dtype``."""
    data, scales = planes(cache)
    return dequantize_bytes(data, scales, dtype).view(-1, ROW_DIM)
