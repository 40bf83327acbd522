"""Lightning-indexer top-k over paged index-key rows.

For query token t of request r (page table row `page_table[r]`), with n_t = (pos_t + 1) // 4
visible compressed rows: score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) for s < n_t, then the
top min(topk, n_t) rows, best first, as int32 [T, topk] padded with -1.

Key row s of a request lives in page `page_table[r, s // R]` at row `s % R`, where R = the pool's
rows per page (page_size // 4): ENGINE_CONTRACTS.md's rule for ratio 4. Rows past the page
table's capacity (positions the engine gave no page for) are never read: not scored, not picked.

Triton computes the scores; selection is `torch.topk` on the score buffer. k reaches 2048 over up
to 256K rows (1M tokens) per query, where a Triton selection would need a multi-pass radix select;
torch.topk already is one, tuned per GPU, and it is the reference's own selection, applied to
scores that equal the reference's up to fp32 summation order: the picks agree up to ties.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import INDEX_DTYPES, check_format, check_rows, check_same_device, check_tensor, fail
from .row_codec import FORMAT_CODES, INDEX_FORMATS, load_rows
from .rows import unpack_index_rows

RATIO = 4  # the indexer's compressor runs at CSA's ratio
FLOAT_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
# Scores are materialised [tokens, page-table capacity] in fp32; long prefill chunks at long
# context are scored in passes of as many tokens as fit this budget.
SCORE_BUDGET_BYTES = 256 << 20
BLOCK_S = 64  # key rows per dot product
ITERS = 4  # row blocks per program: amortises loading the [heads, dim] query over 256 rows


def check_indexer_args(op, q, weights, index_keys, key_format, page_table, token_req, positions, topk) -> None:
    check_format(op, key_format, INDEX_FORMATS)
    check_tensor(op, "q", q, dims=3, dtypes=FLOAT_DTYPES)
    tokens, heads, dim = q.shape
    check_tensor(op, "weights", weights, dims=2, dtypes=FLOAT_DTYPES, shape=(tokens, heads))
    check_rows(op, "index_keys", index_keys, row_format=key_format, dim=dim, rope_dim=0)
    check_tensor(op, "page_table", page_table, dims=2, dtypes=INDEX_DTYPES)
    check_tensor(op, "token_req", token_req, dims=1, dtypes=INDEX_DTYPES, shape=(tokens,))
    check_tensor(op, "positions", positions, dims=1, dtypes=INDEX_DTYPES, shape=(tokens,))
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        fail(op, f"topk must be a positive int, got {topk!r}")
    check_same_device(op, q=q, weights=weights, index_keys=index_keys, page_table=page_table,
                      token_req=token_req, positions=positions)


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, keys_ptr, page_table_ptr, token_req_ptr, positions_ptr, scores_ptr,
    stride_qt, stride_qh, stride_qd, stride_wt, stride_wh,
    stride_key_page, stride_key_row, stride_pt_req, stride_pt_page, stride_st,
    num_heads, rows_per_page, capacity,
    FORMAT: tl.constexpr, DIM: tl.constexpr, RATIO: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, ITERS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """scores[t, s] for s in this program's ITERS * BLOCK_S rows; -inf where s is not visible."""
    t = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * (BLOCK_S * ITERS)
    visible = tl.minimum((tl.load(positions_ptr + t) + 1) // RATIO, capacity)
    req = tl.load(token_req_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    head_mask = heads < num_heads
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + cols[None, :] * stride_qd,
                mask=head_mask[:, None] & (cols < DIM)[None, :], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + t * stride_wt + heads * stride_wh, mask=head_mask, other=0.0).to(tl.float32)
    for it in range(ITERS):
        start = first + it * BLOCK_S
        rows = start + tl.arange(0, BLOCK_S)
        score = tl.full([BLOCK_S], float("-inf"), tl.float32)
        if start < visible:
            valid = rows < visible
            page = tl.load(page_table_ptr + req * stride_pt_req + (rows // rows_per_page) * stride_pt_page,
                           mask=valid, other=0).to(tl.int64)
            row_ptr = keys_ptr + page * stride_key_page + (rows % rows_per_page).to(tl.int64) * stride_key_row
            keys = load_rows(row_ptr, valid, FORMAT, DIM, 0, BLOCK_D)
            # fp32 operands: the CPU interpreter's bf16 dot is wrong, and on GPU q and fp8/bf16
            # keys are bf16-exact, so tf32 multiplies them exactly (PRECISION says when not).
            logits = tl.dot(q, tl.trans(keys), input_precision=PRECISION)
            score = tl.where(valid, tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0), float("-inf"))
        tl.store(scores_ptr + t * stride_st + rows, score, mask=rows < capacity)


def indexer_topk_triton(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor, key_format: str,
                        page_table: torch.Tensor, token_req: torch.Tensor, positions: torch.Tensor,
                        topk: int) -> torch.Tensor:
    """Triton scoring + torch.topk selection. Arguments as `indexer_topk_torch`."""
    op = "indexer_topk_triton"
    check_indexer_args(op, q, weights, index_keys, key_format, page_table, token_req, positions, topk)
    if q.dtype == torch.float64:
        fail(op, "float64 queries have no Triton path (float64 is the oracle dtype): use the torch path")
    tokens, heads, dim = q.shape
    capacity = page_table.shape[1] * index_keys.shape[1]
    out = torch.full((tokens, topk), -1, dtype=torch.int32, device=q.device)
    if tokens == 0 or capacity == 0:
        return out
    exact_in_tf32 = q.dtype == torch.bfloat16 and key_format != "fp32"
    tokens_per_pass = max(1, SCORE_BUDGET_BYTES // (4 * capacity))
    for t0 in range(0, tokens, tokens_per_pass):
        t1 = min(tokens, t0 + tokens_per_pass)
        scores = torch.empty((t1 - t0, capacity), dtype=torch.float32, device=q.device)
        grid = (t1 - t0, triton.cdiv(capacity, BLOCK_S * ITERS))
        _indexer_scores_kernel[grid](
            q[t0:t1], weights[t0:t1], index_keys, page_table, token_req[t0:t1], positions[t0:t1], scores,
            *q.stride(), *weights.stride(), index_keys.stride(0), index_keys.stride(1),
            *page_table.stride(), scores.stride(0),
            heads, index_keys.shape[1], capacity,
            FORMAT=FORMAT_CODES[key_format], DIM=dim, RATIO=RATIO,
            BLOCK_H=max(16, triton.next_power_of_2(heads)), BLOCK_D=max(16, triton.next_power_of_2(dim)),
            BLOCK_S=BLOCK_S, ITERS=ITERS, PRECISION="tf32" if exact_in_tf32 else "ieee",
        )
        picks = _select(scores, topk)
        out[t0:t1, : picks.shape[1]] = picks
    return out


def indexer_topk_torch(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor, key_format: str,
                       page_table: torch.Tensor, token_req: torch.Tensor, positions: torch.Tensor,
                       topk: int) -> torch.Tensor:
    """Vectorised torch path: each request's keys are gathered and unpacked once, then scored
    for all its tokens with one matmul per pass.

    q [T, H, D] index queries after RoPE; weights [T, H] head weights (already scaled);
    index_keys uint8 [num_pages, page_size // 4, row_bytes] (a pool view); key_format one of
    "fp8" / "bf16" / "fp32"; page_table [R, max_pages]; token_req [T] row of page_table per token;
    positions [T] absolute positions. Returns int32 [T, topk], best first, -1 padded.
    """
    check_indexer_args("indexer_topk_torch", q, weights, index_keys, key_format, page_table, token_req,
                       positions, topk)
    tokens, heads, dim = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.full((tokens, topk), -1, dtype=torch.int32, device=q.device)
    visible = ((positions.long() + 1) // RATIO).clamp(max=page_table.shape[1] * index_keys.shape[1])
    for req in token_req.unique().tolist():
        req_tokens = (token_req == req).nonzero().squeeze(1)
        num_rows = int(visible[req_tokens].max())
        if num_rows == 0:
            continue
        keys = _request_keys(index_keys, key_format, page_table[req], num_rows, dim).to(acc)
        tokens_per_pass = max(1, SCORE_BUDGET_BYTES // (acc.itemsize * heads * num_rows))
        for chunk in req_tokens.split(tokens_per_pass):
            per_head = (q[chunk].to(acc).flatten(0, 1) @ keys.T).relu_().unflatten(0, (len(chunk), heads))
            scores = torch.bmm(weights[chunk].to(acc).unsqueeze(1), per_head).squeeze(1)  # [t, rows]
            hidden = torch.arange(num_rows, device=q.device) >= visible[chunk].unsqueeze(1)
            picks = _select(scores.masked_fill_(hidden, float("-inf")), topk)
            out[chunk, : picks.shape[1]] = picks
    return out


def _request_keys(index_keys: torch.Tensor, key_format: str, pages: torch.Tensor, num_rows: int,
                  dim: int) -> torch.Tensor:
    """The first `num_rows` key rows of one request, unpacked to float32 [num_rows, dim]."""
    rows_per_page = index_keys.shape[1]
    used_pages = pages[: -(-num_rows // rows_per_page)].long()
    packed = index_keys[used_pages].flatten(0, 1)[:num_rows]
    return unpack_index_rows(packed, key_format, dim)


def _select(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 [t, min(topk, columns)]: the best rows of each score row, best first; -inf scores
    are rows the token cannot see and become -1 (they sort last)."""
    values, picks = scores.topk(min(topk, scores.shape[1]), dim=1)
    return torch.where(values == float("-inf"), -1, picks).to(torch.int32)
