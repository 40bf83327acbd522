"""FP8 (128x128 blocks) and FP4 (1x32 blocks, packed) quantisation with e8m0 scales."""

import pytest
import torch

from dsv4.weights import (
    E8M0,
    FP4_VALUES,
    dequantize_fp4,
    dequantize_fp8,
    pack_fp4,
    quantize_fp4,
    quantize_fp8,
    scale_to_float,
    unpack_fp4,
)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _is_power_of_two(x: torch.Tensor) -> bool:
    mantissa, _ = torch.frexp(x)
    return bool((mantissa == 0.5).all())


# -- e8m0 scales -----------------------------------------------------------------------------------


def test_e8m0_bytes_are_biased_exponents():
    raw = torch.tensor([0, 1, 126, 127, 128, 254], dtype=torch.uint8)
    expected = torch.tensor([2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127])
    assert torch.equal(scale_to_float(raw), expected)
    assert torch.equal(scale_to_float(raw.view(E8M0)), expected)
    assert torch.equal(scale_to_float(expected), expected)  # float32 scales are taken as they are


def test_e8m0_byte_255_is_nan():
    assert scale_to_float(torch.tensor([255], dtype=torch.uint8)).isnan().all()


def test_scales_in_any_accepted_dtype_decode_the_same():
    weight, scale = quantize_fp8(torch.randn(130, 260))
    reference = dequantize_fp8(weight, scale)
    assert torch.equal(dequantize_fp8(weight, scale.view(torch.uint8)), reference)
    assert torch.equal(dequantize_fp8(weight, scale_to_float(scale)), reference)


# -- FP8 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(128, 256), (200, 300), (1, 7), (129, 128)])
def test_fp8_shapes_and_power_of_two_scales(shape):
    weight, scale = quantize_fp8(torch.randn(shape))
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == shape
    assert scale.dtype == E8M0 and scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert _is_power_of_two(scale_to_float(scale))


def test_fp8_round_trip_error_is_within_e4m3_precision_per_block():
    w = torch.randn(300, 200) * torch.logspace(-3, 2, 200)  # very different magnitudes per column block
    decoded = dequantize_fp8(*quantize_fp8(w))
    for rows in (slice(0, 128), slice(128, 256), slice(256, 300)):
        for cols in (slice(0, 128), slice(128, 200)):
            block, err = w[rows, cols], (decoded - w)[rows, cols]
            # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values; subnormals
            # add at most half their step, 2^-10 of a scale that is < amax/224.
            bound = block.abs() * 2.0**-4 + block.abs().max() * 2.0**-16
            assert (err.abs() <= bound).all()


def test_fp8_quantisation_of_decoded_values_is_exact():
    decoded = dequantize_fp8(*quantize_fp8(torch.randn(200, 300)))
    # The scale may drop a power of two (a block max that rounded down onto a boundary); the values may not change.
    assert torch.equal(dequantize_fp8(*quantize_fp8(decoded)), decoded)


def test_fp8_scale_is_the_smallest_power_of_two_that_fits_448():
    for amax, exponent in [(448.0, 0), (448.5, 1), (224.0, -1), (1.0, -8), (2.0**-20, -28)]:
        w = torch.zeros(128, 128)
        w[5, 7] = -amax
        _, scale = quantize_fp8(w)
        assert scale_to_float(scale).item() == 2.0**exponent, amax


def test_fp8_block_layout_follows_rows_then_columns():
    w = torch.ones(256, 384)
    w[128:, 256:] = 448.0 * 4  # only block (1, 2) is large
    _, scale = quantize_fp8(w)
    values = scale_to_float(scale)
    assert values[1, 2] == 4.0
    assert (values.flatten()[:5] == 2.0**-8).all()


def test_fp8_all_zero_block_decodes_to_zero():
    weight, scale = quantize_fp8(torch.zeros(130, 10))
    assert (scale.view(torch.uint8) == 0).all()
    assert torch.equal(dequantize_fp8(weight, scale), torch.zeros(130, 10))


# -- FP4 -------------------------------------------------------------------------------------------


def test_fp4_code_table():
    codes = torch.arange(16, dtype=torch.uint8).view(1, 16)
    assert unpack_fp4(pack_fp4(codes), 16).tolist()[0] == [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
    ]


def test_fp4_low_nibble_holds_the_even_element():
    packed = torch.tensor([[0x21, 0x9F]], dtype=torch.uint8).view(torch.int8)
    # 0x21: low 1 -> 0.5 (element 0), high 2 -> 1.0 (element 1); 0x9F: low F -> -6, high 9 -> -0.5
    assert unpack_fp4(packed, 4).tolist() == [[0.5, 1.0, -6.0, -0.5]]
    codes = torch.tensor([[1, 2, 15, 9]], dtype=torch.uint8)
    assert pack_fp4(codes).view(torch.uint8).tolist() == [[0x21, 0x9F]]


def test_fp4_float4_dtype_decodes_like_int8():
    packed, scale = quantize_fp4(torch.randn(4, 64))
    as_fp4 = packed.view(torch.float4_e2m1fn_x2)
    assert torch.equal(dequantize_fp4(as_fp4, scale, 64), dequantize_fp4(packed, scale, 64))


@pytest.mark.parametrize("shape", [(3, 64), (5, 48), (2, 7), (1, 32)])
def test_fp4_shapes(shape):
    packed, scale = quantize_fp4(torch.randn(shape))
    assert packed.dtype == torch.int8 and packed.shape == (shape[0], -(-shape[1] // 2))
    assert scale.dtype == E8M0 and scale.shape == (shape[0], -(-shape[1] // 32))
    assert dequantize_fp4(packed, scale, shape[1]).shape == shape


def test_fp4_representable_values_round_trip_exactly():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (6, 96), generator=gen)
    block_scales = 2.0 ** torch.randint(-10, 10, (6, 3), generator=gen).float()
    w = FP4_VALUES[codes] * block_scales.repeat_interleave(32, 1)
    # Every block must reach its scale's maximum, or the quantiser (rightly) picks a smaller scale.
    w[:, ::32] = 6.0 * block_scales
    packed, scale = quantize_fp4(w)
    assert torch.equal(scale_to_float(scale), block_scales)
    assert torch.equal(dequantize_fp4(packed, scale, 96), w)


def test_fp4_rounds_to_the_nearest_value():
    w = torch.tensor([[6.0, 0.2, 0.3, 0.8, 1.3, 1.8, 2.4, 2.6, 3.6, 4.9, 5.1, -0.7, -5.9] + [0.0] * 19])
    packed, scale = quantize_fp4(w)
    assert scale_to_float(scale).item() == 1.0
    assert dequantize_fp4(packed, scale, 32)[0, :13].tolist() == [
        6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 2.0, 3.0, 4.0, 4.0, 6.0, -0.5, -6.0,
    ]


def test_fp4_scale_is_per_row_and_32_columns():
    w = torch.ones(2, 64)
    w[1, 32:] = 6.0 * 8
    _, scale = quantize_fp4(w)
    assert scale_to_float(scale).tolist() == [[0.25, 0.25], [0.25, 8.0]]


def test_fp4_round_trip_error_is_bounded_by_half_a_step():
    w = torch.randn(64, 256)
    packed, scale = quantize_fp4(w)
    decoded = dequantize_fp4(packed, scale, 256)
    step = scale_to_float(scale).repeat_interleave(32, 1)  # the largest gap (4 -> 6) is 2 scale units
    assert ((decoded - w).abs() <= step + 1e-7).all()
    assert (decoded * w >= 0).all()  # never flips a sign
