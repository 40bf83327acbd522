"""The CPU path's attention as C kernels (AVX512-BF16 or AVX2, cpu_library):
- `band_attention`: the whole attention of prefill chunks' query blocks (dsv4.model.attention.
  banded_sink_attention) for a bf16 model, the logits' products exact on the CPU's bf16 units (bf16
  pairs summed in fp32); the same sums as fp32 arithmetic, in another order. On AMX tiles
  (cpu/band_amx.c) the softmax weights are split into three bf16 pieces that sum to them exactly, so
  that the value products are exact on the tiles too; without them (cpu/band_dots.c) the
  value products are fp32 FMAs, and only the columns some query of a work item attends to are
  computed. The latter takes an fp32 model's attention too, its logits as fp32 FMAs;
- `decode_attention` (cpu/attention.c): the whole attention of decode tokens over their rings and
  compressed rows where they lie in the pools (dsv4.model.attention.decode_sink_attention), in bf16 (logits as bf16
  pair products) or fp32 (FMAs); softmax and value products in fp32.
Their oracle is the model's torch code for the same math (its tests run both against dsv4.reference).

They are built with the other CPU kernels (dsv4/kernels/cpu_library.py); where that library is not
available, the model computes in torch ops.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from dsv4.config.server_args import cpu_has_amx_bf16

from .cpu_library import available, entry

__all__ = ["amx_available", "available", "band_attention", "decode_attention", "tiles_read"]


@functools.cache
def amx_available() -> bool:
    """Whether `band_attention` runs on AMX tiles here: the CPU has them for bf16, the kernels are built
    and Linux lets this process use the tiles."""
    return cpu_has_amx_bf16() and available() and entry("amx_ready")() == 0


def tiles_read(dim: int, blocks: int, block: int) -> bool:
    """Whether `band_attention` on AMX tiles reads a group of `blocks` blocks of `block` queries of
    head dim `dim` (the other kernel, cpu/band_dots.c, reads any of even `dim`)."""
    return dim % 32 == 0 and (blocks == 1 or block % 16 == 0)


def band_attention(q: torch.Tensor, rows: torch.Tensor, raw_allowed: torch.Tensor, sink: torch.Tensor,
                   compressed: torch.Tensor | None = None, compressed_allowed: torch.Tensor | None = None, *,
                   block: int, scale: float, tiles: bool | None = None) -> torch.Tensor:
    """Sink attention of a prefill group's queries q [B, L, H, D] (bf16; each token's [H, D] rows
    contiguous, tokens one after another), in blocks of `block` queries (block n: queries n*Q ..
    n*Q + Q), over their bands of raw rows (block n's: rows [n*Q, n*Q + K) of rows [B, R, D] bf16,
    rows at or past R zero; raw_allowed [B, N, Q, K] bool) and the compressed rows (compressed
    [B, C, D] bf16, compressed_allowed [B, N, Q, C] bool), sink [H] -> [B, L, H, D] bf16: what
    `banded_sink_attention` computes from the same bf16 values, rounded to bf16 (the blocks' queries
    past L are never computed). On AMX tiles where this CPU has them (`tiles`, default: then), else as
    bf16 pair products (cpu/band_dots.c), which reads every layout `tiles_read` does not require, and fp32
    operands too (q, rows and compressed fp32 -> fp32)."""
    tiles = amx_available() if tiles is None else tiles
    batch, length, heads, dim = q.shape
    blocks, keys = raw_allowed.shape[1], raw_allowed.shape[3]
    count = 0 if compressed is None else compressed.shape[1]
    problems = []
    dtypes = (torch.bfloat16,) if tiles else (torch.bfloat16, torch.float32)
    if q.dtype not in dtypes or rows.dtype != q.dtype or q.device.type != "cpu":
        problems.append(f"q and rows must be CPU tensors of one dtype, {'bf16' if tiles else 'bf16 or fp32'} (got "
                        f"{q.dtype}, {rows.dtype} on {q.device})")
    if dim % (32 if tiles else 2) or q.stride(3) != 1 or q.stride(2) != dim or q.stride(1) != heads * dim:
        problems.append(f"q's head dim must be a multiple of {32 if tiles else 2} and its tokens' rows contiguous "
                        f"(got {tuple(q.shape)}, strides {q.stride()})")
    if tiles and blocks > 1 and block % 16:
        problems.append(f"blocks of several must start at multiples of 16 rows (block {block})")
    if blocks * block < length or raw_allowed.shape != (batch, blocks, block, keys) or raw_allowed.dtype != torch.bool:
        problems.append(f"raw_allowed must be bool [B, N, Q, K] covering the {length} queries (got "
                        f"{tuple(raw_allowed.shape)}, block {block})")
    if rows.dim() != 3 or rows.shape[0] != batch or rows.shape[2] != dim or rows.stride(2) != 1:
        problems.append(f"rows must be [B, R, {dim}] with contiguous rows (got {tuple(rows.shape)})")
    if sink.shape != (heads,):
        problems.append(f"sink must be [{heads}] (got {tuple(sink.shape)})")
    if count and (compressed.dtype != q.dtype or compressed.shape != (batch, count, dim) or compressed.stride(2) != 1
                  or compressed_allowed is None or compressed_allowed.shape != (batch, blocks, block, count)
                  or compressed_allowed.dtype != torch.bool):
        problems.append("compressed must be [B, C, D] of q's dtype with contiguous rows, compressed_allowed bool "
                        "[B, N, Q, C]")
    if problems:
        raise RuntimeError("band_attention: " + "; ".join(problems))
    raw_mask = raw_allowed.view(torch.uint8)
    if raw_mask.stride(3) != 1:
        raw_mask = raw_mask.contiguous()
    comp_mask = None
    if count:
        comp_mask = compressed_allowed.view(torch.uint8)
        comp_mask = comp_mask if comp_mask.stride(3) == 1 else comp_mask.contiguous()
    out = q.new_empty(batch, length, heads, dim)
    params = (batch, blocks, block, heads, keys, count, dim, length, rows.shape[1],
              q.stride(0), q.stride(1), rows.stride(0), rows.stride(1),
              raw_mask.stride(0), raw_mask.stride(1), raw_mask.stride(2),
              *((compressed.stride(0), compressed.stride(1)) if count else (0, 0)),
              *((comp_mask.stride(0), comp_mask.stride(1), comp_mask.stride(2)) if count else (0, 0, 0)),
              q.dtype == torch.float32)
    sink = sink.float().contiguous()
    status = entry("band_attention" if tiles else "band_attention_dots")(
        q.data_ptr(), rows.data_ptr(), raw_mask.data_ptr(), compressed.data_ptr() if count else None,
        comp_mask.data_ptr() if count else None, sink.data_ptr(), out.data_ptr(),
        (ctypes.c_int64 * len(params))(*params), scale, torch.get_num_threads())
    if status != 0:
        raise MemoryError("band_attention: the kernel could not allocate its scratch memory")
    return out


def decode_attention(q: torch.Tensor, window: torch.Tensor, slots: torch.Tensor, at: torch.Tensor, sink: torch.Tensor,
                     compressed_pool: torch.Tensor | None = None, pages: torch.Tensor | None = None,
                     page_rows: torch.Tensor | None = None, exists: torch.Tensor | None = None,
                     allowed: torch.Tensor | None = None, *, scale: float) -> torch.Tensor:
    """Sink attention of decode tokens, one query each (q [B, H, D] bf16 or fp32, at positions `at`
    [B]), over their rings, read in place from the window pool (uint8 [slots, W, D * q's element size]:
    rows of q's dtype; token b's ring is slot slots[b], position p at row p % W, rows r <= at[b]
    seen), plus compressed rows read in place from compressed_pool (uint8 [pages, rows, same]; token
    b's row c at pages[b, c], page_rows[b, c], seen where `exists` and `allowed` [B, C]) -> [B, H, D]
    in q's dtype: the softmax over scale * q.k of the seen rows and the head's sink, times the rows
    (K = V). Rows not seen are never read, whatever they hold."""
    batch, heads, dim = q.shape
    count = 0 if compressed_pool is None else pages.shape[1]
    indices = (slots, at, pages, page_rows) if count else (slots, at)
    masks = (exists, allowed) if count else ()
    if not _decode_ready(q, window, compressed_pool if count else None, indices, masks, sink, count):
        q, sink, indices, masks = _decode_inputs(q, window, slots, at, compressed_pool, pages, page_rows, exists,
                                                  allowed, sink)
    out = torch.empty_like(q)
    params = decode_params(batch, heads, dim, q.dtype, window, compressed_pool if count else None, count)
    pointers = (compressed_pool.data_ptr(), *(t.data_ptr() for t in indices[2:] + masks)) if count else (None,) * 5
    status = entry("decode_attention")(
        q.data_ptr(), window.data_ptr(), indices[0].data_ptr(), indices[1].data_ptr(), sink.data_ptr(), *pointers,
        out.data_ptr(), (ctypes.c_int64 * len(params))(*params), scale, torch.get_num_threads())
    if status != 0:
        raise MemoryError("decode_attention: the kernel could not allocate its scratch memory")
    return out


def decode_params(batch: int, heads: int, dim: int, dtype: torch.dtype, window: torch.Tensor,
                  compressed_pool: torch.Tensor | None, count: int) -> tuple[int, ...]:
    """decode_attention's p[] (cpu/attention.c's D_*) for queries [B, H, D] of `dtype`, `count` compressed
    rows a token (compressed_pool None: none); `count` at DECODE_COUNT_AT."""
    pool_strides = (0, 0) if compressed_pool is None else (compressed_pool.stride(0), compressed_pool.stride(1))
    return (batch, heads, dim, window.shape[1], count, dtype == torch.float32, window.stride(0), window.stride(1),
            *pool_strides)


DECODE_COUNT_AT = 4  # (D_C)


def _decode_ready(q: torch.Tensor, window: torch.Tensor, compressed_pool: torch.Tensor | None, indices: tuple,
                  masks: tuple, sink: torch.Tensor, count: int) -> bool:
    """Whether `decode_attention`'s inputs are as its kernel reads them (`count` compressed rows a token),
    so that they pass as they are: attribute reads, where `_decode_inputs`' checks and conversions
    took ~15 us of each call in a c=1 decode step (the model passes them so)."""
    batch, heads, dim = q.shape
    row_bytes = dim * q.element_size()
    shapes = ((batch,), (batch,), (batch, count), (batch, count))
    return (q.is_cpu and q.dtype in _DECODE_DTYPES and q.is_contiguous() and not dim % 2 and sink.shape == (heads,)
            and sink.dtype == torch.float32 and sink.is_contiguous()
            and all(pool.dtype == torch.uint8 and pool.dim() == 3 and pool.shape[2] == row_bytes and pool.stride(2) == 1
                    for pool in ((window,) if compressed_pool is None else (window, compressed_pool)))
            and all(t.dtype == torch.int64 and t.is_contiguous() and t.shape == shape for t, shape in zip(indices, shapes))
            and all(t.dtype == torch.bool and t.is_contiguous() and t.shape == (batch, count) for t in masks))


_DECODE_DTYPES = (torch.bfloat16, torch.float32)


def _decode_inputs(q: torch.Tensor, window: torch.Tensor, slots: torch.Tensor, at: torch.Tensor,
                   compressed_pool: torch.Tensor | None,
                   pages: torch.Tensor | None, page_rows: torch.Tensor | None, exists: torch.Tensor | None,
                   allowed: torch.Tensor | None, sink: torch.Tensor) -> tuple:
    """`decode_attention`'s inputs checked (a named error for what its kernel cannot read) and converted
    as it reads them: q, sink, the index tensors (slots, at[, pages, page_rows]) int64 and the masks
    (exists, allowed) bool, contiguous."""
    batch, heads, dim = q.shape
    count = 0 if compressed_pool is None else pages.shape[1]
    problems = []
    if q.dtype not in _DECODE_DTYPES or q.device.type != "cpu" or dim % 2:
        problems.append(f"q must be bf16 or fp32 [B, H, D] on the CPU, D even (got {q.dtype} {tuple(q.shape)} on "
                        f"{q.device})")
    pools = [window] + ([compressed_pool] if count else [])
    row_bytes = dim * q.element_size()
    if any(pool.dtype != torch.uint8 or pool.dim() != 3 or pool.shape[2] != row_bytes or pool.stride(2) != 1
           for pool in pools):
        problems.append(f"the pools must be uint8 [.., .., {row_bytes}] views of rows of q's dtype")
    if slots.shape != (batch,) or at.shape != (batch,) or sink.shape != (heads,):
        problems.append(f"slots {tuple(slots.shape)}, at {tuple(at.shape)} and sink {tuple(sink.shape)} do not fit q")
    if count and any(t is None or t.shape != (batch, count) for t in (page_rows, exists, allowed)):
        problems.append("pages, page_rows, exists and allowed must all be [B, C]")
    if problems:
        raise RuntimeError("decode_attention: " + "; ".join(problems))
    indices = [t.to(torch.int64).contiguous() for t in ((slots, at, pages, page_rows) if count else (slots, at))]
    masks = tuple(t.to(torch.bool).contiguous() for t in (exists, allowed)) if count else ()
    return q.contiguous(), sink.float().contiguous(), tuple(indices), masks
