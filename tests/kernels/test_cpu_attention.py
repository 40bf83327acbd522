"""The CPU attention kernels (dsv4/kernels/cpu_attention.py) over sweeps of shapes (head dims
and key counts off their 32- and 16-wide steps): the band attention, on AMX tiles and as bf16 pair products
(and in fp32 there), against the model's attention in float64, with bands off their 32-wide steps, blocks that
overrun the chunk, source rows that end before the last band (read as zeros), random masks and the
masks the model's plan builds (a prompt's first chunk, whose early blocks see few of their band's rows,
and a later one), one thread against several; the decode attention against the model's torch op,
reading strided pools in place, bf16 and fp32, tokens on a thread each and on the whole team."""

import pytest
import torch

from dsv4.kernels import cpu_attention
from dsv4.model.attention import banded_sink_attention, decode_sink_attention

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason="the CPU kernels do not run here (no AVX512-BF16 or AVX2, or no C compiler)")

needs_amx = pytest.mark.skipif(not cpu_attention.amx_available(), reason="this CPU has no AMX tiles for bf16")

# (batch, blocks, queries a block, heads, band rows, compressed rows, head dim, queries, source rows)
TILE_SHAPES = [(1, 16, 16, 16, 144, 64, 512, 256, 384), (2, 3, 16, 3, 37, 0, 64, 40, 69), (1, 1, 37, 16, 48, 5, 512, 37, 37),
               (2, 4, 32, 5, 160, 17, 96, 100, 150), (1, 2, 16, 1, 20, 33, 32, 17, 36), (3, 2, 64, 2, 191, 40, 128, 128, 255)]


def tile_inputs(shape, seed):
    """bf16 operands as the model hands them over: q [B, L, H, D]; the bands' source rows [B, R, D] as
    a view of a wider buffer whose rows past R hold NaN (the kernel must read them as zeros)."""
    batch, blocks, block, heads, keys, count, dim, length, source_rows = shape
    g = torch.Generator().manual_seed(seed)

    def bf16(*size):
        return torch.randn(*size, generator=g).bfloat16()

    buffer = bf16(batch, (blocks - 1) * block + keys + 64, dim)
    buffer[:, source_rows:] = float("nan")
    raw_allowed = (torch.rand(1, blocks, block, keys, generator=g) < 0.7).expand(batch, -1, -1, -1)
    compressed = compressed_allowed = None
    if count:
        compressed = bf16(batch, count, dim)
        compressed_allowed = torch.rand(batch, blocks, block, count, generator=g) < 0.5
    return bf16(batch, length, heads, dim), buffer[:, :source_rows], raw_allowed, torch.randn(heads, generator=g) * 3, \
        compressed, compressed_allowed


def tile_expected(q, rows, raw_allowed, sink, compressed, compressed_allowed, block, scale):
    """The model's attention in float64 over the same values, [B, L, H, D]."""
    (batch, length), (blocks, keys) = q.shape[:2], raw_allowed.shape[1::2]
    height = (blocks - 1) * block + keys
    source = torch.cat([rows.double(), rows.new_zeros(batch, max(0, height - rows.shape[1]), q.shape[-1]).double()], 1)
    raw = source[:, :height].unfold(1, keys, block).transpose(-1, -2)
    queries = torch.nn.functional.pad(q.double(), (0, 0, 0, 0, 0, blocks * block - length)).unflatten(1, (blocks, block))
    extra = () if compressed is None else (compressed.double(), compressed_allowed)
    return banded_sink_attention(queries, raw, raw_allowed, sink.double(), *extra, scale=scale).flatten(1, 2)[:, :length]


# (batch, blocks, queries a block, heads, band rows, compressed rows, head dim, queries, source rows): the
# AVX512-BF16 kernel's own layouts besides, which the tiles do not read (blocks of any size, head dims
# of any even size)
DOTS_SHAPES = TILE_SHAPES + [(2, 3, 5, 3, 37, 0, 70, 14, 40), (1, 2, 7, 5, 33, 17, 66, 12, 20), (1, 1, 1, 1, 1, 1, 2, 1, 1)]


@pytest.fixture(params=[True, False], ids=["tiles", "dots"])
def tiles(request):
    if request.param and not cpu_attention.amx_available():
        pytest.skip("this CPU has no AMX tiles for bf16")
    return request.param


def assert_close_to(got, want, where):
    """The float64 result rounded once to bf16 (half a bf16 step: 2^-8 of the value at most), give or
    take fp32 sums' rounding."""
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-5 * want.abs().max()).all(), where
    assert (got == want.bfloat16()).double().mean() > 0.998, where  # (the tiles' inexact split: ~0.5% differ)


@pytest.mark.parametrize("index", range(len(DOTS_SHAPES)))
def test_band_attention_equals_the_float64_attention(index, tiles):
    shape = DOTS_SHAPES[index]
    if tiles and shape not in TILE_SHAPES:
        pytest.skip("a layout the tiles do not read")
    block, scale = shape[2], shape[6] ** -0.5
    for seed in range(2):
        args = tile_inputs(shape, seed)
        got = cpu_attention.band_attention(*args, block=block, scale=scale, tiles=tiles)
        assert got.dtype == torch.bfloat16 and got.shape == args[0].shape
        assert_close_to(got, tile_expected(*args, block, scale), (shape, seed))


