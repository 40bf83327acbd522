"""KV compression: one row per `ratio` tokens, a learned softmax pooling of the window's tokens.

HCA (ratio 128): row w pools tokens 128w .. 128w+127.
CSA (ratio 4, "overlap"): the projections are twice as wide; the first half of the channels (Ca)
of a token feeds the NEXT window's row and the second half (Cb) its own window's row, so row w
pools 8 slots: Ca of tokens 4(w-1) .. 4w-1, then Cb of tokens 4w .. 4w+3. Row 0 has no previous
window: its first four slots carry zero weight. The indexer's keys use the same CSA scheme at
`index_head_dim`.
A row exists only once its window is complete; query t may use rows w < (t + 1) // ratio.
"""

from __future__ import annotations

import torch

from .ops import accumulation_dtype, linear, rms_norm
from .rope import apply_rope


def pool_windows(kv: torch.Tensor, score: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """Softmax-pool every complete window of `ratio` tokens into one row.

    kv, score: [B, T, C] per token, where score = gate + ape[t % ratio] and C = d (overlap=False)
    or 2d (overlap=True, Ca = first d channels, Cb = last d). Tokens after the last complete
    window are ignored. Returns [B, T // ratio, d] in kv's dtype (the softmax and the weighted
    sum run in at least fp32), before the compressor's norm and RoPE.
    """
    batch, tokens, channels = kv.shape
    windows = tokens // ratio
    out_dtype = kv.dtype
    if windows == 0:
        return kv.new_zeros(batch, 0, channels // 2 if overlap else channels)
    acc = accumulation_dtype(kv.dtype)
    kv = kv[:, : windows * ratio].to(acc).view(batch, windows, ratio, channels)
    score = score[:, : windows * ratio].to(acc).view(batch, windows, ratio, channels)
    if overlap:
        d = channels // 2
        # Shift the Ca halves one window later; window 0's predecessor is zero kv with -inf score.
        prev_kv = torch.cat([kv.new_zeros(batch, 1, ratio, d), kv[:, :-1, :, :d]], dim=1)
        prev_score = torch.cat([score.new_full((batch, 1, ratio, d), float("-inf")), score[:, :-1, :, :d]], dim=1)
        kv = torch.cat([prev_kv, kv[..., d:]], dim=2)
        score = torch.cat([prev_score, score[..., d:]], dim=2)
    weights = torch.softmax(score, dim=2)
    return (weights * kv).sum(dim=2).to(out_dtype)


class Compressor:
    """Projections + pooling + norm + RoPE (at position w * ratio) of one compressor."""

    def __init__(self, wkv: torch.Tensor, wgate: torch.Tensor, ape: torch.Tensor, norm: torch.Tensor, *,
                 ratio: int, overlap: bool, inv_freq: torch.Tensor, norm_eps: float):
        self.wkv, self.wgate, self.ape, self.norm = wkv, wgate, ape, norm
        self.ratio, self.overlap, self.inv_freq, self.norm_eps = ratio, overlap, inv_freq, norm_eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, hidden] (the attention input) -> compressed rows [B, S // ratio, d] in x's dtype."""
        tokens = x.shape[1]
        kv = linear(x, self.wkv)
        slot = torch.arange(tokens, device=x.device) % self.ratio
        score = linear(x, self.wgate).to(self.ape.dtype) + self.ape[slot]
        rows = rms_norm(pool_windows(kv, score, self.ratio, self.overlap), self.norm, self.norm_eps)
        positions = torch.arange(rows.shape[1], device=x.device) * self.ratio
        return apply_rope(rows, positions, self.inv_freq).to(x.dtype)
