"""The lightning indexer's training signal and its quality figure, on the reference model.

DeepSeek trains the indexer to match the main attention: KL(p || softmax(indexer scores)) over the
compressed rows a query may see, where p is the main attention's distribution over those rows
(softmax of q . row over visible rows, averaged over heads, detached). The figure that says whether
it worked is the coverage: the share of p that the indexer's top-k picks carry, at queries that see
more rows than they may pick.
"""

from __future__ import annotations

import torch

from dsv4.config import ModelConfig
from dsv4.reference import apply_rope, indexer_scores, visible_rows
from dsv4.reference.ops import linear, rms_norm


class IndexerDistillation:
    """Wraps a CSA layer's reference indexer: returns its picks unchanged and records the KL loss
    between the indexer's distribution over visible compressed rows and the main attention's."""

    def __init__(self, attention, cfg: ModelConfig, losses: list[torch.Tensor], coverage: list[float] | None):
        self.attention, self.indexer, self.cfg = attention, attention.indexer, cfg
        self.losses, self.coverage = losses, coverage

    def __call__(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        picks = self.indexer(x, qr, positions)
        x, qr = x.detach(), qr.detach()
        attn, idx, cfg = self.attention, self.indexer, self.cfg
        with torch.no_grad():  # the target: main attention over compressed rows, as the model computes it
            q = linear(qr, attn.wq_b).unflatten(-1, (cfg.num_heads, cfg.head_dim)).transpose(1, 2)
            q = apply_rope(rms_norm(q, None, cfg.rms_norm_eps), positions, attn.inv_freq)
            rows = attn.round_kv(attn.compressor(x))
            visible = visible_rows(positions, rows.shape[1], idx.compressor.ratio)  # [S, N]
            logits = torch.einsum("bhsd,bnd->bhsn", q.float(), rows.float()) * cfg.head_dim**-0.5
            target = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0).mean(1)
        keys = idx.round_keys(idx.compressor(x))
        iq = linear(qr, idx.wq_b).unflatten(-1, (idx.n_heads, idx.head_dim))
        iq = apply_rope(iq.transpose(1, 2), positions, idx.inv_freq).transpose(1, 2)
        head_weights = linear(x, idx.weights_proj).float() * (idx.head_dim**-0.5 * idx.n_heads**-0.5)
        scores = indexer_scores(iq, head_weights, keys).masked_fill(~visible, float("-inf"))
        has_rows = visible.any(-1)  # [S]
        log_q = torch.log_softmax(scores[:, has_rows], dim=-1).nan_to_num(0.0, neginf=0.0)
        p = target[:, has_rows]
        kl = (p * (p.clamp_min(1e-12).log() - log_q)).sum(-1).mean()
        self.losses.append(kl)
        if self.coverage is not None:  # the share of the attention mass the picks carry, per query
            chosen = torch.zeros_like(target).scatter_(-1, picks.clamp_min(0), 1.0)  # full rows: no -1 picks
            self.coverage.extend((target * chosen).sum(-1)[:, has_rows & (visible.sum(-1) > idx.topk)]
                                 .flatten().tolist())
        return picks


def attach(model, losses: list[torch.Tensor], coverage: list[float] | None = None) -> None:
    """Wraps every CSA layer's indexer of a ReferenceModel in an IndexerDistillation."""
    for block in model.blocks:
        if block.attn.indexer is not None:
            block.attn.indexer = IndexerDistillation(block.attn, model.cfg, losses, coverage)
