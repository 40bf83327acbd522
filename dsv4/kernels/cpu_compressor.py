"""A compressor's work as C calls, for bf16 or fp32 models whose state is fp32:
- `feed` (cpu/feed.c): a batch's tokens through the partial state, dsv4.model.compressor.feed together
  with the state's own gather and scatter (`PagedCompressor.advance`'s), the same values to the bit (every
  row is copied or made as `feed` makes it: kv widened, gate + ape in fp32);
- `store` (cpu/project.c): the rows of the windows the batch completes pooled, normed, rotated and packed
  into the cache where they lie (`PagedCompressor.store`'s torch code, a dozen ops a compressor; the
  softmax's exp within 2 ulp of torch's).
Their oracles are `feed` and the torch code of `PagedCompressor.store` (their tests run both)."""

from __future__ import annotations

import ctypes

import torch

from .cpu_library import as_read, available, entry

__all__ = ["STORE_FORMATS", "available", "feed", "serves", "store", "stores"]

_DTYPES = (torch.float32, torch.bfloat16)


def serves(projected: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether `feed` runs for these rows and this state."""
    return (projected.device.type == "cpu" and projected.dtype in _DTYPES and state.dtype == torch.float32
            and available())


# The row formats `store` packs (cpu/project.c's STORE_*): the fp32 or bf16 values of a main or index-key
# row, or an index-key row's fp8 (dsv4/kernels/rows.py)
STORE_FORMATS = ("fp32", "bf16", "fp8")
MAX_STORE_SPAN = 1024  # cpu/project.c's compressor_store: the most slots a window pools


def stores(windows: torch.Tensor, dtype: torch.dtype, row_format: str) -> bool:
    """Whether `store` packs these windows' rows, of a model of `dtype`, as `row_format`."""
    return (windows.is_cpu and windows.dtype == torch.float32 and dtype in _DTYPES and row_format in STORE_FORMATS
            and available())


def store(windows: torch.Tensor, norm: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, cache: torch.Tensor,
          pages: torch.Tensor, page_rows: torch.Tensor, *, ratio: int, overlap: bool, eps: float, dtype: torch.dtype,
          row_format: str) -> None:
    """windows [W, span, 2 * width] fp32 (the slots of the windows a batch completes, as `feed` returns
    them), the rows' norm [dims] fp32, RoPE tables cos2, sin2 [W, R] fp32 at the windows' positions ->
    each window's row, in the model's `dtype` (fp32 or bf16), packed as `row_format` (STORE_FORMATS) into
    `cache` (uint8 [pages, rows, row bytes]) at (pages[w], page_rows[w])."""
    count, span, double_width = windows.shape
    dims, rope = norm.shape[0], cos2.shape[-1]
    row_bytes = {"fp32": 4 * dims, "bf16": 2 * dims, "fp8": dims + 4}.get(row_format)
    problems = []
    if windows.dtype != torch.float32 or not windows.is_cpu or double_width != 2 * dims * (2 if overlap else 1):
        problems.append(f"windows must be fp32 [W, span, {2 * dims * (2 if overlap else 1)}] on the CPU (got "
                        f"{windows.dtype} {tuple(windows.shape)})")
    if dtype not in _DTYPES or row_bytes is None:
        problems.append(f"no rows of a {dtype} model as {row_format!r}")
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[2] != row_bytes or cache.stride(2) != 1:
        problems.append(f"cache must be uint8 [pages, rows, {row_bytes}] with contiguous rows (got {tuple(cache.shape)})")
    if (any(t.dtype != torch.float32 for t in (norm, cos2, sin2)) or cos2.shape != (count, rope) or sin2.shape != cos2.shape
            or rope % 2 or rope > dims):
        problems.append("the norm and RoPE tables must be fp32, the tables [W, an even number of dims up to the rows']")
    if pages.shape != (count,) or page_rows.shape != (count,) or span > MAX_STORE_SPAN:
        problems.append(f"pages and page_rows must be [W], a window at most {MAX_STORE_SPAN} slots (got {span})")
    if problems:
        raise RuntimeError("cpu compressor store: " + "; ".join(problems))
    params = store_params(count, span, double_width // 2, dims, ratio, overlap, rope, dtype, row_format, cache)
    inputs = [as_read(windows), as_read(norm), as_read(cos2), as_read(sin2), cache, as_read(pages, torch.int64),
              as_read(page_rows, torch.int64)]
    status = entry("compressor_store")(*(t.data_ptr() for t in inputs), (ctypes.c_int64 * len(params))(*params), eps,
                                       torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"cpu compressor store: windows of {span} slots are past its {MAX_STORE_SPAN}")


def store_params(count: int, span: int, width: int, dims: int, ratio: int, overlap: bool, rope: int, dtype: torch.dtype,
                 row_format: str, cache: torch.Tensor) -> tuple[int, ...]:
    """The store kernel's p[] (cpu/project.c's S_*) for `count` windows of `span` slots of [2 * width] into
    `cache` rows of `dims` values as `row_format`, rotated over `rope` dims."""
    return (count, span, width, dims, ratio, overlap, rope, dtype == torch.float32, STORE_FORMATS.index(row_format),
            cache.stride(0), cache.stride(1))


def feed_params(tokens: int, width: int, ratio: int, strides: tuple[int, int], dtype: torch.dtype, state: torch.Tensor,
                read: int, windows: int, span: int, updates: int) -> tuple[int, ...]:
    """The feed kernel's p[] (cpu/feed.c's F_*) for `tokens` projected rows [T, 2 * width] of `strides` and
    `dtype` into `state`: `read` state rows, `windows` windows of `span` rows, `updates` rows changed."""
    return (tokens, width, ratio, *strides, dtype == torch.float32, state.stride(0), state.stride(1), read, windows, span,
            updates)


def feed(projected: torch.Tensor, positions: torch.Tensor, ape: torch.Tensor, state: torch.Tensor,
         state_slots: torch.Tensor, state_rows: torch.Tensor, window_sources: torch.Tensor,
         update_slots: torch.Tensor, update_rows: torch.Tensor, update_sources: torch.Tensor) -> torch.Tensor:
    """projected [T, 2 * width] (any strides; bf16 or fp32), positions [T], ape [ratio, width]
    fp32, state [slots, rows, 2 * width] fp32 (a pool's view: updated in place) and a CompressPlan's
    index tensors -> the slots of every window the tokens complete [n_windows, span, 2 * width] fp32
    (`feed`'s first result); the state's changed rows are written (`feed`'s second, stored)."""
    tokens = projected.shape[0]
    ratio, width = ape.shape
    windows, span = window_sources.shape
    problems = []
    if not serves(projected, state):
        problems.append(f"projected must be bf16 or fp32 and the state fp32, on the CPU (got {projected.dtype}, "
                        f"{state.dtype} on {projected.device})")
    if projected.shape != (tokens, 2 * width) or positions.shape != (tokens,):
        problems.append(f"projected {tuple(projected.shape)} and positions {tuple(positions.shape)} do not fit ape "
                        f"{tuple(ape.shape)}")
    if ape.dtype != torch.float32 or state.dim() != 3 or state.shape[2] != 2 * width or state.stride(2) != 1:
        problems.append(f"ape must be fp32 and state [slots, rows, {2 * width}] with contiguous rows (got "
                        f"{ape.dtype}, {tuple(state.shape)})")
    if state_slots.shape != state_rows.shape or not update_slots.shape == update_rows.shape == update_sources.shape:
        problems.append("the plan's state and update indices do not fit one another")
    if problems:
        raise RuntimeError("cpu compressor feed: " + "; ".join(problems))
    indices = [as_read(t, torch.int64) for t in (positions, state_slots, state_rows, window_sources,
                                                        update_slots, update_rows, update_sources)]
    ape = as_read(ape)  # (held: a copy's memory must outlive the call)
    out = torch.empty(windows, span, 2 * width)
    params = feed_params(tokens, width, ratio, projected.stride(), projected.dtype, state, state_slots.shape[0],
                         windows, span, update_slots.shape[0])
    positions, state_slots, state_rows, window_sources, update_slots, update_rows, update_sources = indices
    status = entry("compressor_feed")(
        projected.data_ptr(), positions.data_ptr(), ape.data_ptr(), state.data_ptr(),
        state_slots.data_ptr(), state_rows.data_ptr(), window_sources.data_ptr(), update_slots.data_ptr(),
        update_rows.data_ptr(), update_sources.data_ptr(), out.data_ptr(), (ctypes.c_int64 * len(params))(*params))
    if status != 0:
        raise MemoryError("cpu compressor feed: the kernel could not allocate its scratch memory")
    return out
