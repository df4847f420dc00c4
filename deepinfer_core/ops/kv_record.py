"""DeepSeek-V4's FP8 KV record: one 512-wide key row in 584 bytes (FlashMLA's V4 sparse format).

A record is an array of structs per token, ``uint8 [584]``:

    bytes [0, 448)    the row's first 448 values (the NoPE part) as float8_e4m3fn, tile i
                      (values [64 i, 64 i + 64), i < 7) divided by its scale 2^e_i
    bytes [448, 576)  the last 64 values (the RoPE part) as bfloat16, little-endian
    bytes [576, 583)  the 7 tiles' scales as UE8M0 bytes: byte b means 2^(b - 127)
    byte 583          padding, 0

Tile i's scale is the smallest power of two 2^e >= max(amax_i, AMAX_FLOOR) / 448 (amax_i: the
tile's largest |value|, as float32; the floor gives an all-zero tile a valid small scale,
2^-22, as DeepSeek's reference and vLLM do), then q = e4m3(clamp(x / 2^e, -448, 448)) with
torch's round-to-nearest-even cast. Quantisation reads the rows' values as given (float32 rows
are not rounded to bf16 first). Dequantisation is exact in float32 and bfloat16: a row whose
NoPE tiles are e4m3 values times their scale and whose RoPE part is bf16 round-trips bit for bit.
"""

from __future__ import annotations

import torch

ROW_DIM = 512
NOPE_DIM = 448
ROPE_DIM = ROW_DIM - NOPE_DIM
TILE = 64
TILES = NOPE_DIM // TILE
ROPE_OFFSET = NOPE_DIM  # byte offsets in a record
SCALE_OFFSET = ROPE_OFFSET + 2 * ROPE_DIM
RECORD_BYTES = SCALE_OFFSET + TILES + 1  # 584: 7 scale bytes and one byte of padding
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
UE8M0_BIAS = 127


def is_record_cache(t: torch.Tensor) -> bool:
    """True for a tensor of V4 FP8 records: uint8 with a last dimension of RECORD_BYTES."""
    return t.dtype == torch.uint8 and t.shape[-1] == RECORD_BYTES


def quantize_v4_records(rows: torch.Tensor) -> torch.Tensor:
    """rows [..., 512] (any float dtype) -> uint8 [..., 584] records (module docstring)."""
    if rows.shape[-1] != ROW_DIM or not rows.is_floating_point():
        raise ValueError(f"V4 FP8 records hold float rows of {ROW_DIM} values, got {rows.dtype} {tuple(rows.shape)}")
    lead = rows.shape[:-1]
    flat = rows.reshape(-1, ROW_DIM)
    tiles = flat[:, :NOPE_DIM].float().view(-1, TILES, TILE)
    amax = tiles.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    mant, exp = torch.frexp(amax / E4M3_MAX)  # amax / 448 = mant * 2^exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)  # the smallest e with 2^e >= amax / 448
    q = (tiles / torch.exp2(e.float())[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    out = torch.zeros(flat.shape[0], RECORD_BYTES, dtype=torch.uint8, device=rows.device)
    out[:, :NOPE_DIM] = q.view(torch.uint8).view(-1, NOPE_DIM)
    out[:, ROPE_OFFSET:SCALE_OFFSET] = flat[:, NOPE_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8)
    out[:, SCALE_OFFSET:SCALE_OFFSET + TILES] = (e + UE8M0_BIAS).to(torch.uint8)
    return out.view(*lead, RECORD_BYTES)


def dequantize_v4_records(records: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., 584] records -> [..., 512] rows in ``dtype`` (exact in float32 / bfloat16)."""
    if not is_record_cache(records):
        raise ValueError(f"V4 FP8 records are uint8 [..., {RECORD_BYTES}], got {records.dtype} {tuple(records.shape)}")
    lead = records.shape[:-1]
    flat = records.reshape(-1, RECORD_BYTES)
    q = flat[:, :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float().view(-1, TILES, TILE)
    scale = torch.exp2(flat[:, SCALE_OFFSET:SCALE_OFFSET + TILES].float() - UE8M0_BIAS)
    nope = (q * scale[..., None]).view(-1, NOPE_DIM)
    rope = flat[:, ROPE_OFFSET:SCALE_OFFSET].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=-1).to(dtype).view(*lead, ROW_DIM)
