"""A decode step's layers as one C call each (dsv4/kernels/cpu_layer.py), where the CPU's C kernels take
every piece of the layer: what `_Block` computes through a dozen kernel calls and the torch ops around
them, from tensors bound once. A c=1 decode layer of `small` spent ~250 us in its kernels and ~200 more
in the Python and torch ops around them.

`FusedLayer` binds a layer's weights, pools and constants at construction; `DecodeStep` prepares, once per
forward, the batch's indices (from its DecodePlan, dsv4/model/plan.py) and RoPE tables that every layer
reads; `DecodeBuffers` keeps the layers' residuals and their kernels' p[] arrays from step to step. The
layers' calls are queued on the step and run together (cpu/layer.c's decode_layers) where something reads
their output, with the step's inputs passed once for all of them (cpu_layer.Calls.step): the step's Python
then runs in one stretch, not nine, each of which ran ~4 times slower than hot, its caches cold from the
kernels' weight streams. A forward every layer of which runs fused is planned as a DecodePlan alone (ModelRunner,
`PagedModel.runs_fused`). A layer runs fused where its indexer (a CSA layer's) does not select
(`FusedLayer.serves`: contexts of at most index_topk compressed rows). Where windows of its compressors
complete in the step, the call also pools and stores their new rows, which its attention reads; where the
pools fingerprint the index keys it would write, it runs in two calls around the compressors' own storing
(PagedCompressor.store) and recording of them instead. Otherwise, and for batches that are not decode steps
of at most cpu_project.KERNEL_TOKENS tokens, the layer runs as `_Block`. Both give the same bits."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import NamedTuple

import torch

from dsv4.config import ModelConfig
from dsv4.kernels import cpu_attention, cpu_compressor, cpu_layer, cpu_mhc, cpu_moe, cpu_project
from dsv4.kernels.cpu_library import as_read
from dsv4.memory.pools import StatePools

from .attention import softmax_scale
from .mhc import Residual
from .ops import Rope, RopeTables
from .plan import CompressedRows, CompressPlan, DecodePlan

_AT = {name: i for i, name in enumerate(cpu_layer.POINTERS)}
# Where FusedLayer.__call__ puts each of its call's pointers that are not bound: the residual in and out, the
# step's (`DecodeStep.pointers`), a ratio's compressed rows and its compressors' plan rows
_RESIDUAL = [_AT[name] for name in ("streams", "output", "post", "comb", "streams_out", "output_out", "post_out",
                                     "comb_out")]
_STEP = [_AT[name] for name in ("cos2", "sin2", "positions", "slots", "at", "token_ids")]
_ROWS = [_AT[name] for name in ("pages", "page_rows", "exists", "allowed")]
_COMP_POOL = _AT["comp_pool"]
_FEED = [[_AT[f"{name}_{c}"] for name in ("state_slots", "state_rows", "update_slots", "update_rows", "update_sources",
                                         "window_sources")] for c in (0, 1)]
_WINDOWS = [_AT["windows_0"], _AT["windows_1"]]
_STORES = [[_AT[f"store_norm_{c}"], _AT[f"store_cache_{c}"]] for c in (0, 1)]
_NEW_ROWS = [_AT[name] for name in ("window_cos2", "window_sin2", "window_pages", "window_page_rows")]
_EMBED = _AT["embed"]
_HEAD = [_AT[name] for name in ("head_fn", "head_base", "head_scale", "head_norm", "head", "logits")]
_SCRATCH = _AT["scratch"]
_ATTENTION_PARAMS = cpu_layer.PARAMS.index("attention")
_UNSEEN = [None] * len(_ROWS)  # (a ratio's rows where no token sees one yet)
_KINDS: dict[tuple, int] = {}  # every kind of FusedLayer made, by its number (`FusedLayer.kind`)


class _Seen(NamedTuple):
    """The compressed rows (one ratio) each token of a step sees, as decode_attention reads them."""

    count: int  # rows a token (0: none yet; the tensors and pointers are then None)
    tensors: list[torch.Tensor] | None  # pages, page rows, exists, allowed
    pointers: list[int] | None  # their addresses

    @classmethod
    def of(cls, rows: CompressedRows) -> _Seen:
        count = rows.pages.shape[1]
        if not count:
            return cls(0, None, None)
        tensors = [as_read(rows.pages, torch.int64), as_read(rows.page_rows, torch.int64),
                   as_read(rows.exists, torch.bool), as_read(rows.visible[:, 0], torch.bool)]
        return cls(count, tensors, [t.data_ptr() for t in tensors])


class _Feed(NamedTuple):
    """How one ratio's compressors advance in a step, as compressor_feed reads it."""

    read: int  # state rows read
    windows: int  # windows completed ...
    span: int  # ... and the rows each pools
    updates: int  # state rows written
    # the plan's state_slots, state_rows, update_slots, update_rows, update_sources, window_sources
    indices: list[torch.Tensor]
    pointers: list[int]  # their addresses

    @classmethod
    def of(cls, compress: CompressPlan) -> _Feed:
        indices = [as_read(t, torch.int64) for t in (compress.state_slots, compress.state_rows, compress.update_slots,
                                                     compress.update_rows, compress.update_sources,
                                                     compress.window_sources)]
        return cls(len(compress.state_slots), *compress.window_sources.shape, len(compress.update_slots), indices,
                   [t.data_ptr() for t in indices])


