"""Where every row of a forward lives: index tensors built once per ForwardBatch, used by every layer.

The batch is flattened into T token rows, laid out group by group (see `AttentionGroup`). A plan
says, in those terms and in pool coordinates (page, row) / (slot, row):
- which raw rows each query sees (the slot's window ring, its own chunk's rows);
- how each compressor ratio advances (which completed windows pool which token / state rows, where
  the new compressed rows go, which partial-state rows change);
- which compressed rows each query may see, and from which pages they are read;
- which rows go into the snapshot units of boundaries captured inside chunks (`BoundaryCapture`).
Index building is vectorised over chunks and tokens: its cost does not grow with the batch in Python.
It runs in NumPy and hands torch tensors over at the end: a plan is ~100 small index ops, which
cost ~1 us each in NumPy against ~5..10 us in torch (the plan of a decode step of `small`, one
thread: 2.8 -> 0.75..1.4 ms at c=1, 3.7 -> 1.3 ms at c=32). A forward of decode tokens whose every
layer runs as one C call reads only a few of these: its `DecodePlan` (`DecodePlanner`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

from dsv4.config import ModelConfig
from dsv4.memory.pools import compressor_state_rows
from dsv4.protocol import ForwardBatch


@dataclass(frozen=True)
class CompressPlan:
    """How every compressor of one ratio advances over this batch.

    Pooled rows come from `source = cat(state[state_slots, state_rows], token rows [T], empty row)`,
    where the empty row (kv 0, score -inf) stands for the missing predecessor of window 0.
    """

    ratio: int
    state_slots: torch.Tensor  # [n_read] partial-state rows the new windows or the new state read
    state_rows: torch.Tensor
    window_sources: torch.Tensor  # [n_windows, span] rows of `source` pooled into each new row
    window_positions: torch.Tensor  # [n_windows] w * ratio: the RoPE position of each new row
    window_pages: torch.Tensor  # [n_windows] where each new row is stored
    window_page_rows: torch.Tensor
    update_slots: torch.Tensor  # [n_update] partial-state rows that change ...
    update_rows: torch.Tensor
    update_sources: torch.Tensor  # ... and the row of `source` each one takes (captured boundaries'
    # snapshot units included: the partial state a slot has at such a boundary)


@dataclass(frozen=True)
class CompressedRows:
    """The compressed rows (one ratio) visible to an attention group, padded to the longest request."""

    pages: torch.Tensor  # [B, n_max]
    page_rows: torch.Tensor  # [B, n_max]
    exists: torch.Tensor  # [B, n_max] bool: the request has row w (padding rows do not)
    visible: torch.Tensor  # [B, L, n_max] bool: row w is complete at the query (w < (t + 1) // ratio)


@dataclass(frozen=True)
class AttentionGroup:
    """Chunks whose attention runs as one batch: all decodes (L = 1), or one prefill chunk.

    The group's tokens are rows first_token .. first_token + B*L - 1 of the batch. Its queries run
    in blocks of Q consecutive positions (L padded to N*Q): block n of a request sees K >= Q + W - 1
    raw rows from position start - W + 1 + n*Q on, a band of [ring rows | own rows], so the sliding
    window costs O(L * (Q + W)), not O(L^2). With `own_rows_only` (one block from position 0, L <= W:
    no ring row exists) the band is the block's own rows from the chunk's start instead. See
    `_block_layout` for the choice of Q and K.
    """

    first_token: int
    batch: int  # B
    length: int  # L
    block: int  # Q
    band: int  # K
    own_rows_only: bool
    slots: torch.Tensor  # [B, 1]
    ring_rows: torch.Tensor  # [B, W - 1]: ring rows of positions start-W+1 .. start-1, in position order
    ring_exists: torch.Tensor  # [B, W - 1] bool: those positions are >= 0
    band_allowed: torch.Tensor  # [B, N, Q, K] bool: the block's raw row is in the query's window
    compressed: dict[int, CompressedRows]  # by ratio

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The group's rows of a per-token tensor [T, ...] -> [B, L, ...] (a view)."""
        return x[self.first_token : self.first_token + self.batch * self.length].unflatten(0, (self.batch, self.length))


