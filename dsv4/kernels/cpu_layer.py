"""A decoder layer of a decode step's few tokens as one C call (cpu/layer.c; on AVX512-BF16 or AVX2, cpu_library): the attention's
mHC mix, its projections, the compressors' feeds, the ring write, the attention and its exit, the MoE's
mix and the MoE (and in a step's first layer its tokens' embedding, in its last the head), through the
kernels the model otherwise calls one at a time (cpu_mhc, cpu_project, cpu_compressor, cpu_attention,
cpu_moe), in the same order on the same values. Its oracle is that
sequence: its test runs the model both ways and compares them to the bit. The tensors are checked once,
where dsv4.model.decode_layer binds a layer's weights and prepares a step's indices; this module only
lays out the call."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from .cpu_library import available, entry

__all__ = ["BACK", "FLOATS", "FRONT", "PARAMS", "POINTERS", "RATIO", "STEP", "WHOLE", "Calls", "Params", "available",
           "decode_layer", "layer_params", "pointers", "scratch_bytes"]

# cpu/layer.c's ptr[] order: the residual; the attention's mix weights; its projections' weights and the
# RoPE tables; the positions; two compressors' ape, state and plan rows; the attention's pools, rows and
# sink; the exit's weights; the MoE's mix weights; the MoE's token ids, router and weights; the new residual;
# two compressors' stores (their norms and pools: None where the call stores nothing) and the new rows' RoPE
# tables and places; the embedding (None: the streams are given); the head's mix weights, norm and weight,
# and its logits (None: no head in the call); the intermediates kept between two phases (None: the call's own)
POINTERS = ("streams", "output", "post", "comb", "attn_fn", "attn_base", "attn_scale", "attn_norm",
            "w_input", "q_norm", "wq_b", "kv_norm", "cos2", "sin2", "positions",
            *(f"{name}_{c}" for c in (0, 1) for name in ("ape", "state", "state_slots", "state_rows", "update_slots",
                                                         "update_rows", "update_sources", "window_sources", "windows")),
            "window", "slots", "at", "sink", "comp_pool", "pages", "page_rows", "exists", "allowed",
            "wo_a", "wo_b", "ffn_fn", "ffn_base", "ffn_scale", "ffn_norm",
            "token_ids", "gate", "route", "w13", "w2", "shared_w13", "shared_w2",
            "streams_out", "output_out", "post_out", "comb_out",
            "store_norm_0", "store_cache_0", "store_norm_1", "store_cache_1", "window_cos2", "window_sin2", "window_pages",
            "window_page_rows", "embed", "head_fn", "head_base", "head_scale", "head_norm", "head", "logits", "scratch")
# cpu/layer.c's params[]: the layer's own p[] (`layer_params`), then each kernel's as its module builds it
PARAMS = ("layer", "mix", "project", "feed_0", "feed_1", "attention", "exit", "route", "moe", "store_0", "store_1",
          "logits")
FLOATS = ("hc_eps", "norm_eps", "project_eps", "attention_scale", "routed_scaling_factor", "swiglu_limit",
          "store_eps_0", "store_eps_1")
# A call's phases (cpu/layer.c): FRONT through the compressors' feeds, which copy out the rows of the windows
# that complete; BACK from the ring write on; WHOLE both, and the stores between them where they are set
FRONT, BACK, WHOLE = 1, 2, 3


def layer_params(tokens: int, streams: int, hidden: int, width: int, q_rank: int, dim: int, heads: int,
                 dtype: torch.dtype, window: torch.Tensor, feed_columns: Sequence[int], tiles: bool,
                 window_layer: bool, ratio_index: int) -> tuple[int, ...]:
    """The layer's p[] (cpu/layer.c's L_*): the shapes, the window pool's ring (uint8 [slots, W, row bytes]),
    where each fed compressor's kv | gate columns start in the projected row, which RoPE tables of the
    step (`Calls.step`) the layer reads (a window layer's, else a compressed one's) and which ratio's
    parts (its place among the step's; -1: none)."""
    columns = (*feed_columns, 0, 0)[:2]
    return (tokens, streams, hidden, width, q_rank, dim, heads, dtype == torch.float32, window.shape[1],
            window.stride(0), window.stride(1), len(feed_columns), *columns, tiles, not window_layer, ratio_index)


class Params:
    """The kernels' p[] arrays of one call (`PARAMS` order; a compressor not fed: any), laid out once for
    every call of a step that shares them."""

    def __init__(self, params: Sequence[Sequence[int]]):
        if len(params) != len(PARAMS):
            raise RuntimeError(f"cpu decode_layer: {len(PARAMS)} parameter arrays (got {len(params)})")
        self.arrays = [(ctypes.c_int64 * len(p))(*p) for p in params]  # (held: the pointers below are theirs)
        self.pointers = (ctypes.c_void_p * len(PARAMS))(*map(ctypes.addressof, self.arrays))
        self.address = ctypes.addressof(self.pointers)

    def set(self, kernel: int, at: int, value: int) -> None:
        """Sets element `at` of kernel `kernel`'s p[] (its index in PARAMS) for the calls that follow."""
        self.arrays[kernel][at] = value


# The pointers of a step that `Calls.run` sets in every layer's call: the RoPE tables of a window layer and
# of a compressed one, the positions (also the ring's), the slots and the token ids (cpu/layer.c's STEP_*);
# then RATIO for each ratio, in the order of the layers' ratio_index: the compressed rows seen (None where no
# token sees one yet) and the compressors' plan rows (cpu/layer.c's RATIO_*)
STEP = ("cos2_window", "sin2_window", "cos2_compressed", "sin2_compressed", "positions", "slots", "token_ids")
RATIO = ("pages", "page_rows", "exists", "allowed", "state_slots", "state_rows", "update_slots", "update_rows",
         "update_sources", "window_sources")


class Calls:
    """Whole layers' calls queued to run as one (`run`: cpu/layer.c's decode_layers), in the order added:
    a step's Python prepares every layer's call in one stretch, between two of its kernels' runs."""

    def __init__(self, capacity: int, ratios: int):
        """`capacity`: the most calls queued; `ratios`: the parts of how many ratios `step` holds."""
        self._pointers, self._params, self._floats = ((ctypes.c_void_p * capacity)() for _ in range(3))
        self._held: list = []  # (the arrays the queued addresses are of)
        self.count = 0
        # (STEP, then RATIO by ratio: the caller sets them before `run`)
        self.step = (ctypes.c_void_p * (len(STEP) + ratios * len(RATIO)))()

    def add(self, pointers: ctypes.Array, params: Params, floats: ctypes.Array) -> None:
        """Queues a layer's call: `pointers` as `pointers` makes them (those of STEP and RATIO: `step`'s), `floats` in
        FLOATS order; the arrays are read when the calls run, as they are then."""
        _check_call(pointers, floats)
        i = self.count
        if i == len(self._pointers):
            raise RuntimeError(f"cpu decode_layers: more than {i} calls queued")
        self._pointers[i], self._params[i], self._floats[i] = (ctypes.addressof(pointers), params.address,
                                                               ctypes.addressof(floats))
        self._held += (pointers, params, floats)
        self.count = i + 1

    def clear(self) -> None:
        """Drops the queued calls unrun."""
        self.count = 0
        self._held.clear()

    def run(self) -> None:
        """Runs the queued calls, in order, and empties the queue."""
        count, held = self.count, self._held  # (held through the call)
        if not count:
            return
        self.count, self._held = 0, []
        status = entry("decode_layers")(count, self._pointers, self._params, self._floats, self.step,
                                        torch.get_num_threads())
        del held
        if status != 0:
            raise MemoryError(f"cpu decode_layers: a kernel could not allocate its scratch memory ({status})")


def scratch_bytes(params: Params) -> int:
    """The bytes of the intermediates a layer of these params keeps between its phases (its "scratch")."""
    return entry("decode_layer_scratch")(params.arrays[0])


def pointers(values: Sequence[int | None]) -> ctypes.Array:
    """A call's pointers (POINTERS order, None: absent) as `decode_layer` takes them: an array a caller may
    keep and change between calls."""
    if len(values) != len(POINTERS):
        raise RuntimeError(f"cpu decode_layer: {len(POINTERS)} pointers (got {len(values)})")
    return (ctypes.c_void_p * len(POINTERS))(*values)


def decode_layer(pointers: ctypes.Array, params: Params, floats: ctypes.Array, phases: int = WHOLE) -> None:
    """Runs cpu/layer.c's decode_layer's `phases`: `pointers` as `pointers` makes them, `floats` in FLOATS
    order (a c_float array)."""
    _check_call(pointers, floats)
    status = entry("decode_layer")(pointers, params.pointers, floats, phases, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"cpu decode_layer: a kernel could not allocate its scratch memory ({status})")


def _check_call(pointers: ctypes.Array, floats: ctypes.Array) -> None:
    if len(pointers) != len(POINTERS) or len(floats) != len(FLOATS):
        raise RuntimeError(f"cpu decode_layer: {len(POINTERS)} pointers and {len(FLOATS)} floats (got "
                           f"{len(pointers)}, {len(floats)})")