class DecodeBuffers:
    """What decode steps of one token count keep from step to step: the residuals, the first layer's input
    (its streams the embedded tokens', its output and post zero and its comb the identity, as
    Residual.start makes them) and every layer's output, in two sets by layer parity (a layer reads the
    last one's, which it never writes); the layers' kernels' p[] arrays, by what they depend on (built
    anew in every step, a kind's took ~25 us of it in situ); the kernel-read forms of the plan parts
    steps share (`read`); where the compressors' feeds copy out the windows that complete (`windows`); and
    the queue of the layers' calls."""

    MAX_PARAMS = 64  # p[] sets kept (by kind and how compressors advance: then dropped all at once)
    MAX_READ = 1024  # plan parts whose kernel-read forms are kept (`read`; as many as DecodePlanner keeps)

    def __init__(self, tokens: int, streams: int, hidden: int, dtype: torch.dtype, layers: int, ratios: int):
        def residual() -> Residual:
            return Residual(torch.empty(tokens, streams, hidden, dtype=dtype), torch.empty(tokens, hidden, dtype=dtype),
                            torch.empty(tokens, streams), torch.empty(tokens, streams, streams))

        start = Residual.start(torch.empty(tokens, streams, hidden, dtype=dtype))
        if start.post.dtype != torch.float32:
            raise RuntimeError(f"decode buffers: a {dtype} model's mixing weights are not fp32")
        self.start, self.outputs = start, [residual(), residual()]
        self.params: dict[tuple, cpu_layer.Params] = {}
        self._read: dict[int, tuple] = {}  # id(part) -> (the part, held: its id stays its own; its form)
        self._windows: dict[tuple[int, ...], torch.Tensor] = {}  # (`windows`)
        self.calls = cpu_layer.Calls(layers, ratios)  # (a step's, `DecodeStep.run_layers`)

    def read(self, part: CompressedRows | CompressPlan, form: Callable) -> _Seen | _Feed:
        """`form(part)` of a part of a decode plan, as the layers' calls read it: the same object in every step
        that shares the part (DecodePlanner keeps parts between steps), whose addresses a layer's call keeps."""
        kept = self._read.get(id(part))
        if kept is not None and kept[0] is part:
            return kept[1]
        if len(self._read) >= self.MAX_READ:
            self._read.clear()
        value = form(part)
        self._read[id(part)] = (part, value)
        return value

    def windows(self, feed: int, windows: int, span: int, width: int) -> torch.Tensor:
        """Where a layer's fed compressor `feed` (0 or 1) copies out the slots of the `windows` windows that
        complete in a step, [windows, span, width] fp32, as its call's stores read them: kept, since the
        layers' calls run one at a time."""
        key = (feed, windows, span, width)
        slots = self._windows.get(key)
        if slots is None:
            slots = self._windows[key] = torch.empty(windows, span, width)
        return slots

    def first(self, x: torch.Tensor) -> Residual:
        """The first layer's input for the embedded tokens x [T, hidden] (the buffers' start, x in its streams)."""
        self.start.streams.copy_(x.unsqueeze(1).expand_as(self.start.streams))
        return self.start