@dataclass(frozen=True)
class RingWrite:
    """The raw rows that enter window rings (slots', and captured boundaries' snapshot units) after a
    layer's attention has read them."""

    slots: torch.Tensor
    rows: torch.Tensor  # position p goes to ring row p % W
    tokens: torch.Tensor  # rows of the flattened batch


@dataclass(frozen=True)
class BatchPlan:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    sample_tokens: torch.Tensor  # [n_sample] rows of the last token of each sampling chunk, in chunk order
    # [n_prompt] rows of every chunk's `prompt_logit_positions`, in chunk order (prompt logprobs)
    prompt_tokens: torch.Tensor
    groups: tuple[AttentionGroup, ...]
    ring_write: RingWrite  # captured boundaries' snapshot units included (their window rings)
    compress: dict[int, CompressPlan]  # by ratio
    # The chunks in token-row order, as the kernels (`dsv4.kernels.dispatch`) take them:
    rids: tuple[str, ...]  # [C]
    token_chunk: torch.Tensor  # [T] each token's chunk (its row of page_table)
    page_table: torch.Tensor  # [C, max pages], each row padded with its last page
    chunk_slots: torch.Tensor  # [C]
    chunk_starts: torch.Tensor  # [C] start_pos

    def to(self, device: torch.device) -> BatchPlan:
        """The same plan with every tensor on `device`."""
        return _to_device(self, device)


@dataclass(frozen=True)
class DecodePlan:
    """What the layers of a forward of decode tokens alone (one a chunk, none capturing a boundary) read
    where each runs as one C call (dsv4/model/decode_layer.py): the fields of its BatchPlan they read.
    `DecodePlanner` builds it without the rest, for a forward every layer of which runs so."""

    token_ids: torch.Tensor  # [T] int64, a token a chunk in chunk order
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T]
    compressed: dict[int, CompressedRows]  # by ratio (visible [T, 1, n_max])
    compress: dict[int, CompressPlan]  # by ratio
    last_position: int  # the largest of `positions`

    @classmethod
    def of(cls, plan: BatchPlan) -> DecodePlan | None:
        """The decode plan of `plan`, None where its batch is not decode tokens alone without captures."""
        if not decodes_wrote_ring(plan):
            return None
        group = plan.groups[0]
        return cls(plan.token_ids, plan.positions, group.slots[:, 0], group.compressed, plan.compress,
                   int(plan.positions.max()))


def decodes_wrote_ring(plan: BatchPlan) -> bool:
    """Whether the batch's ring writes are its decode tokens' alone (one group of decodes, no captured
    boundary's ring), which `PagedAttention._attend_decodes` stored before attending."""
    groups = plan.groups
    return len(groups) == 1 and groups[0].length == 1 and plan.ring_write.tokens.shape[0] == groups[0].batch


