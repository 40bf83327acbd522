"""Manifold-constrained hyper-connections (mHC) over a flat batch of tokens, in a few batched ops.

Each token carries `hc_mult` residual streams. A sublayer reads their `pre`-weighted sum and writes
its output back into every stream (`post`) on top of a Sinkhorn-normalised mix of the old streams
(`comb`). All mixing weights come from one projection of the RMS-normalised streams; everything
runs in at least fp32 and the streams keep their dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .ops import accumulation_dtype, rms_norm


class Residual(NamedTuple):
    """The streams [T, n, hidden] and the last sublayer's output [T, hidden], not yet written into them
    (with its `post` [T, n] and `comb` [T, n, n] mixing weights): writing it is the first step of the
    next sublayer's `mix`, so both run as one piece."""

    streams: torch.Tensor
    output: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor

    @classmethod
    def start(cls, streams: torch.Tensor) -> Residual:
        """Streams that no sublayer has written to: output 0, post 0 and comb the identity, which write
        them back unchanged (exactly: every stream is 1 x itself + zeros)."""
        tokens, n, hidden = streams.shape
        acc = accumulation_dtype(streams.dtype)
        return cls(streams, streams.new_zeros(tokens, hidden), streams.new_zeros(tokens, n, dtype=acc),
                   torch.eye(n, dtype=acc, device=streams.device).repeat(tokens, 1, 1))

    def rows(self, index: torch.Tensor) -> Residual:
        return Residual(*(part[index] for part in self))

    def written(self) -> torch.Tensor:
        """The streams with the output written into them."""
        return expand(*self)


class HyperConnection:
    """The mixing weights of one sublayer, as `mix` takes them: `fn` [(2+n)*n, n*hidden], `base`
    [(2+n)*n], `scale` [3] (pre, post and comb scales), already in the accumulation dtype, and the
    RMSNorm weight of the sublayer's input."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm: torch.Tensor, *, hc_mult: int):
        n = hc_mult
        # One scale per mix, so the three scale-and-shift steps are one addcmul.
        scale = scale.repeat_interleave(torch.tensor([n, n, n * n], device=scale.device))
        self.weights = (fn, base, scale, norm)


def mix(streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
        base: torch.Tensor, scale: torch.Tensor, norm: torch.Tensor, *, n: int, sinkhorn_iters: int, hc_eps: float,
        norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Between two sublayers: the last one's output written into the streams (`expand`), then the next
    one's input collapsed from them (`collapse`) and RMS-normed. A function of tensors and constants
    only, so that one compiled form serves every sublayer (`scale` already repeated per mix)."""
    streams = expand(streams, output, post, comb)
    x, post, comb = collapse(streams, fn, base, scale, n, sinkhorn_iters, hc_eps, norm_eps)
    return streams, rms_norm(x, norm, norm_eps), post, comb


def expand(streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New stream j = post_j * output + sum_i comb[i, j] * stream i."""
    acc = post.dtype
    # Broadcast products summed over i rather than a batched matmul: compiled, one fused pass over the
    # streams instead of T tiny products (the `mix` piece at 256 tokens of `small`, 2 cores: 0.9 ms
    # against 2.9; at 32 tokens 112 us against 167).
    mixed = (comb.unsqueeze(-1) * streams.to(acc).unsqueeze(-2)).sum(-3)  # [T, n, hidden]
    return (post.unsqueeze(-1) * output.to(acc).unsqueeze(-2) + mixed).to(streams.dtype)


def collapse(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int,
             sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, hidden] -> (sublayer input [T, hidden], post [T, n], comb [T, n, n])."""
    logits = torch.addcmul(base, stream_mixes(streams, fn, norm_eps), scale)
    gates = torch.sigmoid(logits[:, : 2 * n])
    pre, post = gates[:, :n] + hc_eps, gates[:, n:] * 2
    comb = _sinkhorn(logits[:, 2 * n :].unflatten(-1, (n, n)), sinkhorn_iters, hc_eps)
    return weighted_sum(streams, pre), post, comb


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """The final collapse of the streams [T, n, hidden] into one hidden vector per token."""
    pre = torch.sigmoid(torch.addcmul(base, stream_mixes(streams, fn, norm_eps), scale)) + hc_eps
    return weighted_sum(streams, pre)


def stream_mixes(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """fn @ rms_normalised(a token's streams, flattened) [T, mixes], in at least fp32. (Scaling the
    projection by the per-token norm instead is cheaper, but its rounding moved the logits of the
    bf16 index-key model test past that test's 1e-4.)"""
    return rms_norm(streams.flatten(-2).to(accumulation_dtype(streams.dtype)), None, norm_eps) @ fn.T


def weighted_sum(streams: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i weights_i * stream i [T, hidden], accumulated in the weights' dtype; the streams' dtype.
    (Broadcast and summed, as in `expand`.)"""
    return (weights.unsqueeze(-1) * streams.to(weights.dtype)).sum(-2).to(streams.dtype)


def _sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax (+eps), then alternating column / row normalisation (`iters` column passes), in place."""
    comb = torch.softmax(logits, dim=-1).add_(eps)
    comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
    for _ in range(iters - 1):
        comb.div_(comb.sum(dim=-1, keepdim=True).add_(eps))
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
    return comb
