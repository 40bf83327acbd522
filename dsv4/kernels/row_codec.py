"""The cached row formats of `dsv4.kernels.rows`, read and written inside Triton kernels.

Kernels see every pool as raw bytes (uint8) and address a row by the pointer to its first byte,
so one loader serves window rings, paged compressed rows and a batch's own new rows alike. The
byte layouts are those of `rows.py` (the one definition); `tests/kernels/test_row_codec.py`
checks these helpers against its pack/unpack byte for byte.

FP8 e4m3 and bf16 conversions are done with integer arithmetic on the bits rather than with
Triton's casts: the CPU interpreter (which the test suite runs on) truncates fp32 -> bf16 instead
of rounding to nearest-even, and its fp8 support is unreliable; the bit arithmetic is exact on
both, and on a GPU it costs a few integer ops per element in kernels that are memory-bound.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .rows import FP8_MAX, MAIN_BLOCK, UE8M0_BIAS, index_row_bytes, main_row_bytes

# Row format codes, passed to kernels as constexpr.
FP8_MAIN = 0  # main row: [nope e4m3][rope bf16][ue8m0 scale per 64 nope dims][pad]
FP8_INDEX = 1  # index-key row: [dim e4m3][fp32 power-of-two scale]
BF16 = 2  # dim bfloat16 values
FP32 = 3  # dim float32 values

# rows.py format name -> code. bf16/fp32 rows are plain arrays whether they hold main rows or
# index keys, so the format name alone says how to read a row; fp64 rows have no Triton path.
FORMAT_CODES = {"fp8_e4m3": FP8_MAIN, "fp8": FP8_INDEX, "bf16": BF16, "fp32": FP32}
MAIN_FORMATS = ("fp8_e4m3", "bf16", "fp32", "fp64")
INDEX_FORMATS = ("fp8", "bf16", "fp32")


def row_bytes(row_format: str, dim: int, rope_dim: int) -> int:
    """Bytes of one row of `dim` values in `row_format` (a main-row or an index-key format)."""
    if row_format == "fp8":
        return index_row_bytes("fp8", dim)
    return main_row_bytes(row_format, dim, rope_dim)


def row_alignment(row_format: str) -> int:
    """The widest element a row of this format holds: row starts must be aligned to it."""
    return {"fp8_e4m3": 2, "fp8": 4, "bf16": 2, "fp32": 4, "fp64": 8}[row_format]


@triton.jit
def pow2(k):
    """2.0 ** k as float32 for integer k in [-126, 127], built from the exponent bits (exact)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def decode_e4m3(code):
    """uint8 e4m3fn codes -> float32 values, exactly (NaN codes are never written)."""
    bits = code.to(tl.int32)
    exponent = (bits >> 3) & 15
    mantissa = bits & 7
    # A normal e4m3 value moved into fp32's fields: exponent bias 7 -> 127, mantissa 3 -> 23 bits.
    normal = ((exponent + 120) << 23 | mantissa << 20).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
    return tl.where((bits & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def encode_e4m3(x):
    """float32 values within +-448 -> uint8 e4m3fn codes, rounding to nearest-even like torch."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = tl.abs(x)
    # Quantum of x's binade (subnormals share the lowest normal binade's): 2^(e - 3), e >= -6.
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    steps = magnitude * pow2(3 - e)  # exact: in [0, 16]
    whole = steps.to(tl.int32)
    frac = steps - whole.to(tl.float32)
    round_up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    # (e + 6) * 8 + steps is the code: steps == 16 carries into the next binade by itself.
    code = (e + 6) * 8 + whole + round_up.to(tl.int32)
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def round_bf16(x):
    """float32 -> the nearest bfloat16 value (ties to even), still as float32."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded & -65536).to(tl.float32, bitcast=True)


@triton.jit
def pow2_scale_exponent(amax):
    """k = ceil(log2(max(amax, 1e-4) / 448)) as in rows.pow2_scale_exponent, from amax's bits.

    With amax = m * 2^e (m in [1, 2)) and 448 = 1.75 * 2^8, k = e - 8, plus one when m > 1.75.
    """
    bits = tl.maximum(amax, 1e-4).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    return e - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def load_rows(row_ptr, row_mask, FORMAT: tl.constexpr, DIM: tl.constexpr, ROPE: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """Rows starting at uint8 pointers `row_ptr` [BLOCK_N] -> float32 [BLOCK_N, BLOCK_D].

    Masked rows and columns >= DIM read as 0 (finite, so they may enter a dot product).
    """
    cols = tl.arange(0, BLOCK_D)
    base = row_ptr[:, None]
    in_row = row_mask[:, None] & (cols < DIM)[None, :]
    if FORMAT == 0:  # FP8_MAIN
        NOPE: tl.constexpr = DIM - ROPE
        is_nope = in_row & (cols < NOPE)[None, :]
        is_rope = in_row & (cols >= NOPE)[None, :]
        codes = tl.load(base + cols[None, :], mask=is_nope, other=0)
        scale_byte = tl.load(base + (NOPE + 2 * ROPE) + (cols // 64)[None, :], mask=is_nope, other=0)
        nope = decode_e4m3(codes) * pow2(scale_byte.to(tl.int32) - 127)
        rope_ptr = (base + NOPE + 2 * (cols - NOPE)[None, :]).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rope_ptr, mask=is_rope, other=0.0).to(tl.float32)
        return tl.where(is_nope, nope, rope)
    elif FORMAT == 1:  # FP8_INDEX
        codes = tl.load(base + cols[None, :], mask=in_row, other=0)
        scale = tl.load((row_ptr + DIM).to(tl.pointer_type(tl.float32)), mask=row_mask, other=0.0)
        return decode_e4m3(codes) * scale[:, None]
    elif FORMAT == 2:  # BF16
        ptr = (base + 2 * cols[None, :]).to(tl.pointer_type(tl.bfloat16))
        return tl.load(ptr, mask=in_row, other=0.0).to(tl.float32)
    else:  # FP32
        ptr = (base + 4 * cols[None, :]).to(tl.pointer_type(tl.float32))
        return tl.load(ptr, mask=in_row, other=0.0)


@triton.jit
def store_row(row_ptr, x, FORMAT: tl.constexpr, DIM: tl.constexpr, ROPE: tl.constexpr,
              BLOCK_D: tl.constexpr, ROW_BYTES: tl.constexpr):
    """Quantise one row x (float32 [BLOCK_D], zero beyond DIM) and store it at uint8 `row_ptr`."""
    cols = tl.arange(0, BLOCK_D)
    if FORMAT == 0:  # FP8_MAIN: one power-of-two scale per 64 no-RoPE dims
        NOPE: tl.constexpr = DIM - ROPE
        BLOCKS: tl.constexpr = BLOCK_D // 64
        blocks = tl.reshape(x, (BLOCKS, 64))
        exponent = pow2_scale_exponent(tl.max(tl.abs(blocks), axis=1))  # [BLOCKS]
        scaled = tl.reshape(blocks * pow2(-exponent)[:, None], (BLOCK_D,))
        codes = encode_e4m3(tl.minimum(tl.maximum(scaled, -448.0), 448.0))
        tl.store(row_ptr + cols, codes, mask=cols < NOPE)
        rope_ptr = (row_ptr + NOPE + 2 * (cols - NOPE)).to(tl.pointer_type(tl.bfloat16))
        tl.store(rope_ptr, round_bf16(x).to(tl.bfloat16), mask=(cols >= NOPE) & (cols < DIM))
        block_ids = tl.arange(0, BLOCKS)
        tl.store(row_ptr + (NOPE + 2 * ROPE) + block_ids, (exponent + 127).to(tl.uint8),
                 mask=block_ids < NOPE // 64)
        USED: tl.constexpr = NOPE + 2 * ROPE + NOPE // 64
        pad = tl.arange(0, 8)
        tl.store(row_ptr + USED + pad, tl.zeros([8], tl.uint8), mask=pad < ROW_BYTES - USED)
    elif FORMAT == 1:  # FP8_INDEX: one power-of-two scale for the whole row
        exponent = pow2_scale_exponent(tl.max(tl.abs(x), axis=0))
        codes = encode_e4m3(tl.minimum(tl.maximum(x * pow2(-exponent), -448.0), 448.0))
        tl.store(row_ptr + cols, codes, mask=cols < DIM)
        tl.store((row_ptr + DIM).to(tl.pointer_type(tl.float32)), pow2(exponent))
    elif FORMAT == 2:  # BF16
        tl.store((row_ptr + 2 * cols).to(tl.pointer_type(tl.bfloat16)), round_bf16(x).to(tl.bfloat16),
                 mask=cols < DIM)
    else:  # FP32
        tl.store((row_ptr + 4 * cols).to(tl.pointer_type(tl.float32)), x, mask=cols < DIM)


# The constants the helpers above hard-code, tied to rows.py so a format change fails loudly.
assert (FP8_MAX, MAIN_BLOCK, UE8M0_BIAS) == (448.0, 64, 127)
