"""The MoE feed-forward, batched by expert: every (token, pick) pair is sorted by expert, each expert
runs once over its tokens with its gate and up projections fused, and the results are summed back.

Routing: scores s = score_fn(x @ W_gate^T) in at least fp32; learned layers pick the top-k of s + bias
(the bias only steers selection), hash layers pick tid2eid[token id]; the picks are weighted by their
s, normalised to sum 1 (norm_topk_prob), times routed_scaling_factor.

Under tensor parallelism (`dsv4.model.sharding`) every rank routes every token the same way but runs
only its own experts and its share of the shared expert; the partial sums meet in one all_reduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4.config import ModelConfig

from .ops import accumulation_dtype, linear
from .sharding import Reducer, ShardPlan

_SCORE_FUNCTIONS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt_(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
}


class GroupedMoE:
    def __init__(self, cfg: ModelConfig, layer: int, w, *, shard: ShardPlan, reduce: Reducer | None):
        """`w(name)` fetches this layer's tensor `ffn.<name>` (this rank's part, `shard`), already in the
        dtype its math runs in. `reduce` sums partial results across tensor-parallel ranks (None: TP=1)."""
        self.cfg, self.reduce = cfg, reduce
        self.gate = w("gate.weight")
        self.bias = None if cfg.is_hash_layer(layer) else w("gate.bias")
        self.tid2eid = w("gate.tid2eid") if cfg.is_hash_layer(layer) else None
        experts = self.experts = shard.experts
        # [E, 2 * inter, hidden]: w1 (gate) rows then w3 (up) rows; [E, hidden, inter]
        self.w13 = torch.stack([torch.cat([w(f"experts.{e}.w1.weight"), w(f"experts.{e}.w3.weight")]) for e in experts])
        self.w2 = torch.stack([w(f"experts.{e}.w2.weight") for e in experts])
        self.shared = None
        if cfg.n_shared_experts:
            self.shared = (torch.cat([w("shared_experts.w1.weight"), w("shared_experts.w3.weight")]),
                           w("shared_experts.w2.weight"))

    def __call__(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (ffn_norm'ed), token_ids [T] -> [T, hidden]."""
        cfg = self.cfg
        experts, weights = self._route(x, token_ids)
        # Stable sort by expert: each token's picks are then summed in ascending expert order. Only
        # this rank's experts' picks are kept.
        first, count = self.experts.start, len(self.experts)
        local = experts.flatten() - first
        order = torch.argsort(local, stable=True)
        order = order[(local[order] >= 0) & (local[order] < count)]
        tokens = order // cfg.num_experts_per_tok
        counts = torch.bincount(local[order], minlength=count).tolist()
        inputs = x[tokens].split(counts)
        out = torch.zeros_like(x, dtype=weights.dtype)
        outputs = [self._expert(inp, self.w13[e], self.w2[e]) for e, inp in enumerate(inputs) if inp.shape[0]]
        if outputs:
            out.index_add_(0, tokens, torch.cat(outputs).to(weights.dtype) * weights.flatten()[order].unsqueeze(-1))
        if self.shared is not None:
            out = out + self._expert(x, *self.shared).to(out.dtype)
        if self.reduce is not None:
            out = self.reduce.all_reduce_sum(out, "ffn.out")
        return out.to(x.dtype)

    def _route(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden], token_ids [T] -> (expert ids [T, k], their weights [T, k] in at least fp32)."""
        cfg = self.cfg
        scores = _SCORE_FUNCTIONS[cfg.scoring_func](F.linear(x.to(accumulation_dtype(x.dtype)), self.gate))
        if self.tid2eid is not None:
            experts = self.tid2eid[token_ids]
        else:
            experts = (scores + self.bias).topk(cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(-1, experts)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.mul_(cfg.routed_scaling_factor)

    def _expert(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        limit = self.cfg.swiglu_limit
        gate, up = linear(x, w13).chunk(2, dim=-1)
        return linear(F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit), w2)
