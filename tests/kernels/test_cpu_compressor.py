"""The compressors' feed and store as C calls (dsv4/kernels/cpu_compressor.py) against their torch code
(dsv4.model.compressor.feed with the state's gather and scatter, as PagedCompressor.advance runs it, and
PagedCompressor.store's pooling, norm, rotation and packing)."""

import pytest
import torch

from dsv4.kernels import cpu_compressor
from dsv4.kernels.rows import pack_index_rows
from dsv4.model import compressor
from dsv4.model.ops import Rope

pytestmark = pytest.mark.skipif(not cpu_compressor.available(), reason="the CPU kernels do not run here (no AVX512-BF16 or AVX2, or no C compiler)")


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


def store_case(ratio: int, overlap: bool, dims: int, count: int, g: torch.Generator):
    """`count` windows' slots as the feed copies them out (kv | score, the scores with position biases; window
    0's missing predecessor as the empty row, kv 0 and score -inf), a norm and RoPE tables, a compressor."""
    width, span = dims * (2 if overlap else 1), ratio * (2 if overlap else 1)
    windows = torch.cat([torch.randn(count, span, width, generator=g), torch.randn(count, span, width, generator=g) * 3],
                        dim=-1)
    if overlap:
        windows[0, :ratio, :width], windows[0, :ratio, width:] = 0.0, float("-inf")
    norm = torch.rand(dims, generator=g) + 0.5
    rope = Rope(torch.randint(0, 100_000, (count,), generator=g), torch.rand(16, generator=g), torch.float32)
    ape = torch.zeros(ratio, width)
    return windows, rope, compressor.PagedCompressor(ape, norm, ratio=ratio, overlap=overlap, norm_eps=1e-6)


def stored(comp, windows, rope, dtype, row_format, row_bytes, c_kernel: bool):
    """The rows `PagedCompressor.store` packs (through the C kernel, or its torch code), in a cache of
    three pages of rows with other bytes between them, the windows' pages and rows out of order."""
    count = windows.shape[0]
    cache = torch.full((3, 8, row_bytes + 8), 7, dtype=torch.uint8)[:, :, 4 : 4 + row_bytes]
    pages, rows = torch.arange(count) % 3, (torch.arange(count) * 5) % 8
    plan = type("Plan", (), {"window_pages": pages, "window_page_rows": rows})()
    available = cpu_compressor.available
    if not c_kernel:
        cpu_compressor.available = lambda: False
    try:
        comp.store(windows, plan, rope, cache, row_format, dtype, kernels=False)
    finally:
        cpu_compressor.available = available
    return cache[pages, rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio,overlap,dims,count", [(4, True, 64, 5), (128, False, 48, 2), (4, True, 128, 1)])
def test_store_matches_torch(dtype, ratio, overlap, dims, count):
    """The windows' rows pooled, normed, rotated and packed by the C kernel against the torch code, as the
    model's fp32 / bf16 rows: within the dtype's rounding (the softmax's exp differs within 2 ulp)."""
    g = torch.Generator().manual_seed(ratio + dims + count)
    windows, rope, comp = store_case(ratio, overlap, dims, count, g)
    row_format = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    got, want = (stored(comp, windows, rope, dtype, row_format, dims * dtype.itemsize, c).view(dtype).float()
                 for c in (True, False))
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    assert ((got - want).abs() <= tolerance * want.abs() + tolerance * 1e-2).all()
    assert ((got - want).abs() > 0).float().mean() < (0.2 if dtype == torch.bfloat16 else 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_packs_fp8_index_keys_as_the_row_format_does(dtype):
    """Index-key rows as fp8: the kernel's bytes are pack_index_rows' of the kernel's own rows (stored as
    the model's dtype from the same windows), to the bit: scales and e4m3 values rounded as torch rounds."""
    g = torch.Generator().manual_seed(11)
    windows, rope, comp = store_case(4, True, 128, 6, g)
    comp.norm = torch.logspace(-5, 1, 128)  # values over six decades in each row: e4m3's subnormals too
    plain = stored(comp, windows, rope, dtype, {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype],
                   128 * dtype.itemsize, True).view(dtype)
    assert torch.equal(stored(comp, windows, rope, dtype, "fp8", 132, True), pack_index_rows(plain, "fp8"))
