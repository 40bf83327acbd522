"""The MoE feed-forward, batched by expert: every (token, pick) pair is sorted by expert, each expert
runs once over its tokens with its gate and up projections fused, and the results are summed back.
Routing is the reference's (`dsv4.reference.moe.route`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4.config import ModelConfig
from dsv4.reference.moe import route
from dsv4.reference.ops import linear


class GroupedMoE:
    def __init__(self, cfg: ModelConfig, layer: int, w):
        """`w(name)` fetches this layer's tensor `ffn.<name>`, already in the dtype its math runs in."""
        self.cfg = cfg
        self.gate = w("gate.weight")
        self.bias = None if cfg.is_hash_layer(layer) else w("gate.bias")
        self.tid2eid = w("gate.tid2eid") if cfg.is_hash_layer(layer) else None
        experts = range(cfg.n_routed_experts)
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
        experts, weights = route(x, self.gate, bias=self.bias, tid2eid=self.tid2eid, token_ids=token_ids,
                                 top_k=cfg.num_experts_per_tok, score_func=cfg.scoring_func,
                                 normalise=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor)
        # Stable sort by expert: each token's picks are then summed in ascending expert order.
        order = torch.argsort(experts.flatten(), stable=True)
        tokens = order // cfg.num_experts_per_tok
        counts = torch.bincount(experts.flatten(), minlength=cfg.n_routed_experts).tolist()
        inputs = x[tokens].split(counts)
        outputs = [self._expert(inp, self.w13[e], self.w2[e]) for e, inp in enumerate(inputs) if inp.shape[0]]
        routed = torch.cat(outputs).to(weights.dtype) * weights.flatten()[order].unsqueeze(-1)
        out = torch.zeros_like(x, dtype=weights.dtype).index_add_(0, tokens, routed)
        if self.shared is not None:
            out = out + self._expert(x, *self.shared).to(out.dtype)
        return out.to(x.dtype)

    def _expert(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        limit = self.cfg.swiglu_limit
        gate, up = linear(x, w13).chunk(2, dim=-1)
        return linear(F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit), w2)
