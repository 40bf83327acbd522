"""The MoE feed-forward, batched by expert (`grouped`): every (token, pick) pair is sorted by expert,
every expert runs over its tokens in one grouped matmul per projection (`F.grouped_mm`: the gate and
up projections fused, then the down projection), and the results are summed back; each expert's rows
are padded with zero rows to a multiple of GROUP_ROWS, so its matmuls come in a few shapes. For the
few tokens of a decode step, compiled, `few` reads each pick's expert in place instead (no sort, no
grouped matmul); on a CPU whose C kernels run (AVX512-BF16 or AVX2), the forwards of up to cpu_moe.KERNEL_TOKENS tokens of a bf16
model (or of an fp32 one whose weights hold bf16 values, from bf16 copies of them) run the same sums
as one C kernel instead, and a bf16 model's longer forwards run them in blocks of 16 picks (on a CPU
with AMX tiles, on the tiles, forwards of any size; dsv4/kernels/cpu_moe.py), each after the routing
and sort: in C for up to KERNEL_TOKENS tokens, else the compiled dispatch.

Routing: scores s = score_fn(x @ W_gate^T) in at least fp32; learned layers pick the top-k of s + bias
(the bias only steers selection), hash layers pick tid2eid[token id]; the picks are weighted by their
s, normalised to sum 1 (norm_topk_prob), times routed_scaling_factor.

Under tensor parallelism (`dsv4.model.sharding`) every rank routes every token the same way but runs
only its own experts and its share of the shared expert; the partial sums meet in one all_reduce."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dsv4.config import ModelConfig
from dsv4.kernels import cpu_attention, cpu_moe

from . import ops
from .ops import accumulation_dtype, as_bf16, linear, row_linear
from .sharding import Reducer, ShardPlan

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# On the CPU, oneDNN builds a kernel for every matmul shape it has not seen (0.3..0.9 ms each), and a
# group's row count changes with every batch: unpadded, each 256-token bf16 prefill of `small` built ~50
# of them (~19 ms), and its grouped matmuls took 3.65 + 2.27 ms a layer (1.01 + 0.68 padded). Rounded up
# to 16 rows (the height of an AMX tile, which computes whole tiles anyway), a group has at most
# picks / 16 + 1 shapes, each built once.
GROUP_ROWS = 16
_SCORE_FUNCTIONS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt_(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
}


class GroupedMoE:
    def __init__(self, cfg: ModelConfig, layer: int, w, *, shard: ShardPlan, reduce: Reducer | None):
        """`w(name)` fetches this layer's tensor `ffn.<name>` (this rank's part, `shard`), already in the
        dtype its math runs in. `reduce` sums partial results across tensor-parallel ranks (None: TP=1)."""
        self.reduce, self.swiglu_limit = reduce, cfg.swiglu_limit
        self.experts = shard.experts
        # Hash layers route by the token id (tid2eid [vocab, k], long); learned layers by score + bias.
        self.router = (w("gate.weight"), w("gate.tid2eid") if cfg.is_hash_layer(layer) else w("gate.bias"))
        # The checkpoint's [out, in] layout: [E, 2 * inter, hidden], w1 (gate) rows then w3 (up) rows;
        # [E, hidden, inter]
        self.w13 = torch.stack([torch.cat([w(f"experts.{e}.w1.weight"), w(f"experts.{e}.w3.weight")])
                                for e in self.experts])
        self.w2 = torch.stack([w(f"experts.{e}.w2.weight") for e in self.experts])
        self.shared = (None, None)
        if cfg.n_shared_experts:
            self.shared = (torch.cat([w("shared_experts.w1.weight"), w("shared_experts.w3.weight")]),
                           w("shared_experts.w2.weight"))
        # Decode steps through the C kernel on a CPU that runs it: bf16 weights (decode steps of `small` on
        # a Xeon with AMX, in process, alternated: 1 request 12.7..13.0 -> 11.9..12.2 ms against `few`; 8
        # requests 29.2..30.5 -> 24.7..24.9 ms and 32 requests 50.0..50.2 -> 48.0..48.3 against `grouped`),
        # or bf16 copies of fp32 weights that hold bf16 values (None: the kernel does not serve)
        on_cpu = self.w13.device.type == "cpu" and cpu_moe.available()
        self.kernel_weights = as_bf16(self.w13, self.w2, *self.shared) if on_cpu else None
        # A bf16 model's forwards of more tokens in blocks of 16 picks (`cpu_moe.moe_blocks`), where the
        # widths allow: on AMX tiles where the CPU has them, and they take the decode steps too (ms a layer
        # of `small` against the kernel above / the grouped matmuls, eager routing included: 1 token 0.35
        # / 0.37, 32 tokens 0.78 / 1.54, 128 tokens 1.19 / 2.32 grouped, 512 tokens 2.84 / 4.65 grouped),
        # else as bf16 pair products (AVX512-BF16 on a Zen 5, kernel and eager routing against the eager grouped MoE: 64 tokens 0.52
        # against 1.0, 512 tokens 2.6 against 3.0)
        widths = (self.w13.shape[-1], self.w2.shape[-1]) + (() if self.shared[1] is None else (self.shared[1].shape[-1],))
        self.routing = {**dispatch_constants(cfg, self.experts), "group_rows": GROUP_ROWS}  # (cpu_moe.routed's)
        self.blocks = (on_cpu and self.w13.dtype == torch.bfloat16 and self.kernel_weights is not None
                       and all(width % 32 == 0 for width in widths))
        self.tiles = self.blocks and cpu_attention.amx_available()

    def __call__(self, x: torch.Tensor, token_ids: torch.Tensor, moe: Callable, dispatch: Callable) -> torch.Tensor:
        """x [T, hidden] (ffn_norm'ed), token_ids [T] -> [T, hidden]. `moe`: `grouped` or `few` with the
        model's constants bound, eager or compiled (dsv4.model.compile.Pieces.moe); `dispatch` likewise
        (Pieces.moe_dispatch), which the C kernels follow in forwards of more tokens than
        cpu_moe.KERNEL_TOKENS."""
        few = x.shape[0] <= cpu_moe.KERNEL_TOKENS
        if self.kernel_weights is not None and few:  # with the routing and sort in C, in the same call (the
            # compiled dispatch took ~90 us a layer, most of it its own overhead)
            out = cpu_moe.routed(x, token_ids, *self.router, *self.kernel_weights, tiles=self.tiles, **self.routing,
                                 swiglu_limit=self.swiglu_limit)
        elif self.blocks:
            _, places, tokens, ends, scale, keep = dispatch(x, token_ids, *self.router)
            out = cpu_moe.moe_blocks(x, tokens, places, ends, scale, keep, *self.kernel_weights,
                                     swiglu_limit=self.swiglu_limit, tiles=self.tiles)
        else:
            out = moe(x, token_ids, *self.router, self.w13, self.w2, *self.shared)
        if self.reduce is not None:
            out = self.reduce.all_reduce_sum(out, "ffn.out")
        return out.to(x.dtype)


def grouped(x: torch.Tensor, token_ids: torch.Tensor, gate: torch.Tensor, route: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor, shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None, *, dispatch: Callable,
            combine: Callable, swiglu_limit: float) -> torch.Tensor:
    """The MoE of any number of tokens: `dispatch` and `combine` (the functions below with the model's
    constants bound, eager or compiled), and between them every expert over its rows in two grouped
    matmuls, whatever the split (no loop, no host sync). This rank's share [T, hidden] in at least fp32."""
    rows, places, tokens, ends, scale, keep = dispatch(x, token_ids, gate, route)
    up = _grouped_matmul(rows.to(w13.dtype), w13, ends)
    outputs = _grouped_matmul(swiglu(up, swiglu_limit), w2, ends)  # rows past ends[-1] unset
    return combine(outputs, places, tokens, scale, keep, x, shared_w13, shared_w2)


def few(x: torch.Tensor, token_ids: torch.Tensor, gate: torch.Tensor, route: torch.Tensor, w13: torch.Tensor,
        w2: torch.Tensor, shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None, *, first_expert: int,
        local_experts: int, top_k: int, scoring_func: str, norm_topk_prob: bool, routed_scaling_factor: float,
        swiglu_limit: float, product: Callable = linear) -> torch.Tensor:
    """`grouped`'s result for the few tokens of a decode step: each (token, pick) runs its expert's
    weights where they lie (`row_linear` over w13[expert]: compiled, an indexed read, not a copy), with
    the rounding `grouped` has (each projection rounded to the model's dtype). The picks are one flat
    axis, the one the compiled products split over the threads: with the token axis outermost, a
    one-token step ran its up-projections on one thread (small, fp32, 2 threads, weights from memory:
    262..292 -> 249..266 us a layer; bf16 211..222 -> 179..200). `product` multiplies by the shared
    expert's whole weights: `linear`, or `ops.decode_linear` where the decode packages take it (fp32, one
    token: 249..266 -> 201..223 us). Compiled only: eager, every pick would copy its expert's weights."""
    experts, weights = _route(x, token_ids, gate, route, top_k, scoring_func, norm_topk_prob, routed_scaling_factor)
    local = (experts - first_expert).flatten()  # [T * k]; picks of other ranks' experts run a stand-in, then drop out
    mine = ((local >= 0) & (local < local_experts)).unsqueeze(-1)
    local = local.clamp(0, local_experts - 1)
    up = row_linear(x.repeat_interleave(top_k, 0), w13[local])  # [T * k, 2 * inter]
    outputs = row_linear(swiglu(up, swiglu_limit), w2[local])  # [T * k, hidden]
    weighted = torch.where(mine, outputs.to(weights.dtype) * weights.flatten().unsqueeze(-1), 0)
    return _plus_shared(weighted.unflatten(0, (-1, top_k)).sum(1), x, shared_w13, shared_w2, swiglu_limit, product)


def dispatch(x: torch.Tensor, token_ids: torch.Tensor, gate: torch.Tensor, route: torch.Tensor, *, first_expert: int,
             local_experts: int, top_k: int, scoring_func: str, norm_topk_prob: bool,
             routed_scaling_factor: float) -> tuple[torch.Tensor, ...]:
    """Routes x [T, hidden] (token ids [T]; `route`: tid2eid, long, or the gate's bias) and sorts the
    (token, pick) pairs by this rank's experts first_expert..+local_experts. Returns, for the P picks:
    - rows [P + local_experts * (GROUP_ROWS - 1), hidden]: each expert's group, its picks' rows of x
      then zero rows up to a multiple of GROUP_ROWS, the groups in expert order;
    - places [P]: the row of each pick, the picks in expert order (as the next three);
    - tokens [P]: each pick's token;
    - ends [local_experts] (int32): where each group ends in the rows;
    - weights [P, 1] in at least fp32, and whether each pick is this rank's [P, 1]."""
    experts, weights = _route(x, token_ids, gate, route, top_k, scoring_func, norm_topk_prob, routed_scaling_factor)
    # Stable sort by expert: each token's picks are then summed in ascending expert order. Picks of
    # other ranks' experts sort last, past the final group, and are dropped.
    local = experts.flatten() - first_expert
    mine = (local >= 0) & (local < local_experts)
    local = torch.where(mine, local, local_experts)
    order = torch.argsort(local, stable=True)
    tokens = order // top_k
    local = local[order]
    # the ends from the sorted ids: a static shape (bincount's depends on the largest id)
    ends = torch.searchsorted(local, torch.arange(local_experts + 1, device=x.device), right=True)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = torch.cat([(sizes[:-1] + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS, sizes[-1:]])
    padded_ends = padded.cumsum(0)
    # a pick's row: its rank in the sorted picks, moved by how far its group's start moved
    places = torch.arange(local.shape[0], device=x.device) + ((padded_ends - padded) - (ends - sizes))[local]
    rows = x.new_zeros(local.shape[0] + local_experts * (GROUP_ROWS - 1), x.shape[1])
    rows[places] = x[tokens]
    return (rows, places, tokens, padded_ends[:-1].to(torch.int32), weights.flatten()[order].unsqueeze(-1),
            mine[order].unsqueeze(-1))


def combine(outputs: torch.Tensor, places: torch.Tensor, tokens: torch.Tensor, scale: torch.Tensor,
            keep: torch.Tensor, x: torch.Tensor, shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None, *,
            swiglu_limit: float) -> torch.Tensor:
    """The experts' outputs (rows laid out as `dispatch`'s) at the picks' `places`, weighted and summed
    per token, plus the shared expert over x [T, hidden]: this rank's share of the MoE's output [T,
    hidden] in at least fp32."""
    out = torch.zeros_like(x, dtype=scale.dtype)
    out.index_add_(0, tokens, torch.where(keep, outputs[places].to(scale.dtype) * scale, 0))
    return _plus_shared(out, x, shared_w13, shared_w2, swiglu_limit, linear)


def _plus_shared(out: torch.Tensor, x: torch.Tensor, shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None,
                 swiglu_limit: float, product: Callable) -> torch.Tensor:
    if shared_w13 is None:
        return out
    return out + product(swiglu(product(x, shared_w13), swiglu_limit), shared_w2).to(out.dtype)


def _route(x: torch.Tensor, token_ids: torch.Tensor, gate: torch.Tensor, route: torch.Tensor, top_k: int,
           scoring_func: str, norm_topk_prob: bool, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k], their weights [T, k] in at least fp32)."""
    scores = _SCORE_FUNCTIONS[scoring_func](F.linear(x.to(accumulation_dtype(x.dtype)), gate))
    if route.dtype == torch.long:
        experts = route[token_ids]
    else:
        experts = (scores + route).topk(top_k, dim=-1).indices
    weights = scores.gather(-1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights * routed_scaling_factor


def swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def dispatch_constants(cfg: ModelConfig, experts: range) -> dict:
    """`dispatch`'s constants for a rank that runs `experts`."""
    return {"first_expert": experts.start, "local_experts": len(experts), "top_k": cfg.num_experts_per_tok,
            "scoring_func": cfg.scoring_func, "norm_topk_prob": cfg.norm_topk_prob,
            "routed_scaling_factor": cfg.routed_scaling_factor}


def _grouped_matmul(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x [P, in] rows ends[g-1]..ends[g] times w[g] [out, in] -> [P, out]; rows past ends[-1] unset."""
    # (the transposed view, measured against an [in, out] copy at 64 and 512 rows: as fast in fp32,
    # up to ~15% slower in bf16; a 256-token prefill of `small` took the same time either way)
    if x.dtype in _GROUPED_MM_DTYPES and not ops.onednn_serves(w):
        return F.grouped_mm(x, w.mT, offs=ends)
    # One `linear` per group: float64 (the oracle tests' dtype), and fp32 on the CPU, whose `linear` is
    # oneDNN's (the ends are on the host, no sync), ~2.3x grouped_mm's pace there (a Zen 5, 3072 picks
    # over 8 experts of `small`: 3.8 against 9.0 ms, and 2.0 against 3.7)
    out = x.new_empty(x.shape[0], w.shape[-2])
    for g, (start, end) in enumerate(itertools.pairwise([0, *ends.tolist()])):
        out[start:end] = linear(x[start:end], w[g])
    return out