class DecodePlanner:
    """`DecodePlan.of(build_plan(cfg, batch, page_size))`, by the same functions, without building the rest of
    the plan (`plan`), for a batch of decode tokens alone that each sample and none asks prompt logits or
    captures a boundary. The parts that repeat from step to step are kept, not built again: a ratio's
    compressed rows seen (they change where a token completes a window, or a chunk its pages) and its
    compressors' plan, which depends on the slots and the windows' phases alone, but for the positions and
    places of the windows that complete (`_at_windows`) and, near a sequence's start, its pooled rows
    before position 0. Nothing writes a plan's tensors, so steps may share them. A c=1 decode step of
    `small` (its process's caches cold from the weights' stream) planned in ~240 us as a whole BatchPlan,
    in ~170 as a DecodePlan built anew, in ~35 (median) with the kept parts; a step in which a window
    completes in ~60 us hot with its compressors' plan built anew, ~15 with it kept."""

    # Parts kept, by kind (each kind dropped all at once where it is full): the rows seen change as windows
    # complete, and only the latest serve; the compressors' plans repeat with the phases, every one of the
    # largest ratio's in a long request (at 512, shared with the rows, a c=1 request's plans of ratio 128
    # were each built anew: ~20 us a step hot)
    MAX_ROWS = 256
    MAX_FEEDS = 1024

    def __init__(self, cfg: ModelConfig, page_size: int):
        self.page_size = page_size
        self.state_rows = {r: _state_rows(cfg, r) for r in cfg.compressed_ratios}
        self._rows: dict[tuple, CompressedRows] = {}
        self._feeds: dict[tuple, CompressPlan] = {}

    def plan(self, batch: ForwardBatch) -> DecodePlan | None:
        """The batch's decode plan; None where it is not such a batch."""
        if batch.captures or not all(len(c.token_ids) == 1 and c.sample and c.prompt_logits_from is None
                                     for c in batch.chunks):
            return None
        ends = [c.start_pos + 1 for c in batch.chunks]
        slots = tuple(c.slot for c in batch.chunks)
        pages = tuple(c.page_ids for c in batch.chunks)
        chunks = None  # (built where a part is not kept)
        compressed, compress = {}, {}
        for kept, most in ((self._rows, self.MAX_ROWS), (self._feeds, self.MAX_FEEDS)):
            if len(kept) >= most:
                kept.clear()
        for ratio, state_rows in self.state_rows.items():
            rows_key = (ratio, pages, tuple(end // ratio for end in ends))
            completes = any(end % ratio == 0 for end in ends)
            feed_key = (ratio, slots, tuple(end % ratio for end in ends),
                        completes and tuple(end < state_rows for end in ends))  # (windows reaching before 0)
            rows, feed = self._rows.get(rows_key), self._feeds.get(feed_key)
            if feed is None and not completes:  # (from the slots and phases alone)
                lookback = state_rows - ratio
                feed = self._feeds[feed_key] = _state_writes(ratio, state_rows, slots,
                                                             [(end - 1) % ratio + lookback for end in ends])
            if rows is None or feed is None:
                chunks = chunks or _Chunks.of(batch.chunks, self.page_size)
            if rows is None:
                rows = self._rows[rows_key] = _compressed_rows(chunks, chunks.start[:, None], ratio)
            if feed is None:
                feed = self._feeds[feed_key] = _decode_compress_plan(chunks, ratio, state_rows)
            elif completes:
                feed = _at_windows(feed, batch.chunks, ends, self.page_size)
            compressed[ratio], compress[ratio] = rows, feed
        return DecodePlan(token_ids=_tensor([c.token_ids[0] for c in batch.chunks]),
                          positions=_tensor([c.start_pos for c in batch.chunks]), slots=_tensor(slots),
                          compressed=compressed, compress=compress, last_position=max(ends) - 1)


def _at_windows(kept: CompressPlan, chunks, ends: list[int], page_size: int) -> CompressPlan:
    """`kept`, the plan of decode chunks of the same slots and phases in an earlier step, with the positions
    and places of the windows that complete in this one (`chunks`, whose tokens end at `ends`), as
    `_decode_compress_plan` numbers them: one a chunk whose token ends a window, in chunk order."""
    ratio = kept.ratio
    done = [(chunk, end - ratio) for chunk, end in zip(chunks, ends, strict=True) if end % ratio == 0]
    return dataclasses.replace(
        kept, window_positions=_tensor([first for _, first in done]),
        window_pages=_tensor([chunk.page_ids[min(first // page_size, len(chunk.page_ids) - 1)] for chunk, first in done]),
        window_page_rows=_tensor([first % page_size // ratio for _, first in done]))


def build_plan(cfg: ModelConfig, batch: ForwardBatch, page_size: int) -> BatchPlan:
    decodes = [c for c in batch.chunks if len(c.token_ids) == 1]
    members = ([decodes] if decodes else []) + [[c] for c in batch.chunks if len(c.token_ids) > 1]
    # Tokens are laid out group by group (all decodes first), so each group is one contiguous range.
    order = [c for group in members for c in group]
    chunks = _Chunks.of(order, page_size)
    row_of = {id(c): i for i, c in enumerate(order)}
    sampled = np.array([row_of[id(c)] for c in batch.chunks if c.sample], dtype=np.int64)
    ratios = cfg.compressed_ratios
    captures = _Captures.of(batch, {c.slot: row_of[id(c)] for c in order}, chunks)
    groups, first = [], 0
    for group in members:
        groups.append(_attention_group(cfg, chunks.select(first, first + len(group)), ratios))
        first += len(group)
    positions, token_chunk = _ragged_arange(chunks.start, chunks.end)
    prompt_rows = [int(chunks.offset[row_of[id(c)]]) + p - c.start_pos
                   for c in batch.chunks for p in c.prompt_logit_positions()]
    if len(decodes) == len(order) and not batch.captures:  # decode tokens alone: the same plan in closed form
        ring_write = RingWrite(_tensor(chunks.slot), _tensor(chunks.start % cfg.sliding_window), _tensor(token_chunk))
        compress = {r: _decode_compress_plan(chunks, r, _state_rows(cfg, r)) for r in ratios}
    else:
        ring_write = _concat_writes(_ring_write(chunks, cfg.sliding_window),
                                    captures.rows_before(cfg.sliding_window, ring=True))
        compress = {r: _compress_plan(chunks, r, _state_rows(cfg, r), captures) for r in ratios}
    return BatchPlan(
        token_ids=_tensor([t for c in order for t in c.token_ids]),
        positions=_tensor(positions),
        sample_tokens=_tensor(chunks.offset[sampled] + chunks.length[sampled] - 1),
        prompt_tokens=_tensor(prompt_rows),
        groups=tuple(groups),
        ring_write=ring_write,
        compress=compress,
        rids=tuple(c.rid for c in order),
        token_chunk=_tensor(token_chunk),
        page_table=_tensor(chunks.page_table),
        chunk_slots=_tensor(chunks.slot),
        chunk_starts=_tensor(chunks.start),
    )


def _tensor(values) -> torch.Tensor:
    """An array (int64 or bool) or a list of ints as a torch tensor; a contiguous array's memory is shared."""
    array = np.ascontiguousarray(values) if isinstance(values, np.ndarray) else np.array(values, dtype=np.int64)
    return torch.from_numpy(array)


def _to_device(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{f.name: _to_device(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_to_device(item, device) for item in value)
    return value


@dataclass(frozen=True)
class _Chunks:
    """The chunks of the flattened batch (in token-row order) as per-chunk int64 arrays [C]."""

    start: np.ndarray
    length: np.ndarray
    offset: np.ndarray  # first token row
    slot: np.ndarray
    page_table: np.ndarray  # [C, max pages], each row padded with its last page
    page_size: int
    num_tokens: int  # T, of the whole batch

    @classmethod
    def of(cls, chunks, page_size: int) -> _Chunks:
        length = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
        width = max((len(c.page_ids) for c in chunks), default=1)
        return cls(
            start=np.array([c.start_pos for c in chunks], dtype=np.int64),
            length=length,
            offset=np.cumsum(length) - length,
            slot=np.array([c.slot for c in chunks], dtype=np.int64),
            page_table=np.array([list(c.page_ids) + [c.page_ids[-1]] * (width - len(c.page_ids)) for c in chunks],
                                dtype=np.int64).reshape(len(chunks), width),
            page_size=page_size,
            num_tokens=int(length.sum()),
        )

    @property
    def end(self) -> np.ndarray:
        return self.start + self.length

    def select(self, first: int, stop: int) -> _Chunks:
        return _Chunks(self.start[first:stop], self.length[first:stop], self.offset[first:stop],
                       self.slot[first:stop], self.page_table[first:stop], self.page_size, self.num_tokens)

    def page_coordinates(self, chunk: np.ndarray, first_token: np.ndarray, ratio: int):
        """(page id, row in page) of the compressed rows of `chunk` whose windows start at `first_token`
        (broadcast together); positions past a chunk's page table read its last page."""
        page_index = np.minimum(first_token // self.page_size, self.page_table.shape[1] - 1)
        return self.page_table[chunk, page_index], (first_token % self.page_size) // ratio


def _ragged_arange(low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cat(arange(low[i], high[i]) for each i), and the i each value came from."""
    counts = np.maximum(high - low, 0)
    owner = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts
    return np.arange(int(counts.sum())) - first[owner] + low[owner], owner


def _state_rows(cfg: ModelConfig, ratio: int) -> int:
    kind = next(cfg.layer_kind(i) for i, r in enumerate(cfg.compress_ratios) if r == ratio)
    return compressor_state_rows(kind, ratio)


@dataclass(frozen=True)
class _Captures:
    """The batch's captured boundaries: each one's position, snapshot unit and chunk."""

    position: np.ndarray  # [n]
    unit: np.ndarray
    offset: np.ndarray  # token row of the chunk's start_pos
    start: np.ndarray

    @classmethod
    def of(cls, batch: ForwardBatch, row_of_slot: dict[int, int], chunks: _Chunks) -> _Captures:
        rows = np.array([row_of_slot[c.slot] for c in batch.captures], dtype=np.int64)
        return cls(np.array([c.position for c in batch.captures], dtype=np.int64),
                   np.array([c.unit for c in batch.captures], dtype=np.int64),
                   chunks.offset[rows], chunks.start[rows])

    def rows_before(self, count: int, *, ring: bool) -> _Rows:
        """Positions b - count .. b - 1 of every capture at b: (its unit, row in the unit, token row);
        the unit row of p is p % count in a ring, else p - (b - count)."""
        if not self.position.size:  # (most batches capture nothing)
            return _NO_ROWS
        positions, owner = _ragged_arange(self.position - count, self.position)
        rows = positions % count if ring else positions - self.position[owner] + count
        return _Rows(slots=self.unit[owner], rows=rows, tokens=self.offset[owner] + positions - self.start[owner])


@dataclass(frozen=True)
class _Rows:
    """A `RingWrite` (or rows of snapshot units) as arrays, before it becomes tensors."""

    slots: np.ndarray
    rows: np.ndarray
    tokens: np.ndarray


_NO_ROWS = _Rows(*(np.zeros(0, dtype=np.int64),) * 3)


def _compress_plan(chunks: _Chunks, ratio: int, state_rows: int, captures: _Captures) -> CompressPlan:
    lookback = state_rows - ratio  # CSA keeps the previous window for its overlap half; HCA keeps none
    start, end = chunks.start, chunks.end
    window_start, new_window_start = start - start % ratio, end - end % ratio
    # Rows are first numbered in a virtual space: [tokens (T) | empty row | state (slot, row) ...].
    empty = chunks.num_tokens
    first_state = empty + 1

    def source(p: np.ndarray, chunk: np.ndarray) -> np.ndarray:
        """Virtual row of position p of `chunk` (broadcast together)."""
        from_chunk = chunks.offset[chunk] + p - start[chunk]
        from_state = first_state + chunks.slot[chunk] * state_rows + p - window_start[chunk] + lookback
        return np.where(p < 0, empty, np.where(p >= start[chunk], from_chunk, from_state))

    windows, owner = _ragged_arange(start // ratio, end // ratio)  # the windows this batch completes
    first = windows * ratio
    window_sources = source(first[:, None] + np.arange(-lookback, ratio), owner[:, None])

    # The new state: the overlap window and the partial one; rows from before the chunk that stay
    # where they are (no window completed) are left alone.
    low = np.maximum(new_window_start - lookback, 0)
    low = np.where(new_window_start == window_start, np.maximum(low, start), low)
    kept, kept_owner = _ragged_arange(low, end)
    update_sources = source(kept, kept_owner)

    # At a captured boundary (a multiple of the ratio) the state is the overlap window alone, rows
    # 0 .. lookback - 1, as `update_rows` numbers them.
    captured = captures.rows_before(lookback, ring=False)
    return _numbered_plan(chunks, ratio, state_rows, owner, first, window_sources,
                          np.concatenate([chunks.slot[kept_owner], captured.slots]),
                          np.concatenate([kept - new_window_start[kept_owner] + lookback, captured.rows]),
                          np.concatenate([update_sources, captured.tokens]))  # token t: virtual row t


def _decode_compress_plan(chunks: _Chunks, ratio: int, state_rows: int) -> CompressPlan:
    """`_compress_plan` for a batch of one-token chunks none of which captures a boundary, in closed form
    (`small`, one or eight chunks: 39..42 us a ratio against 49..52; where no window completes, as in most
    steps, a few ops: a c=1 plan of both ratios 173 -> 108 us): chunk i's token (row i) at position p
    completes a window where p + 1 is a multiple of the ratio, which pools positions
    p + 1 - ratio - lookback .. p; each chunk's state keeps its token's row, or where it completes a window
    the lookback rows ending at it."""
    lookback = state_rows - ratio
    p, empty = chunks.start, chunks.num_tokens
    phase = p % ratio
    done = phase == ratio - 1
    if not done.any():  # (most steps) each token's row goes to its state, which nothing reads
        return _state_writes(ratio, state_rows, chunks.slot, phase + lookback)
    window_start = p - phase
    state = empty + 1 + chunks.slot * state_rows + lookback - window_start  # + q: position q's virtual state row
    owner = np.flatnonzero(done)
    first = window_start[owner]
    pooled = first[:, None] + np.arange(-lookback, ratio)
    window_sources = np.where(pooled < 0, empty,
                              np.where(pooled == p[owner, None], owner[:, None], state[owner, None] + pooled))
    kept, kept_owner = _ragged_arange(np.where(done, np.maximum(p + 1 - lookback, 0), p), p + 1)
    new_window_start = np.where(done, p + 1, window_start)
    return _numbered_plan(chunks, ratio, state_rows, owner, first, window_sources, chunks.slot[kept_owner],
                          kept - new_window_start[kept_owner] + lookback,
                          np.where(kept == p[kept_owner], kept_owner, state[kept_owner] + kept))


def _state_writes(ratio: int, state_rows: int, slots, rows) -> CompressPlan:
    """The compressors' plan of one-token chunks in `slots` none of whose tokens completes a window: token i's
    row goes to its slot's state at row `rows[i]` (lookback + its position's phase). The plan of ratio 128
    is new at every step of a request: DecodePlanner builds it so from the slots and phases alone (as NumPy
    arrays of the chunks, ~13 us hot and ~50 in situ)."""
    none, no_windows = _no_rows(state_rows)
    return CompressPlan(ratio, none, none, no_windows, none, none, none, _tensor(slots), _tensor(rows),
                        _tensor(range(len(slots))))


@functools.cache
def _no_rows(state_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty int64 [0] and [0, state_rows]: what every plan that reads no state and completes no window holds
    (shared: nothing writes a plan's tensors)."""
    return _tensor(np.zeros(0, dtype=np.int64)), _tensor(np.zeros((0, state_rows), dtype=np.int64))


def _numbered_plan(chunks: _Chunks, ratio: int, state_rows: int, owner: np.ndarray, first: np.ndarray,
                   window_sources: np.ndarray, update_slots: np.ndarray, update_rows: np.ndarray,
                   update_sources: np.ndarray) -> CompressPlan:
    """The plan of windows starting at positions `first` of chunks `owner`, their rows `window_sources`
    and the updates' `update_sources` in the virtual numbering of `_compress_plan`, renumbered into
    `source` order: the state rows actually read, then tokens, then the empty row."""
    first_state = chunks.num_tokens + 1
    virtual = np.concatenate([window_sources.ravel(), update_sources])
    state_refs = np.unique(virtual[virtual >= first_state]) - first_state
    n_read = state_refs.size

    def renumber(v: np.ndarray) -> np.ndarray:
        rank = np.searchsorted(state_refs, np.maximum(v - first_state, 0))
        return np.where(v >= first_state, rank, v + n_read)

    window_pages, window_page_rows = chunks.page_coordinates(owner, first, ratio)
    return CompressPlan(
        ratio=ratio,
        state_slots=_tensor(state_refs // state_rows),
        state_rows=_tensor(state_refs % state_rows),
        window_sources=_tensor(renumber(window_sources)),
        window_positions=_tensor(first),
        window_pages=_tensor(window_pages),
        window_page_rows=_tensor(window_page_rows),
        update_slots=_tensor(update_slots),
        update_rows=_tensor(update_rows),
        update_sources=_tensor(renumber(update_sources)),
    )


# Band widths are padded (with masked columns) to a multiple of this: on the CPU a matmul whose
# dimension is such a multiple runs markedly faster than one of Q + W - 1 (255 for Q = W = 128).
BAND_ALIGN = 16
BLOCK_SIZES = (16, 32, 64, 128)


def _block_layout(length: int, window: int, from_start: bool) -> tuple[int, int, bool]:
    """(Q, K, own_rows_only) for a chunk of `length` queries: the block size whose padded bands
    cost the fewest query-row products, N*Q*K. Small blocks waste less of each band (a query uses W
    of its block's Q + W - 1 rows), big ones pad less of the chunk's last block."""
    def aligned(n: int) -> int:
        return -(-n // BAND_ALIGN) * BAND_ALIGN

    if from_start and length <= window:
        return length, aligned(length), True
    sizes = {min(length, window)} | {q for q in BLOCK_SIZES if q < min(length, window)}
    block = min(sorted(sizes), key=lambda q: (-(-length // q) * q * aligned(q + window - 1), -q))
    return block, aligned(block + window - 1), False


def _attention_group(cfg: ModelConfig, chunks: _Chunks, ratios) -> AttentionGroup:
    window, batch, length = cfg.sliding_window, len(chunks.start), int(chunks.length[0])
    block, band, own_rows_only = _block_layout(length, window, bool((chunks.start == 0).all()))
    blocks = -(-length // block)
    n = np.arange(blocks).reshape(1, blocks, 1, 1)
    j = np.arange(block).reshape(1, 1, block, 1)
    k = np.arange(band).reshape(1, 1, 1, -1)
    if own_rows_only:  # band row k is the chunk's own row k
        band_allowed = (k <= j) & (j < length)
    else:  # block n, query j, band row k: the band row sits at position start - W + 1 + n*Q + k
        start = chunks.start.reshape(batch, 1, 1, 1)
        band_allowed = (k >= j) & (k < j + window) & (n * block + j < length) & (start - window + 1 + n * block + k >= 0)
    ring_positions = chunks.start[:, None] + np.arange(1 - window, 0)  # [B, W-1]
    positions = chunks.start[:, None] + np.arange(length)  # [B, L]
    return AttentionGroup(
        first_token=int(chunks.offset[0]),
        batch=batch,
        length=length,
        block=block,
        band=band,
        own_rows_only=own_rows_only,
        slots=_tensor(chunks.slot[:, None]),
        ring_rows=_tensor(ring_positions % window),
        ring_exists=_tensor(ring_positions >= 0),
        band_allowed=_tensor(band_allowed).expand(batch, -1, -1, -1),
        compressed={r: _compressed_rows(chunks, positions, r) for r in ratios},
    )


def _compressed_rows(chunks: _Chunks, positions: np.ndarray, ratio: int) -> CompressedRows:
    rows = np.arange(int((chunks.end // ratio).max()))
    owner = np.arange(len(chunks.start))[:, None]
    pages, page_rows = chunks.page_coordinates(owner, rows * ratio, ratio)
    return CompressedRows(
        pages=_tensor(pages),
        page_rows=_tensor(page_rows).expand(pages.shape),
        exists=_tensor(rows < (chunks.end // ratio)[:, None]),
        visible=_tensor(rows < ((positions + 1) // ratio)[..., None]),
    )


def _concat_writes(*writes: _Rows) -> RingWrite:
    return RingWrite(*(_tensor(np.concatenate([getattr(w, f.name) for w in writes]))
                       for f in dataclasses.fields(_Rows)))


def _ring_write(chunks: _Chunks, window: int) -> _Rows:
    positions, owner = _ragged_arange(np.maximum(chunks.start, chunks.end - window), chunks.end)
    return _Rows(
        slots=chunks.slot[owner],
        rows=positions % window,
        tokens=chunks.offset[owner] + positions - chunks.start[owner],
    )
