"""Paged pools for every kind of DeepSeek-V4 state. Holds state, decides nothing.

Two kinds of unit, each one contiguous byte buffer, so that a unit moves, is checksummed and is
compared as a whole (ARCHITECTURE.md invariant 4: "KV rows and indexer rows of a page move as one
unit"):

- a page holds `page_size` tokens of one request: for every CSA/HCA layer its compressed main rows
  (`page_size // ratio` of them) and for every CSA layer its index-key rows (`page_size // 4`).
  Compressed row w of a layer with ratio r lives in page `page_ids[(w*r) // P]` at row
  `((w*r) % P) // r` (ENGINE_CONTRACTS.md);
- a slot holds one running request's per-request state: for every layer the window ring (the last
  `sliding_window` raw main rows, position p at ring row p % W) and, for every compressed layer, the
  compressor's fp32 partial state; CSA layers also keep their indexer compressor's.

Row formats are those of `dsv4.kernels.rows`; pools see rows as opaque bytes.

Compressor partial state, as DeepSeek's own inference code keeps it: `state[slot, row, :]` is
`kv | score` (score already includes `ape`), `2 * coff * dim` channels per row, in fp32 (fp64 for a
float64 model, whose pooling runs in fp64). HCA keeps the
`ratio` rows of the current window; CSA keeps `2 * ratio` rows: the previous complete window (whose
first `dim` channels, the overlap half, feed the next compressed row) then the current window.

Index-key fingerprints (`--verify-indexer`): with `fingerprint_index_keys`, every index-key row
has an int64 fingerprint of its bytes, recorded when the row is written (by the model, or by
`write_page`); a verifier recomputes it to catch bytes that changed afterwards, which both the fast
and the reference indexer would read alike (a late or racing write into the cache).

Generations: the engine's allocator bumps a page's or slot's generation on every allocation, and the
pools learn each handout (`begin_tenancies`, from the tick plan) before anything names it; every
reader or writer names (id, generation) and `bind` rejects any generation but the current one.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import cache

import torch

from dsv4.config import CSA, WINDOW, ModelConfig
from dsv4.kernels.rows import index_row_bytes, main_row_bytes

INDEX_RATIO = 4  # the lightning indexer's compressor runs at CSA's ratio
_ALIGN = 64  # region offsets and unit sizes: keeps every typed view aligned for any dtype
_MODEL_DTYPE_ROW_FORMAT = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
_INDEX_KEY_DTYPES = ("fp8", "bf16", "fp32")
_KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


class StaleReference(RuntimeError):
    """A page or slot was named under a generation other than the one it now belongs to."""


@dataclass(frozen=True)
class Region:
    """One layer's rows inside a page or slot unit: bytes [offset, offset + rows * row_bytes)."""

    name: str  # e.g. "layers.2.compressed", "layers.2.index_keys", "layers.0.window"
    offset: int
    rows: int
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


