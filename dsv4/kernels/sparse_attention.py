"""Multi-query attention over a token's window rows, compressed rows and CSA-selected rows.

One kv head shared by all query heads; key = value (the whole main row); scale head_dim^-0.5; a
per-head sink logit joins the softmax denominator with no value. Rows are read packed
(`rows.py` main-row formats) straight from the pools. The output is before the inverse RoPE the
model applies.

Token t at position p of request r sees:
- window positions max(0, p - W + 1) .. p (W = the ring's rows). Positions at or after the
  request's chunk start come from `new_rows` (this batch's own rows: token t - p + j holds
  position j, so a request's tokens must be consecutive and in position order); earlier ones from
  the request's ring, which must hold positions < chunk start (write the batch's rows into the
  ring after attention). A decode token is a chunk of one.
- with `compressed` (CSA and HCA layers), compressed rows w < n = (p + 1) // ratio, in page
  `page_table[r, w // R]` row `w % R`: all of them (HCA), or only those listed in `selected[t]`
  (CSA: the indexer's picks; entries outside 0 .. n - 1, such as the -1 padding, are none). Rows
  past the page table's capacity (positions the engine gave no page for) are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import INDEX_DTYPES, check_format, check_rows, check_same_device, check_tensor, fail
from .row_codec import FORMAT_CODES, MAIN_FORMATS, load_rows
from .rows import unpack_main_rows

FLOAT_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
TRITON_FORMATS = ("fp8_e4m3", "bf16", "fp32")
BLOCK_H = 16  # query heads per program: tl.dot's minimum; [16, 512] fp32 accumulators stay in registers
BLOCK_N = 32  # kv rows per step
# The torch path attends a request's tokens in passes of at most this many elements of logits
# (or of gathered CSA rows), so a long prefill chunk does not materialise them all at once.
PASS_BUDGET_ELEMENTS = 1 << 25


def check_attention_args(op, q, sink, new_rows, window, token_req, positions, req_slots, req_starts, row_format,
                         compressed, page_table, ratio, selected, rope_dim) -> None:
    check_format(op, row_format, MAIN_FORMATS)
    check_tensor(op, "q", q, dims=3, dtypes=FLOAT_DTYPES)
    tokens, heads, dim = q.shape
    check_tensor(op, "sink", sink, dims=1, dtypes=FLOAT_DTYPES, shape=(heads,))
    check_rows(op, "new_rows", new_rows, row_format=row_format, dim=dim, rope_dim=rope_dim, dims=2)
    if new_rows.shape[0] != tokens:
        fail(op, f"new_rows has {new_rows.shape[0]} rows for {tokens} tokens")
    check_rows(op, "window", window, row_format=row_format, dim=dim, rope_dim=rope_dim)
    check_tensor(op, "token_req", token_req, dims=1, dtypes=INDEX_DTYPES, shape=(tokens,))
    check_tensor(op, "positions", positions, dims=1, dtypes=INDEX_DTYPES, shape=(tokens,))
    check_tensor(op, "req_slots", req_slots, dims=1, dtypes=INDEX_DTYPES)
    check_tensor(op, "req_starts", req_starts, dims=1, dtypes=INDEX_DTYPES, shape=req_slots.shape)
    if compressed is None:
        if page_table is not None or selected is not None:
            fail(op, "page_table and selected need compressed rows (a CSA or HCA layer)")
    else:
        check_rows(op, "compressed", compressed, row_format=row_format, dim=dim, rope_dim=rope_dim)
        check_tensor(op, "page_table", page_table, dims=2, dtypes=INDEX_DTYPES, shape=(req_slots.shape[0], None))
        if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
            fail(op, f"ratio must be a positive int with compressed rows, got {ratio!r}")
        if selected is not None:
            check_tensor(op, "selected", selected, dims=2, dtypes=INDEX_DTYPES, shape=(tokens, None))
    check_same_device(op, q=q, sink=sink, new_rows=new_rows, window=window, token_req=token_req,
                      positions=positions, req_slots=req_slots, req_starts=req_starts, compressed=compressed,
                      page_table=page_table, selected=selected)


@triton.jit
def _attend(q, kv, valid, running_max, denominator, acc, scale, PRECISION: tl.constexpr):
    """One online-softmax step over kv rows [BLOCK_N, BLOCK_D] (masked by `valid`)."""
    logits = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * scale
    logits = tl.where(valid[None, :], logits, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(logits, axis=1))  # finite: the max starts at the sink logit
    alpha = tl.exp(running_max - new_max)
    p = tl.exp(logits - new_max[:, None])
    denominator = denominator * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision=PRECISION)
    return new_max, denominator, acc


@triton.jit
def _sparse_attention_kernel(
    q_ptr, sink_ptr, out_ptr, new_rows_ptr, window_ptr, compressed_ptr, page_table_ptr, selected_ptr,
    token_req_ptr, positions_ptr, req_slots_ptr, req_starts_ptr,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_new, stride_ring_slot, stride_ring_row, stride_comp_page, stride_comp_row,
    stride_pt_req, stride_pt_page, stride_sel_t, stride_sel_k,
    num_heads, ring_rows, rows_per_page, capacity, ratio, num_selected, scale,
    FORMAT: tl.constexpr, DIM: tl.constexpr, ROPE: tl.constexpr,
    HAS_COMPRESSED: tl.constexpr, HAS_SELECTED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    head_mask = heads < num_heads
    q_mask = head_mask[:, None] & (cols < DIM)[None, :]
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + cols[None, :] * stride_qd,
                mask=q_mask, other=0.0).to(tl.float32)
    pos = tl.load(positions_ptr + t)
    req = tl.load(token_req_ptr + t).to(tl.int64)
    slot = tl.load(req_slots_ptr + req).to(tl.int64)
    chunk_start = tl.load(req_starts_ptr + req)

    # The sink is a logit with no value: start the running max at it with weight exp(0) = 1.
    running_max = tl.load(sink_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
    denominator = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    offsets = tl.arange(0, BLOCK_N)

    for j0 in range(0, ring_rows, BLOCK_N):
        j = pos - ring_rows + 1 + j0 + offsets  # window position
        valid = (j >= 0) & (j0 + offsets < ring_rows)
        from_batch = j >= chunk_start
        batch_ptr = new_rows_ptr + (t - pos + j) * stride_new
        ring_ptr = window_ptr + slot * stride_ring_slot + (j % ring_rows) * stride_ring_row
        row_ptr = tl.where(from_batch, batch_ptr, ring_ptr)
        kv = load_rows(row_ptr, valid, FORMAT, DIM, ROPE, BLOCK_D)
        running_max, denominator, acc = _attend(q, kv, valid, running_max, denominator, acc, scale,
                                                 PRECISION)

    if HAS_COMPRESSED:
        visible = tl.minimum((pos + 1) // ratio, capacity)
        count = num_selected if HAS_SELECTED else visible
        for k0 in range(0, count, BLOCK_N):
            k = k0 + offsets
            if HAS_SELECTED:
                w = tl.load(selected_ptr + t * stride_sel_t + k * stride_sel_k, mask=k < count, other=-1)
            else:
                w = k
            valid = (w >= 0) & (w < visible) & (k < count)
            page = tl.load(page_table_ptr + req * stride_pt_req + (w // rows_per_page) * stride_pt_page,
                           mask=valid, other=0).to(tl.int64)
            row_ptr = compressed_ptr + page * stride_comp_page + (w % rows_per_page).to(tl.int64) * stride_comp_row
            kv = load_rows(row_ptr, valid, FORMAT, DIM, ROPE, BLOCK_D)
            running_max, denominator, acc = _attend(q, kv, valid, running_max, denominator, acc, scale,
                                                     PRECISION)

    out = acc / denominator[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + cols[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def sparse_attention_triton(q, sink, new_rows, window, token_req, positions, req_slots, req_starts, *,
                            row_format, compressed=None, page_table=None, ratio=0, selected=None,
                            rope_dim=64) -> torch.Tensor:
    """Triton path. Arguments as `sparse_attention_torch`."""
    op = "sparse_attention_triton"
    check_attention_args(op, q, sink, new_rows, window, token_req, positions, req_slots, req_starts, row_format,
                         compressed, page_table, ratio, selected, rope_dim)
    if row_format not in TRITON_FORMATS or q.dtype == torch.float64:
        fail(op, f"{row_format} rows / {q.dtype} queries have no Triton path (float64 is the oracle dtype)")
    tokens, heads, dim = q.shape
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    has_compressed, has_selected = compressed is not None, selected is not None
    # Dummies for absent operands: never dereferenced (constexpr-disabled branches).
    compressed_t = compressed if has_compressed else window
    page_table_t = page_table if has_compressed else req_slots.view(1, -1)
    selected_t = selected if has_selected else positions.view(-1, 1)
    # bf16 queries and bf16/fp8 rows are exact in tf32; fp32 models get full-precision dots.
    exact_in_tf32 = q.dtype == torch.bfloat16 and row_format != "fp32"
    grid = (tokens, triton.cdiv(heads, BLOCK_H))
    _sparse_attention_kernel[grid](
        q, sink, out, new_rows, window, compressed_t, page_table_t, selected_t,
        token_req, positions, req_slots, req_starts,
        *q.stride(), *out.stride(),
        new_rows.stride(0), window.stride(0), window.stride(1), compressed_t.stride(0), compressed_t.stride(1),
        *page_table_t.stride(), *selected_t.stride(),
        heads, window.shape[1], compressed_t.shape[1], page_table_t.shape[1] * compressed_t.shape[1], max(ratio, 1),
        selected_t.shape[1], dim**-0.5,
        FORMAT=FORMAT_CODES[row_format], DIM=dim, ROPE=rope_dim,
        HAS_COMPRESSED=has_compressed, HAS_SELECTED=has_selected,
        BLOCK_H=BLOCK_H, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=BLOCK_N,
        PRECISION="tf32" if exact_in_tf32 else "ieee",
        num_warps=8,
    )
    return out


def sparse_attention_torch(q, sink, new_rows, window, token_req, positions, req_slots, req_starts, *,
                           row_format, compressed=None, page_table=None, ratio=0, selected=None,
                           rope_dim=64) -> torch.Tensor:
    """Vectorised torch path: per request, its rows are unpacked once and all its tokens attend
    to them with one masked matmul (CSA's per-token picks are gathered per token).

    q [T, H, D] queries after RoPE; sink [H]; new_rows uint8 [T, row_bytes] this batch's main rows;
    window uint8 [num_slots, W, row_bytes] the rings; token_req [T]; positions [T];
    req_slots [R] and req_starts [R] each request's slot and chunk start; row_format one of
    rows.MAIN_ROW_DTYPES; compressed uint8 [num_pages, page_size // ratio, row_bytes] with
    page_table [R, max_pages] and ratio; selected [T, K] (CSA). Returns [T, H, D] in q's dtype.
    """
    check_attention_args("sparse_attention_torch", q, sink, new_rows, window, token_req, positions, req_slots,
                         req_starts, row_format, compressed, page_table, ratio, selected, rope_dim)
    tokens, heads, dim = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    ring = window.shape[1]

    def unpack(packed):
        return unpack_main_rows(packed, row_format, dim, rope_dim).to(acc)

    for req in token_req.unique().tolist():
        req_tokens = (token_req == req).nonzero().squeeze(1)
        pos = positions[req_tokens].long()
        start, slot = int(req_starts[req]), int(req_slots[req])
        first, last = max(0, int(pos.min()) - ring + 1), int(pos.max())
        # Window rows: positions first..last, ring rows before the chunk, the batch's own after it.
        span = torch.arange(first, last + 1, device=q.device)
        in_batch = span >= start
        batch_index = (req_tokens[0] - pos[0] + span).clamp(0, tokens - 1)
        packed = torch.where(in_batch.unsqueeze(1), new_rows[batch_index], window[slot, span % ring])
        shared = unpack(packed)
        shared_visible = (span <= pos.unsqueeze(1)) & (span > pos.unsqueeze(1) - ring)  # [t, span]
        if compressed is not None:
            visible = ((pos + 1) // ratio).clamp(max=page_table.shape[1] * compressed.shape[1])
            if selected is None:  # HCA: every visible compressed row
                n_rows = int(visible.max())
                shared = torch.cat([shared, unpack(_paged_rows(compressed, page_table[req], n_rows))])
                rows_visible = torch.arange(n_rows, device=q.device) < visible.unsqueeze(1)
                shared_visible = torch.cat([shared_visible, rows_visible], dim=1)
        picks = selected.shape[1] if selected is not None else 0
        # Per pass: logits [t, H, rows + picks] and the picks' rows [t, picks, D].
        tokens_per_pass = max(1, PASS_BUDGET_ELEMENTS // max(heads * (shared.shape[0] + picks), picks * dim))
        for i in range(0, len(req_tokens), tokens_per_pass):
            part = slice(i, i + tokens_per_pass)
            chunk = req_tokens[part]
            qc = q[chunk].to(acc)
            logits = torch.einsum("thd,nd->thn", qc, shared).masked_fill(
                ~shared_visible[part].unsqueeze(1), float("-inf"))
            if selected is not None:  # CSA: each token's own picks
                picked, picked_visible = _selected_rows(compressed, page_table[req], selected[chunk],
                                                        visible[part])
                picked = unpack(picked.flatten(0, 1)).unflatten(0, picked.shape[:2])  # [t, K, D]
                picked_logits = torch.einsum("thd,tkd->thk", qc, picked).masked_fill(
                    ~picked_visible.unsqueeze(1), float("-inf"))
                logits = torch.cat([logits, picked_logits], dim=2)
            sink_logit = sink.to(acc).view(1, heads, 1).expand(len(chunk), heads, 1)
            probs = torch.softmax(torch.cat([logits * dim**-0.5, sink_logit], dim=2), dim=2)
            result = torch.einsum("thn,nd->thd", probs[..., : shared.shape[0]], shared)
            if selected is not None:
                result += torch.einsum("thk,tkd->thd", probs[..., shared.shape[0] : -1], picked)
            out[chunk] = result.to(q.dtype)
    return out


def _paged_rows(pool: torch.Tensor, pages: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A request's first `num_rows` compressed rows, packed [num_rows, row_bytes]."""
    used_pages = pages[: -(-num_rows // pool.shape[1])].long()
    return pool[used_pages].flatten(0, 1)[:num_rows]


def _selected_rows(pool, pages, picks, visible):
    """Packed rows [t, K, row_bytes] of each token's picks, and which picks are real [t, K]."""
    real = (picks >= 0) & (picks < visible.unsqueeze(1))
    w = torch.where(real, picks.long(), 0)
    rows_per_page = pool.shape[1]
    return pool[pages.long()[w // rows_per_page], w % rows_per_page], real
