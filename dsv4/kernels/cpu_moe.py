"""The MoE as C kernels (AVX512-BF16 or AVX2, cpu_library): `moe_few` (cpu/moe.c) for a decode step's tokens, of a bf16 model
or an fp32 one whose weights hold bf16 values (read from bf16 copies, widened exactly as they are read),
and `moe_blocks` (cpu/moe_blocks.c) for any number of a bf16 model's tokens, in blocks of 16 picks, on
AMX tiles or as bf16 pair products (AVX512-BF16's, or AVX2's widened): after the routing and sort (dsv4.model.moe.dispatch, or `route` for a
decode step's few tokens), each expert's weights and the shared expert's read where they lie, against
their picks, rounded where dsv4.model.moe.grouped rounds. Their oracles are `grouped` and `dispatch`
(their tests run the kernels against `grouped` and float64, and `route` against `dispatch`)."""

from __future__ import annotations

import ctypes

import torch

from .cpu_library import as_read, available, entry

__all__ = ["KERNEL_TOKENS", "available", "moe_blocks", "moe_few", "route", "routed"]

# The most tokens the model sends through the kernel rather than the grouped matmuls (decode steps of up
# to 32 requests; measured on a Xeon, eager routing: 32 tokens 1.5 ms against 1.9, 64 tokens 2.7 against
# 2.3, where oneDNN's matmuls pay for the sort)
KERNEL_TOKENS = 32
_SCORE_FUNCTIONS = ("sqrtsoftplus", "sigmoid", "softmax")  # cpu/route.c's SCORE_*


def route(x: torch.Tensor, token_ids: torch.Tensor, gate: torch.Tensor, route: torch.Tensor, *, first_expert: int,
          local_experts: int, top_k: int, scoring_func: str, norm_topk_prob: bool, routed_scaling_factor: float,
          group_rows: int) -> tuple[torch.Tensor, ...]:
    """dsv4.model.moe.dispatch's picks (places, tokens, ends, scale, keep; not its rows) of x [T, hidden]
    bf16 or fp32 (T <= KERNEL_TOKENS), token ids [T], gate [experts, hidden] fp32 and `route` (the
    gate's bias, fp32 [experts], or tid2eid, long [vocab, k]), with its constants; `group_rows`:
    dsv4.model.moe.GROUP_ROWS."""
    inputs, params = _route_inputs(x, token_ids, gate, route, first_expert, local_experts, top_k, scoring_func,
                                   norm_topk_prob, group_rows)
    picks = x.shape[0] * top_k
    places, tokens = torch.empty(2, picks, dtype=torch.int64)
    ends, scale = torch.empty(local_experts, dtype=torch.int32), torch.empty(picks, 1)
    keep = torch.empty(picks, 1, dtype=torch.bool)
    status = entry("moe_route")(*_pointers((*inputs, places, tokens, ends, scale, keep)), params,
                                routed_scaling_factor, torch.get_num_threads())
    if status != 0:
        raise MemoryError("cpu route: the kernel could not allocate its scratch memory")
    return places, tokens, ends, scale, keep


def routed(x: torch.Tensor, token_ids: torch.Tensor, gate: torch.Tensor, route: torch.Tensor, w13: torch.Tensor,
           w2: torch.Tensor, shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None, *, tiles: bool,
           first_expert: int, local_experts: int, top_k: int, scoring_func: str, norm_topk_prob: bool,
           routed_scaling_factor: float, group_rows: int, swiglu_limit: float) -> torch.Tensor:
    """`route`, then `moe_blocks` on AMX tiles (`tiles`) or `moe_few` over its picks, as one call (a decode
    step's MoE; the picks never reach Python): this rank's share of the MoE's output [T, hidden] in fp32."""
    name = "moe_tiles" if tiles else "moe_few"
    route_inputs, route_params = _route_inputs(x, token_ids, gate, route, first_expert, local_experts, top_k,
                                               scoring_func, norm_topk_prob, group_rows)
    x, weights, moe_params = _moe_inputs(name, x, x.shape[0] * top_k, w13, w2, shared_w13, shared_w2)
    if w13.shape[0] != local_experts:
        raise RuntimeError(f"cpu routed: w13 holds {w13.shape[0]} experts, the routing {local_experts}")
    out = x.new_empty(x.shape, dtype=torch.float32)
    status = entry("moe_routed")(*_pointers(route_inputs), *_pointers(weights), out.data_ptr(), route_params,
                                 moe_params, routed_scaling_factor, swiglu_limit, tiles, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"cpu routed: the kernel could not allocate its scratch memory ({status})")
    return out