@pytest.mark.parametrize("shape", DOTS_SHAPES)
def test_band_attention_in_fp32_equals_the_float64_attention(shape):
    """An fp32 model's operands (no bf16 values: the logits as fp32 FMAs) on AVX512-BF16: the float64
    result within fp32 sums' rounding; the tiles refuse them."""
    block, scale = shape[2], shape[6] ** -0.5
    for seed in range(2):
        q, rows, raw_allowed, sink, compressed, compressed_allowed = tile_inputs(shape, seed)
        q = q.float() + torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)) * 1e-3
        args = (q, rows.float(), raw_allowed, sink, None if compressed is None else compressed.float(),
                compressed_allowed)
        got = cpu_attention.band_attention(*args, block=block, scale=scale, tiles=False)
        want = tile_expected(*args, block, scale)
        assert got.dtype == torch.float32 and got.shape == q.shape
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5, (shape, seed)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_attention.band_attention(*args, block=block, scale=scale, tiles=True)


def plan_masks(blocks, block, keys, window, start, length, compressed, ratio):
    """The band and compressed masks `dsv4.model.plan` builds for one chunk of `length` queries from
    position `start` (blocks of `block` queries, bands of `keys` rows from start - window + 1 + n * block),
    over `compressed` rows of `ratio` positions each (row w complete at position (w + 1) * ratio - 1)."""
    n = torch.arange(blocks).view(blocks, 1, 1)
    j = torch.arange(block).view(1, block, 1)
    k = torch.arange(keys).view(1, 1, keys)
    band = (k >= j) & (k < j + window) & (n * block + j < length) & (start - window + 1 + n * block + k >= 0)
    position = start + n * block + j
    seen = (torch.arange(compressed).view(1, 1, -1) < (position + 1) // ratio) & (n * block + j < length)
    return band.unsqueeze(0), seen.unsqueeze(0)


@pytest.mark.parametrize("start", [0, 300], ids=["first chunk", "later chunk"])
def test_band_attention_over_the_plan_s_masks(start, tiles):
    """The masks of a real chunk: the first one's early blocks see only their last band rows (the
    AVX512-BF16 kernel then computes only the columns their queries attend to), compressed rows become
    visible as the queries advance, and the blocks' work differs (the kernel shares it by cost)."""
    window, block, length, ratio = 32, 16, 120, 4
    blocks, keys = -(-length // block), block + window - 1 + 1
    count = (start + length) // ratio
    g = torch.Generator().manual_seed(start)
    q = torch.randn(1, length, 4, 64, generator=g).bfloat16()
    rows = torch.randn(1, (blocks - 1) * block + keys, 64, generator=g).bfloat16()
    compressed = torch.randn(1, count, 64, generator=g).bfloat16()
    band, seen = plan_masks(blocks, block, keys, window, start, length, count, ratio)
    sink = torch.randn(4, generator=g)
    args = (q, rows, band, sink, compressed, seen)
    got = cpu_attention.band_attention(*args, block=block, scale=0.125, tiles=tiles)
    assert_close_to(got, tile_expected(*args, block, 0.125), start)


def test_band_attention_on_one_thread_computes_the_same_bits_as_on_several(tiles):
    band, seen = plan_masks(16, 16, 144, 128, 0, 256, 64, 4)
    q, rows, _, sink, compressed, _ = tile_inputs(TILE_SHAPES[0], 3)
    for args in (tile_inputs(TILE_SHAPES[0], 3), (q, rows, band, sink, compressed, seen)):
        several = cpu_attention.band_attention(*args, block=16, scale=0.05, tiles=tiles)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            one = cpu_attention.band_attention(*args, block=16, scale=0.05, tiles=tiles)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, several)


def test_band_attention_refuses_layouts_it_cannot_read(tiles):
    q, rows, raw_allowed, sink, compressed, _ = tile_inputs(TILE_SHAPES[3], 0)
    step = 32 if tiles else 2
    with pytest.raises(RuntimeError, match=f"multiple of {step}"):
        cpu_attention.band_attention(q[..., :47], rows[..., :47], raw_allowed, sink, block=32, scale=1.0, tiles=tiles)
    with pytest.raises(RuntimeError, match=f"multiple of {step}"):
        cpu_attention.band_attention(q.transpose(1, 2).contiguous().transpose(1, 2), rows, raw_allowed, sink, block=32,
                                     scale=1.0, tiles=tiles)
    if tiles:
        with pytest.raises(RuntimeError, match="multiples of 16"):
            cpu_attention.band_attention(q, rows, raw_allowed[:, :, :24], sink, block=24, scale=1.0, tiles=tiles)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_attention.band_attention(q.float(), rows, raw_allowed, sink, block=32, scale=1.0, tiles=tiles)
    with pytest.raises(RuntimeError, match="compressed"):
        cpu_attention.band_attention(q, rows, raw_allowed, sink, compressed, None, block=32, scale=1.0, tiles=tiles)


# (tokens, heads, head dim, ring rows, compressed rows a token, slots, pages, rows a page)
DECODE_SHAPES = [(2, 16, 512, 128, 64, 5, 40, 32), (3, 5, 70, 9, 0, 4, 0, 0), (1, 1, 2, 1, 1, 2, 3, 2),
                 (4, 20, 64, 33, 17, 6, 30, 8), (32, 16, 512, 128, 64, 40, 300, 32)]


def decode_inputs(shape, seed, dtype=torch.bfloat16):
    """Pools as strided views of wider buffers (other layers' bytes between rows), each token's ring
    in its own slot, its compressed rows at distinct places; what it does not see holds NaN."""
    tokens, heads, dim, window, count, slots, pages, page_rows = shape
    g = torch.Generator().manual_seed(seed)
    ring_pool = torch.randn(slots, window, 2, dim, generator=g).to(dtype).view(torch.uint8)[:, :, 0]
    slot = torch.randperm(slots, generator=g)[:tokens]
    at = torch.randint(0, 3 * window, (tokens,), generator=g)
    at[0] = min(2, window - 1)  # a ring still filling: its rows past `at` were never written
    ring_pool.view(dtype)[slot[0], at[0] + 1 :] = float("nan")
    q, sink = torch.randn(tokens, heads, dim, generator=g).to(dtype), torch.randn(heads, generator=g)
    compressed = ()
    if count:
        pool = torch.randn(pages, page_rows, 3, dim, generator=g).to(dtype).view(torch.uint8)[:, :, 1]
        flat = torch.randperm(pages * page_rows, generator=g)[: tokens * count].view(tokens, count)
        page, row = flat // page_rows, flat % page_rows
        exists = torch.rand(tokens, count, generator=g) < 0.8
        allowed = exists & (torch.rand(tokens, count, generator=g) < 0.7)
        pool.view(dtype)[page[~exists], row[~exists]] = float("nan")
        compressed = (pool, page, row, exists, allowed)
    return q, ring_pool, slot, at, sink, compressed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_decode_attention_equals_the_models_torch_op(shape, dtype):
    """Against decode_sink_attention over the gathered rows (itself tested against the reference):
    the same sums in another order, so in bf16 at most one rounding apart, and no NaN from rows not
    seen."""
    scale = shape[2] ** -0.5
    for seed in range(2):
        q, ring_pool, slot, at, sink, compressed = decode_inputs(shape, seed, dtype)
        got = cpu_attention.decode_attention(q, ring_pool, slot, at, sink, *compressed, scale=scale)
        gathered = ()
        if compressed:
            pool, page, row, exists, allowed = compressed
            gathered = (pool[page, row].view(dtype), exists, allowed)
        want = decode_sink_attention(q, ring_pool[slot].view(dtype), at, sink, *gathered, scale=scale)
        assert got.dtype == dtype and got.shape == q.shape and torch.isfinite(got).all()
        # the fp32 sums' own error where a result cancels to ~0, plus in bf16 one rounding (8 significant bits)
        rounding = 2**-7 if dtype == torch.bfloat16 else 1e-5
        bound = want.float().abs() * rounding + 1e-5 * want.float().abs().amax(-1, keepdim=True)
        assert ((got.float() - want.float()).abs() <= bound).all(), (shape, seed)
        if dtype == torch.bfloat16:
            assert (got != want).float().mean() < 0.01, (shape, seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tokens_on_the_whole_team_equal_tokens_on_one_thread_each(dtype):
    """Fewer tokens than threads: the team shares each token (key ranges, then value chunks); the
    same results as one thread, but for the order of the denominators' fp32 sums."""
    shape = DECODE_SHAPES[0]
    q, ring_pool, slot, at, sink, compressed = decode_inputs(shape, 5, dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 3))  # (a team, whatever this machine's count)
    try:
        team = cpu_attention.decode_attention(q, ring_pool, slot, at, sink, *compressed, scale=0.05)
        torch.set_num_threads(1)
        alone = cpu_attention.decode_attention(q, ring_pool, slot, at, sink, *compressed, scale=0.05)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(team.float(), alone.float(), rtol=2**-7 if dtype == torch.bfloat16 else 1e-6, atol=0)


def test_decode_attention_refuses_rows_it_cannot_read_in_place():
    q, ring_pool, slot, at, sink, _ = decode_inputs(DECODE_SHAPES[1], 0)
    with pytest.raises(RuntimeError, match="pools must be"):
        cpu_attention.decode_attention(q, ring_pool.view(torch.bfloat16), slot, at, sink, scale=1.0)
    with pytest.raises(RuntimeError, match="pools must be"):  # fp32 queries over bf16 rows
        cpu_attention.decode_attention(q.float(), ring_pool, slot, at, sink, scale=1.0)
    with pytest.raises(RuntimeError, match="q must be"):
        cpu_attention.decode_attention(q.half(), ring_pool, slot, at, sink, scale=1.0)
