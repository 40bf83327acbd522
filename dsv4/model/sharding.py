"""How the model's weights split across `--tp-size` ranks (docs/TENSOR_PARALLEL.md).

- attention: query heads (wq_b rows, attn_sink) and output groups (wo_a rows, wo_b columns) split
  by contiguous blocks; each rank's heads are exactly its groups' heads, so its partial wo_b
  output is summed across ranks (all_reduce "attn.out"). The single KV head (wkv, kv_norm), wq_a,
  q_norm and both compressors are replicated: every rank keeps the whole KV cache.
- indexer: heads split (wq_b rows, weights_proj rows); each rank scores the compressed rows over
  its heads and the partial scores are summed (all_reduce "indexer.scores") before the top-k.
- MoE: routed experts split by contiguous blocks (expert parallelism); routing (gate, bias,
  tid2eid) is replicated so every rank picks the same experts; the shared expert splits its
  intermediate dimension (w1/w3 rows, w2 columns). Routed and shared partial sums are summed in
  one all_reduce ("ffn.out").
- embedding, head, norms and mHC: replicated.

A rank reads only its own routed experts from the checkpoint; the other tensors it slices once
decoded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch

from dsv4.config import ConfigError, ModelConfig

_EXPERT = re.compile(r"layers\.\d+\.ffn\.experts\.(\d+)\.")


@dataclass(frozen=True)
class ShardPlan:
    cfg: ModelConfig
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        cfg, n = self.cfg, self.size
        if not 0 <= self.rank < n:
            raise ConfigError(f"rank {self.rank} outside 0..{n - 1}")
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        for what, count in (("attention heads", cfg.num_heads), ("output groups (o_groups)", cfg.o_groups),
                            ("indexer heads", cfg.index_n_heads), ("routed experts", cfg.n_routed_experts),
                            ("shared-expert intermediate size", shared)):
            if count % n:
                raise ConfigError(f"--tp-size {n} does not divide the model's {what} ({count})")

    def block(self, total: int) -> tuple[int, int]:
        """This rank's contiguous share [start, stop) of `total` units."""
        share = total // self.size
        return self.rank * share, (self.rank + 1) * share

    @property
    def o_groups(self) -> int:
        return self.cfg.o_groups // self.size

    @property
    def experts(self) -> range:
        return range(*self.block(self.cfg.n_routed_experts))

    def select(self, name: str) -> tuple[slice, ...] | None:
        """The index of this rank's part of tensor `name` (official name): () for all of it, None for
        none (a routed expert of another rank)."""
        if self.size == 1:
            return ()
        cfg = self.cfg
        expert = _EXPERT.match(name)
        if expert:
            return () if int(expert.group(1)) in self.experts else None
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        rows = {
            "attn.wq_b.weight": cfg.num_heads * cfg.head_dim,
            "attn.attn_sink": cfg.num_heads,
            "attn.wo_a.weight": cfg.o_groups * cfg.o_lora_rank,
            "attn.indexer.wq_b.weight": cfg.index_n_heads * cfg.index_head_dim,
            "attn.indexer.weights_proj.weight": cfg.index_n_heads,
            "ffn.shared_experts.w1.weight": shared,
            "ffn.shared_experts.w3.weight": shared,
        }
        columns = {"attn.wo_b.weight": cfg.o_groups * cfg.o_lora_rank, "ffn.shared_experts.w2.weight": shared}
        suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
        if suffix in rows:
            return (slice(*self.block(rows[suffix])),)
        if suffix in columns:
            return (slice(None), slice(*self.block(columns[suffix])))
        return ()


class Reducer(Protocol):
    """What the model needs of the group (`dsv4.dist.collectives.TpGroup`): a named sum across ranks."""

    def all_reduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor: ...
