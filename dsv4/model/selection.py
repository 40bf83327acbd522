"""What a CSA layer's indexer hands to an observer of its selections (`--verify-indexer`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class IndexerSelection:
    """What a CSA layer's indexer saw and picked for the batch's T tokens."""

    layer: int
    x: torch.Tensor  # [T, hidden] the layer's attention input (attn_norm'ed), which the queries come from
    q: torch.Tensor  # [T, index heads, index dim] index queries, after RoPE
    weights: torch.Tensor  # [T, index heads] head weights, scaled
    picks: torch.Tensor  # [T, topk] compressed row indices, best first, -1 padded


SelectionSink = Callable[[IndexerSelection], None]
