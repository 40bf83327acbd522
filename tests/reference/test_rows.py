"""The cached row formats of dsv4.kernels.rows: sizes, layout, rounding bounds, determinism."""

from __future__ import annotations

import pytest
import torch

from dsv4.kernels.rows import (
    AMAX_FLOOR,
    FP8_MAX,
    index_row_bytes,
    main_row_bytes,
    pack_index_rows,
    pack_main_rows,
    pow2_scale_exponent,
    unpack_index_rows,
    unpack_main_rows,
)

E4M3_RELATIVE = 2.0**-4  # 3 mantissa bits, round to nearest
E4M3_SUBNORMAL_STEP = 2.0**-9
BF16_RELATIVE = 2.0**-8


def rows(n: int, dim: int, seed: int = 0, magnitude: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # a heavy-ish tail per row, so blocks hold both large and tiny values
    return torch.randn(n, dim, generator=generator) * torch.rand(n, dim, generator=generator) ** 3 * magnitude


def test_row_sizes():
    assert (index_row_bytes("fp8"), index_row_bytes("bf16"), index_row_bytes("fp32")) == (132, 256, 512)
    assert main_row_bytes("fp8_e4m3") == 584 == 448 + 128 + 7 + 1
    assert (main_row_bytes("bf16"), main_row_bytes("fp32"), main_row_bytes("fp64")) == (1024, 2048, 4096)
    x = rows(3, 512)
    for dtype in ("fp8", "bf16", "fp32"):
        packed = pack_index_rows(x[:, :128], dtype)
        assert packed.dtype == torch.uint8 and packed.shape == (3, index_row_bytes(dtype))
    for dtype in ("fp8_e4m3", "bf16", "fp32", "fp64"):
        packed = pack_main_rows(x, dtype)
        assert packed.dtype == torch.uint8 and packed.shape == (3, main_row_bytes(dtype))


def test_scale_exponent_is_the_smallest_power_of_two_that_fits():
    amax = torch.tensor([448.0, 448.0 * 1.0001, 224.0, 300.0, 1.0, 3e30, 0.0])
    exponent = pow2_scale_exponent(amax)
    assert exponent.tolist() == [0, 1, -1, 0, -8, 93, -22]
    scale = torch.ldexp(torch.ones(7), exponent)
    fitted = amax.clamp_min(AMAX_FLOOR) / scale
    assert (fitted <= FP8_MAX).all() and (fitted > FP8_MAX / 2).all()


def test_index_fp8_layout_and_error_bound():
    x = rows(64, 128, seed=1, magnitude=5.0)
    packed = pack_index_rows(x, "fp8")
    scale = packed[:, 128:].contiguous().view(torch.float32).squeeze(1)
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all(), "scales must be powers of two"
    assert torch.equal(scale, torch.ldexp(torch.ones(64), pow2_scale_exponent(x.abs().amax(dim=1))))
    restored = unpack_index_rows(packed, "fp8")
    bound = x.abs() * E4M3_RELATIVE + scale.unsqueeze(1) * E4M3_SUBNORMAL_STEP / 2
    assert ((restored - x).abs() <= bound).all()
    assert (restored.abs().amax(dim=1) / scale <= FP8_MAX).all()


def test_main_fp8_layout_and_error_bound():
    x = rows(64, 512, seed=2, magnitude=3.0)
    packed = pack_main_rows(x, "fp8_e4m3")
    exponents = packed[:, 576:583].to(torch.int32) - 127
    assert torch.equal(exponents, pow2_scale_exponent(x[:, :448].abs().unflatten(1, (7, 64)).amax(dim=-1)))
    assert torch.equal(packed[:, 448:576], x[:, 448:].to(torch.bfloat16).contiguous().view(torch.uint8))
    assert (packed[:, 583] == 0).all()
    restored = unpack_main_rows(packed, "fp8_e4m3")
    scale = torch.ldexp(torch.ones(64, 7), exponents).repeat_interleave(64, dim=1)
    bound = x[:, :448].abs() * E4M3_RELATIVE + scale * E4M3_SUBNORMAL_STEP / 2
    assert ((restored[:, :448] - x[:, :448]).abs() <= bound).all()
    assert torch.equal(restored[:, 448:], x[:, 448:].to(torch.bfloat16).float())


@pytest.mark.parametrize("kind", ["index", "main"])
def test_bf16_and_full_precision_rows(kind):
    dim = 128 if kind == "index" else 512
    pack, unpack = (pack_index_rows, unpack_index_rows) if kind == "index" else (pack_main_rows, unpack_main_rows)
    x = rows(16, dim, seed=3)
    restored = unpack(pack(x, "bf16"), "bf16")
    assert ((restored - x).abs() <= x.abs() * BF16_RELATIVE).all()
    assert torch.equal(unpack(pack(x, "fp32"), "fp32"), x)
    if kind == "main":
        x64 = x.double() / 3
        restored = unpack_main_rows(pack_main_rows(x64, "fp64"), "fp64")
        assert restored.dtype == torch.float64 and torch.equal(restored, x64)


def test_zero_rows_stay_exactly_zero():
    zeros = torch.zeros(4, 512)
    assert torch.equal(unpack_main_rows(pack_main_rows(zeros, "fp8_e4m3"), "fp8_e4m3"), zeros)
    assert torch.equal(unpack_index_rows(pack_index_rows(zeros[:, :128], "fp8"), "fp8"), zeros[:, :128])


@pytest.mark.parametrize("magnitude", [1e-3, 1e3, 1e30])
def test_large_and_small_magnitudes_keep_their_relative_precision(magnitude):
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(4)) * magnitude
    main = unpack_main_rows(pack_main_rows(x, "fp8_e4m3"), "fp8_e4m3")
    index = unpack_index_rows(pack_index_rows(x[:, :128], "fp8"), "fp8")
    for restored, original in ((main, x), (index, x[:, :128])):
        assert torch.isfinite(restored).all()
        assert (restored.double() - original.double()).norm() / original.double().norm() < 0.05


def test_rows_below_the_amax_floor_flush_towards_zero_without_blowing_up():
    tiny = torch.full((2, 128), 1e-12)
    restored = unpack_index_rows(pack_index_rows(tiny, "fp8"), "fp8")
    assert (restored.abs() <= 1e-9).all()


def test_packing_is_deterministic_and_round_trips_are_projections():
    x = rows(32, 512, seed=5)
    first, second = pack_main_rows(x, "fp8_e4m3"), pack_main_rows(x.clone(), "fp8_e4m3")
    assert torch.equal(first, second)
    once = unpack_main_rows(first, "fp8_e4m3")
    assert torch.equal(unpack_main_rows(pack_main_rows(once, "fp8_e4m3"), "fp8_e4m3"), once)
    first = pack_index_rows(x[:, :128], "fp8")
    assert torch.equal(first, pack_index_rows(x[:, :128].clone(), "fp8"))
    once = unpack_index_rows(first, "fp8")
    assert torch.equal(unpack_index_rows(pack_index_rows(once, "fp8"), "fp8"), once)


def test_bad_shapes_and_dtypes_are_named():
    with pytest.raises(ValueError, match="unpack_main_rows"):
        unpack_main_rows(torch.zeros(2, 583, dtype=torch.uint8), "fp8_e4m3")
    with pytest.raises(ValueError, match="unknown row dtype 'fp16'"):
        pack_index_rows(torch.zeros(2, 128), "fp16")
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_main_rows(torch.zeros(2, 500), "fp8_e4m3")
