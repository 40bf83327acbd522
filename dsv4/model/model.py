"""The production DeepSeek-V4 model over paged state: one forward per ForwardBatch.

Every per-token step (embedding, mHC, norms, projections, MoE) runs on the flattened batch; attention
reads and writes the pools (`PagedAttention`). Only the last token of each sampling chunk reaches
the head. Weights are converted once, at construction, into the dtypes and layouts used here, on
the pools' device.
"""

from __future__ import annotations

import torch

from dsv4.config import ModelConfig
from dsv4.memory.pools import StatePools
from dsv4.reference.mhc import HyperConnection, hc_head, layer_hyper_connections
from dsv4.reference.ops import accumulation_dtype, linear, rms_norm
from dsv4.reference.rope import layer_inv_freq

from .attention import PagedAttention
from .indexer_check import SelectionSink
from .moe import GroupedMoE
from .plan import BatchPlan
from .sharding import Reducer, ShardPlan

# Tensors kept in at least fp32 whatever the compute dtype, as the reference keeps them: they feed
# the fp32 math (mHC, norms, sinks, compressor scores, routing).
_FULL_PRECISION_SUFFIXES = ("_fn", "_base", "_scale", "norm.weight", "attn_sink", ".ape", "ffn.gate.weight",
                            "ffn.gate.bias")


class PagedModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, pools: StatePools,
                 *, kernels: bool | None = None, shard: ShardPlan | None = None, reduce: Reducer | None = None):
        """`kernels`: attention, indexer and compressor inserts through `dsv4.kernels.dispatch` (Triton
        on CUDA); default: when the pools are on CUDA. `weights` hold this rank's part (`shard`, default
        all of it); `reduce` sums partial results across tensor-parallel ranks (None: TP=1)."""
        self.cfg = cfg
        shard = shard or ShardPlan(cfg)
        self.kernels = pools.device.type == "cuda" if kernels is None else kernels
        w = _WeightReader(weights, dtype, accumulation_dtype(dtype), pools.device)
        self.embed, self.head, self.norm = w("embed.weight"), w("head.weight"), w("norm.weight")
        self.hc_head_weights = (w("hc_head_fn"), w("hc_head_base"), w("hc_head_scale"))
        self.blocks = [_Block(cfg, i, w, pools, self.kernels, shard, reduce) for i in range(cfg.num_layers)]

    @torch.inference_mode()
    def forward(self, plan: BatchPlan, on_selection: SelectionSink | None = None) -> torch.Tensor:
        """Runs the batch (its plan on the pools' device), stores its rows in the pools; float32
        logits [sampling chunks, vocab]. CSA layers hand their indexer selections to `on_selection`."""
        cfg = self.cfg
        x = self.embed[plan.token_ids]
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).unsqueeze(0)  # [1, T, hc, hidden]
        for block in self.blocks:
            streams = block(streams, plan, on_selection)
        last = streams[:, plan.sample_tokens]
        x = hc_head(last, *self.hc_head_weights, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        return linear(rms_norm(x, self.norm, cfg.rms_norm_eps), self.head)[0].float()


class _Block:
    """One decoder layer: mHC around attention, then mHC around the MoE."""

    def __init__(self, cfg: ModelConfig, layer: int, w, pools: StatePools, kernels: bool, shard: ShardPlan,
                 reduce: Reducer | None):
        self.eps = cfg.rms_norm_eps
        self.attn_hc, self.ffn_hc = layer_hyper_connections(cfg, w, layer)
        self.attn_norm, self.ffn_norm = w(f"layers.{layer}.attn_norm.weight"), w(f"layers.{layer}.ffn_norm.weight")
        self.attn = PagedAttention(cfg, layer, w.under(f"layers.{layer}.attn."),
                                   layer_inv_freq(cfg, layer).to(pools.device), pools, kernels=kernels,
                                   shard=shard, reduce=reduce)
        self.ffn = GroupedMoE(cfg, layer, w.under(f"layers.{layer}.ffn."), shard=shard, reduce=reduce)

    def __call__(self, streams: torch.Tensor, plan: BatchPlan, on_selection: SelectionSink | None) -> torch.Tensor:
        """streams [1, T, hc, hidden]: the batch's tokens as one sequence of independent rows."""
        x, post, comb = self.attn_hc.collapse(streams)
        y = self.attn(rms_norm(x[0], self.attn_norm, self.eps), plan, on_selection)
        streams = HyperConnection.expand(streams, y.unsqueeze(0), post, comb)
        x, post, comb = self.ffn_hc.collapse(streams)
        y = self.ffn(rms_norm(x[0], self.ffn_norm, self.eps), plan.token_ids)
        return HyperConnection.expand(streams, y.unsqueeze(0), post, comb)


class _WeightReader:
    """Official name -> tensor in the dtype its math runs in."""

    def __init__(self, weights: dict[str, torch.Tensor], dtype: torch.dtype, acc: torch.dtype, device: torch.device,
                 prefix: str = ""):
        self.weights, self.dtype, self.acc, self.device, self.prefix = weights, dtype, acc, device, prefix

    def __call__(self, name: str) -> torch.Tensor:
        name = self.prefix + name
        tensor = self.weights[name]
        if name.endswith("tid2eid"):
            return tensor.to(self.device, torch.long)
        return tensor.to(self.device, self.acc if name.endswith(_FULL_PRECISION_SUFFIXES) else self.dtype)

    def under(self, prefix: str) -> _WeightReader:
        return _WeightReader(self.weights, self.dtype, self.acc, self.device, self.prefix + prefix)
