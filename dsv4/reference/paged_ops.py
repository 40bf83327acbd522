"""Reference ops over PAGED state: the oracle for `dsv4.kernels` (Triton and vectorised torch).

Plain loops, one token or one row at a time, reading packed rows through `kernels.rows` exactly
as stored, and reusing this package's math (`indexer_scores`, `pool_windows`, `rms_norm`). Slow
on purpose: every line can be checked against DSV4_MODEL.md by eye.

Paged addressing (ENGINE_CONTRACTS.md): compressed row w of a request lives in page
`page_table[r, w // R]` at row `w % R`, R = rows per page of the pool (page_size // ratio). A
request's window ring holds position p at ring row p % W. Arguments mirror the kernels' ops
(`dsv4.kernels.dispatch`), which document them.
"""

from __future__ import annotations

import torch

from dsv4.kernels.rows import pack_index_rows, pack_main_rows, unpack_index_rows, unpack_main_rows

from .compressor import pool_windows
from .indexer import indexer_scores
from .ops import accumulation_dtype, rms_norm

INDEX_RATIO = 4
CSA_RATIO = 4  # the ratio whose compressor overlaps windows


def paged_row(pool: torch.Tensor, pages: torch.Tensor, w: int) -> torch.Tensor:
    """The packed bytes [row_bytes] of a request's compressed row w (`pages` = its page table)."""
    rows_per_page = pool.shape[1]
    return pool[int(pages[w // rows_per_page]), w % rows_per_page]


def indexer_scores_paged(q, weights, index_keys, key_format, page_table, token_req, positions) -> list[torch.Tensor]:
    """Per token t: the scores [n_t] of its visible rows s < n_t = (pos_t + 1) // 4."""
    scores = []
    for t in range(q.shape[0]):
        visible = (int(positions[t]) + 1) // INDEX_RATIO
        pages = page_table[int(token_req[t])]
        packed = torch.stack([paged_row(index_keys, pages, s) for s in range(visible)]) if visible else \
            index_keys.new_zeros((0, index_keys.shape[2]))
        keys = unpack_index_rows(packed, key_format, q.shape[2])
        scores.append(indexer_scores(q[t][None, None], weights[t][None, None], keys[None])[0, 0])
    return scores


def indexer_topk_paged(q, weights, index_keys, key_format, page_table, token_req, positions, topk) -> torch.Tensor:
    """int32 [T, topk]: each token's top min(topk, n_t) visible rows, best first, -1 padded."""
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    for t, scores in enumerate(indexer_scores_paged(q, weights, index_keys, key_format, page_table, token_req,
                                                    positions)):
        picks = scores.topk(min(topk, scores.numel())).indices
        out[t, : picks.numel()] = picks.to(torch.int32)
    return out


def sparse_attention_paged(q, sink, new_rows, window, token_req, positions, req_slots, req_starts, *,
                           row_format, compressed=None, page_table=None, ratio=0, selected=None,
                           rope_dim=64) -> torch.Tensor:
    """[T, H, D] in q's dtype: softmax over the token's rows plus the sink logit, values = keys.

    Rows of token t at position p of request r: window positions max(0, p - W + 1) .. p, read
    from `new_rows` (this batch's rows, token t - p + j holds position j) for positions at or
    after the request's chunk start and from the ring otherwise; then, when `compressed` is given,
    compressed rows w < (p + 1) // ratio: all of them (HCA), or only those in `selected[t]`
    (CSA; entries outside 0 .. n - 1 are none).
    """
    tokens, _, dim = q.shape
    acc = accumulation_dtype(q.dtype)
    ring = window.shape[1]
    out = torch.empty_like(q)
    for t in range(tokens):
        pos, req = int(positions[t]), int(token_req[t])
        start, slot = int(req_starts[req]), int(req_slots[req])
        rows = [new_rows[t - pos + j] if j >= start else window[slot, j % ring]
                for j in range(max(0, pos - ring + 1), pos + 1)]
        if compressed is not None:
            visible = (pos + 1) // ratio
            picks = range(visible) if selected is None else [int(w) for w in selected[t] if 0 <= int(w) < visible]
            rows += [paged_row(compressed, page_table[req], w) for w in picks]
        kv = unpack_main_rows(torch.stack(rows), row_format, dim, rope_dim).to(acc)
        logits = (q[t].to(acc) @ kv.T) * dim**-0.5  # [H, rows]
        with_sink = torch.cat([logits, sink.to(acc).unsqueeze(1)], dim=1)
        probs = torch.softmax(with_sink, dim=1)[:, :-1]
        out[t] = (probs @ kv).to(q.dtype)
    return out


def compress_insert_paged(state, units, first_rows, windows, cos, sin, norm_weight, cache, pages, rows, *,
                          ratio, row_format, eps, model_dtype) -> None:
    """Pool, norm, rotate, pack and store one compressed row per entry n into cache[pages[n], rows[n]].

    Row n pools the slots `state[units[n], first_rows[n] : first_rows[n] + S]` (kv | score per
    slot): S = 8 for CSA (the previous window, whose first `dim` channels overlap into this row,
    then the current window's last `dim` channels; none of the previous one for window 0) or
    S = ratio for HCA.
    """
    overlap = ratio == CSA_RATIO
    slots = 2 * ratio if overlap else ratio
    for n in range(units.shape[0]):
        block = state[int(units[n]), int(first_rows[n]) : int(first_rows[n]) + slots]
        kv, score = block.chunk(2, dim=-1)
        if overlap and int(windows[n]) == 0:  # pool the current window alone: its row 0
            pooled = pool_windows(kv[None, ratio:], score[None, ratio:], ratio, overlap=True)[0, 0]
        else:  # overlap: the second of the two windows is the one whose row this is
            pooled = pool_windows(kv[None], score[None], ratio, overlap)[0, -1]
        row = rms_norm(pooled.to(model_dtype), norm_weight, eps)
        row = _rotate_last_dims(row, cos[n], sin[n])
        cache[int(pages[n]), int(rows[n])] = _pack(row[None], row_format, 2 * cos.shape[1])[0]


def _rotate_last_dims(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the last 2 * len(cos) dims of x [D], interleaved pairs, as `rope.apply_rope`."""
    acc = accumulation_dtype(x.dtype)
    rope_dim = 2 * cos.numel()
    even, odd = x[-rope_dim:].to(acc).unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos.to(acc), sin.to(acc)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat([x[:-rope_dim], rotated.to(x.dtype)])


def _pack(x: torch.Tensor, row_format: str, rope_dim: int) -> torch.Tensor:
    if row_format == "fp8":  # the only index-key-only format; bf16/fp32 rows are the same bytes either way
        return pack_index_rows(x, row_format)
    return pack_main_rows(x, row_format, rope_dim)
