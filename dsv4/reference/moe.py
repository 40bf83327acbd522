"""The MoE feed-forward: routed experts (learned top-k or hash routing) plus shared experts.

Router scores s = score_fn(x @ W_gate^T) in at least fp32. Learned layers pick the top-k of
s + bias (the bias only steers selection); hash layers (the first `num_hash_layers`) pick
tid2eid[token id]. The chosen experts are weighted by their s, normalised to sum 1 (norm_topk_prob),
times routed_scaling_factor. Every expert is a SwiGLU with clamped pre-activations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .ops import accumulation_dtype, linear

SCORE_FUNCTIONS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
}


def swiglu_expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float) -> torch.Tensor:
    """w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit))."""
    gate = linear(x, w1).clamp(max=limit)
    up = linear(x, w3).clamp(min=-limit, max=limit)
    return linear(F.silu(gate) * up, w2)


def route(x: torch.Tensor, gate_weight: torch.Tensor, *, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
          token_ids: torch.Tensor, top_k: int, score_func: str, normalise: bool,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden], token_ids [T] -> (expert ids [T, k], expert weights [T, k] in at least fp32).

    Exactly one of `bias` (learned routing) and `tid2eid` (hash routing) is given.
    """
    acc = accumulation_dtype(x.dtype)
    scores = SCORE_FUNCTIONS[score_func](x.to(acc) @ gate_weight.to(acc).T)
    if tid2eid is not None:
        experts = tid2eid[token_ids]
    else:
        experts = (scores + bias.to(acc)).topk(top_k, dim=-1).indices
    weights = scores.gather(-1, experts)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights * scaling


class MoE:
    def __init__(self, cfg, layer: int, w):
        """`w(name)` fetches this layer's tensor `ffn.<name>`."""
        self.cfg = cfg
        self.gate = w("gate.weight")
        self.bias = None if cfg.is_hash_layer(layer) else w("gate.bias")
        self.tid2eid = w("gate.tid2eid") if cfg.is_hash_layer(layer) else None
        self.experts = [tuple(w(f"experts.{e}.{m}.weight") for m in ("w1", "w2", "w3"))
                        for e in range(cfg.n_routed_experts)]
        self.shared = (tuple(w(f"shared_experts.{m}.weight") for m in ("w1", "w2", "w3"))
                       if cfg.n_shared_experts else None)

    def __call__(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [B, S, hidden] (already ffn_norm'ed), token_ids [B, S] -> [B, S, hidden]."""
        cfg = self.cfg
        flat = x.flatten(0, 1)
        experts, weights = route(flat, self.gate, bias=self.bias, tid2eid=self.tid2eid,
                                 token_ids=token_ids.flatten(), top_k=cfg.num_experts_per_tok,
                                 score_func=cfg.scoring_func, normalise=cfg.norm_topk_prob,
                                 scaling=cfg.routed_scaling_factor)
        out = torch.zeros_like(flat, dtype=weights.dtype)
        for expert in experts.unique().tolist():
            tokens, slot = torch.nonzero(experts == expert, as_tuple=True)
            y = swiglu_expert(flat[tokens], *self.experts[expert], cfg.swiglu_limit)
            out.index_add_(0, tokens, y.to(out.dtype) * weights[tokens, slot].unsqueeze(-1))
        if self.shared is not None:
            out = out + swiglu_expert(flat, *self.shared, cfg.swiglu_limit).to(out.dtype)
        return out.to(x.dtype).view_as(x)
