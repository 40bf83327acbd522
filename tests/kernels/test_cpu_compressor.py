"""The compressors' feed as one C call (dsv4/kernels/cpu_compressor.py) against its torch code
(dsv4.model.compressor.feed with the state's gather and scatter, as PagedCompressor.advance runs it)."""

import pytest
import torch

from dsv4.kernels import cpu_compressor
from dsv4.model import compressor

pytestmark = pytest.mark.skipif(not cpu_compressor.available(), reason="the CPU lacks AVX512-BF16 or a C compiler")


def torch_feed(projected, positions, ape, state, plan):
    state_slots, state_rows, window_sources, update_slots, update_rows, update_sources = plan
    windows, updates = compressor.feed(projected, positions, ape, state[state_slots, state_rows], window_sources,
                                       update_sources)
    state[update_slots, update_rows] = updates.to(state.dtype)
    return windows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,ratio,width,state_rows,windows,span,updates", [
    (1, 4, 64, 8, 0, 8, 1), (1, 4, 64, 8, 1, 8, 5), (3, 128, 40, 128, 1, 128, 2), (17, 4, 96, 8, 4, 8, 9),
    (2, 4, 16, 8, 0, 8, 0)])
def test_matches_torch(dtype, tokens, ratio, width, state_rows, windows, span, updates):
    """Random plans over a strided pool view (a slot's rows among other regions, as the pools lay them
    out): windows that pool state rows, token rows and the empty row; changed rows taken from rows that
    change too (read before any is written). The same bits, windows and state."""
    g = torch.Generator().manual_seed(tokens * 7 + width)
    slots = 5
    pool = torch.randn(slots, state_rows * 2 * width + 24, generator=g)  # each slot's region, then another
    state = pool[:, 8 : 8 + state_rows * 2 * width].view(slots, state_rows, 2 * width)
    source_layout = torch.randn(tokens, 3 * width, generator=g).to(dtype)
    projected = source_layout[:, width:]  # (rows strided, as the product's compressor columns are)
    if tokens % 2:  # (transposed, as a compiled product may return it)
        projected = projected.T.contiguous().T
    positions = torch.randint(0, 1000, (tokens,), generator=g)
    ape = torch.randn(ratio, width, generator=g)
    if tokens % 2:  # (the checkpoint's layout may leave it transposed)
        ape = ape.T.contiguous().T
    read = 6
    cells = torch.randperm(slots * state_rows, generator=g)
    state_slots, state_rows_read = cells[:read] // state_rows, cells[:read] % state_rows
    window_sources = torch.randint(0, read + tokens + 1, (windows, span), generator=g)
    if windows:
        window_sources[0, 0] = read + tokens  # the empty row
    targets = torch.randperm(slots * state_rows, generator=g)[:updates]
    update_slots, update_rows = targets // state_rows, targets % state_rows
    update_sources = torch.randint(0, read + tokens + 1, (updates,), generator=g)
    if updates >= 2:  # the second changed row takes the first's old value
        state_slots[0], state_rows_read[0], update_sources[1] = update_slots[0], update_rows[0], 0
    plan = (state_slots, state_rows_read, window_sources, update_slots, update_rows, update_sources)
    expected_pool = pool.clone()
    expected_state = expected_pool[:, 8 : 8 + state_rows * 2 * width].view(slots, state_rows, 2 * width)
    expected = torch_feed(projected, positions, ape, expected_state, plan)
    got = cpu_compressor.feed(projected, positions, ape, state, *plan)
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert torch.equal(pool, expected_pool)  # (the other region untouched as well)


def test_rejects_what_it_cannot_read():
    state = torch.zeros(2, 8, 32)
    plan = [torch.zeros(1, dtype=torch.long)] * 2 + [torch.zeros(0, 8, dtype=torch.long)] + [
        torch.zeros(1, dtype=torch.long)] * 3
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        cpu_compressor.feed(torch.zeros(1, 32, dtype=torch.float64), torch.zeros(1), torch.zeros(4, 16), state, *plan)
    with pytest.raises(RuntimeError, match="do not fit ape"):
        cpu_compressor.feed(torch.zeros(1, 48), torch.zeros(1), torch.zeros(4, 16), state, *plan)
    with pytest.raises(RuntimeError, match="do not fit one another"):
        cpu_compressor.feed(torch.zeros(1, 32), torch.zeros(1), torch.zeros(4, 16), state, *plan[:5],
                            torch.zeros(2, dtype=torch.long))
