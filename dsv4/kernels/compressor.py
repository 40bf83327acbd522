"""The compressor step: pool a complete window into one compressed row and store it in the cache.

For each row n to emit (compressed row index w = windows[n]): per channel, a softmax over the
window's slots of their scores (gate + ape) weights their kv; the pooled row is rounded to the
model dtype, RMS-normalised with `norm_weight`, rotated (RoPE on its last rope_dim dims,
interleaved pairs, given cos/sin for position w * ratio), rounded again, then quantised into
`row_format` and written to cache[pages[n], rows[n]]. The same op fills the indexer's key cache
(dim 128, format "fp8"/"bf16"/"fp32") and the main compressed rows (dim 512, main formats).

Slots come from `state[units[n], first_rows[n] : first_rows[n] + S]`, one row per token holding
`kv | score` (`coff * dim` channels each; score already includes ape), the layout of the pools'
compressor partial state. Decode passes the pool's state (units = slots, first_rows = 0);
prefill may pass any tensor of that layout, e.g. the previous window's tokens then the chunk's,
with first_rows[n] = where row n's slots start (for CSA, at its previous window; before window 0,
4 placeholder rows whose values are ignored).
- HCA (ratio 128, coff 1): S = 128 slots, the window's tokens.
- CSA (ratio 4, coff 2): S = 8 slots: the previous window's 4 tokens, which contribute their
  first `dim` channels (the overlap half), then the current window's 4 tokens, contributing their
  last `dim` channels. Window 0 has no previous window: those 4 slots get zero weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import INDEX_DTYPES, check_format, check_rows, check_same_device, check_tensor, fail
from .row_codec import FORMAT_CODES, MAIN_FORMATS, round_bf16, row_bytes, store_row
from .rows import pack_index_rows, pack_main_rows

CSA_RATIO, HCA_RATIO = 4, 128
ROW_FORMATS = (*MAIN_FORMATS, "fp8")
MODEL_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
BLOCK_SLOTS = 8  # slots pooled per step (online softmax across steps)


def check_compressor_args(op, state, units, first_rows, windows, cos, sin, norm_weight, cache, pages, rows, ratio,
                          row_format, eps, model_dtype) -> None:
    check_format(op, row_format, ROW_FORMATS)
    if ratio not in (CSA_RATIO, HCA_RATIO):
        fail(op, f"ratio must be {CSA_RATIO} (CSA) or {HCA_RATIO} (HCA), got {ratio!r}")
    if model_dtype not in MODEL_DTYPES:
        fail(op, f"model_dtype must be one of {MODEL_DTYPES}, got {model_dtype}")
    if not isinstance(eps, float) or eps <= 0:
        fail(op, f"eps must be a positive float, got {eps!r}")
    check_tensor(op, "state", state, dims=3, dtypes=(torch.float32, torch.float64))
    coff = 2 if ratio == CSA_RATIO else 1
    if state.shape[2] % (2 * coff):
        fail(op, f"state has {state.shape[2]} channels: not kv | score of {coff} x dim each")
    dim = state.shape[2] // (2 * coff)
    slots = 2 * ratio if ratio == CSA_RATIO else ratio
    if state.shape[1] < slots:
        fail(op, f"state has {state.shape[1]} rows per unit, fewer than a window's {slots} slots")
    check_tensor(op, "units", units, dims=1, dtypes=INDEX_DTYPES)
    emitted = units.shape[0]
    for name, t in (("first_rows", first_rows), ("windows", windows), ("pages", pages), ("rows", rows)):
        check_tensor(op, name, t, dims=1, dtypes=INDEX_DTYPES, shape=(emitted,))
    check_tensor(op, "cos", cos, dims=2, dtypes=(torch.float32, torch.float64), shape=(emitted, None))
    check_tensor(op, "sin", sin, dims=2, dtypes=(torch.float32, torch.float64), shape=cos.shape)
    rope_dim = 2 * cos.shape[1]
    if not 0 < rope_dim <= dim:
        fail(op, f"cos/sin give {rope_dim} RoPE dims for rows of {dim}")
    check_tensor(op, "norm_weight", norm_weight, dims=1, dtypes=MODEL_DTYPES, shape=(dim,))
    if row_format == "fp8_e4m3" and (dim - rope_dim <= 0 or (dim - rope_dim) % 64):
        fail(op, f"fp8_e4m3 rows need the no-RoPE dims ({dim - rope_dim}) to be a positive multiple of 64")
    check_rows(op, "cache", cache, row_format=row_format, dim=dim, rope_dim=rope_dim)
    check_same_device(op, state=state, units=units, first_rows=first_rows, windows=windows, cos=cos, sin=sin,
                      norm_weight=norm_weight, cache=cache, pages=pages, rows=rows)


@triton.jit
def _compress_insert_kernel(
    state_ptr, units_ptr, first_rows_ptr, windows_ptr, cos_ptr, sin_ptr, norm_ptr, cache_ptr, pages_ptr, rows_ptr,
    stride_su, stride_sr, stride_sc, stride_cos, stride_sin, stride_cache_page, stride_cache_row,
    eps,
    RATIO: tl.constexpr, OVERLAP: tl.constexpr, SLOTS: tl.constexpr, DIM: tl.constexpr, ROPE: tl.constexpr,
    ROUND_BF16: tl.constexpr, FORMAT: tl.constexpr, ROW_BYTES: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
):
    n = tl.program_id(0)
    unit = tl.load(units_ptr + n).to(tl.int64)
    first_row = tl.load(first_rows_ptr + n).to(tl.int64)
    # CSA window 0 has no previous window: its first RATIO slots are dead.
    first_live_slot = tl.where(tl.load(windows_ptr + n) > 0, 0, RATIO) if OVERLAP else 0
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < DIM
    base = state_ptr + unit * stride_su + first_row * stride_sr
    SCORE_OFFSET: tl.constexpr = DIM * (2 if OVERLAP else 1)  # score channels follow all kv channels

    # Online softmax over the slots, per channel. `shift` is the running max, except 0 where a
    # column has seen only dead slots (-inf) so far, so no exp() ever sees -inf - -inf.
    running_max = tl.full([BLOCK_D], float("-inf"), tl.float32)
    shift = tl.full([BLOCK_D], float("-inf"), tl.float32)
    denominator = tl.zeros([BLOCK_D], tl.float32)
    pooled = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, SLOTS, BLOCK_SLOTS):
        slot = s0 + tl.arange(0, BLOCK_SLOTS)
        if OVERLAP:  # slots of the previous window give their first half, the current window its second
            channel = tl.where(slot >= RATIO, DIM, 0)[:, None] + cols[None, :]
        else:
            channel = tl.zeros([BLOCK_SLOTS], tl.int32)[:, None] + cols[None, :]
        live = (slot >= first_live_slot)[:, None] & col_mask[None, :]
        ptr = base + slot[:, None].to(tl.int64) * stride_sr
        kv = tl.load(ptr + channel * stride_sc, mask=live, other=0.0).to(tl.float32)
        score = tl.load(ptr + (SCORE_OFFSET + channel) * stride_sc, mask=live, other=float("-inf")).to(tl.float32)
        running_max = tl.maximum(running_max, tl.max(score, axis=0))
        new_shift = tl.where(running_max == float("-inf"), 0.0, running_max)
        alpha = tl.exp(shift - new_shift)
        p = tl.exp(score - new_shift[None, :])
        denominator = denominator * alpha + tl.sum(p, axis=0)
        pooled = pooled * alpha + tl.sum(p * kv, axis=0)
        shift = new_shift
    row = pooled / tl.where(col_mask, denominator, 1.0)  # columns past DIM pooled nothing
    if ROUND_BF16:
        row = round_bf16(row)

    norm_weight = tl.load(norm_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    row = row * (1.0 / tl.sqrt_rn(tl.sum(row * row, axis=0) / DIM + eps)) * norm_weight
    if ROUND_BF16:
        row = round_bf16(row)

    # RoPE on the last ROPE dims: rotate (even, odd) pairs; pairs before them get cos 1, sin 0.
    pair = tl.arange(0, BLOCK_D // 2)
    rope_pair = pair - (DIM - ROPE) // 2
    in_rope = (rope_pair >= 0) & (rope_pair < ROPE // 2)
    cos = tl.load(cos_ptr + n * stride_cos + rope_pair, mask=in_rope, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + n * stride_sin + rope_pair, mask=in_rope, other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(row, (BLOCK_D // 2, 2)))
    row = tl.reshape(tl.join(even * cos - odd * sin, even * sin + odd * cos), (BLOCK_D,))
    if ROUND_BF16:
        row = round_bf16(row)

    page = tl.load(pages_ptr + n).to(tl.int64)
    dest_row = tl.load(rows_ptr + n).to(tl.int64)
    store_row(cache_ptr + page * stride_cache_page + dest_row * stride_cache_row, row,
              FORMAT, DIM, ROPE, BLOCK_D, ROW_BYTES)


def compress_insert_triton(state, units, first_rows, windows, cos, sin, norm_weight, cache, pages, rows, *,
                           ratio, row_format, eps, model_dtype) -> None:
    """Triton path. Arguments as `compress_insert_torch`."""
    op = "compress_insert_triton"
    check_compressor_args(op, state, units, first_rows, windows, cos, sin, norm_weight, cache, pages, rows, ratio,
                          row_format, eps, model_dtype)
    if row_format == "fp64" or model_dtype == torch.float64 or state.dtype == torch.float64:
        fail(op, "float64 has no Triton path (float64 is the oracle dtype): use the torch path")
    if units.shape[0] == 0:
        return
    overlap = ratio == CSA_RATIO
    dim = state.shape[2] // (4 if overlap else 2)
    rope_dim = 2 * cos.shape[1]
    _compress_insert_kernel[(units.shape[0],)](
        state, units, first_rows, windows, cos, sin, norm_weight, cache, pages, rows,
        *state.stride(), cos.stride(0), sin.stride(0), cache.stride(0), cache.stride(1),
        eps,
        RATIO=ratio, OVERLAP=overlap, SLOTS=2 * ratio if overlap else ratio, DIM=dim, ROPE=rope_dim,
        ROUND_BF16=model_dtype == torch.bfloat16, FORMAT=FORMAT_CODES[row_format],
        ROW_BYTES=row_bytes(row_format, dim, rope_dim),
        BLOCK_D=max(64, triton.next_power_of_2(dim)), BLOCK_SLOTS=BLOCK_SLOTS,
    )


def compress_insert_torch(state, units, first_rows, windows, cos, sin, norm_weight, cache, pages, rows, *,
                          ratio, row_format, eps, model_dtype) -> None:
    """Vectorised torch path: every emitted row at once.

    state float [units, rows, 2 * coff * dim] (kv | score per token); units, first_rows, windows,
    pages, rows [N]; cos, sin [N, rope_dim // 2] for position windows[n] * ratio; norm_weight [dim];
    cache uint8 [num_pages, rows_per_page, row_bytes] in `row_format` (a main-row format, or
    "fp8" / "bf16" / "fp32" for index keys); ratio 4 (CSA) or 128 (HCA); model_dtype the dtype
    the pooled, normed and rotated row is rounded to at each step, as the model computes it.
    """
    check_compressor_args("compress_insert_torch", state, units, first_rows, windows, cos, sin, norm_weight, cache,
                          pages, rows, ratio, row_format, eps, model_dtype)
    if units.shape[0] == 0:
        return
    overlap = ratio == CSA_RATIO
    slots = 2 * ratio if overlap else ratio
    pool_dtype = torch.promote_types(state.dtype, torch.float32)
    slot_rows = first_rows.long().unsqueeze(1) + torch.arange(slots, device=state.device)
    gathered = state[units.long().unsqueeze(1), slot_rows].to(pool_dtype)  # [N, S, channels]
    kv, score = gathered.chunk(2, dim=-1)
    if overlap:
        dim = kv.shape[-1] // 2
        previous = (torch.arange(slots, device=state.device) < ratio).view(1, -1, 1)
        kv = torch.where(previous, kv[..., :dim], kv[..., dim:])
        score = torch.where(previous, score[..., :dim], score[..., dim:])
        no_previous = previous & (windows == 0).view(-1, 1, 1)
        kv = kv.masked_fill(no_previous, 0.0)
        score = score.masked_fill(no_previous, float("-inf"))
    pooled = (torch.softmax(score, dim=1) * kv).sum(dim=1).to(model_dtype)

    acc = torch.promote_types(model_dtype, torch.float32)
    x = pooled.to(acc)
    normed = (x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps) * norm_weight.to(acc)).to(model_dtype)
    rope_dim = 2 * cos.shape[1]
    even, odd = normed[:, -rope_dim:].to(acc).unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos.to(acc), sin.to(acc)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    final = torch.cat([normed[:, :-rope_dim], rotated.to(model_dtype)], dim=1)

    packed = pack_index_rows(final, "fp8") if row_format == "fp8" else pack_main_rows(final, row_format, rope_dim)
    cache[pages.long(), rows.long()] = packed
