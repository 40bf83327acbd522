"""The lightning indexer of CSA layers: which compressed rows each query attends to.

Score I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) over `index_n_heads` heads, with head weights
w = weights_proj(x) * index_head_dim^-0.5 * index_n_heads^-0.5. Query t may pick only complete
rows s < (t + 1) // ratio, and picks the top min(index_topk, that many) of them.
"""

from __future__ import annotations

import torch

from .compressor import Compressor
from .ops import accumulation_dtype, linear
from .rope import apply_rope


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [B, S, H, D] index queries (after RoPE), weights [B, S, H] (already scaled),
    keys [B, N, D] compressed index keys -> scores [B, S, N] in at least fp32 (not yet masked)."""
    acc = accumulation_dtype(q.dtype)
    per_head = torch.einsum("bshd,bnd->bshn", q.to(acc), keys.to(acc)).relu()
    return torch.einsum("bshn,bsh->bsn", per_head, weights.to(acc))


def visible_rows(positions: torch.Tensor, num_rows: int, ratio: int) -> torch.Tensor:
    """[S, N] bool: compressed row s is complete (visible) at query position t iff s < (t + 1) // ratio."""
    rows = torch.arange(num_rows, device=positions.device)
    return rows < ((positions + 1) // ratio).unsqueeze(-1)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                 ratio: int, topk: int) -> torch.Tensor:
    """The reference selection: LongTensor [B, S, min(topk, N)] of row indices, best score first.

    q, weights, keys as in `indexer_scores`; positions [S] absolute query positions. A query that
    sees fewer than min(topk, N) complete rows gets -1 in its surplus slots (after its valid picks).
    """
    num_rows = keys.shape[1]
    visible = visible_rows(positions, num_rows, ratio)
    scores = indexer_scores(q, weights, keys).masked_fill(~visible, float("-inf"))
    picks = scores.topk(min(topk, num_rows), dim=-1).indices
    n_visible = visible.sum(dim=-1, keepdim=True)  # [S, 1]: rows below this index are visible
    return torch.where(picks < n_visible, picks, torch.full_like(picks, -1))


class Indexer:
    """Queries from the attention's q low-rank path (`qr`), keys from its own compressor."""

    def __init__(self, wq_b: torch.Tensor, weights_proj: torch.Tensor, compressor: Compressor, *,
                 n_heads: int, head_dim: int, topk: int, inv_freq: torch.Tensor, round_keys):
        self.wq_b, self.weights_proj, self.compressor = wq_b, weights_proj, compressor
        self.n_heads, self.head_dim, self.topk, self.inv_freq = n_heads, head_dim, topk, inv_freq
        self.round_keys = round_keys  # the index-key cache's row format, applied to every key row

    def __call__(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, S, hidden] attention input, qr [B, S, q_lora_rank] -> picks [B, S, k] (-1 = none)."""
        keys = self.round_keys(self.compressor(x))
        q = linear(qr, self.wq_b).unflatten(-1, (self.n_heads, self.head_dim))
        q = apply_rope(q.transpose(1, 2), positions, self.inv_freq).transpose(1, 2)
        acc = accumulation_dtype(x.dtype)
        weights = linear(x, self.weights_proj).to(acc) * (self.head_dim**-0.5 * self.n_heads**-0.5)
        return indexer_topk(q, weights, keys, positions, self.compressor.ratio, self.topk)
