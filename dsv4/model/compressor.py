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

import torch

from dsv4.kernels import dispatch
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

    def token_rows(self, projected: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """projected [T, 2 * width] (the layer input times wkv | wgate) -> state rows [T, 2 * width]
        (kv | gate + ape) in at least fp32."""
        acc = accumulation_dtype(projected.dtype)
        kv, gate = projected.split(self.width, dim=-1)
        score = gate.to(self.ape.dtype) + self.ape[positions % self.ratio]
        return torch.cat([kv.to(acc), score.to(acc)], dim=-1)

    def advance(self, projected: torch.Tensor, positions: torch.Tensor, plan: CompressPlan, rope: Rope,
                state: torch.Tensor, cache: torch.Tensor, row_format: str, *, kernels: bool) -> None:
        """Feed this batch's tokens (`projected`: their layer input times wkv | wgate, in the model's
        dtype) into `state` [slots, rows, 2 * width] (updated in place) and store
        the rows of the windows they complete in `cache` (a pool view of `row_format` rows) at
        (plan.window_pages, plan.window_page_rows); `rope` rotates at plan.window_positions. With
        `kernels`, through the dispatcher's op."""
        windows = self._feed(projected, positions, plan, state)
        if windows.shape[0] == 0:  # no window completes (most decode steps): nothing to store
            return
        if kernels:
            units = torch.arange(windows.shape[0], device=projected.device)
            dispatch.compress_insert(windows, units, torch.zeros_like(units), plan.window_positions // self.ratio,
                                     rope.cos, rope.sin, self.norm, cache, plan.window_pages,
                                     plan.window_page_rows, ratio=self.ratio, row_format=row_format,
                                     eps=self.norm_eps, model_dtype=projected.dtype)
            return
        pooled = self._pool(windows).to(projected.dtype)
        normed = rms_norm(pooled, self.norm, self.norm_eps)
        rows = rope.rotate_(normed)
        # "fp8" is the one index-key-only format; bf16 / fp32 rows are the same bytes either way.
        packed = pack_index_rows(rows, "fp8") if row_format == "fp8" else pack_main_rows(rows, row_format, rope.dim)
        put_rows(cache, (plan.window_pages, plan.window_page_rows), packed)

    def _feed(self, projected: torch.Tensor, positions: torch.Tensor, plan: CompressPlan,
              state: torch.Tensor) -> torch.Tensor:
        """Updates `state` with this batch's tokens; returns the slots of every window they complete,
        [n_windows, span, 2 * width] in at least fp32 (CSA: the previous window's 4 tokens first)."""
        rows = self.token_rows(projected, positions)
        empty = torch.cat([rows.new_zeros(self.width), rows.new_full((self.width,), float("-inf"))])
        source = torch.cat([state[plan.state_slots, plan.state_rows].to(rows.dtype), rows, empty.unsqueeze(0)])
        windows = source[plan.window_sources]
        state[plan.update_slots, plan.update_rows] = source[plan.update_sources].to(state.dtype)
        return windows

    def _pool(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [n, span, 2 * width] -> [n, dim]: softmax over the window's slots, per channel."""
        kv, score = windows.split(self.width, dim=-1)
        if self.overlap:
            # Slots 0..ratio-1 are the previous window's tokens (their Ca half), the rest this window's (Cb).
            d, r = self.dim, self.ratio
            kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
            score = torch.cat([score[:, :r, :d], score[:, r:, d:]], dim=1)
        return (torch.softmax(score, dim=1) * kv).sum(dim=1)
