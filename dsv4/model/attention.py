"""DeepSeek-V4 attention over paged state, for every chunk of a batch at once.

Projections, RoPE and the compressors run on the flattened batch. Attention itself runs per
`AttentionGroup` (all decode tokens together; each prefill chunk alone) over
  the slot's window ring + the chunk's own raw rows   (query t sees positions t-W+1 .. t, taken as
                                                        one band of Q+W-1 rows (padded) per block of
                                                        Q queries; a lone block from position 0: its
                                                        own Q rows; a one-token chunk: the slot's
                                                        whole ring, its own row written first)
  ∪ compressed rows read back from the pages          (rows w < (t+1) // ratio;
                                                        CSA: only the lightning indexer's picks)
plus the per-head sink. Every cached row is read back through its cache format, the chunk's own
raw rows and the rows this chunk just compressed included, exactly as the reference rounds them.

With `kernels` (on CUDA), the indexer's selection, the attention and the compressors' inserts run
as the dispatcher's ops (`dsv4.kernels.dispatch`: Triton on CUDA tensors) over the whole batch,
reading the pools directly; the torch code above is the CPU path, where a bf16 model's prefill
attention runs as a C kernel on a CPU with AVX512-BF16 or AVX2 (on AMX tiles where it has them), and so does
the attention of decode tokens (dsv4/kernels/cpu_attention.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from dsv4.config import CSA, HCA, WINDOW, ModelConfig
from dsv4.config.server_args import cpu_has_amx_bf16
from dsv4.kernels import cpu_attention, cpu_project, dispatch
from dsv4.kernels import rows as row_formats
from dsv4.memory.pools import StatePools, put_rows, take_rows

from .compressor import PagedCompressor
from .ops import Rope, accumulation_dtype, as_bf16, linear, rms_norm, rotate_
from .plan import AttentionGroup, BatchPlan, CompressedRows, decodes_wrote_ring
from .selection import IndexerSelection, SelectionSink
from .sharding import Reducer, ShardPlan

if TYPE_CHECKING:
    from .compile import Pieces

log = logging.getLogger(__name__)

_PLAIN_ROW_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
# Row formats whose rows read back as bf16 values (fp8: e4m3 times a power of two; the rotated part bf16).
_BF16_VALUED_ROW_FORMATS = ("bf16", "fp8")


class AttentionInputs(NamedTuple):
    """What an attention layer computes from its input before it touches any state (`project_inputs`)."""

    x: torch.Tensor  # [T, hidden] the layer input (attn_norm'ed)
    q: torch.Tensor  # [T, H, D] queries, normed and rotated
    kv: torch.Tensor  # [T, D] the raw (key = value) rows, normed and rotated
    qr: torch.Tensor  # [T, q_lora_rank] the normed low-rank query (the indexer's input)
    # [T, width] the whole product of the input: wq_a | wkv | the compressors' kv | gate | the indexer's
    # head weights (a window layer has only the first two)
    projected: torch.Tensor


class PagedAttention:
    def __init__(self, cfg: ModelConfig, layer: int, w, pools: StatePools, *, kernels: bool, shard: ShardPlan,
                 reduce: Reducer | None):
        """`w(name)` fetches this layer's tensor `attn.<name>` (this rank's part, `shard`), already in the
        dtype its math runs in. `reduce` sums partial results across tensor-parallel ranks (None: TP=1)."""
        self.cfg, self.layer, self.pools, self.kernels = cfg, layer, pools, kernels
        self.reduce = reduce
        # Every projection in the checkpoint's [out, in] layout (`linear`); wo_a grouped [G, o_lora_rank,
        # heads/G * head_dim].
        self.q_norm, self.wq_b, self.kv_norm = w("q_norm.weight"), w("wq_b.weight"), w("kv_norm.weight")
        self.wo_a = w("wo_a.weight").unflatten(0, (shard.o_groups, -1)).contiguous()
        self.wo_b, self.sink = w("wo_b.weight"), w("attn_sink")
        kind = cfg.layer_kind(layer)
        self.ratio = cfg.compress_ratios[layer]
        self.compressor = self.index_compressor = None
        if kind != WINDOW:
            self.compressor = _compressor(cfg, w, "compressor.", self.ratio, kind == CSA)
        if kind == CSA:
            self.index_compressor = _compressor(cfg, w, "indexer.compressor.", self.ratio, True)
            self.index_wq_b = w("indexer.wq_b.weight")
        # Every projection of the layer input as one product (wq_a, wkv, then the compressors' kv | gate
        # and the indexer's head weights where the layer has them): one stream over all of them instead
        # of up to five short ones, which read their weights at half speed on the CPU (small, fp32: a
        # c=1 decode forward ~1 ms faster, a c=32 one 119 -> 113 ms).
        inputs = [w("wq_a.weight"), w("wkv.weight")]
        compressors = {WINDOW: [], HCA: ["compressor."], CSA: ["compressor.", "indexer.compressor."]}[kind]
        inputs += [torch.cat([w(prefix + "wkv.weight"), w(prefix + "wgate.weight")]) for prefix in compressors]
        if kind == CSA:
            inputs.append(w("indexer.weights_proj.weight"))
        self.rest_start, self.rest_widths = sum(part.shape[0] for part in inputs[:2]), [part.shape[0] for part in inputs[2:]]
        # (`project_inputs`' weights, in its order)
        self.input_weights = (torch.cat(inputs), self.q_norm, self.wq_b, self.kv_norm)
        # On the CPU: a bf16 model's prefill attention on the CPU's bf16 units (`bf16_logits`: the whole
        # attention as one kernel; its queries and rows hold bf16 values); a model that stores its rows in its own dtype (bf16 or fp32), its decode
        # tokens' attention as the CPU's kernel that reads them in place
        # (dsv4/kernels/cpu_attention.py): at 32 decodes of `small` in bf16, 1.2 ms a layer against
        # 6.4..7.3 for the gather and the eager attention; in a step against the compiled attention, 32
        # decodes: bf16 40.6 against 53.0 ms, fp32 72 against 80; one: bf16 8.2 against 9.8, fp32 7.8 against 8.9.
        on_cpu, dtype = pools.device.type == "cpu" and not kernels, self.wq_b.dtype
        self.exact_bf16 = (on_cpu and dtype == torch.bfloat16 and pools.main_format in _BF16_VALUED_ROW_FORMATS
                           and bf16_logits() is not None)
        self.decode_kernel = (on_cpu and _PLAIN_ROW_DTYPES.get(pools.main_format) == dtype
                              and dtype in (torch.bfloat16, torch.float32) and cpu_attention.available())
        # an fp32 model's prefill attention as the CPU's kernel too, its logits fp32 FMAs
        self.fp32_band_kernel = on_cpu and dtype == torch.float32 and cpu_attention.available()
        self.scale = softmax_scale(cfg)
        # The projections of decode steps of up to cpu_project.KERNEL_TOKENS tokens as the C kernels
        # that read these (bf16, or bf16 copies of fp32 ones): w_input, wq_b, wo_a, wo_b (None: torch's)
        self.kernel_weights = (as_bf16(self.input_weights[0], self.wq_b, self.wo_a, self.wo_b)
                               if on_cpu and cpu_project.available() else None)
        # The indexer's queries of those decode steps likewise (an fp32 model's wq_b read from its bf16
        # copy: the indexer runs where contexts are long, and its queries' weight in fp32 was a fifth of
        # the bytes such a step read; `small` at a 3000-token context, 304 us a CSA layer compiled)
        copies = as_bf16(self.index_wq_b) if kind == CSA and on_cpu and cpu_project.available() else None
        self.index_kernel_weight = None if copies is None else copies[0]
        # Forwards of more tokens than this (None: none) multiply eagerly and norm and rotate their rows
        # with the C kernel (cpu_project.norm_rope) rather than in the compiled piece: a 512-token
        # chunk of `small`'s layer in bf16 3.1 ms against 4.2 (in fp32 16 against 28; at 32 tokens 0.7
        # against 0.75, fp32 2.2 against 2.3; fp32 decode steps of `small` at 16 / 32 requests, whose
        # matmuls are oneDNN's, 18.4 / 27.0 ms against 22.5 / 35.2 with the compiled piece).
        self.norm_rope_past = None
        if on_cpu and dtype in (torch.bfloat16, torch.float32) and cpu_project.available():
            self.norm_rope_past = cpu_project.KERNEL_TOKENS

    def __call__(self, inputs: AttentionInputs, plan: BatchPlan, rope: Rope, on_selection: SelectionSink | None,
                 pieces: Pieces) -> torch.Tensor:
        """The layer's projected input (`project_inputs` with `input_weights`) -> [T, hidden]; stores
        this layer's rows of the batch. `rope` rotates at the batch's positions. A CSA layer hands its
        indexer's inputs and selection to `on_selection` (--verify-indexer). `pieces`: the model's
        implementations of `banded_sink_attention` and `decode_sink_attention` (the CPU path),
        `attention_exit`, `index_queries` and the compressors' `feed`, each eager or compiled."""
        cfg, pools, positions = self.cfg, self.pools, plan.positions
        x, q, kv, qr, projected = inputs
        compressor_inputs = projected[:, self.rest_start :].split_with_sizes(self.rest_widths, dim=-1)
        raw_rows = row_formats.pack_main_rows(kv, pools.main_format, cfg.rope_head_dim)

        index_queries = None
        if self.compressor is not None:  # rows of windows this batch completes, before any query reads them
            compress = plan.compress[self.ratio]
            # the new rows' positions; most decode steps complete no window and need no tables
            window_rope = rope.at(compress.window_positions) if len(compress.window_positions) else None
            self.compressor.advance(compressor_inputs[0], positions, compress, window_rope,
                                    pools.compressor_state(self.layer), pools.compressed_rows(self.layer),
                                    pools.main_format, kernels=self.kernels, feed_rows=pieces.compressor_feed)
            if self.index_compressor is not None:
                index_rows, head_weights = compressor_inputs[1:]
                self.index_compressor.advance(index_rows, positions, compress, window_rope,
                                              pools.indexer_state(self.layer), pools.index_keys(self.layer),
                                              pools.index_format, kernels=self.kernels,
                                              feed_rows=pieces.compressor_feed)
                pools.record_index_keys(self.layer, compress.window_pages, compress.window_page_rows)
                if self.kernels or on_selection is not None or self._selection_needed(plan):
                    index_queries = self._index_queries(qr, head_weights, rope, pieces)

        if self.kernels:
            out = self._attend_with_kernels(x, q, raw_rows, index_queries, plan, on_selection)
        else:
            raw_keys = self._main_rows(raw_rows)  # [T, D] as the ring will return them
            picks = [None] * len(plan.groups)
            if index_queries is not None:
                picks = [self._picks(group, index_queries, positions) for group in plan.groups]
                if on_selection is not None:
                    on_selection(IndexerSelection(self.layer, x, *index_queries, _token_picks(picks, cfg.index_topk)))
            outs = [self._attend_decodes(group, q, raw_rows, positions, group_picks, pieces.attend_decodes)
                    if group.length == 1 else self._attend(group, q, raw_keys, group_picks, pieces.attend)
                    for group, group_picks in zip(plan.groups, picks, strict=True)]
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
        ring = plan.ring_write
        # (a batch of decodes alone, on this path, has written its rows already: `_attend_decodes`)
        if self.kernels or not decodes_wrote_ring(plan):
            put_rows(pools.window(self.layer), (ring.slots, ring.rows), raw_rows[ring.tokens])

        out = self._exit(out, rope, pieces)
        return out if self.reduce is None else self.reduce.all_reduce_sum(out, "attn.out")  # this rank's groups' share

    def _index_queries(self, qr: torch.Tensor, head_weights: torch.Tensor, rope: Rope,
                       pieces: Pieces) -> tuple[torch.Tensor, torch.Tensor]:
        """`index_queries`: the C kernel for the few tokens of a decode step where it serves, else
        `pieces.index_queries`."""
        if self.index_kernel_weight is None or qr.shape[0] > cpu_project.KERNEL_TOKENS:
            return pieces.index_queries(qr, head_weights, self.index_wq_b, rope.cos2, rope.sin2)
        cfg = self.cfg
        q = cpu_project.index_queries(qr, self.index_kernel_weight, rope.cos2, rope.sin2, head_dim=cfg.index_head_dim)
        return q, head_weights.to(accumulation_dtype(head_weights.dtype)) * index_scale(cfg)

    def project(self, x: torch.Tensor, rope: Rope, pieces: Pieces) -> AttentionInputs:
        """`project_inputs` of the layer input x [T, hidden] at the batch's positions (`rope`): the C
        kernel for the few tokens of a decode step where it serves, else `pieces.project_inputs`."""
        tokens, eps = x.shape[0], self.cfg.rms_norm_eps
        if self.kernel_weights is not None and tokens <= cpu_project.KERNEL_TOKENS:
            w_input, wq_b = self.kernel_weights[:2]
            return AttentionInputs(x, *cpu_project.project(x, w_input, self.q_norm, wq_b, self.kv_norm, rope.cos2,
                                                           rope.sin2, eps=eps))
        if self.norm_rope_past is None or tokens <= self.norm_rope_past:
            return AttentionInputs(x, *pieces.project_inputs(x, *self.input_weights, rope.cos2, rope.sin2))
        q_rank, dim = self.q_norm.shape[0], self.kv_norm.shape[0]
        projected = linear(x, self.input_weights[0])
        qr = rms_norm(projected[:, :q_rank], self.q_norm, eps)
        q = cpu_project.norm_rope(linear(qr, self.wq_b).unflatten(-1, (-1, dim)), None, rope.cos2, rope.sin2, eps=eps)
        kv = cpu_project.norm_rope(projected[:, q_rank : q_rank + dim].contiguous(), self.kv_norm, rope.cos2,
                                   rope.sin2, eps=eps)
        return AttentionInputs(x, q, kv, qr, projected)

    def _exit(self, out: torch.Tensor, rope: Rope, pieces: Pieces) -> torch.Tensor:
        """`attention_exit` of the attention's output out [T, H, D] (ours to overwrite), as `project`
        chooses its implementation (a 512-token chunk of `small` in bf16, eager with the C kernel's
        rotation: 1.65 ms against 1.85)."""
        tokens = out.shape[0]
        if self.kernel_weights is not None and tokens <= cpu_project.KERNEL_TOKENS:
            return cpu_project.exit(out.contiguous(), rope.cos2, rope.sin2, *self.kernel_weights[2:])
        if self.norm_rope_past is None or tokens <= self.norm_rope_past:
            return pieces.attention_exit(out, rope.cos2, rope.sin2, self.wo_a, self.wo_b)
        out = cpu_project.norm_rope(out.contiguous(), None, rope.cos2, rope.sin2, eps=None, inverse=True)
        # wo_a a group at a time, over strided views of the rows: the grouped product (`linear`'s einsum)
        # first copies them group-major (two 256-token chunks of `small` in bf16 on a Zen 5: the exits
        # 18.6 -> 15.2 ms a forward)
        groups = out.flatten(1).to(self.wo_a.dtype).unflatten(-1, (self.wo_a.shape[0], -1)).unbind(1)
        return linear(torch.cat([linear(rows, weight) for rows, weight in zip(groups, self.wo_a, strict=True)], -1),
                      self.wo_b)

    def _attend_with_kernels(self, x: torch.Tensor, q: torch.Tensor, raw_rows: torch.Tensor, index_queries,
                             plan: BatchPlan, on_selection: SelectionSink | None) -> torch.Tensor:
        """x [T, hidden] the layer input, q [T, H, D], raw_rows [T, row_bytes] -> attention output [T, H, D],
        the whole batch at once."""
        cfg, pools = self.cfg, self.pools
        selected = None
        if index_queries is not None and self.reduce is not None:  # scores summed across ranks first
            selected = _token_picks([self._picks(group, index_queries, plan.positions) for group in plan.groups],
                                    cfg.index_topk)
        elif index_queries is not None:
            selected = dispatch.indexer_topk(*index_queries, pools.index_keys(self.layer), pools.index_format,
                                             plan.page_table, plan.token_chunk, plan.positions, cfg.index_topk)
            if on_selection is not None:
                on_selection(IndexerSelection(self.layer, x, *index_queries, selected))
        compressed = self.compressor is not None
        return dispatch.sparse_attention(
            q, self.sink, raw_rows, pools.window(self.layer), plan.token_chunk, plan.positions,
            plan.chunk_slots, plan.chunk_starts, row_format=pools.main_format,
            compressed=pools.compressed_rows(self.layer) if compressed else None,
            page_table=plan.page_table if compressed else None, ratio=self.ratio, selected=selected,
            rope_dim=cfg.rope_head_dim)

    def _attend(self, group: AttentionGroup, q: torch.Tensor, raw_keys: torch.Tensor, picks, attend) -> torch.Tensor:
        """q [T, H, D] of the whole batch -> attention output [B*L, H, D] of the group's tokens; `picks`
        [B, L, k] the indexer's (CSA layers)."""
        batch, length, block, band = group.batch, group.length, group.block, group.band
        blocks = group.band_allowed.shape[1]
        pad = blocks * block - length
        kernel = self._band_kernel(group)
        rows_dtype = q.dtype if kernel is not None else accumulation_dtype(q.dtype)
        own = group.rows(raw_keys).to(rows_dtype)
        if group.own_rows_only:  # the band is the chunk's own rows (no ring row exists)
            sources = [own]
        else:
            ring = self._gather_main_rows(self.pools.window(self.layer), (group.slots, group.ring_rows),
                                          group.ring_exists)
            sources = [ring.to(rows_dtype), own]
        compressed, compressed_allowed = self._compressed_rows(group, picks, pad, rows_dtype)
        if kernel is not None:  # the band's rows as one source (the kernel reads rows past it as zeros)
            rows = sources[0] if len(sources) == 1 else torch.cat(sources, 1)
            return cpu_attention.band_attention(group.rows(q), rows, group.band_allowed, self.sink, compressed,
                                                compressed_allowed, block=block, scale=self.scale,
                                                tiles=kernel == "tiles").flatten(0, 1)
        height = (blocks - 1) * block + band  # rows the blocks' bands span, the last one's padding included
        sources.append(own.new_zeros(batch, height - sum(part.shape[1] for part in sources), own.shape[-1]))
        raw = torch.cat(sources, 1).unfold(1, band, block).transpose(-1, -2)  # [B, N, K, D]: each block's band
        queries = group.rows(q)
        if pad:  # (a copy: avoided when the blocks tile the chunk)
            queries = torch.nn.functional.pad(queries, (0, 0, 0, 0, 0, pad))  # [B, N*Q, H, D]
        queries = queries.unflatten(1, (blocks, block)).to(rows_dtype)  # [B, N, Q, H, D]: (query, head) rows in memory order
        extra = () if compressed is None else (compressed, compressed_allowed)
        out = attend(queries, raw, group.band_allowed, self.sink, *extra, exact_bf16=self.exact_bf16)  # [B, N, Q, H, D]
        return out.flatten(1, 2)[:, :length].flatten(0, 1).to(q.dtype)  # [B*L, H, D]

    def _band_kernel(self, group: AttentionGroup) -> str | None:
        """How the group's attention runs as one C kernel (`cpu_attention.band_attention`): for a bf16
        model's bf16 values, "tiles" on AMX tiles in the layouts they read, else "dots" as bf16 pair
        products (AVX512-BF16's, or AVX2's widened; where `bf16_logits` says either; a 256-token chunk of `small`'s layer on a
        Zen 5: 2.0 ms against 4.2 for the torch ops around the logits' kernel, with 64 compressed rows
        2.9 against 7.5); "dots" for an fp32 model's values (`fp32_band_kernel`: two 256-token chunks
        of `small` on a Zen 5, the attention 133 -> 52 ms a forward); None: the torch ops of
        `banded_sink_attention`."""
        path = bf16_logits() if self.exact_bf16 else None
        if path == "amx" and cpu_attention.tiles_read(self.cfg.head_dim, group.band_allowed.shape[1], group.block):
            return "tiles"
        dots = path in ("amx", "dots") or self.fp32_band_kernel
        return "dots" if dots and self.cfg.head_dim % 2 == 0 else None

    def _attend_decodes(self, group: AttentionGroup, q: torch.Tensor, raw_rows: torch.Tensor, positions: torch.Tensor,
                        picks, attend_decodes) -> torch.Tensor:
        """`_attend` for a group of one-token chunks: each token's raw row enters its slot's ring first
        (it replaces position p - W, which the query at p no longer sees), then the query attends over
        the whole ring, rows r <= p that exist, in ring order rather than position order (the same
        softmax up to summation order). One gather of W rows per token, no band to assemble (the
        layer's ring write after attention stores the same bytes again). `attend_decodes`:
        `decode_sink_attention`, eager or compiled."""
        window = self.cfg.sliding_window
        pool, slots, at = self.pools.window(self.layer), group.slots[:, 0], group.rows(positions)[:, 0]
        put_rows(pool, (slots, at % window), group.rows(raw_rows)[:, 0])
        queries = group.rows(q)[:, 0]  # [B, H, D]
        seen = self._compressed_seen(group, picks)
        if self.decode_kernel:  # the rows read where they lie
            compressed = () if seen is None else (self.pools.compressed_rows(self.layer), seen[0].pages,
                                                  seen[0].page_rows, seen[0].exists, seen[1][:, 0])
            return cpu_attention.decode_attention(queries, pool, slots, at, self.sink, *compressed, scale=self.scale)
        ring = self._main_rows_at(pool, slots)  # [B, W, D]: each slot's whole ring
        if seen is None:
            return attend_decodes(queries, ring, at, self.sink)
        rows, allowed = seen
        compressed = self._main_rows_at(self.pools.compressed_rows(self.layer), rows.pages, rows.page_rows)
        return attend_decodes(queries, ring, at, self.sink, compressed, rows.exists, allowed[:, 0])

    def _compressed_rows(self, group: AttentionGroup, picks, pad: int, dtype: torch.dtype):
        """The compressed rows the group's queries see, [B, C, D] in `dtype`, and which of them each
        query attends to, [B, N, Q, C] (the last block's `pad` queries past the chunk see none); (None,
        None) while the group has none."""
        seen = self._compressed_seen(group, picks)
        if seen is None:
            return None, None
        rows, allowed = seen
        stored = self.pools.compressed_rows(self.layer)
        compressed = self._gather_main_rows(stored, (rows.pages, rows.page_rows), rows.exists).to(dtype)
        blocks, block = group.band_allowed.shape[1:3]
        return compressed, torch.nn.functional.pad(allowed, (0, 0, 0, pad)).unflatten(1, (blocks, block))

    def _compressed_seen(self, group: AttentionGroup, picks) -> tuple[CompressedRows, torch.Tensor] | None:
        """The group's compressed rows at this layer's ratio and which of them each query attends to
        ([B, L, C]: the indexer's `picks`, or every row complete at the query); None while it has none."""
        rows = group.compressed[self.ratio] if self.compressor is not None else None
        if rows is None or rows.pages.shape[1] == 0:
            return None
        return rows, rows.visible if picks is None else _picks_mask(picks, rows.pages.shape[1])

    def _selection_needed(self, plan: BatchPlan) -> bool:
        """Whether any query of the batch may see more compressed rows than the indexer keeps. If none
        may, its top-k is every row the query sees (`_top_rows` of at most topk rows, whatever their
        scores): the attention then reads them all as an HCA layer does (`visible`), and neither the
        index queries nor the scores are computed. The index compressor still stores every key, for the
        longer contexts to come. With --verify-indexer the indexer always runs, so that it is checked."""
        seen = (group.compressed[self.ratio] for group in plan.groups)
        return any(rows is not None and rows.pages.shape[1] > self.cfg.index_topk for rows in seen)

    def _picks(self, group: AttentionGroup, index_queries, positions: torch.Tensor) -> torch.Tensor:
        """[B, L, min(topk, n_max)]: the compressed rows the lightning indexer picks for each query, -1 padded."""
        cfg, seen = self.cfg, group.compressed[self.ratio]
        stored = take_rows(self.pools.index_keys(self.layer), seen.pages, seen.page_rows)
        keys = row_formats.unpack_index_rows(stored.flatten(0, 1), self.pools.index_format, cfg.index_head_dim)
        q, weights = index_queries
        scores = _indexer_scores(group.rows(q), group.rows(weights), keys.unflatten(0, stored.shape[:2]))
        if self.reduce is not None:  # this rank's heads' share: a top-k over a partial score would be wrong
            scores = self.reduce.all_reduce_sum(scores, "indexer.scores")
        return _top_rows(scores, group.rows(positions), self.ratio, cfg.index_topk)

    def _gather_main_rows(self, pool: torch.Tensor, index: tuple[torch.Tensor, ...], exists: torch.Tensor):
        """pool[index] as the cache returns it, [*gathered rows' shape, head_dim]; rows that do not exist
        (`exists` False: before position 0, past a shorter request's end, not yet written) read as
        zeros, whatever bytes their storage holds."""
        rows = self._main_rows_at(pool, *index)
        if bool(exists.all()):  # (most decode steps' rings): nothing to zero
            return rows
        return rows.masked_fill_(~exists.unsqueeze(-1), 0)  # rows: a fresh gather, ours to change

    @property
    def main_rows_dtype(self) -> torch.dtype:
        """The dtype the cache returns this layer's rows in."""
        return self._main_rows(torch.zeros(1, self.pools.main_row_bytes, dtype=torch.uint8,
                                           device=self.pools.device)).dtype

    def _main_rows_at(self, pool: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
        """pool[index] as the cache returns it, [*index's shape, head_dim]; whatever rows that do not
        exist hold (their readers mask them)."""
        packed = take_rows(pool, *index)
        return self._main_rows(packed.flatten(0, -2)).unflatten(0, packed.shape[:-1])

    def _main_rows(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed main rows [N, bytes] -> [N, head_dim] as the cache returns them."""
        cfg, fmt = self.cfg, self.pools.main_format
        if fmt in _PLAIN_ROW_DTYPES:  # rows stored as-is: a view, not unpack's copy
            return packed.view(_PLAIN_ROW_DTYPES[fmt])
        return row_formats.unpack_main_rows(packed, fmt, cfg.head_dim, cfg.rope_head_dim)


def project_inputs(x: torch.Tensor, w_input: torch.Tensor, q_norm: torch.Tensor, wq_b: torch.Tensor,
                   kv_norm: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, *, eps: float,
                   product: Callable = linear) -> tuple[torch.Tensor, ...]:
    """Every projection of the layer input x [T, hidden] as one product (`w_input`: wq_a, wkv, then the
    rest), the query and raw-row norms and their rotation at the tokens' positions (RoPE tables cos2,
    sin2 [T, R]): AttentionInputs' fields after x (q, kv, qr, projected), a plain tuple as compiled
    pieces return. Shapes come from the weights, so one compiled form serves every layer (the part past
    wq_a | wkv, empty in window layers, is left in the product: sliced out here, its width would be
    specialised). `product`: `linear`, or `ops.decode_linear` in the compiled pieces of decode steps."""
    q_rank, head_dim = q_norm.shape[0], kv_norm.shape[0]
    projected = product(x, w_input)
    q_low, kv = projected[:, :q_rank], projected[:, q_rank : q_rank + head_dim]
    qr = rms_norm(q_low, q_norm, eps)
    q = product(qr, wq_b).unflatten(-1, (-1, head_dim))
    q = rotate_(rms_norm(q, None, eps), cos2, sin2)
    kv = rotate_(rms_norm(kv, kv_norm, eps), cos2, sin2)
    return q, kv, qr, projected


def attention_exit(out: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, wo_a: torch.Tensor,
                   wo_b: torch.Tensor, *, product: Callable = linear) -> torch.Tensor:
    """The attention's output [T, H, D] (ours to overwrite) -> the layer's output [T, hidden]: the
    rotation undone at the tokens' positions (tables cos2, sin2 [T, R]), then the grouped low-rank
    projection (wo_a [G, o_lora_rank, heads/G * D]) and wo_b. One piece: compiled, the rotation's
    passes and both products are one call. `product`: as `project_inputs`'."""
    out = rotate_(out, cos2, sin2, inverse=True)
    grouped = out.flatten(1).unflatten(-1, (wo_a.shape[0], -1))  # [T, G, heads/G * D]
    return product(product(grouped, wo_a).flatten(1), wo_b)


def index_queries(qr: torch.Tensor, head_weights: torch.Tensor, wq_b: torch.Tensor, cos2: torch.Tensor,
                  sin2: torch.Tensor, *, head_dim: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The lightning indexer's queries [T, heads, head_dim] from the normed low-rank query qr [T, q_lora_rank]
    (wq_b [heads * head_dim, q_lora_rank], rotated at the tokens' positions), and its head weights
    [T, heads] (the layer input times weights_proj) scaled, in at least fp32."""
    q = rotate_(linear(qr, wq_b).unflatten(-1, (-1, head_dim)), cos2, sin2)
    return q, head_weights.to(accumulation_dtype(head_weights.dtype)) * scale


def _indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [B, S, H, D] index queries, weights [B, S, H] (scaled), keys [B, N, D] -> scores [B, S, N] in at
    least fp32: sum over the heads given of w[h] * relu(q[h] . k)."""
    acc = accumulation_dtype(q.dtype)
    per_head = torch.einsum("bshd,bnd->bshn", q.to(acc), keys.to(acc)).relu()
    return torch.einsum("bshn,bsh->bsn", per_head, weights.to(acc))


def _top_rows(scores: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int) -> torch.Tensor:
    """[B, S, min(topk, N)] the best-scoring complete rows (s < (t + 1) // ratio) of each query, best
    first; a query with fewer complete rows gets -1 in its surplus places."""
    num_rows = scores.shape[-1]
    visible = torch.arange(num_rows, device=positions.device) < ((positions + 1) // ratio).unsqueeze(-1)
    picks = scores.masked_fill(~visible, float("-inf")).topk(min(topk, num_rows), dim=-1).indices
    return torch.where(picks < visible.sum(dim=-1, keepdim=True), picks, torch.full_like(picks, -1))


def _picks_mask(picks: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Indexer picks [B, L, k] (-1 = none) -> [B, L, num_rows] bool of the rows each query attends to."""
    slots = torch.where(picks < 0, num_rows, picks)  # "none" lands in a spare column, then dropped
    return torch.zeros(*picks.shape[:-1], num_rows + 1, dtype=torch.bool, device=picks.device).scatter_(
        -1, slots, True)[..., :num_rows]


def _token_picks(group_picks: list[torch.Tensor], topk: int) -> torch.Tensor:
    """Each group's picks [B, L, k] -> the batch's [T, topk] (the groups' tokens are consecutive)."""
    return torch.cat([torch.nn.functional.pad(picks.flatten(0, 1), (0, topk - picks.shape[-1]), value=-1)
                      for picks in group_picks])


def softmax_scale(cfg: ModelConfig) -> float:
    """The attention logits' scale."""
    return cfg.head_dim**-0.5


def index_scale(cfg: ModelConfig) -> float:
    """The indexer's head weights' scale (`index_queries`)."""
    return cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5


def banded_sink_attention(q: torch.Tensor, raw: torch.Tensor, raw_allowed: torch.Tensor, sink: torch.Tensor,
                          compressed: torch.Tensor | None = None, compressed_allowed: torch.Tensor | None = None, *,
                          scale: float, exact_bf16: bool = False) -> torch.Tensor:
    """Sink attention of query blocks over their own raw-row bands plus the request's compressed rows.

    q [B, N, Q, H, D]; raw [B, N, K, D] with raw_allowed [B, N, Q, K]; sink [H]; compressed [B, C, D]
    (or None) with compressed_allowed [B, N, Q, C]. Returns [B, N, Q, H, D] in q's dtype, computed as
    the reference's `sink_attention` over the union of both key sets (K = V). Queries and heads stay
    in q's memory order ([T, H, D] rows), so every product is one batched matmul without a copy. One
    of the model's compiled pieces (dsv4/model/compile.py): with and without compressed rows.

    `exact_bf16`: q, raw and compressed hold bf16 values (upcast to fp32), so every product of q^T k
    is exact in bf16 arithmetic: the logits then run on the CPU's bf16 units (oneDNN's bf16
    products), summing in fp32. The value products keep fp32 (the weights are not bf16 values).
    """
    batch, blocks, block, heads, dim = q.shape
    # The softmax over [raw | compressed | sink] without concatenating its parts: exp(logit - max) per
    # part, one denominator, and the output divided by it after the value products (which
    # accumulate into one buffer); the same math as normalising first, up to rounding.
    raw_weights, compressed_weights, denominator = _softmax_weights(
        q, raw, raw_allowed, sink, compressed, compressed_allowed, scale=scale, bf16_products=exact_bf16)
    out = torch.bmm(raw_weights.view(batch * blocks, block * heads, -1), raw.reshape(batch * blocks, -1, dim))
    if compressed is not None:
        # (in place: out is this function's own, and a fresh result would first copy all of it)
        out.view(batch, blocks * block * heads, dim).baddbmm_(compressed_weights.view(batch, blocks * block * heads, -1),
                                                              compressed)
    return out.view(batch, blocks, block, heads, dim).div_(denominator)


def _softmax_weights(q: torch.Tensor, raw: torch.Tensor, raw_allowed: torch.Tensor, sink: torch.Tensor,
                     compressed: torch.Tensor | None, compressed_allowed: torch.Tensor | None, *, scale: float,
                     bf16_products: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`banded_sink_attention`'s softmax weights exp(logit - peak) over the band [B, N, Q, H, K] and
    the compressed rows [B, N, Q, H, C] (or None), and their denominator [B, N, Q, H, 1] with the
    sink's term (what dsv4/kernels/cpu_attention.py computes), in torch ops; `bf16_products`: the logits'
    matmuls on bf16 units (oneDNN's `fp32_precision = "bf16"`, scoped to them)."""
    with _bf16_products(bf16_products):
        raw_logits = torch.einsum("bnqhd,bnkd->bnqhk", q, raw)
        compressed_logits = None if compressed is None else torch.einsum("bnqhd,bcd->bnqhc", q, compressed)
    raw_logits = raw_logits.mul_(scale).masked_fill_(~raw_allowed.unsqueeze(3), -torch.inf)
    sink = sink.to(q.dtype).view(1, 1, 1, -1, 1)
    peak = torch.maximum(raw_logits.amax(-1, keepdim=True), sink)
    if compressed is not None:
        compressed_logits = compressed_logits.mul_(scale)
        compressed_logits.masked_fill_(~compressed_allowed.unsqueeze(3), -torch.inf)
        peak = torch.maximum(peak, compressed_logits.amax(-1, keepdim=True))
    raw_weights = raw_logits.sub_(peak).exp_()  # [B, N, Q, H, K]
    denominator = raw_weights.sum(-1, keepdim=True) + (sink - peak).exp()
    compressed_weights = None
    if compressed is not None:
        compressed_weights = compressed_logits.sub_(peak).exp_()
        denominator += compressed_weights.sum(-1, keepdim=True)
    return raw_weights, compressed_weights, denominator


@functools.cache
def bf16_logits() -> str | None:
    """How a bf16 model's prefill attention (`exact_bf16`) runs on this CPU's bf16 units, or None (in fp32):
    - "amx" with AMX tiles: the whole attention as one kernel on the tiles (`cpu_attention.band_attention`;
      a 256-token chunk of `small`'s layer: 2.7 ms against 10.6 for the torch ops on oneDNN), and on
      AVX512-BF16 for the layouts the tiles do not read (`PagedAttention._band_kernel`);
    - "onednn" with AMX where the kernels are not built: `banded_sink_attention` with oneDNN's fp32
      matmuls on bf16 products for the logits (their matmuls took a third of the time);
    - "dots" without AMX where the kernels run (AVX512-BF16 alone, a Zen 4 or 5, where oneDNN copies the
      operands to convert them: a 256-token bf16 prefill of `small` took 235 ms against 227 in fp32,
      interleaved, 7 each; or AVX2, whose kernels widen the bf16 pairs): the whole attention as one kernel
      of bf16 pair products (`cpu_attention.band_attention`, built on the first call)."""
    if cpu_has_amx_bf16():
        path = "amx" if cpu_attention.amx_available() else "onednn"
    else:
        path = "dots" if cpu_attention.available() else None
    log.info("a bf16 model's prefill attention runs %s", {
        "amx": "on AMX tiles (dsv4/kernels/cpu_attention.py)", "onednn": "with its logits on AMX (oneDNN's bf16 products)",
        "dots": "as the CPU kernels' bf16 pair products (dsv4/kernels/cpu_attention.py)", None: "in fp32"}[path])
    return path


def decode_sink_attention(q: torch.Tensor, ring: torch.Tensor, at: torch.Tensor, sink: torch.Tensor,
                          compressed: torch.Tensor | None = None, compressed_exists: torch.Tensor | None = None,
                          compressed_allowed: torch.Tensor | None = None, *, scale: float) -> torch.Tensor:
    """Sink attention of decode tokens, one query each (q [B, H, D] at positions `at` [B]), over their
    slots' whole window rings (ring [B, W, D] as the cache returns the rows, position p at row p % W,
    each token's own row in place) plus the compressed rows they may see (compressed [B, C, D], of
    which `compressed_exists` [B, C] hold rows and `compressed_allowed` [B, C] are attended to) ->
    [B, H, D] in q's dtype: `banded_sink_attention` with one block of one query. Rows that do not
    exist (ring rows before position 0, a shorter request's padding) read as zeros whatever their
    storage holds (a masked row's zero weight times garbage could still be NaN). One of the model's
    compiled pieces: the masks, the rows' upcast and the attention in one call."""
    acc, (batch, window) = accumulation_dtype(q.dtype), ring.shape[:2]
    exists = torch.arange(window, device=at.device) <= at.unsqueeze(-1)  # [B, W]: all once p >= W - 1
    raw = torch.where(exists.unsqueeze(-1), ring.to(acc), 0).unsqueeze(1)  # [B, 1, W, D]
    queries = q.to(acc).view(batch, 1, 1, *q.shape[1:])  # [B, 1, 1, H, D]
    raw_allowed = exists.view(batch, 1, 1, window)
    if compressed is None:
        out = banded_sink_attention(queries, raw, raw_allowed, sink, scale=scale)
    else:
        rows = torch.where(compressed_exists.unsqueeze(-1), compressed.to(acc), 0)
        out = banded_sink_attention(queries, raw, raw_allowed, sink, rows, compressed_allowed.view(batch, 1, 1, -1),
                                    scale=scale)
    return out.view(q.shape).to(q.dtype)


@contextlib.contextmanager
def _bf16_products(on: bool):
    """fp32 matmuls within run on bf16 units (exact only for operands that hold bf16 values)."""
    if not on:
        yield
        return
    setting = torch.backends.mkldnn.matmul
    before, setting.fp32_precision = setting.fp32_precision, "bf16"
    try:
        yield
    finally:
        setting.fp32_precision = before


def _compressor(cfg: ModelConfig, w, prefix: str, ratio: int, overlap: bool) -> PagedCompressor:
    return PagedCompressor(w(prefix + "ape"), w(prefix + "norm.weight"), ratio=ratio, overlap=overlap,
                           norm_eps=cfg.rms_norm_eps)