def _route_inputs(x, token_ids, gate, route, first_expert, local_experts, top_k, scoring_func, norm_topk_prob,
                  group_rows):
    """`route`'s checks; its tensors (x, gate, route, token ids: contiguous, int64 ids) and moe_route's p[]."""
    count, hidden = x.shape
    experts, hashed = gate.shape[0], route.dtype == torch.long
    problems = []
    if x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu" or count > KERNEL_TOKENS:
        problems.append(f"x must be bf16 or fp32 on the CPU, at most {KERNEL_TOKENS} tokens (got {x.dtype} "
                        f"{tuple(x.shape)} on {x.device})")
    if gate.dtype != torch.float32 or gate.shape != (experts, hidden) or token_ids.shape != (count,):
        problems.append(f"gate {gate.dtype} {tuple(gate.shape)} and token ids {tuple(token_ids.shape)} do not fit x")
    if (route.shape[-1] != top_k or route.dim() != 2) if hashed else (route.dtype != torch.float32
                                                                      or route.shape != (experts,)):
        problems.append(f"route must be tid2eid [vocab, {top_k}] long or a bias [{experts}] fp32 (got {route.dtype} "
                        f"{tuple(route.shape)})")
    if scoring_func not in _SCORE_FUNCTIONS or not 0 < top_k <= min(experts, 64):
        problems.append(f"no routing by {scoring_func!r} with k {top_k} of {experts} experts")
    if problems:
        raise RuntimeError("cpu route: " + "; ".join(problems))
    params = route_params(count, hidden, experts, top_k, first_expert, local_experts, x.dtype, hashed, scoring_func,
                          norm_topk_prob, group_rows)
    inputs = (as_read(x), as_read(gate), as_read(route), as_read(token_ids, torch.int64))
    return inputs, (ctypes.c_int64 * len(params))(*params)


def route_params(tokens: int, hidden: int, experts: int, top_k: int, first_expert: int, local_experts: int,
                 dtype: torch.dtype, hashed: bool, scoring_func: str, norm_topk_prob: bool,
                 group_rows: int) -> tuple[int, ...]:
    """moe_route's p[] (cpu/route.c's R_*)."""
    return (tokens, hidden, experts, top_k, first_expert, local_experts, dtype == torch.float32, hashed,
            _SCORE_FUNCTIONS.index(scoring_func), norm_topk_prob, group_rows)


def moe_params(tokens: int, picks: int, experts: int, hidden: int, inter: int, shared: int,
               dtype: torch.dtype) -> tuple[int, ...]:
    """The MoE kernels' p[] (cpu/moe.c's M_*, cpu/moe.h's T_*)."""
    return tokens, picks, experts, hidden, inter, shared, dtype == torch.float32


def moe_few(x: torch.Tensor, tokens: torch.Tensor, places: torch.Tensor, ends: torch.Tensor, scale: torch.Tensor,
            keep: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, shared_w13: torch.Tensor | None,
            shared_w2: torch.Tensor | None, *, swiglu_limit: float) -> torch.Tensor:
    """x [T, hidden] bf16 or fp32 and its picks as `dispatch` sorts them (each pick's token, row `places`,
    weight `scale` [P, 1] fp32 and whether it is this rank's, `keep` [P, 1]; the groups' padded `ends`
    [E] int32), the experts' w13 [E, 2 * inter, hidden] and w2 [E, hidden, inter], and the shared
    expert's (or None), all bf16 -> this rank's share of the MoE's output [T, hidden] in fp32 (in x's
    dtype's arithmetic: rounded into bf16 where `grouped` rounds for a bf16 x, not at all for fp32)."""
    return _moe("moe_few", x, tokens, places, ends, scale, keep, w13, w2, shared_w13, shared_w2, swiglu_limit)


