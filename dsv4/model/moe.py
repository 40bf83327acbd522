"""The MoE feed-forward, batched by expert: every (token, pick) pair is sorted by expert, every expert
runs over its tokens in one grouped matmul per projection (`F.grouped_mm`: the gate and up
projections fused, then the down projection), and the results are summed back.

Routing: scores s = score_fn(x @ W_gate^T) in at least fp32; learned layers pick the top-k of s + bias
(the bias only steers selection), hash layers pick tid2eid[token id]; the picks are weighted by their
s, normalised to sum 1 (norm_topk_prob), times routed_scaling_factor.

Under tensor parallelism (`dsv4.model.sharding`) every rank routes every token the same way but runs
only its own experts and its share of the shared expert; the partial sums meet in one all_reduce."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from dsv4.config import ModelConfig

from .ops import accumulation_dtype, input_major, linear
from .sharding import Reducer, ShardPlan

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
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
        # [E, hidden, 2 * inter]: w1 (gate) columns then w3 (up) columns; [E, inter, hidden]
        self.w13 = input_major(torch.stack([torch.cat([w(f"experts.{e}.w1.weight"), w(f"experts.{e}.w3.weight")])
                                            for e in experts]))
        self.w2 = input_major(torch.stack([w(f"experts.{e}.w2.weight") for e in experts]))
        self.shared = None
        if cfg.n_shared_experts:
            self.shared = (input_major(torch.cat([w("shared_experts.w1.weight"), w("shared_experts.w3.weight")])),
                           input_major(w("shared_experts.w2.weight")))

    def __call__(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (ffn_norm'ed), token_ids [T] -> [T, hidden]."""
        cfg = self.cfg
        experts, weights = self._route(x, token_ids)
        # Stable sort by expert: each token's picks are then summed in ascending expert order. Picks
        # of other ranks' experts sort last, past the final group, and are dropped.
        first, count = self.experts.start, len(self.experts)
        local = experts.flatten() - first
        mine = (local >= 0) & (local < count)
        local = torch.where(mine, local, count)
        order = torch.argsort(local, stable=True)
        tokens = order // cfg.num_experts_per_tok
        ends = torch.bincount(local, minlength=count + 1)[:count].cumsum(0).to(torch.int32)
        outputs = self._experts(x[tokens], ends)  # [picks, hidden]; rows past ends[-1] unset
        scale, keep = weights.flatten()[order].unsqueeze(-1), mine[order].unsqueeze(-1)
        out = torch.zeros_like(x, dtype=weights.dtype)
        out.index_add_(0, tokens, torch.where(keep, outputs.to(scale.dtype) * scale, 0))
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

    def _experts(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """x [P, hidden] sorted by expert, rows ends[e-1]..ends[e] for this rank's expert e -> [P, hidden]:
        each expert over its rows in two grouped matmuls, whatever the split (no loop, no host sync)."""
        up = _grouped_matmul(x.to(self.w13.dtype), self.w13, ends)
        return _grouped_matmul(self._swiglu(up), self.w2, ends)

    def _expert(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return linear(self._swiglu(linear(x, w13)), w2)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        limit = self.cfg.swiglu_limit
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _grouped_matmul(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [P, in] rows ends[g-1]..ends[g] times w[g] [in, out] -> [P, out]; rows past ends[-1] unset."""
    if x.dtype in _GROUPED_MM_DTYPES:
        return F.grouped_mm(x, w, offs=ends)
    out = x.new_empty(x.shape[0], w.shape[-1])  # float64 (the oracle tests' dtype): one matmul per group
    for g, (start, end) in enumerate(itertools.pairwise([0, *ends.tolist()])):
        torch.mm(x[start:end], w[g], out=out[start:end])
    return out
