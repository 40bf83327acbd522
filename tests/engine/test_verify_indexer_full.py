"""--verify-indexer=full: the index queries and head weights recomputed from the layer input with
reference code. A bug in the fast path's index-query projection gives queries that both sides of the
`count` check then score alike, so `count` cannot see it; `full` judges the picks by its own queries.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4.config import ModelConfig, ServerArgs
from dsv4.engine.runner import ModelRunner
from dsv4.protocol import ForwardBatch, ForwardChunk
from dsv4.weights import load_state_dict

PAGE, PROMPT_LEN = 128, 300  # past 4 * index_topk (tiny: 16), so the indexer selects


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    cfg = ModelConfig.from_json(tiny_ckpt)
    return cfg, load_state_dict(tiny_ckpt, cfg, dtype=torch.float32)


def check_prefill(model, mode: str, dtype: str = "float32", heads_shifted: bool = False):
    """The indexer check of one verified prefill of a 300-token prompt; with `heads_shifted`, each index
    head's query is computed with its neighbour's projection rows (a bug in the fast path)."""
    cfg, weights = model
    args = ServerArgs(dtype=dtype, page_size=PAGE, max_running_requests=1, max_total_tokens=4 * PAGE,
                      verify_indexer=mode)
    runner = ModelRunner(cfg, weights, args)
    if heads_shifted:
        correct = runner.model.pieces.index_queries

        def shifted(*tensors):
            q, head_weights = correct(*tensors)
            return q.roll(1, dims=1), head_weights

        runner.model.pieces = dataclasses.replace(runner.model.pieces, index_queries=shifted)
    runner.begin_tenancies([(p, 1) for p in range(runner.num_pages)], [(0, 1)])
    prompt = torch.randint(0, cfg.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
    chunk = ForwardChunk(rid="r", slot=0, slot_generation=1, start_pos=0, token_ids=tuple(prompt),
                         page_ids=(2, 0, 1), page_generations=(1, 1, 1), sample=True)
    runner.forward(ForwardBatch(tick=1, chunks=(chunk,)))
    return runner.indexer_check


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_mode_agrees_with_a_correct_fast_path(model, dtype):
    count, full = check_prefill(model, "count", dtype), check_prefill(model, "full", dtype)
    assert count.mismatches == [] and full.mismatches == []
    assert full.verified == count.verified == 2 * (PROMPT_LEN - 3)  # 2 CSA layers, every position >= 3


def test_full_mode_catches_a_bad_index_query_projection_that_count_cannot_see(model):
    assert check_prefill(model, "count", heads_shifted=True).mismatches == []
    mismatches = check_prefill(model, "full", heads_shifted=True).mismatches
    assert {m.layer for m in mismatches} == {1, 3}  # both CSA layers
    assert all(m.detail.startswith("picked row ") for m in mismatches), mismatches[0].detail