def moe_blocks(x: torch.Tensor, tokens: torch.Tensor, places: torch.Tensor, ends: torch.Tensor, scale: torch.Tensor,
               keep: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, shared_w13: torch.Tensor | None,
               shared_w2: torch.Tensor | None, *, swiglu_limit: float, tiles: bool) -> torch.Tensor:
    """`moe_few`'s result for a bf16 x of any number of tokens, in blocks of 16 picks, with the products on
    AMX tiles (`tiles`: cpu/moe_amx.c, where cpu_attention.amx_available()) or as bf16 pair
    products (AVX512-BF16's, or AVX2's widened): the hidden size and the experts' widths multiples of 32."""
    inter, hidden = w2.shape[-1], x.shape[-1]
    widths = (hidden, inter) + (() if shared_w2 is None else (shared_w2.shape[-1],))
    if x.dtype != torch.bfloat16 or any(width % 32 for width in widths):
        raise RuntimeError(f"moe_blocks: x must be bf16 (got {x.dtype}) and the hidden size and the experts' widths "
                           f"multiples of 32 (got {widths})")
    return _moe("moe_tiles" if tiles else "moe_dots", x, tokens, places, ends, scale, keep, w13, w2, shared_w13,
                shared_w2, swiglu_limit)


def _moe(name: str, x: torch.Tensor, tokens: torch.Tensor, places: torch.Tensor, ends: torch.Tensor,
         scale: torch.Tensor, keep: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, shared_w13: torch.Tensor | None,
         shared_w2: torch.Tensor | None, swiglu_limit: float) -> torch.Tensor:
    picks, experts = tokens.shape[0], w13.shape[0]
    x, weights, params = _moe_inputs(name, x, picks, w13, w2, shared_w13, shared_w2)
    if places.shape != (picks,) or scale.shape != (picks, 1) or keep.shape != (picks, 1) or ends.shape != (experts,):
        raise RuntimeError(f"{name}: places [P], scale [P, 1], keep [P, 1] and ends [E] must fit the picks and the "
                           f"experts")
    tokens, places = as_read(tokens, torch.int64), as_read(places, torch.int64)
    ends, scale, keep = as_read(ends, torch.int32), as_read(scale, torch.float32), as_read(keep, torch.bool)
    out = x.new_empty(x.shape, dtype=torch.float32)
    status = entry(name)(x.data_ptr(), *_pointers(weights), tokens.data_ptr(), places.data_ptr(), ends.data_ptr(),
                         keep.data_ptr(), scale.data_ptr(), out.data_ptr(), params, swiglu_limit,
                         torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"{name}: the kernel could not allocate its scratch memory")
    return out


def _moe_inputs(name: str, x: torch.Tensor, picks: int, w13: torch.Tensor, w2: torch.Tensor,
                shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None):
    """The MoE kernels' checks of x and the weights; x and the weights contiguous (None for an absent
    shared expert), and the kernel's p[] for `picks` picks."""
    count, hidden = x.shape
    experts, inter = w13.shape[0], w2.shape[2]
    shared = 0 if shared_w13 is None else shared_w2.shape[1]
    weights = [w13, w2] + ([shared_w13, shared_w2] if shared else [])
    problems = []
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32):
        problems.append(f"x must be bf16 or fp32 on the CPU (got {x.dtype} on {x.device})")
    if any(t.dtype != torch.bfloat16 for t in weights):
        problems.append("the weights must be bf16")
    if w13.shape != (experts, 2 * inter, hidden) or w2.shape != (experts, hidden, inter):
        problems.append(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit hidden {hidden}")
    if shared and (shared_w13.shape != (2 * shared, hidden) or shared_w2.shape != (hidden, shared)):
        problems.append(f"shared_w13 {tuple(shared_w13.shape)} and shared_w2 {tuple(shared_w2.shape)} do not fit")
    if problems:
        raise RuntimeError(f"{name}: " + "; ".join(problems))
    weights = [as_read(t) for t in weights] + ([] if shared else [None, None])
    params = moe_params(count, picks, experts, hidden, inter, shared, x.dtype)
    return as_read(x), weights, (ctypes.c_int64 * len(params))(*params)


def _pointers(tensors) -> list[int | None]:
    return [None if t is None else t.data_ptr() for t in tensors]
