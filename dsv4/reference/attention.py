"""DeepSeek-V4 attention: one shared K=V head, sliding window + compressed rows + a sink per head.

Every query t attends to the raw rows of tokens max(0, t - window + 1) .. t and, on compressed
layers, to compressed rows: all complete ones (HCA) or the indexer's picks (CSA). A learned
per-head sink logit joins the softmax denominator without contributing a value. Because K = V,
values carry RoPE on their last dims; RoPE is undone on the output at the query's position.
"""

from __future__ import annotations

import torch

from dsv4.config import CSA, WINDOW

from .compressor import Compressor
from .indexer import Indexer, visible_rows
from .ops import accumulation_dtype, linear, rms_norm
from .rope import apply_rope


def window_mask(positions: torch.Tensor, window: int) -> torch.Tensor:
    """[S, S] bool: query t sees raw row j iff t - window < j <= t."""
    distance = positions.unsqueeze(-1) - positions.unsqueeze(0)
    return (distance >= 0) & (distance < window)


def picks_mask(picks: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Indexer picks [B, S, k] (-1 = none) -> [B, S, N] bool of the rows each query attends to."""
    batch, tokens, _ = picks.shape
    slots = torch.where(picks < 0, num_rows, picks)  # park "none" in a spare column, then drop it
    mask = torch.zeros(batch, tokens, num_rows + 1, dtype=torch.bool, device=picks.device)
    return mask.scatter_(-1, slots, True)[..., :num_rows]


def sink_attention(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [B, H, S, D]; keys [B, K, D] (K = V, shared by all heads); allowed [B, S, K] bool;
    sink [H] logits -> output [B, H, S, D]. Logits, softmax and the weighted sum run in at least fp32."""
    acc = accumulation_dtype(q.dtype)
    keys = keys.to(acc)
    logits = torch.einsum("bhsd,bkd->bhsk", q.to(acc), keys) * scale
    logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    sink_logits = sink.to(acc).view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    probs = torch.softmax(torch.cat([logits, sink_logits], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhsk,bkd->bhsd", probs, keys).to(q.dtype)


class Attention:
    def __init__(self, cfg, layer: int, w, inv_freq: torch.Tensor, round_kv, round_index_keys):
        """`w(name)` fetches this layer's tensor `attn.<name>`; `round_*` model the caches' row formats."""
        self.cfg, self.inv_freq, self.round_kv = cfg, inv_freq, round_kv
        self.wq_a, self.q_norm, self.wq_b = w("wq_a.weight"), w("q_norm.weight"), w("wq_b.weight")
        self.wkv, self.kv_norm = w("wkv.weight"), w("kv_norm.weight")
        self.wo_a, self.wo_b, self.sink = w("wo_a.weight"), w("wo_b.weight"), w("attn_sink")
        kind = cfg.layer_kind(layer)
        self.compressor = self.indexer = None
        if kind != WINDOW:
            self.compressor = _compressor(cfg, w, "compressor.", cfg.compress_ratios[layer],
                                          overlap=kind == CSA, inv_freq=inv_freq)
        if kind == CSA:
            index_compressor = _compressor(cfg, w, "indexer.compressor.", cfg.compress_ratios[layer],
                                           overlap=True, inv_freq=inv_freq)
            self.indexer = Indexer(w("indexer.wq_b.weight"), w("indexer.weights_proj.weight"), index_compressor,
                                   n_heads=cfg.index_n_heads, head_dim=cfg.index_head_dim, topk=cfg.index_topk,
                                   inv_freq=inv_freq, round_keys=round_index_keys)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, S, hidden] (already attn_norm'ed), positions [S] -> [B, S, hidden]."""
        cfg = self.cfg
        batch, tokens, _ = x.shape
        qr = rms_norm(linear(x, self.wq_a), self.q_norm, cfg.rms_norm_eps)
        q = linear(qr, self.wq_b).unflatten(-1, (cfg.num_heads, cfg.head_dim)).transpose(1, 2)
        q = apply_rope(rms_norm(q, None, cfg.rms_norm_eps), positions, self.inv_freq)  # [B, H, S, D]

        kv = rms_norm(linear(x, self.wkv), self.kv_norm, cfg.rms_norm_eps)
        keys = self.round_kv(apply_rope(kv, positions, self.inv_freq))  # [B, S, D]
        allowed = window_mask(positions, cfg.sliding_window).expand(batch, tokens, tokens)
        if self.compressor is not None:
            rows = self.round_kv(self.compressor(x))
            if self.indexer is not None:
                rows_allowed = picks_mask(self.indexer(x, qr, positions), rows.shape[1])
            else:
                rows_allowed = visible_rows(positions, rows.shape[1], self.compressor.ratio).expand(batch, -1, -1)
            keys = torch.cat([keys, rows], dim=1)
            allowed = torch.cat([allowed, rows_allowed], dim=-1)

        out = sink_attention(q, keys, allowed, self.sink, cfg.head_dim**-0.5)
        out = apply_rope(out, positions, self.inv_freq, inverse=True).transpose(1, 2)  # [B, S, H, D]
        return self._grouped_output(out)

    def _grouped_output(self, out: torch.Tensor) -> torch.Tensor:
        """Heads are split into o_groups groups; wo_a projects each group separately, wo_b mixes them."""
        groups = self.cfg.o_groups
        grouped = out.flatten(2).unflatten(-1, (groups, -1))  # [B, S, G, heads/G * D]
        wo_a = self.wo_a.unflatten(0, (groups, -1))  # [G, o_lora_rank, heads/G * D]
        low_rank = torch.einsum("bsgi,gri->bsgr", grouped.to(wo_a.dtype), wo_a).flatten(2)
        return linear(low_rank, self.wo_b)


def _compressor(cfg, w, prefix: str, ratio: int, *, overlap: bool, inv_freq: torch.Tensor) -> Compressor:
    return Compressor(w(prefix + "wkv.weight"), w(prefix + "wgate.weight"), w(prefix + "ape"),
                      w(prefix + "norm.weight"), ratio=ratio, overlap=overlap, inv_freq=inv_freq,
                      norm_eps=cfg.rms_norm_eps)
