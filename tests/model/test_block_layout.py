"""The attention's block layout (dsv4.model.plan._block_layout): every query's window fits its band,
bands are aligned, and the chosen layout never costs more than one block per window."""

import pytest

from dsv4.model.plan import BAND_ALIGN, _block_layout

W = 128


def cost(length: int, block: int, band: int) -> int:
    return -(-length // block) * block * band


@pytest.mark.parametrize("from_start", [False, True])
@pytest.mark.parametrize("length", [1, 2, 5, 15, 16, 17, 37, 64, 100, 127, 128, 129, 255, 256, 300, 1000, 4096])
def test_layout_covers_every_window_and_is_aligned(length, from_start):
    block, band, own_rows_only = _block_layout(length, W, from_start)
    assert band % BAND_ALIGN == 0
    if own_rows_only:  # one block of the whole chunk, over its own rows
        assert from_start and block == length <= W and band >= length
    else:
        assert 1 <= block <= min(length, W) and band >= block + W - 1
    plain = min(length, W)
    assert cost(length, block, band) <= cost(length, plain, -(-(plain + W - 1) // BAND_ALIGN) * BAND_ALIGN)


def test_decode_and_long_prefill_layouts():
    assert _block_layout(1, W, False) == (1, W, False)  # a decode step: its window, nothing more
    assert _block_layout(100, W, True) == (100, 112, True)  # a short prompt: its own rows
    block, band, _ = _block_layout(256, W, False)
    assert block < W and band < 2 * W - 1  # a long chunk: smaller blocks, narrower bands