class DecodeStep:
    """A batch of decode tokens as every layer's one call reads it, prepared once a forward."""

    def __init__(self, plan: DecodePlan, rope_tables: dict[bool, RopeTables], buffers: DecodeBuffers):
        """`rope_tables`: by "is a window layer", the RoPE of each kind of layer; `buffers`: of the step's
        token count, where the layers' outputs go."""
        self.tokens = len(plan.token_ids)
        self.buffers = buffers
        self._calls = buffers.calls
        self._calls.clear()  # (a failed step's, unrun)
        self._residuals = buffers.outputs
        self.positions, self.token_ids = as_read(plan.positions, torch.int64), as_read(plan.token_ids, torch.int64)
        self.slots = as_read(plan.slots, torch.int64)
        self._held: list = []  # (what the addresses given to the calls point into)
        # By kind of layer: the addresses of its RoPE tables (cos2, sin2 [T, width] fp32) and their width
        one = plan.last_position if self.tokens == 1 else None
        self.tables = {window: self._rope_rows(tables, plan.positions, one) for window, tables in rope_tables.items()}
        # By ratio: the compressed rows each token sees, and how the compressors advance
        self.seen: dict[int, _Seen] = {}
        self.feeds: dict[int, _Feed] = {}
        self.compress = plan.compress
        self._compressed_rope = rope_tables.get(False)  # (the compressed layers')
        self._window_ropes: dict[int, Rope] = {}
        self._new_rows: dict[int, list[int]] = {}
        # Where the first layer's call embeds the tokens: the embedding's address (None: its input is given);
        # where the last one's runs the head: its tensors' addresses (None: no head in the call)
        self.embed: int | None = None
        self.head: list[int] | None = None
        self._params = buffers.params
        self._kind_params: dict[int, cpu_layer.Params] = {}  # (`params`)
        # The addresses every layer's call reads besides the RoPE tables: positions, slots, token ids
        self._inputs = [t.data_ptr() for t in (self.positions, self.slots, self.token_ids)]
        # (the queue's run sets them in every call: cpu_layer.STEP, then RATIO by ratio, in order)
        ropes = [self.tables.get(window, (None, None))[:2] for window in (True, False)]
        step = [*ropes[0], *ropes[1], *self._inputs]
        for ratio in sorted(plan.compress):
            seen = self.seen[ratio] = buffers.read(plan.compressed[ratio], _Seen.of)
            feed = self.feeds[ratio] = buffers.read(plan.compress[ratio], _Feed.of)
            step += seen.pointers or _UNSEEN
            step += feed.pointers
        self._calls.step[:] = step

    def pointers(self, window: bool) -> list[int]:
        """The step's addresses that a layer's own call reads (cpu_layer's POINTERS cos2, sin2, positions,
        slots, at, token_ids), by kind of layer (a window layer's RoPE tables or a compressed one's): what the
        queue's run sets from `Calls.step`."""
        cos2, sin2, _ = self.tables[window]
        positions, slots, token_ids = self._inputs
        return [cos2, sin2, positions, slots, positions, token_ids]

    def run_layers(self) -> None:
        """Runs the layers' calls queued so far (a layer's call is queued, not run: `FusedLayer.__call__`), as
        one: what reads their outputs runs after this."""
        self._calls.run()

    def queue(self, pointers: ctypes.Array, params: cpu_layer.Params, floats: ctypes.Array, held: list) -> None:
        """Queues a layer's call (cpu_layer.Calls.add), `held` kept until it has run."""
        self._calls.add(pointers, params, floats)
        self._held += held

    def _rope_rows(self, tables: RopeTables, positions: torch.Tensor, one: int | None) -> tuple[int, int, int]:
        """The addresses of the RoPE tables (cos2, sin2 [n, width] fp32) at `positions` [n], and their width:
        where there is `one` position, its rows in the kept tables (address arithmetic: the tensor ops of a
        Rope of one row, ~5 us, took ~4 times that in situ, their caches cold from the weights' stream), else
        the tables at the positions (RopeTables.at)."""
        table = None if one is None else tables.table(one)
        if table is not None and table.cos2.dtype == torch.float32:
            self._held.append(table)
            cos2, sin2 = table.cos2, table.sin2
            row = one * cos2.stride(0) * cos2.element_size()  # (both contiguous, of one shape)
            return cos2.data_ptr() + row, sin2.data_ptr() + row, cos2.shape[-1]
        rope = tables.at(positions)
        cos2, sin2 = as_read(rope.cos2, torch.float32), as_read(rope.sin2, torch.float32)
        self._held += [cos2, sin2]
        return cos2.data_ptr(), sin2.data_ptr(), cos2.shape[-1]

    def residual(self, layer: int) -> Residual:
        """Where layer `layer`'s call writes its residual: one of two sets of buffers, by the layer's parity
        (a layer reads the last one's, which it never writes)."""
        return self._residuals[layer % 2]

    def window_rope(self, ratio: int) -> Rope:
        """RoPE at the positions of the windows of `ratio` that complete in the step, by the compressed
        layers' frequencies (as the attention rotates their rows)."""
        rope = self._window_ropes.get(ratio)
        if rope is None:
            rope = self._window_ropes[ratio] = self._compressed_rope.at(self.compress[ratio].window_positions)
        return rope

    def new_rows(self, ratio: int) -> list[int]:
        """The addresses of the RoPE tables (cos2, sin2) and the places (pages, page rows) of the new rows of
        the windows of `ratio` that complete in the step, as a layer's call stores them."""
        pointers = self._new_rows.get(ratio)
        if pointers is None:
            compress = self.compress[ratio]
            first = compress.window_positions.tolist()
            cos2, sin2, _ = self._rope_rows(self._compressed_rope, compress.window_positions,
                                            first[0] if len(first) == 1 else None)
            places = [as_read(compress.window_pages, torch.int64), as_read(compress.window_page_rows, torch.int64)]
            pointers = self._new_rows[ratio] = [cos2, sin2, *(t.data_ptr() for t in places)]
            self._held.extend(places)
        return pointers

    def embed_and_head(self, embed: int, head: list[int], vocab: int) -> torch.Tensor:
        """Has the first layer's call embed the step's tokens (their rows of the embedding at address
        `embed`, into the start buffers' streams) and the last one's run the head (`head`: the addresses of
        PagedModel.head_kernel's padded mix weights, norm and bf16 head [vocab, hidden]), as
        PagedModel.forward does around the layers; returns the logits [T, vocab] the last call writes."""
        logits = torch.empty(self.tokens, vocab)
        self.embed, self.head = embed, [*head, logits.data_ptr()]
        return logits

    @staticmethod
    def takes(plan: DecodePlan) -> bool:
        """Whether the layers' calls take a step of `plan`: at most cpu_project.KERNEL_TOKENS tokens."""
        return len(plan.token_ids) <= cpu_project.KERNEL_TOKENS

    def params(self, layer: FusedLayer) -> cpu_layer.Params:
        """`layer`'s kernels' p[] arrays for this step: its kind's, given how its compressors advance and
        whether its tokens see compressed rows (the buffers' from an earlier step where those were the same),
        the count of the rows seen set in them: it grows by one every `ratio` tokens, and a p[] set built
        anew for each count took ~25 us in those steps."""
        params = self._kind_params.get(layer.kind)  # (the step's, set by an earlier layer of the kind)
        if params is not None:
            return params
        ratio = layer.ratio
        if ratio is None:
            key, count = (layer.kind,), None
        else:
            count = self.seen[ratio].count
            key = (layer.kind, count > 0, *self.feeds[ratio][:4])
        params = self._params.get(key)
        if params is None:
            if len(self._params) >= DecodeBuffers.MAX_PARAMS:
                self._params.clear()
            params = self._params[key] = cpu_layer.Params(layer.params(self))
        if count is not None:
            params.set(_ATTENTION_PARAMS, cpu_attention.DECODE_COUNT_AT, count)
        self._kind_params[layer.kind] = params
        return params


