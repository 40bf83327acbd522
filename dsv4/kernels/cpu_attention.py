"""The CPU path's attention as C kernels on AVX512-BF16 (cpu/attention.c):
- `band_softmax`: the softmax weights of prefill chunks' query blocks over their bands and the
  compressed rows (dsv4.model.attention.banded_sink_attention) for bf16-valued operands: the logits'
  products on the CPU's bf16 units, summed in fp32 (exact products: the same sums as fp32
  arithmetic, in another order), a tile of rows at a time while it is in cache;
- `band_attention`: the whole attention of prefill chunks' query blocks (banded_sink_attention) for
  a bf16 model on AMX tiles (cpu/band_amx.c): the logits' products exact, the softmax weights split
  into three bf16 pieces that sum to them exactly, so that the value products are exact on the tiles
  too; the same sums as fp32 arithmetic, in another order;
- `decode_attention`: the whole attention of decode tokens over their rings and compressed rows
  where they lie in the pools (dsv4.model.attention.decode_sink_attention), in bf16 (logits as bf16
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

__all__ = ["amx_available", "available", "band_attention", "band_softmax", "decode_attention"]


@functools.cache
def amx_available() -> bool:
    """Whether `band_attention` runs here: the CPU has AMX tiles for bf16, the kernels are built and
    Linux lets this process use the tiles."""
    return cpu_has_amx_bf16() and available() and entry("amx_ready")() == 0


def band_attention(q: torch.Tensor, rows: torch.Tensor, raw_allowed: torch.Tensor, sink: torch.Tensor,
                   compressed: torch.Tensor | None = None, compressed_allowed: torch.Tensor | None = None, *,
                   block: int, scale: float) -> torch.Tensor:
    """Sink attention of a prefill group's queries q [B, L, H, D] (bf16; each token's [H, D] rows
    contiguous, tokens one after another), in blocks of `block` queries (block n: queries n*Q ..
    n*Q + Q), over their bands of raw rows (block n's: rows [n*Q, n*Q + K) of rows [B, R, D] bf16,
    rows at or past R zero; raw_allowed [B, N, Q, K] bool) and the compressed rows (compressed
    [B, C, D] bf16, compressed_allowed [B, N, Q, C] bool), sink [H] -> [B, L, H, D] bf16: what
    `banded_sink_attention` computes from the same bf16 values, rounded to bf16 (the blocks' queries
    past L are never computed)."""
    batch, length, heads, dim = q.shape
    blocks, keys = raw_allowed.shape[1], raw_allowed.shape[3]
    count = 0 if compressed is None else compressed.shape[1]
    problems = []
    if q.dtype != torch.bfloat16 or rows.dtype != torch.bfloat16 or q.device.type != "cpu":
        problems.append(f"q and rows must be bf16 CPU tensors (got {q.dtype}, {rows.dtype} on {q.device})")
    if dim % 32 or q.stride(3) != 1 or q.stride(2) != dim or q.stride(1) != heads * dim:
        problems.append(f"q's head dim must be a multiple of 32 and its tokens' rows contiguous (got "
                        f"{tuple(q.shape)}, strides {q.stride()})")
    if blocks > 1 and block % 16:
        problems.append(f"blocks of several must start at multiples of 16 rows (block {block})")
    if blocks * block < length or raw_allowed.shape != (batch, blocks, block, keys) or raw_allowed.dtype != torch.bool:
        problems.append(f"raw_allowed must be bool [B, N, Q, K] covering the {length} queries (got "
                        f"{tuple(raw_allowed.shape)}, block {block})")
    if rows.dim() != 3 or rows.shape[0] != batch or rows.shape[2] != dim or rows.stride(2) != 1:
        problems.append(f"rows must be [B, R, {dim}] with contiguous rows (got {tuple(rows.shape)})")
    if sink.shape != (heads,):
        problems.append(f"sink must be [{heads}] (got {tuple(sink.shape)})")
    if count and (compressed.dtype != torch.bfloat16 or compressed.shape != (batch, count, dim) or compressed.stride(2) != 1
                  or compressed_allowed is None or compressed_allowed.shape != (batch, blocks, block, count)
                  or compressed_allowed.dtype != torch.bool):
        problems.append("compressed must be bf16 [B, C, D] with contiguous rows, compressed_allowed bool [B, N, Q, C]")
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
              *((comp_mask.stride(0), comp_mask.stride(1), comp_mask.stride(2)) if count else (0, 0, 0)))
    sink = sink.float().contiguous()
    status = entry("band_attention")(
        q.data_ptr(), rows.data_ptr(), raw_mask.data_ptr(), compressed.data_ptr() if count else None,
        comp_mask.data_ptr() if count else None, sink.data_ptr(), out.data_ptr(),
        (ctypes.c_int64 * len(params))(*params), scale, torch.get_num_threads())
    if status != 0:
        raise MemoryError("band_attention: the kernel could not allocate its scratch memory")
    return out


def band_softmax(q: torch.Tensor, raw: torch.Tensor, raw_allowed: torch.Tensor, sink: torch.Tensor,
                 compressed: torch.Tensor | None = None, compressed_allowed: torch.Tensor | None = None, *,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """q [B, N, Q, H, D] over raw [B, N, K, D] (raw_allowed [B, N, Q, K] bool) and compressed [B, C, D]
    (compressed_allowed [B, N, Q, C]), all fp32 holding bf16 values, sink [H] -> the unnormalised
    softmax weights exp(logit - peak) [B, N, Q, H, K] and [B, N, Q, H, C] (None without compressed), and
    each row's denominator [B, N, Q, H, 1] (the sink's term included), in fp32. A logit is
    scale * q.k; masked keys weigh 0; a row's peak is its largest logit or the head's sink."""
    batch, blocks, block, heads, dim = q.shape
    keys = raw.shape[2]
    count = 0 if compressed is None else compressed.shape[1]
    _check(q, raw, raw_allowed, sink, compressed, compressed_allowed)
    raw_weights = q.new_empty(batch, blocks, block, heads, keys)
    compressed_weights = None if compressed is None else q.new_empty(batch, blocks, block, heads, count)
    denominator = q.new_empty(batch, blocks, block, heads, 1)
    raw_mask = raw_allowed.view(torch.uint8)
    comp_mask = compressed_allowed.view(torch.uint8) if count else None
    params = (batch, blocks, block, heads, keys, count, dim,
              q.stride(0), q.stride(1), q.stride(3),
              raw.stride(0), raw.stride(1), raw.stride(2),
              raw_mask.stride(0), raw_mask.stride(1), raw_mask.stride(2),
              *((compressed.stride(0), compressed.stride(1)) if count else (0, 0)),
              *((comp_mask.stride(0), comp_mask.stride(1), comp_mask.stride(2)) if count else (0, 0, 0)))
    sink = sink.float().contiguous()
    status = entry("band_softmax")(
        q.data_ptr(), raw.data_ptr(), raw_mask.data_ptr(), compressed.data_ptr() if count else None,
        comp_mask.data_ptr() if count else None, sink.data_ptr(), raw_weights.data_ptr(),
        compressed_weights.data_ptr() if count else None, denominator.data_ptr(),
        (ctypes.c_int64 * len(params))(*params), scale, torch.get_num_threads())
    if status != 0:
        raise MemoryError("band_softmax: the kernel could not allocate its scratch memory")
    return raw_weights, compressed_weights, denominator


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
    problems = []
    if q.dtype not in (torch.bfloat16, torch.float32) or q.device.type != "cpu" or dim % 2:
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
    q, sink = q.contiguous(), sink.float().contiguous()
    slots, at = (t.to(torch.int64).contiguous() for t in (slots, at))
    comp = ()
    if count:
        pages, page_rows = (t.to(torch.int64).contiguous() for t in (pages, page_rows))
        exists, allowed = (t.to(torch.bool).contiguous().view(torch.uint8) for t in (exists, allowed))
        comp = (compressed_pool, pages, page_rows, exists, allowed)
    out = torch.empty_like(q)
    params = (batch, heads, dim, window.shape[1], count, int(q.dtype == torch.float32), window.stride(0), window.stride(1),
              *((compressed_pool.stride(0), compressed_pool.stride(1)) if count else (0, 0)))
    pointers = [t.data_ptr() for t in comp] if count else [None] * 5
    status = entry("decode_attention")(
        q.data_ptr(), window.data_ptr(), slots.data_ptr(), at.data_ptr(), sink.data_ptr(), *pointers, out.data_ptr(),
        (ctypes.c_int64 * len(params))(*params), scale, torch.get_num_threads())
    if status != 0:
        raise MemoryError("decode_attention: the kernel could not allocate its scratch memory")
    return out


def _check(q, raw, raw_allowed, sink, compressed, compressed_allowed) -> None:
    """The layouts the kernel reads (strides in elements; every innermost one 1)."""
    batch, blocks, block, heads, dim = q.shape
    keys = raw.shape[2]
    problems = []
    if q.dtype != torch.float32 or raw.dtype != torch.float32:
        problems.append(f"q and raw must be fp32 (got {q.dtype}, {raw.dtype})")
    if q.device.type != "cpu":
        problems.append(f"the kernel runs on CPU tensors (got {q.device})")
    if q.stride(4) != 1 or q.stride(3) != dim or q.stride(2) != heads * dim:
        problems.append(f"q's (query, head, dim) rows must be contiguous (strides {q.stride()})")
    if raw.shape[:2] != (batch, blocks) or raw.shape[3] != dim or raw.stride(3) != 1:
        problems.append(f"raw must be [B, N, K, {dim}] with contiguous rows (got {tuple(raw.shape)}, {raw.stride()})")
    if raw_allowed.shape != (batch, blocks, block, keys) or raw_allowed.dtype != torch.bool or raw_allowed.stride(3) != 1:
        problems.append(f"raw_allowed must be bool [B, N, Q, K] with contiguous rows (got {tuple(raw_allowed.shape)})")
    if sink.shape != (heads,):
        problems.append(f"sink must be [{heads}] (got {tuple(sink.shape)})")
    if compressed is not None and compressed.shape[1]:
        count = compressed.shape[1]
        if compressed.dtype != torch.float32 or compressed.shape != (batch, count, dim) or compressed.stride(2) != 1:
            problems.append(f"compressed must be fp32 [B, C, {dim}] with contiguous rows (got {tuple(compressed.shape)})")
        if (compressed_allowed is None or compressed_allowed.shape != (batch, blocks, block, count)
                or compressed_allowed.dtype != torch.bool or compressed_allowed.stride(3) != 1):
            problems.append("compressed_allowed must be bool [B, N, Q, C] with contiguous rows")
    if problems:
        raise RuntimeError("band_softmax: " + "; ".join(problems))
