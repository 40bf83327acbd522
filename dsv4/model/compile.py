"""Ahead-of-time compilation (AOTInductor) of the model's pieces made of many tiny ops, once per machine.

Why: on the CPU a decode step is dominated by per-op overhead, not arithmetic. These pieces cover
much of a layer's small ops:
- `mix` (dsv4.model.mhc): between two sublayers, the last one's output is written into the streams
  and the next one's input collapsed from them (4x4 mixing matrices normalised by 20 Sinkhorn
  iterations of row and column sums) and normed; on a CPU whose C kernels run (AVX512-BF16 or AVX2) a C kernel instead, for fp32
  and bf16 models (dsv4/kernels/cpu_mhc.py: a c=1 fp32 decode step of `small` in process 13.8..16 ->
  10.8 ms, a 32 x 256-token bf16 prefill 3.63 -> 3.19 s), and no package is compiled for it;
- `project_inputs` (dsv4.model.attention): every projection of the attention's input, the query and
  raw-row norms and RoPE (the C kernels of dsv4/kernels/cpu_project.py take the decode steps of up
  to 8 tokens, and longer forwards' norms and RoPE, where they serve: dsv4.model.attention.
  PagedAttention.project);
- `attend_decodes` (dsv4.model.attention.decode_sink_attention, one package with compressed rows
  and one without): the CPU path's attention of decode tokens over their gathered rings (and
  compressed rows): the rows' masks and upcast, then a softmax of a dozen elementwise passes over the
  logits (moving the masks and upcast in took a c=1 bf16 decode step of `small` from 15.2..15.7 to
  13.9..14.1 ms). Prefill chunks' query blocks (more than one query each) run `banded_sink_attention` eagerly:
  a 256-token prefill of `small` spent 65..70 ms in it against 82..100 ms compiled, in bf16 and fp32
  alike;
- `attention_exit` (dsv4.model.attention): the attention output's inverse RoPE and its grouped
  low-rank output projection (wo_a, wo_b);
- `compressor_feed` (dsv4.model.compressor.feed): a batch's tokens through a compressor's partial
  state (its score rows with the position bias, and the rows the new windows pool);
- `moe_dispatch` and `moe_combine` (dsv4.model.moe, one dispatch package per routing kind): the
  MoE's routing and sort by expert, and its weighted sum back plus the shared expert, around the
  grouped matmuls, which stay eager (torch's export cannot trace `grouped_mm` in fp32 on the CPU);
- `index_queries` (dsv4.model.attention.index_queries): the lightning indexer's queries and head
  weights;
- for forwards of at most `ops.FEW_TOKENS` tokens (decode steps), the whole MoE (`moe_few`,
  dsv4.model.moe.few, one per routing kind), which reads each pick's expert where it lies with
  `ops.row_linear` (a c=1 decode step's MoE of `small` took 1.8 against 7.1 ms); on a CPU whose C
  kernels run a bf16 model, or an fp32 one whose weights hold bf16 values, runs C kernels instead (routing
  and MoE) in forwards of up to `cpu_moe.KERNEL_TOKENS` tokens, and a bf16 model runs the MoE of
  longer forwards in blocks of 16 picks (on a CPU with AMX, on its tiles, forwards of any size), after
  the dispatch package past that many (dsv4/kernels/cpu_moe.py; its `moe_few` packages, and the projections'
  packages that the C kernels replace, are still compiled, unused).
Compiled, each is one call of fused C++ kernels around its matmuls. Ahead of time rather than
`torch.compile`'s just-in-time form because a call then skips dynamo's guards on every input: in a
c=1 decode step (small, fp32, in process, alternated runs) the jit-compiled collapse took 207 us a
call against 411 us eager and saved ~3 ms a step; the mix compiled ahead of time saved 5 ms (32.7 ->
27.6 ms), with the attention's entry the two take 7.3..9.9 ms of a step against 13.5..21 ms, and
the attention 1.5..2.1 ms against 2.4..3.0 ms (in a 256-token prefill it gains nothing); a layer's MoE
dispatch 44 us against 103 us eager and its combine 75 against 117 us (one token, one layer in a loop).
A package is called through its runner, not its Python wrapper (see `_load_or_compile`): the pieces'
share of a c=1 decode step of `small` fell by ~1.3 ms more (mix 1.21 -> 0.75 ms a step, the MoE's
dispatch 0.85 -> 0.56, the attention 1.96 -> 1.47).

Each compiled piece is the eager function exported as it stands: the same math, where only the
summation order of the fused code may differ, within fp32 rounding. Its batch sizes are symbolic
(tokens; the MoE's picks; the decode attention's batch and compressed rows; and the width of the layer's
input projection, which differs between window, HCA and CSA layers), so one package per piece serves every
layer and batch size. The fused kernels of most pieces that serve every batch size run on one thread
(`cpp.threads`, `_ONE_THREAD`): they are small, and forking for each costs more than it saves (every
package at two threads, the decode products then `row_linear`: a c=1 decode step of `small` took
24.4 ms in bf16 and 33.8 in fp32, against 21.3 and 22.0 at one, the products matmuls); the matmuls
inside follow the calling thread's count (every core, dsv4.engine.runner). The attention's projections
and exit have two packages each, both on every thread (`_BY_TOKENS`; measured
when the entry was one piece with the mix):
- one for forwards of at most `ops.DECODE_TOKENS` tokens, whose products are `ops.decode_linear`'s
  where this machine's one-row matmuls read weights slower than a sum does (`_decode_products`,
  measured at every start; so far bf16 on a Xeon and a Zen 4, fp32 on the Zen 4): products summed
  over the output features spread over every thread (a c=1 bf16 decode step of `small` on the Xeon:
  17.0 -> 15.2..15.7 ms, the entries 5.5 -> 4.1 ms of it, the exits 2.3 -> 1.7);
- one for more tokens, whose query-sized passes (norms and RoPE over [tokens, heads, head_dim])
  pay for the fork (at 256 tokens of `small` in bf16 the entry took 4.2 ms against 5.9 on one
  thread, the exit 1.0 against 1.1).
The decode attention's packages run on every thread too (its passes over the gathered rings: in
isolation, at 1 / 8 / 32 decodes, fp32 without compressed rows, 72 / 282 / 1190..1350 us against
86 / 374 / 1464..1845 on one thread; with them, bf16 at 32, 3.5 against 5.5 ms). The decode steps'
MoE (`moe_few`) runs on every thread too: its products spread over the picks
(two tokens in bf16: 231 against 453 us a layer; one, 194 against 200, when they spread over the
tokens), and its shared expert multiplies as the projections and exit do (`_decode_products`). Where they
multiply as products, an fp32 model whose weights hold bf16 values gives these three packages bf16
copies of the weights they read whole (`_bf16_twins`): the same math from half the bytes (a c=1 fp32
decode step of `small` on a Zen 4, in process: 12.0 -> 9.3 ms).

Packages are kept in `cache` under a key of everything the code depends on (torch's version, the
CPU's vector ISA, the pieces' input shapes and dtypes, the model's constants, the choice of decode
products, and the source of this module and of those that define the math), so a restart on the same
machine loads them (`small`'s fourteen packages: the server ready 4.6 s after start; compiling them,
120 s to ready on 2 cores, bf16, each package logged as it lands), and a start that has its packages
removes those of all but the few most recently used keys (dsv4/model/package_cache.py). Compiling or
loading is bounded by `timeout`: past it, or on any failure, the model serves eagerly and says so (a
slow compiler never keeps a server from starting; a compile that finishes late still fills the cache
for the next start).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.utils._pytree as pytree

from dsv4.config import ModelConfig
from dsv4.config.server_args import cpu_has_fast_bf16
from dsv4.kernels import cpu_mhc

from . import attention, compressor, mhc, moe, ops, package_cache

if TYPE_CHECKING:
    from .model import PagedModel

log = logging.getLogger(__name__)

_SOURCES = (attention, compressor, mhc, moe, ops)  # the modules whose code the pieces run


@dataclass(frozen=True)
class Pieces:
    """The implementations the model calls for its compilable pieces (tensors in, tensors out), each
    with the model's constants (and this rank's experts) bound."""

    mix: Callable  # mhc.mix (or its C kernel, cpu_mhc.mix)
    project_inputs: Callable  # attention.project_inputs
    attend: Callable  # attention.banded_sink_attention (eager: prefill chunks' query blocks)
    attend_decodes: Callable  # attention.decode_sink_attention
    attention_exit: Callable  # attention.attention_exit
    compressor_feed: Callable  # compressor.feed
    index_queries: Callable  # attention.index_queries
    moe: Callable  # moe.grouped (compiled: moe.few for forwards of at most FEW_TOKENS tokens)
    moe_dispatch: Callable  # moe.dispatch (the one moe.grouped calls)
    compiled: bool


def eager_pieces(cfg: ModelConfig, experts: range, dtype: torch.dtype, device: torch.device) -> Pieces:
    """The pieces uncompiled, for a model of `dtype` on `device`: its `mix` the C kernel where that serves
    it (`cpu_mhc.serves`), which no compiled package replaces."""
    constants = _constants(cfg)
    dispatch = functools.partial(moe.dispatch, **moe.dispatch_constants(cfg, experts))
    mix_kernel = cpu_mhc.serves(dtype, device, cfg.hc_mult)
    return Pieces(mix=functools.partial(cpu_mhc.mix if mix_kernel else mhc.mix, **constants),
                  project_inputs=functools.partial(attention.project_inputs, eps=cfg.rms_norm_eps),
                  attend=functools.partial(attention.banded_sink_attention, scale=attention.softmax_scale(cfg)),
                  attend_decodes=functools.partial(attention.decode_sink_attention, scale=attention.softmax_scale(cfg)),
                  attention_exit=attention.attention_exit, compressor_feed=compressor.feed,
                  index_queries=functools.partial(attention.index_queries, **_index_constants(cfg)),
                  moe=functools.partial(moe.grouped, dispatch=dispatch,
                                        combine=functools.partial(moe.combine, swiglu_limit=cfg.swiglu_limit),
                                        swiglu_limit=cfg.swiglu_limit),
                  moe_dispatch=dispatch, compiled=False)


def compile_pieces(model: PagedModel, timeout: float, cache: Path, threads: int) -> Pieces:
    """`model`'s pieces compiled (or loaded from `cache`), for its weights' shapes and dtypes and for
    forwards on `threads` threads; its eager pieces if that takes over `timeout` s or fails."""
    experts = model.blocks[0].ffn.experts
    eager = eager_pieces(model.cfg, experts, model.dtype, model.embed.device)
    products = _decode_products(model, threads)
    twins = _bf16_twins(model) if products else {}
    examples = _examples(model, twins)
    if eager.mix.func is cpu_mhc.mix:  # (the C kernel's mix serves every batch)
        del examples["mix"]
    key = _key(model.cfg, experts, examples, products)
    packages = {name: cache / f"{name}-{key}.pt2" for name in examples}
    started = time.monotonic()
    action = "loading" if all(path.exists() for path in packages.values()) else "compiling (once per machine)"
    log.info("%s the model's pieces (%s) with AOTInductor into %s (bounded by --compile-timeout %.0f s; "
             "--disable-compile to skip)", action, ", ".join(packages), cache, timeout)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4-compile")
    try:
        compiled = pool.submit(_load_or_compile_all, packages, examples, _modules(model.cfg, experts, products)).result(
            timeout=timeout)
    except FutureTimeout:
        log.warning("compiling did not finish within %.0f s: serving eagerly", timeout)
        return eager
    except Exception as e:  # noqa: BLE001 -- any compiler failure means: serve eagerly, and say why
        log.warning("compiling failed (%s: %s): serving eagerly", type(e).__name__, e)
        return eager
    finally:
        pool.shutdown(wait=False)
    log.info("compiled pieces ready in %.1f s", time.monotonic() - started)
    try:
        package_cache.mark_used(list(packages.values()))
        package_cache.prune(cache)
    except OSError as e:  # a cache the server cannot tidy still serves it
        log.warning("could not prune the compiled packages' cache %s: %s", cache, e)
    return _assemble(eager, compiled, twins)


# The decode packages multiply as `ops.decode_linear` where this machine's one-row `ops.linear` takes at
# least this many times as long as a sum over the same weights. On a Zen 4 (2 cores, `small`'s wq_b) it took
# 2.2x in bf16 and 2.9..5.2x in fp32, and the products took the c=1 fp32 decode step from 24.7 to
# 13.1..14.1 ms; on a Xeon with AMX, bf16 F.linear took 1.8x the products' time and fp32 F.linear was
# the faster (its lag against a sum was not measured there). (Those fp32 figures are MKL's: fp32
# `ops.linear` is oneDNN's now: one row of a [512, 512] weight on a Zen 5 in 21 us against MKL's 14.)
_PRODUCTS_LAG = 1.25


def _decode_products(model: PagedModel, threads: int) -> bool:
    """Whether the decode packages (the projections', the exit's and the MoE's shared expert) multiply as
    `ops.decode_linear` rather than with `ops.linear`: on the CPU, where one-row `ops.linear` over the layers'
    query projections (wq_b) lags a sum over them by `_PRODUCTS_LAG` or more. Off the CPU, `ops.linear`
    (the products were not measured there); and where the C kernels take every layer's decode steps
    (dsv4/kernels/cpu_project.py, cpu_moe.py), which leave those packages unused, `ops.linear` unmeasured:
    the measurement, noisy near the threshold, keys the packages, and a flip recompiled them (~2 min)."""
    if model.embed.device.type != "cpu":
        return False
    if all(block.attn.kernel_weights is not None and block.ffn.kernel_weights is not None for block in model.blocks):
        log.info("decode projections by the CPU's C kernels (their packages serve no decode step)")
        return False
    lag = ops.one_row_linear_lag([block.attn.wq_b for block in model.blocks], threads)
    products = lag >= _PRODUCTS_LAG
    log.info("decode projections %s: one-row ops.linear took %.2fx a sum over the same weights (%s threads)",
             "as summed products (ops.decode_linear)" if products else "with ops.linear", lag, threads)
    return products


# Pieces with two packages (the module's docstring): the one named as the piece serves forwards of at
# most DECODE_TOKENS tokens, with `ops.decode_linear`'s products where they pay (`_decode_products`);
# `<name>_many` the rest.
_BY_TOKENS = ("project_inputs", "attention_exit")
# Packages (by name prefix) whose fused kernels run on one thread
_ONE_THREAD = ("mix", "compressor_feed", "index_queries", "moe_dispatch", "moe_combine")


# How the log says that the decode packages read bf16 copies (scripts/bench reads it to count their bytes)
BF16_COPIES_LOGGED = "decode steps read bf16 copies of the fp32 weights"


def _bf16_twins(model: PagedModel) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """For an fp32 model whose decode packages multiply as products: bf16 copies of the weights they
    read whole (the attention's input and output projections, the experts), where every one of them
    holds bf16 values exactly (a bf16 checkpoint served in fp32). The products upcast each weight as
    they read it, so the math is the same while a decode step reads half the bytes of those weights
    (most of `small`'s 186 MB a step in fp32). {id(weight): (weight, its copy)}; empty where any
    weight would round (one layout for every layer: the packages serve them all)."""
    if model.dtype != torch.float32:
        return {}
    weights = [w for block in model.blocks
               for w in (block.attn.input_weights[0], block.attn.wq_b, block.attn.wo_a, block.attn.wo_b,
                         block.ffn.w13, block.ffn.w2, *block.ffn.shared) if w is not None]
    # (the copies that the C kernels read, where they serve, are these weights' twins too)
    copies = {id(w): copy for block in model.blocks
              for owner, originals in ((block.attn, (block.attn.input_weights[0], block.attn.wq_b, block.attn.wo_a,
                                                     block.attn.wo_b)),
                                       (block.ffn, (block.ffn.w13, block.ffn.w2, *block.ffn.shared)))
              if owner.kernel_weights is not None
              for w, copy in zip(originals, owner.kernel_weights, strict=True) if w is not None and w is not copy}
    twins, added = {}, 0
    for weight in weights:
        twin = copies.get(id(weight))
        if twin is None:
            twin = weight.to(torch.bfloat16).contiguous()
            added += twin.numel() * 2
        if not torch.equal(twin.to(weight.dtype), weight):
            return {}
        twins[id(weight)] = (weight, twin)
    log.info("%s they multiply by whole (%.0f MB more memory): every one holds bf16 values", BF16_COPIES_LOGGED,
             added / 1e6)
    return twins


def _with_twins(args: tuple, twins: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> tuple:
    """`args` with every weight that has a bf16 twin (`_bf16_twins`) replaced by it."""
    return tuple(twins[id(t)][1] if id(t) in twins else t for t in args)


def _assemble(eager: Pieces, compiled: dict[str, Callable], twins: dict[int, tuple[torch.Tensor, torch.Tensor]]
              ) -> Pieces:
    """The Pieces over the loaded packages: each call routed to the package for its sizes and kind (the
    packages of few tokens given the weights' bf16 `twins` where there are some); `eager`'s where no
    package serves (what a model lacks)."""
    attend, attend_compressed = compiled["attend_decodes"], compiled["attend_decodes_compressed"]

    def attend_decodes(*tensors: torch.Tensor):  # (q, ring, at, sink[, compressed, its exists, allowed])
        return (attend_compressed if len(tensors) == 7 else attend)(*tensors)

    def by_route(name: str) -> Callable:  # one package per routing kind the model has (hash: tid2eid, long)
        packages = {kind: compiled[f"{name}_{kind}"] for kind in ("hash", "scored") if f"{name}_{kind}" in compiled}
        return lambda x, token_ids, gate, route, *weights: packages["hash" if route.dtype == torch.long else "scored"](
            x, token_ids, gate, route, *weights)

    def by_tokens(tiers: list[tuple[str, Callable]], general: Callable) -> Callable:
        """Calls for a number of tokens routed to the first of `tiers` (package name, its callable; from
        the fewest tokens up) whose `_token_limit` admits it, else to `general`."""
        bounded = [(_token_limit(name), _reads_twins(name) and bool(twins), piece) for name, piece in tiers]

        def route(first: torch.Tensor, *rest: torch.Tensor):  # the first argument's rows: tokens
            tokens = first.shape[0]
            for limit, reads_twins, piece in bounded:
                if tokens <= limit:
                    return piece(first, *(_with_twins(rest, twins) if reads_twins else rest))
            return general(first, *rest)
        return route

    dispatch = by_route("moe_dispatch")
    entry, exit_ = (by_tokens([(name, compiled[name])], compiled[f"{name}_many"]) for name in _BY_TOKENS)
    # (a model of window layers alone has no compressor to compile a feed for, nor index queries)
    return Pieces(mix=compiled.get("mix", eager.mix), project_inputs=entry, attend=eager.attend,
                  attend_decodes=attend_decodes,
                  attention_exit=exit_,
                  compressor_feed=compiled.get("compressor_feed", eager.compressor_feed),
                  index_queries=compiled.get("index_queries", eager.index_queries),
                  moe=by_tokens([("moe_few", by_route("moe_few"))],
                                functools.partial(eager.moe, dispatch=dispatch, combine=compiled["moe_combine"])),
                  moe_dispatch=dispatch, compiled=True)


class _Piece(torch.nn.Module):
    """A piece as the module torch.export takes: `function` with its constants bound, called with
    explicit arguments (export maps its dynamic shapes onto them)."""

    def __init__(self, function: Callable, **constants):
        super().__init__()
        self.function, self.constants = function, constants

    def forward(self, *tensors: torch.Tensor | None):
        return self.function(*tensors, **self.constants)


def _modules(cfg: ModelConfig, experts: range, decode_products: bool) -> dict[str, _Piece]:
    """Every package's module by name (`moe_few_*` and the `_BY_TOKENS` pieces' own names: forwards of
    few tokens, `_token_limit`, whose whole-weight products are `ops.decode_linear`'s with
    `decode_products`)."""
    constants, dispatch = _constants(cfg), moe.dispatch_constants(cfg, experts)
    product = ops.decode_linear if decode_products else ops.linear
    return {
        "mix": _Piece(mhc.mix, **constants),
        "project_inputs": _Piece(attention.project_inputs, eps=cfg.rms_norm_eps, product=product),
        "project_inputs_many": _Piece(attention.project_inputs, eps=cfg.rms_norm_eps),
        "attend_decodes": _Piece(attention.decode_sink_attention, scale=attention.softmax_scale(cfg)),
        "attend_decodes_compressed": _Piece(attention.decode_sink_attention, scale=attention.softmax_scale(cfg)),
        "attention_exit": _Piece(attention.attention_exit, product=product),
        "attention_exit_many": _Piece(attention.attention_exit),
        "compressor_feed": _Piece(compressor.feed),
        "index_queries": _Piece(attention.index_queries, **_index_constants(cfg)),
        **{f"moe_dispatch_{kind}": _Piece(moe.dispatch, **dispatch) for kind in ("hash", "scored")},
        **{f"moe_few_{kind}": _Piece(moe.few, **dispatch, swiglu_limit=cfg.swiglu_limit, product=product)
           for kind in ("hash", "scored")},
        "moe_combine": _Piece(moe.combine, swiglu_limit=cfg.swiglu_limit)}


def _examples(model: PagedModel, twins: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, ...]]:
    """Each piece's arguments for a batch of 2 tokens: zero activations, the weights of the layer with
    the widest input projection (traced at a window layer's, the empty rest would be specialised); the
    decode steps' packages (`_reads_twins`) with the weights' bf16 `twins` where there are some
    (`_bf16_twins`)."""
    block = max(model.blocks, key=lambda block: block.attn.input_weights[0].shape[0])
    cfg, tokens = model.cfg, 2
    n, hidden, dtype = cfg.hc_mult, cfg.hidden_size, model.dtype
    acc, device = ops.accumulation_dtype(dtype), model.embed.device
    residual = (torch.zeros(tokens, n, hidden, dtype=dtype, device=device),
                torch.zeros(tokens, hidden, dtype=dtype, device=device),
                torch.zeros(tokens, n, dtype=acc, device=device),
                torch.zeros(tokens, n, n, dtype=acc, device=device))
    # (every example its own tensor: export would trace two arguments passed as one tensor as one input)
    cos2, sin2 = (torch.zeros(tokens, cfg.rope_head_dim, dtype=acc, device=device) for _ in range(2))
    # Decode attention: batch and compressed rows each of its own size (export would take two dims of
    # one example size for one symbol); heads, the window and head_dim are the model's; the rows in
    # the dtype the cache returns them in.
    heads, dim, window = block.attn.sink.shape[0], cfg.head_dim, cfg.sliding_window
    rows_dtype = block.attn.main_rows_dtype
    batch, rows = 3, 5
    attend = (torch.zeros(batch, heads, dim, dtype=dtype, device=device),
              torch.zeros(batch, window, dim, dtype=rows_dtype, device=device),
              torch.zeros(batch, dtype=torch.long, device=device), block.attn.sink)
    compressed = (torch.zeros(batch, rows, dim, dtype=rows_dtype, device=device),
                  *(torch.ones(batch, rows, dtype=torch.bool, device=device) for _ in range(2)))
    entry = (torch.zeros(tokens, hidden, dtype=dtype, device=device), *block.attn.input_weights, cos2, sin2)
    exit_ = (torch.zeros(tokens, heads, dim, dtype=dtype, device=device), cos2, sin2, block.attn.wo_a, block.attn.wo_b)
    examples = {"mix": (*residual, *block.ffn_hc.weights), "project_inputs": entry, "attend_decodes": attend,
                "attend_decodes_compressed": (*attend, *compressed), "attention_exit": exit_}
    # A compressor's feed at sizes of its own each (2 tokens, 3 state rows read, 5 windows of 7 slots, 9
    # rows updated; an ape of 13 x 17): every compressor of the model has other ratios and widths.
    apes = [b.attn.compressor.ape for b in model.blocks if b.attn.compressor is not None]
    if apes:
        width = 17
        examples["compressor_feed"] = (torch.zeros(tokens, 2 * width, dtype=dtype, device=device),
                                       torch.arange(tokens, device=device),
                                       torch.zeros(13, width, dtype=apes[0].dtype, device=device),
                                       torch.zeros(3, 2 * width, dtype=acc, device=device),
                                       torch.zeros(5, 7, dtype=torch.long, device=device),
                                       torch.zeros(9, dtype=torch.long, device=device))
    indexed = [b.attn for b in model.blocks if b.attn.index_compressor is not None]
    if indexed:
        index_heads = indexed[0].index_wq_b.shape[0] // cfg.index_head_dim
        examples["index_queries"] = (torch.zeros(tokens, cfg.q_lora_rank, dtype=dtype, device=device),
                                         torch.zeros(tokens, index_heads, dtype=dtype, device=device),
                                         indexed[0].index_wq_b, cos2, sin2)
    # The MoE at two tokens (distinct ids: export would specialise on equal ones) and their k picks each
    ffn, picks = block.ffn, tokens * cfg.num_experts_per_tok
    moe_input = (torch.zeros(tokens, hidden, dtype=dtype, device=device), torch.arange(tokens, device=device))
    for b in model.blocks:
        kind = "hash" if b.ffn.router[1].dtype == torch.long else "scored"
        examples.setdefault(f"moe_dispatch_{kind}", (*moe_input, *b.ffn.router))
        examples.setdefault(f"moe_few_{kind}", (*moe_input, *b.ffn.router, b.ffn.w13, b.ffn.w2, *b.ffn.shared))
    examples["moe_combine"] = (torch.zeros(picks + ffn.w13.shape[0] * (moe.GROUP_ROWS - 1), hidden, dtype=dtype,
                                           device=device),
                               torch.arange(picks, device=device),
                               torch.zeros(picks, dtype=torch.long, device=device),
                               torch.zeros(picks, 1, dtype=acc, device=device),
                               torch.ones(picks, 1, dtype=torch.bool, device=device),
                               torch.zeros(tokens, hidden, dtype=dtype, device=device), *ffn.shared)
    # A package's kernels index every input with the strides its example had, unchecked, and `piece`
    # passes contiguous tensors: an example laid out otherwise (a weight that is a view, as dsv4.tiny's
    # tid2eid is) compiles kernels that read the served tensor's elements from the wrong places.
    examples.update({f"{name}_many": examples[name] for name in _BY_TOKENS})
    examples = {name: _with_twins(tensors, twins) if _reads_twins(name) else tensors
                for name, tensors in examples.items()}
    return {name: tuple(None if t is None else t.contiguous() for t in tensors) for name, tensors in examples.items()}



def _token_limit(name: str) -> int | None:
    """The most tokens the package serves (None: any number)."""
    if name.startswith("moe_few"):
        return ops.FEW_TOKENS
    return ops.DECODE_TOKENS if name in _BY_TOKENS else None


def _reads_twins(name: str) -> bool:
    """Whether the package reads the weights' bf16 twins where there are some (`_bf16_twins`): those of
    decode steps, whose products upcast each weight as they read it."""
    return name in _BY_TOKENS or name.startswith("moe_few")


def _dynamic_shapes(name: str, example: tuple[torch.Tensor, ...]) -> list:
    limit = _token_limit(name)
    tokens = torch.export.Dim("tokens", min=1, max=limit) if limit else torch.export.Dim("tokens", min=1)
    if name.startswith(("moe_dispatch", "moe_few")):  # (x, token_ids, gate, route, the experts' weights)
        return [{0: tokens}, {0: tokens}] + [None] * (len(example) - 2)
    if name == "moe_combine":  # picks = tokens * k, which export cannot express: a symbol of its own (and rows)
        picks, rows = torch.export.Dim("picks", min=1), torch.export.Dim("rows", min=1)
        return [{0: rows}, {0: picks}, {0: picks}, {0: picks}, {0: picks}, {0: tokens}, None, None]
    if name.startswith("attend_decodes"):  # (q, ring, at, sink[, compressed, its exists, allowed])
        batch, rows = torch.export.Dim("batch", min=1), torch.export.Dim("compressed", min=1)
        shapes = [{0: batch}, {0: batch}, {0: batch}, None]
        return shapes + ([{0: batch, 1: rows}] * 3 if name == "attend_decodes_compressed" else [])
    if name == "compressor_feed":  # any of them may be empty (most decode steps complete no window)
        tokens, read, windows, updates = (torch.export.Dim(dim, min=0) for dim in ("tokens", "read", "windows", "updates"))
        ratio, width, span = (torch.export.Dim(dim, min=1) for dim in ("ratio", "width", "span"))
        return [{0: tokens, 1: 2 * width}, {0: tokens}, {0: ratio, 1: width}, {0: read, 1: 2 * width},
                {0: windows, 1: span}, {0: updates}]
    if name.startswith("attention_exit"):
        return [{0: tokens}, {0: tokens}, {0: tokens}, None, None]
    if name == "index_queries":
        return [{0: tokens}, {0: tokens}, None, {0: tokens}, {0: tokens}]
    if name == "mix":
        return [{0: tokens}] * 4 + [None] * 4
    # (x, w_input, q_norm, wq_b, kv_norm, cos2, sin2); w_input: wq_a | wkv | the rest, which window, HCA
    # and CSA layers size differently (window layers: empty)
    q_norm, kv_norm = example[2], example[4]
    width = torch.export.Dim("input_width", min=q_norm.shape[0] + kv_norm.shape[0])
    return [{0: tokens}, {0: width}, None, None, None, {0: tokens}, {0: tokens}]


def _load_or_compile_all(packages: dict[str, Path], examples: dict[str, tuple],
                         modules: dict[str, _Piece]) -> dict[str, Callable]:
    """Every package, loaded or compiled; each one compiled is logged as it lands (a first start
    compiles for minutes: the log shows how far it is)."""
    loaded, started = {}, time.monotonic()
    for done, (name, path) in enumerate(packages.items(), 1):
        compiling = not path.exists()
        loaded[name] = _load_or_compile(path, name, examples[name], modules[name])
        if compiling:
            log.info("compiled %s (%d of %d packages, %.0f s so far)", name, done, len(packages),
                     time.monotonic() - started)
    return loaded


def _load_or_compile(package: Path, name: str, example: tuple[torch.Tensor, ...], module: _Piece) -> Callable:
    if not package.exists():
        package.parent.mkdir(parents=True, exist_ok=True)
        # (the module's one parameter is the tuple of tensors)
        program = torch.export.export(module, example, dynamic_shapes=(tuple(_dynamic_shapes(name, example)),))
        partial = package.with_name(f"{package.stem}.{os.getpid()}.partial.pt2")
        configs = {"cpp.threads": 1} if example[0].device.type == "cpu" and name.startswith(_ONE_THREAD) else {}
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=configs)
        os.replace(partial, package)  # whole or absent: a concurrent start never loads half a package
    # The loaded package's own __call__ fetches its input and output tree specs and walks both trees
    # on every call (~30 us; 40 calls a decode step of `small`); every piece takes a flat
    # tuple of tensors (None: an absent weight, which export leaves out) and returns a tensor or a
    # flat tuple, so the runner is called directly.
    loader = torch._inductor.aoti_load_package(str(package)).loader
    returns_one = pytree.treespec_loads(loader.get_call_spec()[1]).is_leaf()

    def piece(*tensors: torch.Tensor | None):
        # The package's kernels index their inputs as the (contiguous) examples were laid out; they
        # do not check strides (an expanded tensor read as whole rows reads garbage).
        outputs = loader.boxed_run([t.contiguous() for t in tensors if t is not None])
        return outputs[0] if returns_one else tuple(outputs)

    return piece


def _constants(cfg: ModelConfig) -> dict:
    return {"n": cfg.hc_mult, "sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
            "norm_eps": cfg.rms_norm_eps}


def _index_constants(cfg: ModelConfig) -> dict:
    return {"head_dim": cfg.index_head_dim, "scale": attention.index_scale(cfg)}


def _key(cfg: ModelConfig, experts: range, examples: dict[str, tuple[torch.Tensor, ...]], decode_products: bool) -> str:
    device = next(iter(examples.values()))[0].device
    # (with whether bf16 products widen to fp32, `ops.widens_bf16`: "AVX512" names CPUs with and without them)
    isa = ((torch.backends.cpu.get_cpu_capability(), cpu_has_fast_bf16()) if device.type == "cpu"
           else torch.cuda.get_device_name(device))
    shapes = {name: [None if t is None else (tuple(t.shape), str(t.dtype)) for t in tensors]  # None: no shared expert
              for name, tensors in examples.items()}
    facts = (torch.__version__, isa, device.type, sorted(_constants(cfg).items()), attention.softmax_scale(cfg),
             sorted(_index_constants(cfg).items()),
             sorted(moe.dispatch_constants(cfg, experts).items()), cfg.swiglu_limit, sorted(shapes.items()),
             decode_products)
    # this module too: how a piece is exported (its wrapper, examples, symbolic sizes) is part of it
    sources = b"".join(Path(path).read_bytes() for path in (__file__, *(module.__file__ for module in _SOURCES)))
    return hashlib.sha256(repr(facts).encode() + sources).hexdigest()[:16]
