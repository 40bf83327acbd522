"""--verify-indexer: the reference indexer re-run on the cached state, against the fast path's picks.

Every token of a verified CSA layer that sees at least one index-key row makes one selection. Its
check reads the request's visible rows out of the pools as stored (unpacked by `kernels/rows.py`),
scores them with the reference (`dsv4.reference.indexer.indexer_scores`) from the queries and head
weights the fast path used, and accepts the fast path's picks when they are a top-k of those
scores up to ties: k = min(topk, visible rows) distinct visible rows, none of them outscored by an
unpicked row by more than eps. So a picked row is wrong when its reference score is below the k-th
best by more than eps, and so is a missed row that beats a picked one by more than eps.

Both indexers read the same bytes, so a byte that changed after the model wrote it (a late or
racing write into the cache) would fool both alike. The pools' fingerprints catch that: a
selection that can see a row whose fingerprint changed fails too (`StatePools.changed_index_keys`).

Both also score with the same queries and head weights, so a bug in how the fast path computes them
(the index-query projection, its RoPE, the head weights) fools both alike too. `--verify-indexer=full`
catches that: the queries and head weights are recomputed from the layer's input with reference
code (`IndexQueryOracle`) and the picks are judged by the scores of those.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from dsv4.config import CSA, ModelConfig
from dsv4.kernels.rows import unpack_index_rows
from dsv4.memory.pools import INDEX_RATIO, StatePools
from dsv4.model.plan import BatchPlan
from dsv4.model.selection import IndexerSelection
from dsv4.reference.indexer import indexer_scores, visible_rows
from dsv4.reference.ops import accumulation_dtype, linear, rms_norm
from dsv4.reference.rope import apply_rope, layer_inv_freq

# Tie tolerance, relative to scale_t = sum_h |w_th| * |q_th| * max_s |k_s|. Both paths score the same
# stored keys, so the index-key dtype's rounding (fp8 or bf16) is common to both and cancels; they
# differ only in the order of their fp32 sums (queries and keys are exact in the fast path's
# multiplies: bf16 queries, fp8 / bf16 keys). A score sums H heads of w_h * relu(q_h . k), each a
# sum of D products, so each path errs by at most ~(D + H) * 2^-24 times the sum of the terms'
# magnitudes, which Cauchy-Schwarz bounds by scale_t: for V4 (D = 128, H = 64) 1.1e-5 * scale_t.
# 1e-4 is four times both paths' bounds together; rows closer than that are ties either way.
EPS_REL = 1e-4
SHOWN_ROWS = 8  # changed rows named in a mismatch's detail


@dataclass(frozen=True)
class IndexerMismatch:
    """A request's failed selections at one layer of one forward."""

    rid: str
    layer: int
    position: int  # of its first failed selection
    count: int  # failed selections
    detail: str  # why the first one failed


class IndexQueryOracle:
    """--verify-indexer=full: a CSA layer's index queries and head weights, recomputed from the layer's
    input with reference code. Holds its own copies of the few weights that takes, in the model's
    dtype on its device (the model's are laid out for its fast path)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
        self.cfg, self.acc = cfg, accumulation_dtype(dtype)
        self.layers = {}
        for layer in (i for i in range(cfg.num_layers) if cfg.layer_kind(i) == CSA):
            names = ("wq_a.weight", "q_norm.weight", "indexer.wq_b.weight", "indexer.weights_proj.weight")
            wq_a, q_norm, wq_b, proj = (weights[f"layers.{layer}.attn.{name}"].to(device, dtype) for name in names)
            self.layers[layer] = wq_a, q_norm.to(self.acc), wq_b, proj, layer_inv_freq(cfg, layer).to(device)

    def __call__(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] the layer's attention input (attn_norm'ed), positions [T] -> (q [T, heads, dim]
        after RoPE, head weights [T, heads] scaled), as the reference's attention and indexer make them."""
        cfg = self.cfg
        wq_a, q_norm, wq_b, weights_proj, inv_freq = self.layers[layer]
        qr = rms_norm(linear(x, wq_a), q_norm, cfg.rms_norm_eps)
        q = linear(qr, wq_b).unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
        q = apply_rope(q.transpose(0, 1), positions, inv_freq).transpose(0, 1)
        scale = cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5
        return q, linear(x, weights_proj).to(self.acc) * scale


