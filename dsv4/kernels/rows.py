"""The cached row formats: the one definition of how index-key rows and main KV rows are stored.

The reference model round-trips rows through these formats to reproduce exactly what an engine
reads back from its cache, and the paged memory pools store these bytes. Every packed row is a
`uint8` tensor `[N, row_bytes]`, so a pool, a transfer or a checksum can treat rows as opaque bytes.

Index-key rows (the lightning indexer's compressed keys, `index_head_dim` = 128 values):
  fp8   132 B: 128 float8_e4m3fn values, then one float32 power-of-two scale (little-endian)
  bf16  256 B: 128 bfloat16 values
  fp32  512 B: 128 float32 values

Main KV rows (`head_dim` = 512 = 448 no-RoPE dims + 64 RoPE dims):
  fp8_e4m3  584 B: [448 e4m3][64 bf16 = 128 B][7 ue8m0 scale bytes][1 pad byte]; the no-RoPE dims
                   are quantised in blocks of 64, each with a power-of-two scale stored as its
                   exponent + 127; the RoPE dims stay bf16 because rotation spreads magnitudes
  bf16      1024 B: 512 bfloat16 values
  fp32/fp64 the model-dtype row, stored as-is
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
# Scales are computed from max(amax, AMAX_FLOOR) so an all-zero row gets a finite scale (and
# packs to zeros); 1e-4 is the floor DeepSeek's own activation quantiser uses.
AMAX_FLOOR = 1e-4
UE8M0_BIAS = 127
MAIN_BLOCK = 64  # no-RoPE dims per ue8m0 scale in a main fp8 row

INDEX_ROW_DTYPES = ("fp8", "bf16", "fp32")
MAIN_ROW_DTYPES = ("fp8_e4m3", "bf16", "fp32", "fp64")


# -- power-of-two scaled fp8 ---------------------------------------------------------------------


def pow2_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """k = ceil(log2(max(amax, AMAX_FLOOR) / 448)) as int32: 2^k is the smallest power of two
    that brings amax within the e4m3 range. Uses frexp, so it is exact (no log2 rounding)."""
    ratio = amax.float().clamp_min(AMAX_FLOOR) / FP8_MAX
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    return exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two needs no rounding up


def _quantise_fp8(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [..., B] -> (e4m3 values [..., B], scale exponent [...]); one scale per block."""
    blocks = blocks.float()
    exponent = pow2_scale_exponent(blocks.abs().amax(dim=-1))
    scaled = torch.ldexp(blocks, -exponent.unsqueeze(-1))  # exact: a power-of-two division
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), exponent


