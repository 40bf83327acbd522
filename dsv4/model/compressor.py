"""The compressor over paged state: token by token in meaning, whole windows at a time in practice.

Each token contributes a `kv | score` row (score includes `ape`) to its slot's partial state; a
window that completes pools into one compressed row (softmax over its slots, per channel), which is
normed, rotated to position w * ratio and stored. A chunk may start and
end mid-window: the plan (`CompressPlan`) says which state and token rows each completed window
pools and which partial-state rows change, so the CSA overlap half carries across chunks.

Rounding follows the reference (`dsv4.reference.compressor`): kv and score are kept and pooled in
at least fp32, the pooled row is cast to the model dtype, then normed and rotated. On the kernel
path the pooling, norm, RoPE and quantise-and-insert of the new rows are one op
(`dsv4.kernels.dispatch.compress_insert`), which rounds the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4.kernels import cpu_compressor, dispatch
from dsv4.kernels.rows import pack_index_rows, pack_main_rows
from dsv4.memory.pools import put_rows

from .ops import Rope, accumulation_dtype, rms_norm
from .plan import CompressPlan


class PagedCompressor:
    def __init__(self, ape: torch.Tensor, norm: torch.Tensor, *, ratio: int, overlap: bool, norm_eps: float):
        """The token rows' projections (wkv, wgate) belong to the attention, which multiplies them
        together with its own projections of the same layer input."""
        self.dim = norm.numel()
        self.width = ape.shape[-1]  # coff * dim: with overlap, Ca (first dim channels) then Cb
        self.ape, self.norm = ape, norm
        self.ratio, self.overlap, self.norm_eps = ratio, overlap, norm_eps

    def advance(self, projected: torch.Tensor, positions: torch.Tensor, plan: CompressPlan, rope: Rope | None,
                state: torch.Tensor, cache: torch.Tensor, row_format: str, *, kernels: bool,
                feed_rows: Callable) -> None:
        """Feed this batch's tokens (`projected`: their layer input times wkv | wgate, in the model's
        dtype) into `state` [slots, rows, 2 * width] (updated in place) through `feed_rows` (`feed`,
        eager or compiled; on a CPU with the C kernels, bf16 or fp32 rows into an fp32 state,
        `cpu_compressor.feed` instead) and store the rows of the windows they complete in `cache` (a
        pool view of `row_format` rows) at (plan.window_pages, plan.window_page_rows); `rope` rotates at
        plan.window_positions (None when no window completes). With `kernels`, through the
        dispatcher's op."""
        if cpu_compressor.serves(projected, state):  # the gather, feed and scatter in one C call
            windows = cpu_compressor.feed(projected, positions, self.ape, state, plan.state_slots, plan.state_rows,
                                          plan.window_sources, plan.update_slots, plan.update_rows,
                                          plan.update_sources)
        else:
            windows, updates = feed_rows(projected, positions, self.ape, state[plan.state_slots, plan.state_rows],
                                         plan.window_sources, plan.update_sources)
            state[plan.update_slots, plan.update_rows] = updates.to(state.dtype)
        if windows.shape[0] == 0:  # no window completes (most decode steps): nothing to store
            return
        self.store(windows, plan, rope, cache, row_format, projected.dtype, kernels=kernels)

    def store(self, windows: torch.Tensor, plan: CompressPlan, rope: Rope, cache: torch.Tensor, row_format: str,
              dtype: torch.dtype, *, kernels: bool) -> None:
        """The rows of the windows the batch completes, from their slots `windows` [n, span, 2 * width] (at
        least fp32, as `feed` returns them), pooled, rounded into the model's `dtype`, normed, rotated (`rope`
        at plan.window_positions) and stored in `cache` as `advance` says."""
        if not kernels and cpu_compressor.stores(windows, dtype, row_format):  # one C call
            cpu_compressor.store(windows, self.norm, rope.cos2, rope.sin2, cache, plan.window_pages,
                                 plan.window_page_rows, ratio=self.ratio, overlap=self.overlap, eps=self.norm_eps,
                                 dtype=dtype, row_format=row_format)
            return
        if kernels:
            units = torch.arange(windows.shape[0], device=windows.device)
            dispatch.compress_insert(windows, units, torch.zeros_like(units), plan.window_positions // self.ratio,
                                     rope.cos, rope.sin, self.norm, cache, plan.window_pages,
                                     plan.window_page_rows, ratio=self.ratio, row_format=row_format,
                                     eps=self.norm_eps, model_dtype=dtype)
            return
        pooled = self._pool(windows).to(dtype)
        normed = rms_norm(pooled, self.norm, self.norm_eps)
        rows = rope.rotate_(normed)
        # "fp8" is the one index-key-only format; bf16 / fp32 rows are the same bytes either way.
        packed = pack_index_rows(rows, "fp8") if row_format == "fp8" else pack_main_rows(rows, row_format, rope.dim)
        put_rows(cache, (plan.window_pages, plan.window_page_rows), packed)

    def _pool(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [n, span, 2 * width] -> [n, dim]: softmax over the window's slots, per channel."""
        kv, score = windows.split(self.width, dim=-1)
        if self.overlap:
            # Slots 0..ratio-1 are the previous window's tokens (their Ca half), the rest this window's (Cb).
            d, r = self.dim, self.ratio
            kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
            score = torch.cat([score[:, :r, :d], score[:, r:, d:]], dim=1)
        return (torch.softmax(score, dim=1) * kv).sum(dim=1)


def feed(projected: torch.Tensor, positions: torch.Tensor, ape: torch.Tensor, read_state: torch.Tensor,
         window_sources: torch.Tensor, update_sources: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's tokens through a compressor's partial state, without the state's own reads and writes:
    projected [T, 2 * width] (the layer input times wkv | wgate, in the model's dtype), positions [T],
    ape [ratio, width] and read_state [n_read, 2 * width] (state[plan.state_slots, plan.state_rows])
    -> (the slots of every window the tokens complete [n_windows, span, 2 * width], the partial-state
    rows that change [n_update, 2 * width]), both in at least fp32. Sizes come from the tensors, so
    one compiled form (dsv4/model/compile.py) serves every compressor of a model."""
    ratio, width = ape.shape
    acc = accumulation_dtype(projected.dtype)
    kv, gate = projected[:, :width], projected[:, width:]  # (not split: a compiled form's width is symbolic)
    score = gate.to(ape.dtype) + ape[positions % ratio]
    rows = torch.cat([kv.to(acc), score.to(acc)], dim=-1)  # the tokens' state rows: kv | gate + ape
    empty = torch.cat([rows.new_zeros(width), rows.new_full((width,), float("-inf"))])
    source = torch.cat([read_state.to(rows.dtype), rows, empty.unsqueeze(0)])
    return source[window_sources], source[update_sources]
