"""The model's kernel path (attention, indexer and compressor inserts through `dsv4.kernels.dispatch`)
against the reference's full-sequence forward, with --verify-indexer checking every selection.

On CUDA the runner's default device is the GPU and these ops run as Triton kernels
(scripts/device_check.sh); elsewhere the dispatcher takes the ops' torch paths, which checks the
model's wiring of the ops: batch layout, page tables, slots, chunk starts and transposes.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.config import ModelConfig, ServerArgs
from dsv4.engine.runner import ModelRunner
from dsv4.protocol import ForwardBatch, ForwardChunk
from dsv4.reference import ReferenceModel
from dsv4.weights import load_state_dict

PAGE = 128
REL_TOL = 1e-4
# Two requests share every tick: A's prompt in chunks that end mid-window, mid-group and on page
# edges, B's in others, then both decode.
A_SIZES, B_SIZES = (129, 37, 1, 64, 69), (3, 130, 97, 20, 50)
A_PAGES, B_PAGES = (5, 2, 7), (0, 6, 3)


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    cfg = ModelConfig.from_json(tiny_ckpt)
    return cfg, load_state_dict(tiny_ckpt, cfg, dtype=torch.float32)


def chunk(rid, slot, start, ids, pages) -> ForwardChunk:
    return ForwardChunk(rid=rid, slot=slot, slot_generation=1, start_pos=start, token_ids=tuple(ids),
                        page_ids=pages, page_generations=(1,) * len(pages), sample=True)


@pytest.mark.parametrize("index_key_dtype", ["fp32", "fp8", "bf16"])
def test_kernel_path_matches_reference(model, index_key_dtype):
    cfg, weights = model
    gen = torch.Generator().manual_seed(3)
    ids = {rid: torch.randint(0, cfg.vocab_size, (300 + 4,), generator=gen).tolist() for rid in "AB"}
    reference = ReferenceModel(cfg, weights, dtype=torch.float32, index_key_dtype=index_key_dtype)
    want = {rid: reference(torch.tensor([seq]))[0] for rid, seq in ids.items()}
    args = ServerArgs(dtype="float32", page_size=PAGE, max_running_requests=2, max_total_tokens=8 * PAGE,
                      index_key_dtype=index_key_dtype, verify_indexer="count")
    runner = ModelRunner(cfg, weights, args, kernels=True)
    runner.begin_tenancies([(p, 1) for p in range(runner.num_pages)], [(s, 1) for s in range(runner.num_slots)])
    # Prefill in chunks, then four decode steps of the same (teacher-forced) tokens.
    sizes = {"A": list(A_SIZES) + [1] * 4, "B": list(B_SIZES) + [1] * 4}
    slots, pages, start = {"A": 1, "B": 0}, {"A": A_PAGES, "B": B_PAGES}, {"A": 0, "B": 0}
    verified = 0
    for tick, (a, b) in enumerate(zip(sizes["A"], sizes["B"], strict=True), start=1):
        chunks = []
        for rid, size in (("B", b), ("A", a)):
            chunks.append(chunk(rid, slots[rid], start[rid], ids[rid][start[rid] : start[rid] + size], pages[rid]))
            start[rid] += size
        logits = runner.forward(ForwardBatch(tick=tick, chunks=tuple(chunks)))
        for row, c in zip(logits, chunks, strict=True):
            last = want[c.rid][start[c.rid] - 1]
            err = ((row - last).abs().max() / last.abs().max()).item()
            assert err <= REL_TOL, f"tick {tick}, request {c.rid}: relative logit error {err:.2e}"
        assert runner.indexer_check.mismatches == [], f"tick {tick}"
        verified += runner.indexer_check.verified
    assert verified == 2 * sum(n - 3 for n in start.values())  # 2 CSA layers, every position >= 3