class IndexerVerifier:
    """Checks each selection of one forward as the model hands it over (pass it as `on_selection`):
    the layer's index keys are complete for this batch by then, and nothing is kept per layer. With an
    `oracle` (--verify-indexer=full), the selections are scored with its queries, not the fast path's."""

    def __init__(self, plan: BatchPlan, pools: StatePools, topk: int, oracle: IndexQueryOracle | None = None):
        self.plan, self.pools, self.topk, self.oracle = plan, pools, topk, oracle
        self.verified = 0  # selections checked
        self.mismatches: list[IndexerMismatch] = []
        bounds = [0, *itertools.accumulate(torch.bincount(plan.token_chunk, minlength=len(plan.rids)).tolist())]
        self._chunk_tokens = [slice(start, end) for start, end in itertools.pairwise(bounds)]  # chunks' tokens

    def __call__(self, selection: IndexerSelection) -> None:
        eps_rel = EPS_REL
        if self.oracle is not None:
            q, weights = self.oracle(selection.layer, selection.x, self.plan.positions)
            selection = dataclasses.replace(selection, q=q, weights=weights)
            # The two paths' queries and weights may round apart by an ulp of the model dtype each, which
            # moves a score by up to about 2 ulps of scale_t: rows that close are ties too.
            eps_rel += 2 * torch.finfo(selection.x.dtype).eps
        for chunk, tokens in enumerate(self._chunk_tokens):
            self._check_chunk(selection, chunk, tokens, eps_rel)

    def _check_chunk(self, selection: IndexerSelection, chunk: int, tokens: slice, eps_rel: float) -> None:
        pools, layer = self.pools, selection.layer
        positions = self.plan.positions[tokens]
        visible = (positions + 1) // INDEX_RATIO  # [t] rows each token sees
        num_rows = int(visible.max())
        if num_rows == 0:
            return
        # The request's rows 0 .. num_rows - 1: row s in page page_table[chunk, s // R], at row s % R.
        index_keys = pools.index_keys(layer)
        rows = torch.arange(num_rows, device=positions.device)
        pages, page_rows = self.plan.page_table[chunk, rows // index_keys.shape[1]], rows % index_keys.shape[1]
        keys = unpack_index_rows(index_keys[pages, page_rows], pools.index_format, selection.q.shape[-1])
        acc = accumulation_dtype(selection.q.dtype)
        q, weights = selection.q[tokens].to(acc), selection.weights[tokens].to(acc)
        seen = visible_rows(positions, num_rows, INDEX_RATIO)  # [t, rows]
        scores = indexer_scores(q[None], weights[None], keys[None])[0]  # [t, rows]
        eps = eps_rel * (weights.abs() * q.norm(dim=-1)).sum(-1) * keys.to(acc).norm(dim=-1).max()

        picks = selection.picks[tokens].long()
        real = picks >= 0
        outside = real & (picks >= visible.unsqueeze(1))
        chosen = torch.zeros(picks.shape[0], num_rows + 1, dtype=torch.bool, device=picks.device)
        chosen = chosen.scatter_(1, torch.where(real & ~outside, picks, num_rows), True)[:, :num_rows]
        miscounted = chosen.sum(1) != visible.clamp(max=self.topk)
        lowest_chosen = scores.masked_fill(~chosen, torch.inf).amin(1)
        best_unchosen = scores.masked_fill(chosen | ~seen, -torch.inf).amax(1)
        outranked = best_unchosen > lowest_chosen + eps
        changed = pools.changed_index_keys(layer, pages, page_rows)  # [rows]
        stale = (seen & changed).any(1)
        failed = (stale | outside.any(1) | miscounted | outranked) & (visible > 0)

        self.verified += int((visible > 0).sum())
        count = int(failed.sum())
        if count == 0:
            return
        t = int(failed.nonzero()[0, 0])
        if stale[t]:
            shown = (seen[t] & changed).nonzero().flatten()[:SHOWN_ROWS].tolist()
            detail = f"index-key rows {shown} changed after they were written (fingerprint mismatch)"
        elif outside[t].any():
            detail = f"picked row {int(picks[t][outside[t]][0])} but sees only rows 0..{int(visible[t]) - 1}"
        elif miscounted[t]:
            detail = (f"picked {int(chosen[t].sum())} distinct visible rows of {int(visible[t])}, "
                      f"expected {min(int(visible[t]), self.topk)}")
        else:
            low = int(scores[t].masked_fill(~chosen[t], torch.inf).argmin())
            high = int(scores[t].masked_fill(chosen[t] | ~seen[t], -torch.inf).argmax())
            detail = (f"picked row {low} (reference score {float(scores[t, low]):.6g}) over row {high} "
                      f"({float(scores[t, high]):.6g}), more than eps {float(eps[t]):.3g} apart")
        self.mismatches.append(IndexerMismatch(self.plan.rids[chunk], layer, int(positions[t]), count, detail))