class FusedLayer:
    """One decoder layer's weights, pools and constants bound for its one call (cpu_layer.decode_layer)."""

    def __init__(self, cfg: ModelConfig, layer: int, block, pools: StatePools, dtype: torch.dtype, mix_constants: dict):
        """`block`: the model's _Block of this layer, whose weights this binds (`usable` said yes)."""
        attn, ffn = block.attn, block.ffn
        self.cfg, self.dtype, self.window = cfg, dtype, block.window
        self.ratio = attn.ratio if attn.compressor is not None else None
        # (its ratio's place among the model's, in which DecodeStep passes the ratios' parts; -1: none)
        self.ratio_index = -1 if self.ratio is None else cfg.compressed_ratios.index(self.ratio)
        self.selects = attn.index_compressor is not None  # a CSA layer's indexer
        w_input, wq_b, wo_a, wo_b = attn.kernel_weights
        self.shapes = {"width": w_input.shape[0], "q_rank": attn.q_norm.shape[0], "dim": attn.kv_norm.shape[0],
                       "heads": wq_b.shape[0] // attn.kv_norm.shape[0], "groups": wo_a.shape[0], "o_rank": wo_a.shape[1]}
        # the compressors fed: (ape, state, where its kv | gate columns start in the projected row)
        self.layer, self.pools, self.feeds, self.stores = layer, pools, [], []
        if attn.compressor is not None:
            self.feeds.append((as_read(attn.compressor.ape, torch.float32), pools.compressor_state(layer), attn.rest_start))
            self.stores.append((attn.compressor, pools.compressed_rows(layer), pools.main_format))
        if attn.index_compressor is not None:
            self.feeds.append((as_read(attn.index_compressor.ape, torch.float32), pools.indexer_state(layer),
                               attn.rest_start + attn.rest_widths[0]))
            self.stores.append((attn.index_compressor, pools.index_keys(layer), pools.index_format))
        # Where windows complete, the call stores their rows itself (cpu/layer.c), unless the pools fingerprint
        # the index keys it writes: `_around_new_rows` stores and records them instead
        self.stores_in_call = (bool(self.stores) and not pools.fingerprints_index_keys
                               and all(format_ in cpu_compressor.STORE_FORMATS for _, _, format_ in self.stores)
                               and all(state.shape[1] <= cpu_compressor.MAX_STORE_SPAN for _, state, _ in self.feeds))
        # (held: `store_pointers` are theirs)
        self.store_targets = [(as_read(compressor.norm, torch.float32), cache) for compressor, cache, _ in self.stores]
        self.store_pointers = [(at, tensor.data_ptr()) for ats, targets in zip(_STORES, self.store_targets, strict=False)
                               for at, tensor in zip(ats, targets, strict=True)]
        self.window_pool = pools.window(layer)
        self.compressed_pool = pools.compressed_rows(layer) if self.ratio is not None else None
        gate, route = ffn.router
        w13, w2, shared_w13, shared_w2 = ffn.kernel_weights
        self.moe = {"experts": gate.shape[0], "hidden": w13.shape[-1], "inter": w2.shape[-1], "tiles": ffn.tiles,
                    "shared": 0 if shared_w2 is None else shared_w2.shape[-1], "hashed": route.dtype == torch.long}
        self.routing = {k: v for k, v in ffn.routing.items() if k != "routed_scaling_factor"}  # (moe_route's p[])
        # Every bound tensor, held here (the pointers below are theirs), contiguous (a copy, once, of one that
        # is not: the kernels' wrappers would copy it at every call)
        bound = {"attn_fn": block.attn_hc.weights[0], "attn_base": block.attn_hc.weights[1],
                 "attn_scale": block.attn_hc.weights[2], "attn_norm": block.attn_hc.weights[3], "w_input": w_input,
                 "q_norm": attn.q_norm, "wq_b": wq_b, "kv_norm": attn.kv_norm, "sink": attn.sink,
                 "wo_a": wo_a, "wo_b": wo_b, "ffn_fn": block.ffn_hc.weights[0], "ffn_base": block.ffn_hc.weights[1],
                 "ffn_scale": block.ffn_hc.weights[2], "ffn_norm": block.ffn_hc.weights[3], "gate": gate,
                 "route": route, "w13": w13, "w2": w2, "shared_w13": shared_w13, "shared_w2": shared_w2}
        self.bound = {name: None if t is None else as_read(t) for name, t in bound.items()}
        pointers = {name: None if t is None else t.data_ptr() for name, t in self.bound.items()}
        pointers["window"] = self.window_pool.data_ptr()
        pointers["comp_pool"] = None if self.compressed_pool is None else self.compressed_pool.data_ptr()
        for c, (ape, state, _) in enumerate(self.feeds):
            pointers[f"ape_{c}"], pointers[f"state_{c}"] = ape.data_ptr(), state.data_ptr()
        # the call's pointers, the bound ones in place (each call sets the rest)
        self.comp_pool = pointers["comp_pool"]
        self.pointers = cpu_layer.pointers([pointers.get(name) for name in cpu_layer.POINTERS])
        # What `pointers` holds from the last call (None: not set): its residual in and out
        self._bound: list = [None] * 2
        self._storing = False  # (whether `pointers` holds stores: `_set_stores`)
        self.mix_constants = mix_constants
        store_eps = [compressor.norm_eps for compressor, _, _ in self.stores] + [0.0] * (2 - len(self.stores))
        self.floats = (ctypes.c_float * len(cpu_layer.FLOATS))(
            mix_constants["hc_eps"], mix_constants["norm_eps"], cfg.rms_norm_eps, softmax_scale(cfg),
            ffn.routing["routed_scaling_factor"], cfg.swiglu_limit, *store_eps)
        # Layers of one kind share their kernels' p[] in a step: everything `params` reads of the layer, as a
        # number (a key of this tuple took ~1 us a layer to hash)
        pools_read = (self.window_pool, self.compressed_pool)
        kind = (self.window, self.ratio, tuple(self.shapes.items()), tuple(self.moe.items()), tuple(self.routing.items()),
                tuple((ape.shape, state.stride(), column) for ape, state, column in self.feeds),
                tuple((c.width, c.dim, c.ratio, c.overlap, format_, cache.stride()) for c, cache, format_ in self.stores),
                tuple(None if pool is None else (pool.shape[1:], pool.stride()) for pool in pools_read))
        self.kind = _KINDS.setdefault(kind, len(_KINDS))

    @staticmethod
    def usable(block, pools: StatePools, dtype: torch.dtype, mix: object) -> bool:
        """Whether the layer's every piece runs as the C kernels that cpu_layer.decode_layer chains: the
        attention's (its decode kernel, projections' weights and a compressor state it feeds), the MoE's
        and the mixes' (`mix`: the model's mix piece), on one rank."""
        attn, ffn = block.attn, block.ffn
        return (cpu_layer.available() and attn.kernel_weights is not None and attn.decode_kernel and not attn.kernels
                and attn.reduce is None and ffn.reduce is None and ffn.kernel_weights is not None
                and getattr(mix, "func", None) is cpu_mhc.mix and dtype in (torch.float32, torch.bfloat16)
                and pools.state_dtype == torch.float32)

    def serves(self, plan: DecodePlan) -> bool:
        """Whether this layer runs fused in a step of `plan`: its indexer (a CSA layer's) does not select
        (the compressed rows its tokens see are at most as many as it keeps)."""
        return not (self.selects and plan.compressed[self.ratio].pages.shape[1] > self.cfg.index_topk)

    def params(self, step: DecodeStep) -> list[tuple[int, ...]]:
        """The p[] of each of the layer's kernels for `step` (cpu_layer.PARAMS' order)."""
        T, cfg, dtype, s, moe = step.tokens, self.cfg, self.dtype, self.shapes, self.moe
        hidden, n, rope = cfg.hidden_size, cfg.hc_mult, step.tables[self.window][2]
        count = 0 if self.ratio is None else step.seen[self.ratio].count
        feeds, stores = [], []
        for (ape, state, _), (compressor, cache, format_) in zip(self.feeds, self.stores, strict=True):
            feed = step.feeds[self.ratio]
            feeds.append(cpu_compressor.feed_params(T, ape.shape[1], ape.shape[0], (s["width"], 1), dtype, state,
                                                    feed.read, feed.windows, feed.span, feed.updates))
            stores.append(cpu_compressor.store_params(feed.windows, feed.span, compressor.width, compressor.dim,
                                                      compressor.ratio, compressor.overlap, rope, dtype, format_, cache))
        feeds += [(0,)] * (2 - len(feeds))
        stores += [(0,)] * (2 - len(stores))
        return [cpu_layer.layer_params(T, n, hidden, s["width"], s["q_rank"], s["dim"], s["heads"], dtype,
                                       self.window_pool, [column for _, _, column in self.feeds], moe["tiles"],
                                       self.window, self.ratio_index),
                cpu_mhc.mix_params(T, n, hidden, self.mix_constants["sinkhorn_iters"], dtype),
                cpu_project.project_params(T, hidden, s["width"], s["q_rank"], s["dim"], s["heads"], rope, dtype),
                *feeds,
                cpu_attention.decode_params(T, s["heads"], s["dim"], dtype, self.window_pool,
                                            self.compressed_pool if count else None, count),
                cpu_project.exit_params(T, s["heads"], s["dim"], s["groups"], s["o_rank"], hidden, rope, dtype),
                cpu_moe.route_params(T, hidden, moe["experts"], dtype=dtype, hashed=moe["hashed"], **self.routing),
                cpu_moe.moe_params(T, T * self.routing["top_k"], self.routing["local_experts"], hidden, moe["inter"],
                                   moe["shared"], dtype),
                *stores,
                cpu_project.logits_params(T, hidden, cfg.vocab_size, dtype)]

    def __call__(self, residual: Residual, step: DecodeStep) -> Residual:
        """The layer's output residual (its MoE's output unwritten, as `_Block` returns it), once its call has
        run: the call is queued on the step (`DecodeStep.run_layers` runs it), unless windows of its
        compressors complete and it stores their rows itself (`_around_new_rows`: it runs the queue, then
        its own phases)."""
        out = step.residual(self.layer)
        pointers = self.pointers
        # (the residual's addresses are not set again where its buffers are the last call's, as in most steps)
        inputs = []
        if self._bound[0] is not residual or self._bound[1] is not out:
            inputs = [as_read(t) for t in residual]  # (held until the call has run)
            for at, tensor in zip(_RESIDUAL, (*inputs, *out), strict=True):
                pointers[at] = tensor.data_ptr()
            own = all(a is b for a, b in zip(inputs, residual, strict=True))  # (not copies made for this call)
            self._bound[:2] = (residual, out) if own else (None, None)
        if self.layer == 0:
            pointers[_EMBED] = step.embed
        if self.layer == self.cfg.num_layers - 1:
            for at, address in zip(_HEAD, step.head or [None] * len(_HEAD), strict=True):
                pointers[at] = address
        if self._storing:  # (no store unless windows complete)
            for norm, cache in _STORES:
                pointers[norm] = pointers[cache] = None
            self._storing = False
        if self.ratio is not None:
            windows = step.feeds[self.ratio].windows
            if windows:
                slots = self._window_slots(pointers, step, windows)
                if not self.stores_in_call:
                    step.run_layers()
                    self._around_new_rows(pointers, step, slots)
                    return out
                self._set_stores(pointers, step)
        step.queue(pointers, step.params(self), self.floats, inputs)
        return out

    def _window_slots(self, pointers: ctypes.Array, step: DecodeStep, windows: int) -> list[torch.Tensor]:
        """Where each fed compressor's feed copies out the slots of the `windows` windows that complete in the
        step (fp32, as `feed` returns them), their pointers set."""
        span = step.feeds[self.ratio].span
        slots = [step.buffers.windows(c, windows, span, 2 * ape.shape[1]) for c, (ape, _, _) in enumerate(self.feeds)]
        for at, tensor in zip(_WINDOWS, slots, strict=False):
            pointers[at] = tensor.data_ptr()
        return slots

    def _set_stores(self, pointers: ctypes.Array, step: DecodeStep) -> None:
        """Sets the pointers of the call's stores of the rows of the windows that complete in the step (each
        compressor's norm and pool, the rows' RoPE tables and places)."""
        for at, address in self.store_pointers:
            pointers[at] = address
        for at, address in zip(_NEW_ROWS, step.new_rows(self.ratio), strict=True):
            pointers[at] = address
        self._storing = True

    def _around_new_rows(self, pointers: ctypes.Array, step: DecodeStep, slots: list[torch.Tensor]) -> None:
        """The layer's call in two phases around its compressors' storing of the rows of the windows that
        complete in the step (their slots copied out into `slots`), as PagedAttention stores them: the
        attention reads them."""
        params = step.params(self)
        scratch = torch.empty(cpu_layer.scratch_bytes(params), dtype=torch.uint8)
        # (a copy: what the queue's run sets from the step, in this call's own array)
        pointers = cpu_layer.pointers(list(pointers))
        seen, feed = step.seen[self.ratio], step.feeds[self.ratio]
        for ats, addresses in ((_STEP, step.pointers(self.window)), (_ROWS, seen.pointers or _UNSEEN),
                               *((_FEED[c], feed.pointers) for c in range(len(self.feeds)))):
            for at, address in zip(ats, addresses, strict=True):
                pointers[at] = address
        pointers[_COMP_POOL] = None if seen.pointers is None else self.comp_pool  # (None: no row yet)
        pointers[_SCRATCH] = scratch.data_ptr()
        cpu_layer.decode_layer(pointers, params, self.floats, phases=cpu_layer.FRONT)
        compress, rope = step.compress[self.ratio], step.window_rope(self.ratio)
        for (compressor, cache, row_format), rows in zip(self.stores, slots, strict=True):
            compressor.store(rows, compress, rope, cache, row_format, self.dtype, kernels=False)
        if self.selects:  # (the index keys', as PagedAttention records them)
            self.pools.record_index_keys(self.layer, compress.window_pages, compress.window_page_rows)
        cpu_layer.decode_layer(pointers, params, self.floats, phases=cpu_layer.BACK)