def _dequantise_fp8(values: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(values.float(), exponent.unsqueeze(-1).to(torch.int32))


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """[N, D] tensor of any dtype -> [N, D * itemsize] uint8 view of the same bytes."""
    return x.contiguous().view(torch.uint8)


def _as(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, bytes] uint8 slice -> [N, bytes / itemsize] view as dtype."""
    return buf.contiguous().view(dtype)


def _check_rows(x: torch.Tensor, width: int, what: str) -> None:
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"{what}: expected shape [N, {width}], got {list(x.shape)}")


def _check_dtype(dtype: str, allowed: tuple[str, ...], what: str) -> None:
    if dtype not in allowed:
        raise ValueError(f"{what}: unknown row dtype {dtype!r}; expected one of {allowed}")


# -- index-key rows ------------------------------------------------------------------------------


def index_row_bytes(dtype: str, dim: int = 128) -> int:
    """Bytes per packed index-key row of `dim` values."""
    _check_dtype(dtype, INDEX_ROW_DTYPES, "index_row_bytes")
    return {"fp8": dim + 4, "bf16": 2 * dim, "fp32": 4 * dim}[dtype]


def pack_index_rows(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """x [N, dim] float -> uint8 [N, index_row_bytes(dtype, dim)]."""
    _check_dtype(dtype, INDEX_ROW_DTYPES, "pack_index_rows")
    if x.dim() != 2:
        raise ValueError(f"pack_index_rows: expected shape [N, dim], got {list(x.shape)}")
    if dtype == "bf16":
        return _bytes(x.to(torch.bfloat16))
    if dtype == "fp32":
        return _bytes(x.float())
    values, exponent = _quantise_fp8(x)
    scale = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
    return torch.cat([_bytes(values), _bytes(scale.unsqueeze(1))], dim=1)


def unpack_index_rows(buf: torch.Tensor, dtype: str, dim: int = 128) -> torch.Tensor:
    """uint8 [N, index_row_bytes(dtype, dim)] -> float32 [N, dim]."""
    _check_dtype(dtype, INDEX_ROW_DTYPES, "unpack_index_rows")
    _check_rows(buf, index_row_bytes(dtype, dim), f"unpack_index_rows({dtype})")
    if dtype == "bf16":
        return _as(buf, torch.bfloat16).float()
    if dtype == "fp32":
        return _as(buf, torch.float32).clone()
    values = _as(buf[:, :dim], torch.float8_e4m3fn).float()
    scale = _as(buf[:, dim:], torch.float32)  # [N, 1], a power of two
    return values * scale


# -- main KV rows --------------------------------------------------------------------------------


def _main_fp8_layout(head_dim: int, rope_head_dim: int) -> tuple[int, int, int]:
    """(no-RoPE dims, scale blocks, pad bytes) of a main fp8 row; the row is padded to 8 bytes."""
    nope = head_dim - rope_head_dim
    if nope % MAIN_BLOCK:
        raise ValueError(f"main fp8 rows need the no-RoPE dims ({nope}) to be a multiple of {MAIN_BLOCK}")
    blocks = nope // MAIN_BLOCK
    used = nope + 2 * rope_head_dim + blocks
    return nope, blocks, -used % 8


def main_row_bytes(dtype: str, head_dim: int = 512, rope_head_dim: int = 64) -> int:
    """Bytes per packed main KV row."""
    _check_dtype(dtype, MAIN_ROW_DTYPES, "main_row_bytes")
    if dtype == "fp8_e4m3":
        nope, blocks, pad = _main_fp8_layout(head_dim, rope_head_dim)
        return nope + 2 * rope_head_dim + blocks + pad
    return head_dim * {"bf16": 2, "fp32": 4, "fp64": 8}[dtype]


def pack_main_rows(x: torch.Tensor, dtype: str, rope_head_dim: int = 64) -> torch.Tensor:
    """x [N, head_dim] float (RoPE dims last) -> uint8 [N, main_row_bytes(dtype, head_dim, rope_head_dim)]."""
    _check_dtype(dtype, MAIN_ROW_DTYPES, "pack_main_rows")
    if x.dim() != 2:
        raise ValueError(f"pack_main_rows: expected shape [N, head_dim], got {list(x.shape)}")
    if dtype != "fp8_e4m3":
        return _bytes(x.to({"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}[dtype]))
    nope, blocks, pad = _main_fp8_layout(x.shape[1], rope_head_dim)
    values, exponent = _quantise_fp8(x[:, :nope].unflatten(1, (blocks, MAIN_BLOCK)))
    scale_bytes = (exponent + UE8M0_BIAS).to(torch.uint8)
    return torch.cat(
        [
            _bytes(values.flatten(1)),
            _bytes(x[:, nope:].to(torch.bfloat16)),
            scale_bytes,
            x.new_zeros((x.shape[0], pad), dtype=torch.uint8),
        ],
        dim=1,
    )


def unpack_main_rows(buf: torch.Tensor, dtype: str, head_dim: int = 512, rope_head_dim: int = 64) -> torch.Tensor:
    """uint8 [N, main_row_bytes(...)] -> [N, head_dim]: float64 for fp64 rows, float32 otherwise."""
    _check_dtype(dtype, MAIN_ROW_DTYPES, "unpack_main_rows")
    _check_rows(buf, main_row_bytes(dtype, head_dim, rope_head_dim), f"unpack_main_rows({dtype})")
    if dtype == "bf16":
        return _as(buf, torch.bfloat16).float()
    if dtype in ("fp32", "fp64"):
        return _as(buf, torch.float32 if dtype == "fp32" else torch.float64).clone()
    nope, blocks, _ = _main_fp8_layout(head_dim, rope_head_dim)
    rope_end = nope + 2 * rope_head_dim
    values = _as(buf[:, :nope], torch.float8_e4m3fn).unflatten(1, (blocks, MAIN_BLOCK))
    exponent = buf[:, rope_end : rope_end + blocks].to(torch.int32) - UE8M0_BIAS
    no_rope = _dequantise_fp8(values, exponent).flatten(1)
    rope = _as(buf[:, nope:rope_end], torch.bfloat16).float()
    return torch.cat([no_rope, rope], dim=1)
