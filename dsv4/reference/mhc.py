"""Manifold-constrained hyper-connections (mHC): `hc_mult` residual streams per token.

Each sublayer (attention, FFN) reads a weighted sum of the streams (`pre`) and writes its output
back into every stream (`post`) on top of a doubly-stochastic mix of the old streams (`comb`,
Sinkhorn-normalised so the residual cannot grow). All weights are computed in at least fp32.
"""

from __future__ import annotations

import torch

from .ops import accumulation_dtype, rms_norm


def layer_hyper_connections(cfg, w, layer: int) -> tuple[HyperConnection, HyperConnection]:
    """The attention and FFN mixers of decoder layer `layer`; `w(name)` returns a weight."""

    def hc(kind: str) -> HyperConnection:
        return HyperConnection(*(w(f"layers.{layer}.hc_{kind}_{part}") for part in ("fn", "base", "scale")),
                               hc_mult=cfg.hc_mult, sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
                               norm_eps=cfg.rms_norm_eps)

    return hc("attn"), hc("ffn")


class HyperConnection:
    """The mixing weights of one sublayer: `fn` [(2+n)*n, n*hidden], `base` [(2+n)*n], `scale` [3]."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                 hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        self.fn, self.base, self.scale = fn, base, scale
        self.n, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, S, n, hidden] -> (sublayer input [B, S, hidden], post [B, S, n], comb [B, S, n, n])."""
        n = self.n
        mixes = _stream_mixes(streams, self.fn, self.norm_eps)
        pre_logits, post_logits, comb_logits = mixes.split([n, n, n * n], dim=-1)
        pre_base, post_base, comb_base = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_logits * self.scale[0] + pre_base) + self.hc_eps
        post = 2 * torch.sigmoid(post_logits * self.scale[1] + post_base)
        comb = sinkhorn(comb_logits.unflatten(-1, (n, n)) * self.scale[2] + comb_base.view(n, n),
                        self.sinkhorn_iters, self.hc_eps)
        return weighted_sum(streams, pre), post, comb

    @staticmethod
    def expand(streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """New stream j = post_j * output + sum_i comb[i, j] * stream i; returns the streams' dtype."""
        acc = post.dtype
        mixed = torch.einsum("bsij,bsid->bsjd", comb, streams.to(acc))
        return (post.unsqueeze(-1) * output.to(acc).unsqueeze(-2) + mixed).to(streams.dtype)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax (+eps), then alternate column / row normalisation: `iters` column passes in all."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            *, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """The final collapse of the streams into one hidden vector per token (before `norm`)."""
    pre = torch.sigmoid(_stream_mixes(streams, fn, norm_eps) * scale + base) + hc_eps
    return weighted_sum(streams, pre)


def _stream_mixes(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """fn @ rms_normalised(all streams of a token, flattened), in at least fp32."""
    acc = accumulation_dtype(streams.dtype)
    flat = rms_norm(streams.flatten(-2).to(acc), None, norm_eps)
    return flat @ fn.to(acc).T


def weighted_sum(streams: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i weights_i * stream i, accumulated in the weights' precision; returns the streams' dtype."""
    return (weights.unsqueeze(-1) * streams.to(weights.dtype)).sum(dim=-2).to(streams.dtype)
