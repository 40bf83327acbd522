"""The production DeepSeek-V4 model over paged state: one forward per ForwardBatch.

Every per-token step (embedding, mHC, norms, projections, MoE) runs on the flattened batch; attention
reads and writes the pools (`PagedAttention`). Only the last token of each sampling chunk reaches
the head, and the positions whose logits a request's prompt logprobs need. On a CPU whose C kernels
take a whole layer, a decode step's layers run as one C call each (dsv4/model/decode_layer.py) and its
head as two. Weights are converted once, at construction, into the dtypes and layouts used here, on
the pools' device.
"""

from __future__ import annotations

import logging

import torch

from dsv4.config import WINDOW, ModelConfig
from dsv4.kernels import cpu_mhc, cpu_project
from dsv4.kernels.cpu_library import as_read
from dsv4.memory.pools import StatePools

from .attention import PagedAttention
from .compile import Pieces, eager_pieces
from .decode_layer import DecodeBuffers, DecodeStep, FusedLayer
from .mhc import HyperConnection, Residual, hc_head
from .moe import GroupedMoE
from .ops import Rope, RopeTables, accumulation_dtype, as_bf16, layer_inv_freq, linear, rms_norm
from .plan import BatchPlan, DecodePlan
from .selection import SelectionSink
from .sharding import Reducer, ShardPlan

log = logging.getLogger(__name__)