def take_rows(rows: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
    """`rows[index]` for a uint8 row view [..., row_bytes]: a copy, moved as 4-byte words (a byte-wise
    gather is ~10x slower). One flat index goes through index_select, which copies whole rows of a
    strided pool view 2-3x faster than advanced indexing (a slot's window ring: 28 -> 8 us, 32 of
    them 910 -> 400 us)."""
    words = rows.view(torch.int32)
    if len(index) == 1 and index[0].dim() == 1:
        return words.index_select(0, index[0]).view(torch.uint8)
    return words[index].view(torch.uint8)


def put_rows(rows: torch.Tensor, index: tuple[torch.Tensor, ...], values: torch.Tensor) -> None:
    """`rows[index] = values` for a uint8 row view and uint8 packed rows, as 4-byte words."""
    rows.view(torch.int32)[index] = values.view(torch.int32)


def row_fingerprints(rows: torch.Tensor) -> torch.Tensor:
    """int64 [...] fingerprints of packed rows uint8 [..., row_bytes]: a weighted sum of their bytes.

    The weights are fixed random integers in [1, 2^45), so no sum of up to 2^9 bytes x 255 overflows:
    changing any one byte always changes the fingerprint, and several changes cancel only by chance.
    """
    return (rows.to(torch.int64) * _fingerprint_weights(rows.shape[-1], rows.device)).sum(-1)


@cache
def _fingerprint_weights(row_bytes: int, device: torch.device) -> torch.Tensor:
    if row_bytes > 512:
        raise ValueError(f"rows of {row_bytes} bytes are too wide to fingerprint without overflow")
    weights = torch.randint(1, 1 << 45, (row_bytes,), generator=torch.Generator().manual_seed(0))
    return weights.to(device)


def main_row_format(dtype: torch.dtype, kv_cache_dtype: str) -> str:
    """The `kernels.rows` format of main rows for a model dtype and `--kv-cache-dtype`."""
    if kv_cache_dtype not in _KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; expected one of {_KV_CACHE_DTYPES}")
    return "fp8_e4m3" if kv_cache_dtype == "fp8_e4m3" else _MODEL_DTYPE_ROW_FORMAT[dtype]


def compressor_state_rows(kind: str, ratio: int) -> int:
    """Rows of partial state: CSA also keeps the previous window for its overlap half."""
    return 2 * ratio if kind == CSA else ratio


class _Units:
    """A [count, unit_bytes] byte buffer carved into named regions, each viewable per unit."""

    def __init__(self, count: int, regions: list[tuple[str, int, int]], device: torch.device):
        self.regions: dict[str, Region] = {}
        offset = 0
        for name, rows, row_bytes in regions:
            self.regions[name] = Region(name, offset, rows, row_bytes)
            offset += -(-rows * row_bytes // _ALIGN) * _ALIGN
        self.unit_bytes = max(offset, _ALIGN)
        # Zeroed, so never-written bytes are deterministic (checksums, transfers, finite decodes).
        self.data = torch.zeros((count, self.unit_bytes), dtype=torch.uint8, device=device)
        # Each unit's current tenancy (-1: never handed out); a list: a forward binds a few units, and a
        # NumPy check of them took ~5 us each bind hot, ~25 in situ (the caches cold from the weights' stream)
        self.generations = [-1] * count
        # (built once: a forward asks for a few views per layer, ~5 us each to slice and reshape anew)
        self._views = {r.name: self.data[:, r.offset : r.offset + r.nbytes].unflatten(1, (r.rows, r.row_bytes))
                       for r in self.regions.values()}

    def view(self, name: str) -> torch.Tensor:
        """uint8 [count, rows, row_bytes], aliasing the buffer."""
        return self._views[name]

    def begin_tenancies(self, what: str, ids, generations) -> None:
        """Records newly allocated (id, generation) pairs, in allocation order: from now on each id
        answers to its newest generation only (an id freed and allocated again since the last call
        appears more than once). Generations only grow: one not newer is an allocator bug."""
        pairs, current = self._checked(what, ids, generations), self.generations
        for i, generation in pairs:  # (each against the generation before the call)
            if generation <= current[i]:
                raise StaleReference(f"{what} {i}: handed out under generation {generation}, "
                                     f"not newer than its generation {current[i]}")
        for i, generation in pairs:
            current[i] = max(current[i], generation)

    def bind(self, what: str, ids, generations) -> None:
        """Raises unless every (id, generation) names the id's current tenancy."""
        current = self.generations
        for i, generation in self._checked(what, ids, generations):
            if generation != current[i]:
                why = "is stale" if generation < current[i] else "was never handed out"
                raise StaleReference(f"{what} {i}: generation {generation} {why} (now at generation {current[i]})")

    def _checked(self, what: str, ids, generations) -> list[tuple[int, int]]:
        """The (id, generation) pairs, as ints; raises unless they pair up and every id is a unit's."""
        pairs = list(zip(map(int, ids), map(int, generations)))
        if len(pairs) != len(ids) or len(pairs) != len(generations):
            raise ValueError(f"{what}: {len(ids)} ids but {len(generations)} generations")
        count = len(self.generations)
        if any(not 0 <= i < count for i, _ in pairs):
            raise IndexError(f"{what} id out of range 0..{count - 1}: {[i for i, _ in pairs]}")
        return pairs

    def checksum(self, unit: int) -> int:
        return zlib.crc32(self.data[unit].cpu().numpy())


class StatePools:
    """Every kind of DeepSeek-V4 state for `num_pages` pages and `num_slots` slots."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        num_pages: int,
        num_slots: int,
        page_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
        index_key_dtype: str = "fp8",
        device: str | torch.device = "cpu",
        fingerprint_index_keys: bool = False,
    ):
        if page_size <= 0 or page_size % max(cfg.compress_ratios + (INDEX_RATIO,)):
            raise ValueError(f"page_size {page_size} must be a positive multiple of every compress ratio")
        if index_key_dtype not in _INDEX_KEY_DTYPES:
            raise ValueError(f"unknown index_key_dtype {index_key_dtype!r}; expected one of {_INDEX_KEY_DTYPES}")
        self.cfg = cfg
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.main_format = main_row_format(dtype, kv_cache_dtype)
        self.index_format = index_key_dtype
        self.main_row_bytes = main_row_bytes(self.main_format, cfg.head_dim, cfg.rope_head_dim)
        self.index_row_bytes = index_row_bytes(index_key_dtype, cfg.index_head_dim)
        if self.main_row_bytes % 4 or self.index_row_bytes % 4:
            raise ValueError("row sizes must be multiples of 4 bytes (rows move as 4-byte words)")
        self.state_dtype = torch.promote_types(dtype, torch.float32)
        state_bytes = self.state_dtype.itemsize

        page_regions, slot_regions = [], []
        for layer in range(cfg.num_layers):
            kind, ratio = cfg.layer_kind(layer), cfg.compress_ratios[layer]
            slot_regions.append((f"layers.{layer}.window", cfg.sliding_window, self.main_row_bytes))
            if kind == WINDOW:
                continue
            coff = 2 if kind == CSA else 1
            page_regions.append((f"layers.{layer}.compressed", page_size // ratio, self.main_row_bytes))
            state_rows = compressor_state_rows(kind, ratio)
            slot_regions.append((f"layers.{layer}.compressor", state_rows, state_bytes * 2 * coff * cfg.head_dim))
            if kind == CSA:
                page_regions.append((f"layers.{layer}.index_keys", page_size // INDEX_RATIO, self.index_row_bytes))
                slot_regions.append((f"layers.{layer}.indexer", state_rows, state_bytes * 2 * 2 * cfg.index_head_dim))
        self.device = torch.device(device)
        self._pages = _Units(num_pages, page_regions, self.device)
        self._slots = _Units(num_slots, slot_regions, self.device)
        self._index_fingerprints = {
            layer: torch.zeros((num_pages, page_size // INDEX_RATIO), dtype=torch.int64, device=self.device)
            for layer in range(cfg.num_layers) if fingerprint_index_keys and cfg.layer_kind(layer) == CSA
        }  # zeros: the fingerprint of the zeroed rows

    # -- typed views of one layer's rows (all aliasing the pools) ---------------------------------
    def compressed_rows(self, layer: int) -> torch.Tensor:
        """uint8 [num_pages, page_size // ratio, main_row_bytes]."""
        return self._pages.view(f"layers.{layer}.compressed")

    def index_keys(self, layer: int) -> torch.Tensor:
        """uint8 [num_pages, page_size // 4, index_row_bytes] (CSA layers)."""
        return self._pages.view(f"layers.{layer}.index_keys")

    def window(self, layer: int) -> torch.Tensor:
        """uint8 [num_slots, sliding_window, main_row_bytes]; position p at ring row p % W."""
        return self._slots.view(f"layers.{layer}.window")

    def compressor_state(self, layer: int) -> torch.Tensor:
        """[num_slots, state_rows, 2 * coff * head_dim] in state_dtype: kv | score (CSA/HCA layers)."""
        return self._slots.view(f"layers.{layer}.compressor").view(self.state_dtype)

    def indexer_state(self, layer: int) -> torch.Tensor:
        """[num_slots, 8, 4 * index_head_dim] in state_dtype: the indexer compressor's kv | score (CSA)."""
        return self._slots.view(f"layers.{layer}.indexer").view(self.state_dtype)

    # -- index-key fingerprints ---------------------------------------------------------------------
    @property
    def fingerprints_index_keys(self) -> bool:
        """Whether the index keys' rows are fingerprinted (`record_index_keys` must follow every write of them)."""
        return bool(self._index_fingerprints)

    def record_index_keys(self, layer: int, pages: torch.Tensor, rows: torch.Tensor) -> None:
        """Fingerprint index-key rows `index_keys(layer)[pages, rows]` as they now are, right after
        they were written; nothing when fingerprints are off."""
        if self._index_fingerprints:
            written = take_rows(self.index_keys(layer), pages, rows)
            self._index_fingerprints[layer][pages, rows] = row_fingerprints(written)

    def changed_index_keys(self, layer: int, pages: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """bool [...]: which of the index-key rows `index_keys(layer)[pages, rows]` no longer hold the
        bytes they were written with."""
        if not self._index_fingerprints:
            raise RuntimeError("index-key fingerprints are off (StatePools(fingerprint_index_keys=True))")
        now = row_fingerprints(take_rows(self.index_keys(layer), pages, rows))
        return now != self._index_fingerprints[layer][pages, rows]

    # -- generations ------------------------------------------------------------------------------
    def begin_tenancies(self, page_handouts, slot_handouts) -> None:
        """The allocator's handouts since the last call, as (id, generation) pairs (a TickPlan's)."""
        for units, what, handouts in ((self._pages, "page", page_handouts), (self._slots, "slot", slot_handouts)):
            if handouts:
                ids, generations = zip(*handouts)
                units.begin_tenancies(what, ids, generations)

    def bind(self, page_id: int, generation: int) -> None:
        """Raises StaleReference unless `generation` is the page's current one."""
        self._pages.bind("page", [page_id], [generation])

    def bind_pages(self, page_ids, generations) -> None:
        self._pages.bind("page", page_ids, generations)

    def bind_slot(self, slot: int, generation: int) -> None:
        self._slots.bind("slot", [slot], [generation])

    def bind_slots(self, slots, generations) -> None:
        self._slots.bind("slot", slots, generations)

    def page_generation(self, page_id: int) -> int:
        return self._pages.generations[page_id]

    def slot_generation(self, slot: int) -> int:
        return self._slots.generations[slot]

    # -- pages and slots as bytes (transfers, host cache, verification) ----------------------------
    @property
    def page_bytes(self) -> int:
        return self._pages.unit_bytes

    @property
    def slot_bytes(self) -> int:
        return self._slots.unit_bytes

    def page_layout(self) -> tuple[Region, ...]:
        return tuple(self._pages.regions.values())

    def slot_layout(self) -> tuple[Region, ...]:
        return tuple(self._slots.regions.values())

    def page_view(self, page_id: int, generation: int) -> torch.Tensor:
        """uint8 [page_bytes] aliasing the page: every layer's compressed and index-key rows."""
        self.bind(page_id, generation)
        return self._pages.data[page_id]

    def slot_view(self, slot: int, generation: int) -> torch.Tensor:
        """uint8 [slot_bytes] aliasing the slot: window rings and compressor partial state."""
        self.bind_slot(slot, generation)
        return self._slots.data[slot]

    def read_page(self, page_id: int, generation: int) -> bytes:
        return self.page_view(page_id, generation).cpu().numpy().tobytes()

    def write_page(self, page_id: int, generation: int, data: bytes | torch.Tensor) -> None:
        _copy_into(self.page_view(page_id, generation), data, f"page {page_id}")
        self.record_page_index_keys(page_id)

    def record_page_index_keys(self, page_id: int) -> None:
        """Fingerprint every index-key row of a page written whole (a transfer, a host-tier load) as by
        the model; nothing when fingerprints are off."""
        for layer, fingerprints in self._index_fingerprints.items():
            fingerprints[page_id] = row_fingerprints(self.index_keys(layer)[page_id])

    def read_slot(self, slot: int, generation: int) -> bytes:
        return self.slot_view(slot, generation).cpu().numpy().tobytes()

    def write_slot(self, slot: int, generation: int, data: bytes | torch.Tensor) -> None:
        _copy_into(self.slot_view(slot, generation), data, f"slot {slot}")

    def page_checksum(self, page_id: int) -> int:
        """CRC-32 of the page's bytes, for verify-mode commits."""
        return self._pages.checksum(page_id)

    def slot_checksum(self, slot: int) -> int:
        return self._slots.checksum(slot)


def _copy_into(dst: torch.Tensor, data: bytes | torch.Tensor, what: str) -> None:
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8) if isinstance(data, (bytes, bytearray)) else data
    if src.dtype != torch.uint8 or src.numel() != dst.numel():
        raise ValueError(f"{what}: expected {dst.numel()} bytes, got {src.numel()} of {src.dtype}")
    dst.copy_(src.reshape(-1))

