"""A batch's tokens through a compressor's partial state as one C call (cpu/feed.c), for bf16 or fp32
models whose state is fp32: dsv4.model.compressor.feed together with the state's own gather and
scatter (`PagedCompressor.advance`'s), the same values to the bit (every row is copied or made as
`feed` makes it: kv widened, gate + ape in fp32). Its oracle is `feed` (its test runs both)."""

from __future__ import annotations

import ctypes

import torch

from .cpu_library import as_read, available, entry

__all__ = ["available", "feed", "serves"]

_DTYPES = (torch.float32, torch.bfloat16)


def serves(projected: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether `feed` runs for these rows and this state."""
    return (projected.device.type == "cpu" and projected.dtype in _DTYPES and state.dtype == torch.float32
            and available())


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