# How the log names the fp32 weights whose bf16 copies the CPU's C kernels read, by kind (scripts/bench
# reads it to count their bytes)
KERNEL_COPIES_LOGGED = {"projections": "the attention's kernels read bf16 copies of the fp32 projections",
                        "experts": "the MoE kernel reads bf16 copies of the fp32 experts' weights",
                        "head": "the head's kernel reads a bf16 copy of the fp32 head"}

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
        self.cfg, self.dtype = cfg, dtype
        # The implementations of the many-small-op pieces: eager until the runner swaps in compiled
        # ones, built for this model's shapes (dsv4/model/compile.py).
        shard = shard or ShardPlan(cfg)
        self.pieces: Pieces = eager_pieces(cfg, shard.experts, dtype, pools.device)
        self.kernels = pools.device.type == "cuda" if kernels is None else kernels
        w = _WeightReader(weights, dtype, accumulation_dtype(dtype), pools.device)
        self.embed, self.head, self.norm = w("embed.weight"), w("head.weight"), w("norm.weight")
        self.hc_head_weights = (w("hc_head_fn"), w("hc_head_base"), w("hc_head_scale"))
        self.head_kernel = self._head_kernel(cfg)
        self.blocks = [_Block(cfg, i, w, pools, self.kernels, shard, reduce) for i in range(cfg.num_layers)]
        # Each layer of a decode step as one C call where the CPU's kernels take all of it (None: they do not)
        self._buffers_by_tokens: dict[int, DecodeBuffers] = {}  # (`_decode_buffers`)
        self.fused = [FusedLayer(cfg, i, block, pools, dtype, self.pieces.mix.keywords)
                      if FusedLayer.usable(block, pools, dtype, self.pieces.mix) else None
                      for i, block in enumerate(self.blocks)]
        # Where every layer runs fused: a layer of each ratio whose indexer may select (`runs_fused`: the
        # others' calls serve every step); the addresses of the embedding and the head's tensors that a
        # step's first and last calls read
        self._all_fused = all(fused is not None for fused in self.fused)
        self._selecting = list({fused.ratio: fused for fused in self.fused if fused is not None and fused.selects}
                               .values())
        if self.head_kernel is not None:
            weight, fn, base, scale, norm = self.head_kernel
            self._embed_read = as_read(self.embed)  # (held: its address is read)
            self._fused_ends = (self._embed_read.data_ptr(), [t.data_ptr() for t in (fn, base, scale, norm, weight)],
                                weight.shape[0])
        kernels_read = {"projections": [w for block in self.blocks if block.attn.kernel_weights is not None
                                        for w in (*block.attn.kernel_weights, block.attn.index_kernel_weight)],
                        "experts": [w for block in self.blocks if block.ffn.kernel_weights is not None
                                    for w in block.ffn.kernel_weights],
                        "head": [] if self.head_kernel is None else [self.head_kernel[0]]}
        for kind, weights_read in kernels_read.items():
            copies = [w for w in weights_read if w is not None and w.dtype != dtype]
            if copies:
                log.info("%s (%.0f MB more memory): every one holds bf16 values", KERNEL_COPIES_LOGGED[kind],
                         sum(w.numel() * w.element_size() for w in copies) / 1e6)
        # RoPE by "is a window layer": every layer of a kind rotates by the same frequencies.
        self.rope_tables = {block.window: RopeTables(layer_inv_freq(cfg, i).to(pools.device), dtype)
                            for i, block in enumerate(self.blocks)}

    def runs_fused(self, plan: DecodePlan) -> bool:
        """Whether every layer of a step of `plan` runs as one C call: `forward` then takes the decode plan
        alone."""
        return self._all_fused and DecodeStep.takes(plan) and all(fused.serves(plan) for fused in self._selecting)

    @torch.inference_mode()
    def forward(self, plan: BatchPlan | DecodePlan, on_selection: SelectionSink | None = None) -> torch.Tensor:
        """Runs the batch (its plan on the pools' device), stores its rows in the pools; float32
        logits [sampling chunks + prompt logit rows, vocab]: the sampled rows in chunk order, then
        `plan.prompt_tokens`. CSA layers hand their indexer selections to `on_selection`. A DecodePlan
        (every chunk's token sampled) only where `runs_fused` says so."""
        cfg = self.cfg
        decode = plan if isinstance(plan, DecodePlan) else None
        if decode is None and on_selection is None and any(self.fused):
            decode = DecodePlan.of(plan)
        step = None
        if decode is not None and DecodeStep.takes(decode):
            buffers = self._decode_buffers(len(decode.token_ids))
            step = DecodeStep(decode, self.rope_tables, buffers)
            if plan is decode and self.head_kernel is not None:  # (every layer fused: the calls embed, and head)
                logits = step.embed_and_head(*self._fused_ends)
                residual = buffers.start
                for fused in self.fused:
                    residual = fused(residual, step)
                step.run_layers()
                return logits
        ropes = {window: tables.at(plan.positions) for window, tables in self.rope_tables.items()}
        x = self.embed[plan.token_ids]
        if step is not None:
            residual = buffers.first(x)
        else:  # [T, hc, hidden], contiguous like every later layer's streams (one layout for compiled code)
            residual = Residual.start(x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous())
        for block, fused in zip(self.blocks, self.fused, strict=True):
            if step is not None and fused is not None and fused.serves(decode):
                residual = fused(residual, step)
            else:
                if step is not None:
                    step.run_layers()
                residual = block(residual, plan, ropes[block.window], on_selection, self.pieces)
        if step is not None:
            step.run_layers()
        if plan is decode or (step is not None and not len(plan.prompt_tokens)
                              and len(plan.sample_tokens) == step.tokens):
            last = residual  # (every token's row, in order)
        else:
            last = residual.rows(torch.cat([plan.sample_tokens, plan.prompt_tokens]))
        if self.head_kernel is not None and last.output.shape[0] <= cpu_project.KERNEL_TOKENS:
            head, *mix_weights = self.head_kernel
            return cpu_project.logits(self.pieces.mix(*last, *mix_weights)[1], head)
        x = hc_head(last.written(), *self.hc_head_weights, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        return linear(rms_norm(x, self.norm, cfg.rms_norm_eps), self.head).float()

    def _decode_buffers(self, tokens: int) -> DecodeBuffers:
        """What decode steps of `tokens` tokens keep from step to step (made at the first such step)."""
        buffers = self._buffers_by_tokens.get(tokens)
        if buffers is None:
            buffers = self._buffers_by_tokens[tokens] = DecodeBuffers(tokens, self.cfg.hc_mult, self.cfg.hidden_size,
                                                                     self.dtype, self.cfg.num_layers,
                                                                     len(self.cfg.compressed_ratios))
        return buffers

    def _head_kernel(self, cfg: ModelConfig) -> tuple[torch.Tensor, ...] | None:
        """The head of a few rows as two C calls where the CPU's kernels serve (None: they do not): the
        streams written, collapsed as `hc_head` collapses them and normed by the mix kernel (cpu_mhc.mix), whose
        `pre` weights are hc_head's (its post and comb weights zero, their results unused), then the product
        with a bf16 head (cpu_project.logits): the head's bf16 copy, and the mix's weights."""
        copies = as_bf16(self.head) if cpu_project.available() else None
        if copies is None or getattr(self.pieces.mix, "func", None) is not cpu_mhc.mix:
            return None
        fn, base, scale = self.hc_head_weights
        n = cfg.hc_mult
        mixes = (2 + n) * n
        padded_fn = fn.new_zeros(mixes, fn.shape[1])
        padded_fn[:n] = fn
        padded_base, padded_scale = base.new_zeros(mixes), scale.new_zeros(mixes)
        padded_base[:n], padded_scale[:n] = base, scale
        return copies[0], padded_fn, padded_base, padded_scale, self.norm


class _Block:
    """One decoder layer: mHC around attention, then mHC around the MoE. The layer's output stays
    unwritten in the residual it returns: the next layer's first mix writes it."""

    def __init__(self, cfg: ModelConfig, layer: int, w, pools: StatePools, kernels: bool, shard: ShardPlan,
                 reduce: Reducer | None):
        self.window = cfg.layer_kind(layer) == WINDOW
        self.attn_hc, self.ffn_hc = (
            HyperConnection(*(w(f"layers.{layer}.hc_{kind}_{part}") for part in ("fn", "base", "scale")),
                            w(f"layers.{layer}.{kind}_norm.weight"), hc_mult=cfg.hc_mult)
            for kind in ("attn", "ffn"))
        self.attn = PagedAttention(cfg, layer, w.under(f"layers.{layer}.attn."), pools, kernels=kernels,
                                   shard=shard, reduce=reduce)
        self.ffn = GroupedMoE(cfg, layer, w.under(f"layers.{layer}.ffn."), shard=shard, reduce=reduce)

    def __call__(self, residual: Residual, plan: BatchPlan, rope: Rope, on_selection: SelectionSink | None,
                 pieces: Pieces) -> Residual:
        """The residual of the batch's tokens; `rope` at the batch's positions."""
        streams, x, post, comb = pieces.mix(*residual, *self.attn_hc.weights)
        y = self.attn(self.attn.project(x, rope, pieces), plan, rope, on_selection, pieces)
        streams, x, post, comb = pieces.mix(streams, y, post, comb, *self.ffn_hc.weights)
        return Residual(streams, self.ffn(x, plan.token_ids, pieces.moe, pieces.moe_dispatch), post, comb)


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
