"""The Triton row codec against rows.py and torch's own conversions: exact, byte for byte."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_cases import pack, unpack

from dsv4.kernels import row_codec
from dsv4.kernels.row_codec import FORMAT_CODES, decode_e4m3, encode_e4m3, load_rows, row_bytes, store_row

DECODE, ENCODE, ROUND_BF16, SCALE_EXPONENT = range(4)


@triton.jit
def _elementwise_kernel(x_ptr, out_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    if OP == 0:
        y = decode_e4m3(x)
    elif OP == 1:
        y = encode_e4m3(x)
    elif OP == 2:
        y = row_codec.round_bf16(x)
    else:
        y = row_codec.pow2_scale_exponent(x)
    tl.store(out_ptr + offs, y, mask=mask)


@triton.jit
def _store_rows_kernel(x_ptr, out_ptr, stride_x, stride_out, FORMAT: tl.constexpr, DIM: tl.constexpr,
                       ROPE: tl.constexpr, BLOCK_D: tl.constexpr, ROW_BYTES: tl.constexpr):
    n = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + n * stride_x + cols, mask=cols < DIM, other=0.0)
    store_row(out_ptr + n * stride_out, x, FORMAT, DIM, ROPE, BLOCK_D, ROW_BYTES)


@triton.jit
def _load_rows_kernel(buf_ptr, out_ptr, num_rows, stride_buf, stride_out, FORMAT: tl.constexpr,
                      DIM: tl.constexpr, ROPE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    mask = rows < num_rows
    x = load_rows(buf_ptr + rows.to(tl.int64) * stride_buf, mask, FORMAT, DIM, ROPE, BLOCK_D)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], x, mask=mask[:, None] & (cols < DIM)[None, :])


def elementwise(x: torch.Tensor, op: int, out_dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    block = 1024
    _elementwise_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), OP=op, BLOCK=block)
    return out


def e4m3_values() -> torch.Tensor:
    """Every finite e4m3fn value, as float32."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return values[values.isfinite()]


def test_decode_matches_torch_for_every_code(device):
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    want = codes.view(torch.float8_e4m3fn).float()
    got = elementwise(codes, DECODE, torch.float32)
    finite = want.isfinite()  # 0x7f / 0xff are NaN, never written
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(got[finite].signbit(), want[finite].signbit())  # -0.0 stays negative


def test_encode_rounds_like_torch(device):
    gen = torch.Generator().manual_seed(0)
    values = e4m3_values().sort().values
    midpoints = (values[1:] + values[:-1]) / 2  # exact ties: must go to the even code
    near = torch.cat([midpoints * (1 + 2**-20), midpoints * (1 - 2**-20)])
    randoms = torch.cat([torch.empty(4000).uniform_(-448, 448, generator=gen),
                         torch.randn(4000, generator=gen) * 2**-8,  # subnormal range
                         torch.tensor([0.0, -0.0, 448.0, -448.0, 2**-10, -(2**-10)])])
    x = torch.cat([values, midpoints, near, randoms]).clamp(-448, 448).to(device)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    got = elementwise(x, ENCODE, torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"e.g. {x[bad[:5]].tolist()} -> {got[bad[:5]].tolist()} not {want[bad[:5]].tolist()}"


def test_round_bf16_is_nearest_even(device):
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(5000, generator=gen) * 10.0 ** torch.randint(-6, 6, (5000,), generator=gen),
                   torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 0.0, 3.0e38])])  # ties, overflow
    x = x.to(device)
    assert torch.equal(elementwise(x, ROUND_BF16, torch.float32), x.to(torch.bfloat16).float())


def test_scale_exponent_matches_rows_py(device):
    from dsv4.kernels.rows import pow2_scale_exponent

    # Every e4m3 magnitude over many binades (the 1.75 * 2^k boundaries included), then edge cases.
    sweep = (e4m3_values().abs()[:, None] * 2.0 ** torch.arange(-20, 20)[None, :]).flatten()
    amax = torch.cat([sweep, sweep * (1 + 2**-23), sweep * (1 - 2**-23),
                      torch.tensor([0.0, 1e-4, 1e-5, 448.0, 896.0, 3.5, 1.75]),
                      torch.rand(3000, generator=torch.Generator().manual_seed(2)) * 1e4]).to(device)
    assert torch.equal(elementwise(amax, SCALE_EXPONENT, torch.int32), pow2_scale_exponent(amax).to(torch.int32))


ROW_LAYOUTS = [  # (format, dim, rope_dim)
    ("fp8_e4m3", 512, 64),  # V4's 584-byte main row
    ("fp8_e4m3", 128, 64),
    ("fp8", 128, 0),  # V4's 132-byte index-key row
    ("fp8", 48, 0),
    ("bf16", 512, 64),
    ("bf16", 96, 0),
    ("fp32", 128, 64),
]


def sample_rows(dim: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(6, dim, generator=gen)
    x[1] = 0.0  # all-zero row: the amax floor keeps its scale finite
    x[2] *= 1e-7  # below the floor
    x[3] *= 1e4
    x[4, : dim // 2] = 448.0  # a block exactly at the e4m3 limit
    x[5] = x[5].bfloat16().float()  # bf16 inputs, as a bf16 model's rows are
    return x


@pytest.mark.parametrize("fmt,dim,rope", ROW_LAYOUTS)
def test_store_row_packs_like_rows_py(fmt, dim, rope, device):
    x = sample_rows(dim).to(device)
    rb = row_bytes(fmt, dim, rope)
    out = torch.full((x.shape[0], rb), 0xAB, dtype=torch.uint8, device=device)
    _store_rows_kernel[(x.shape[0],)](x, out, x.stride(0), out.stride(0), FORMAT=FORMAT_CODES[fmt], DIM=dim,
                                      ROPE=rope, BLOCK_D=max(64, triton.next_power_of_2(dim)), ROW_BYTES=rb)
    want = pack(x.cpu(), fmt, rope)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("fmt,dim,rope", ROW_LAYOUTS)
def test_load_rows_unpacks_like_rows_py(fmt, dim, rope, device):
    packed = pack(sample_rows(dim), fmt, rope)
    buf = packed.to(device)
    out = torch.full((packed.shape[0], dim), float("nan"), device=device)
    _load_rows_kernel[(triton.cdiv(packed.shape[0], 4),)](buf, out, packed.shape[0], buf.stride(0), out.stride(0),
                                                          FORMAT=FORMAT_CODES[fmt], DIM=dim, ROPE=rope,
                                                          BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=4)
    assert torch.equal(out.cpu(), unpack(packed, fmt, dim, rope))
