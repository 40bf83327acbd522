"""The --verify-indexer check on hand-made state: which selections it accepts (top-k up to ties)
and which it rejects, with the reason it names."""

from __future__ import annotations

import pytest
import torch

from dsv4.engine.indexer_check import IndexerVerifier
from dsv4.kernels.rows import pack_index_rows, unpack_index_rows
from dsv4.memory.pools import StatePools
from dsv4.model.plan import build_plan
from dsv4.model.selection import IndexerSelection
from dsv4.protocol import ForwardBatch, ForwardChunk
from dsv4.reference.indexer import indexer_scores
from dsv4.tiny import tiny_config

CFG = tiny_config("tiny")  # CSA layers 1 and 3; index_topk 16, 16 index heads of 128 dims
LAYER, PAGE = 1, 128
PAGES = (1, 0)  # out of order: rows 0..31 in page 1, rows 32.. in page 0
POSITION = 200  # the query sees rows 0 .. 49
VISIBLE = (POSITION + 1) // 4


class Case:
    """One decode token of one request, its 50 visible fp8 index-key rows written and fingerprinted."""

    def __init__(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.pools = StatePools(CFG, num_pages=2, num_slots=1, page_size=PAGE, dtype=torch.float32,
                                index_key_dtype="fp8", fingerprint_index_keys=True)
        self.pools.begin_tenancies([(0, 1), (1, 1)], [(0, 1)])
        chunk = ForwardChunk(rid="r", slot=0, slot_generation=1, start_pos=POSITION, token_ids=(5,), page_ids=PAGES,
                             page_generations=(1, 1), sample=True)
        self.plan = build_plan(CFG, ForwardBatch(tick=1, chunks=(chunk,)), PAGE)
        self.q = torch.randn(1, CFG.index_n_heads, CFG.index_head_dim, generator=gen)
        self.weights = torch.randn(1, CFG.index_n_heads, generator=gen) / CFG.index_n_heads
        self.write(torch.randn(VISIBLE, CFG.index_head_dim, generator=gen))

    def write(self, keys: torch.Tensor) -> None:
        rows = torch.arange(VISIBLE)
        self.where = torch.tensor(PAGES)[rows // (PAGE // 4)], rows % (PAGE // 4)
        self.pools.index_keys(LAYER)[self.where] = pack_index_rows(keys, "fp8")
        self.pools.record_index_keys(LAYER, *self.where)

    def stored_keys(self) -> torch.Tensor:
        return unpack_index_rows(self.pools.index_keys(LAYER)[self.where], "fp8")

    def scores(self) -> torch.Tensor:
        return indexer_scores(self.q[None], self.weights[None], self.stored_keys()[None])[0, 0]

    def best(self) -> torch.Tensor:
        return self.scores().topk(CFG.index_topk).indices

    def check(self, picks) -> IndexerVerifier:
        verifier = IndexerVerifier(self.plan, self.pools, CFG.index_topk)
        picks = torch.tensor(picks).view(1, -1)
        padded = torch.full((1, CFG.index_topk), -1, dtype=torch.int64)
        padded[:, : picks.shape[1]] = picks[:, : CFG.index_topk]
        verifier(IndexerSelection(LAYER, torch.zeros(1, CFG.hidden_size), self.q, self.weights, padded))
        return verifier


def test_the_reference_top_k_passes():
    case = Case()
    verifier = case.check(case.best().tolist())
    assert verifier.verified == 1 and verifier.mismatches == []


def test_a_tie_at_the_k_th_place_may_go_either_way():
    case = Case()
    order = case.scores().argsort(descending=True)
    kth, next_best = order[CFG.index_topk - 1], order[CFG.index_topk]
    keys = case.stored_keys()
    keys[next_best] = keys[kth]  # equal rows, equal scores
    case.write(keys)
    tied = {int(kth), int(next_best)}
    picks = case.best().tolist()
    assert len(tied & set(picks)) == 1  # the reference picked one of the two
    assert case.check([(tied - {p}).pop() if p in tied else p for p in picks]).mismatches == []  # the other


@pytest.mark.parametrize("wrong, reason", [
    ("worst", "picked row {low} (reference score"),
    ("drop_best", "picked row {low} (reference score"),
    ("duplicate", "picked 15 distinct visible rows of 50, expected 16"),
    ("invisible", "picked row 60 but sees only rows 0..49"),
])
def test_a_wrong_selection_fails_with_its_reason(wrong, reason):
    case = Case()
    order = case.scores().argsort(descending=True).tolist()
    picks = order[: CFG.index_topk]
    if wrong == "worst":  # the k-th pick swapped for the lowest-scoring row
        picks[-1], low = order[-1], order[-1]
    elif wrong == "drop_best":  # the best row dropped for the (k+1)-th: not a tie
        picks, low = picks[1:] + [order[CFG.index_topk]], order[CFG.index_topk]
    elif wrong == "duplicate":
        picks[-1], low = picks[0], None
    else:
        picks[-1], low = 60, None
    verifier = case.check(picks)
    (mismatch,) = verifier.mismatches
    assert (mismatch.rid, mismatch.layer, mismatch.position, mismatch.count) == ("r", LAYER, POSITION, 1)
    assert mismatch.detail.startswith(reason.format(low=low)), mismatch.detail


def test_bytes_changed_after_the_write_fail_even_when_both_paths_agree():
    case = Case()
    page, row = int(case.where[0][40]), int(case.where[1][40])
    case.pools.index_keys(LAYER)[page, row, 7] ^= 0x01  # one bit, in row 40
    verifier = case.check(case.best().tolist())  # the picks the (corrupted) keys give: both paths agree
    (mismatch,) = verifier.mismatches
    assert mismatch.detail == "index-key rows [40] changed after they were written (fingerprint mismatch)"


def test_a_page_written_whole_is_fingerprinted_as_written():
    """A transferred page (StatePools.write_page) arrives with new rows: they are its rows now."""
    case = Case()
    rows = torch.arange(PAGE // 4)
    page_0 = torch.zeros_like(rows)
    case.pools.write_page(0, 1, case.pools.read_page(1, 1))  # page 1's rows over page 0's
    assert not case.pools.changed_index_keys(LAYER, page_0, rows).any()
    case.pools.index_keys(LAYER)[0, 3, 0] ^= 0x80
    assert case.pools.changed_index_keys(LAYER, page_0, rows).tolist() == [r == 3 for r in range(PAGE // 4)]
