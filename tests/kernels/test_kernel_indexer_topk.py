"""Indexer top-k (Triton and vectorised torch) against the paged reference, up to ties.

A selection is right when, per token, it holds min(topk, n_t) distinct visible rows, best first,
then -1s, and no picked row's reference score (float64, from the same dequantised keys) is below
the k-th best score by more than EPS_REL * max |score|. Both sides accumulate in fp32 (the
reference here in fp64) over heads * dim <= 8192 products, in different orders: the difference is
~1e-6 of max |score|, and 1e-4 leaves room while any real mis-selection (a wrong row among
random keys) sits far outside it.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import pack, page_table, strided_pool, tokens_of, write_paged_rows

from dsv4.kernels.indexer_topk import indexer_topk_torch, indexer_topk_triton
from dsv4.reference.paged_ops import indexer_scores_paged, indexer_topk_paged

EPS_REL = 1e-4
PAGE_SIZE = 128
ROWS_PER_PAGE = PAGE_SIZE // 4
IMPLS = {"triton": indexer_topk_triton, "torch": indexer_topk_torch}

# name: (requests as (first position, tokens), heads, dim, topk)
CASES = {
    "one_row_k1": ([(3, 1)], 16, 64, 1),
    "no_visible_rows": ([(0, 3)], 16, 64, 4),
    "fewer_rows_than_k": ([(20, 2)], 16, 64, 8),
    "page_boundaries": ([(126, 3), (255, 1), (131, 1)], 16, 64, 16),
    "requests_with_own_pages": ([(60, 6), (300, 1), (7, 1), (519, 2)], 17, 48, 24),
    "k_2048": ([(400, 2)], 16, 64, 2048),
    "v4_shape": ([(1000, 1)], 64, 128, 64),
}


def build(case: str, fmt: str, device: str, seed: int = 0):
    requests, heads, dim, topk = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    token_req, positions = tokens_of(requests)
    rows_needed = [(start + count) // 4 for start, count in requests]
    table, num_pages = page_table(rows_needed, ROWS_PER_PAGE, gen)
    keys = strided_pool(num_pages, ROWS_PER_PAGE, fmt, dim, 0, device, gen)
    for r, n in enumerate(rows_needed):
        write_paged_rows(keys, table[r], pack(torch.randn(n, dim, generator=gen), fmt, 0).to(device))
    q = torch.randn(len(positions), heads, dim, generator=gen)
    weights = torch.randn(len(positions), heads, generator=gen) * (dim**-0.5 * heads**-0.5)
    args = [q.to(device), weights.to(device), keys, fmt, table.to(device), token_req.to(device), positions.to(device)]
    return args, topk


def assert_selection(got: torch.Tensor, args: list, topk: int) -> None:
    q, weights, *rest = args
    exact = indexer_scores_paged(q.double().cpu(), weights.double().cpu(), *[a.cpu() if torch.is_tensor(a) else a
                                                                            for a in rest])
    assert got.dtype == torch.int32 and got.shape == (len(exact), topk)
    got = got.cpu().long()
    for t, scores in enumerate(exact):
        k = min(topk, scores.numel())
        picks = got[t, :k]
        assert (got[t, k:] == -1).all(), f"token {t}: {got[t]} not padded with -1 after {k} picks"
        if k == 0:
            continue
        assert picks.min() >= 0 and picks.max() < scores.numel(), f"token {t}: picks {picks} not visible"
        assert picks.unique().numel() == k, f"token {t}: duplicate picks {picks}"
        eps = EPS_REL * scores.abs().max()
        kth_best = scores.topk(k).values[-1]
        assert (scores[picks] >= kth_best - eps).all(), f"token {t}: a pick scores below the k-th best"
        assert (scores[picks][:-1] >= scores[picks][1:] - eps).all(), f"token {t}: picks not best first"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", ["fp8", "bf16", "fp32"])
@pytest.mark.parametrize("case", CASES)
def test_selection_matches_reference(case, fmt, impl, device):
    args, topk = build(case, fmt, device)
    assert_selection(IMPLS[impl](*args, topk), args, topk)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_queries(impl, device):
    args, topk = build("requests_with_own_pages", "fp8", device)
    args[0] = args[0].bfloat16()
    assert_selection(IMPLS[impl](*args, topk), args, topk)


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_past_the_page_table_are_never_read(impl, device):
    """Positions beyond the pages a request holds select among the rows it has pages for."""
    args, topk = build("page_boundaries", "fp8", device)
    args[4] = args[4][:, :1]  # one page: 32 rows
    got = IMPLS[impl](*args, topk)
    args[6] = args[6].clamp(max=4 * ROWS_PER_PAGE - 1)  # the positions that see exactly those rows
    assert_selection(got, args, topk)


def test_reference_op_agrees_with_its_scores(device):
    args, topk = build("page_boundaries", "fp8", device)
    assert_selection(indexer_topk_paged(*args, topk), args, topk)


@pytest.mark.parametrize("impl", IMPLS)
def test_long_prefill_is_scored_in_passes(impl, monkeypatch, device):
    """Scores over the budget are computed a few tokens at a time, with the same result."""
    import dsv4.kernels.indexer_topk as module

    args, topk = build("requests_with_own_pages", "bf16", device)
    whole = IMPLS[impl](*args, topk)
    monkeypatch.setattr(module, "SCORE_BUDGET_BYTES", 1)  # one token a pass
    assert torch.equal(IMPLS[impl](*args, topk), whole)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_are_named(impl, device):
    args, topk = build("one_row_k1", "fp8", device)
    call = IMPLS[impl]
    with pytest.raises(ValueError, match="index_keys"):
        call(args[0], args[1], args[2][..., :-4], *args[3:], topk)  # 128-byte rows for fp8 keys of dim 64 + 4
    with pytest.raises(ValueError, match="index_keys"):
        call(args[0], args[1], args[2].view(torch.int8), *args[3:], topk)
    with pytest.raises(ValueError, match="weights"):
        call(args[0], args[1][:, :3], *args[2:], topk)
    with pytest.raises(ValueError, match="row format"):
        call(*args[:3], "fp4", *args[4:], topk)
    with pytest.raises(ValueError, match="topk"):
        call(*args, 0)
    with pytest.raises(ValueError, match="different devices"):
        call(*args[:6], args[6].to("meta"), topk)


def test_float64_has_no_triton_path(device):
    args, topk = build("one_row_k1", "fp32", device)
    with pytest.raises(ValueError, match="float64"):
        indexer_topk_triton(args[0].double(), *args[1:], topk)
    assert_selection(indexer_topk_torch(args[0].double(), *args[1:], topk), args, topk)
