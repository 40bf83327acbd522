"""The batch plan of decode tokens alone in closed form (dsv4.model.plan.build_plan's decode path) against
the general construction it replaces: the same tensors, for batches of decode tokens at every phase of
both compressors' windows, from position 0 on, on slots in any order."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.model import plan
from dsv4.protocol import ForwardBatch, ForwardChunk

PAGE = 128


def decode_batch(rng: random.Random, positions: list[int]) -> ForwardBatch:
    slots = rng.sample(range(40), len(positions))
    chunks = []
    for slot, position in zip(slots, positions, strict=True):
        pages = tuple(rng.sample(range(200), position // PAGE + 1 + rng.randrange(2)))
        chunks.append(ForwardChunk(rid=f"r{slot}", slot=slot, slot_generation=1, start_pos=position,
                                   token_ids=(rng.randrange(100),), page_ids=pages, page_generations=(1,) * len(pages),
                                   sample=rng.random() < 0.9))
    return ForwardBatch(tick=1, chunks=tuple(chunks))


def assert_same(got, want, where: str) -> None:
    for field in want.__dataclass_fields__:
        a, b = getattr(got, field), getattr(want, field)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{where}.{field}"
        else:
            assert a == b, f"{where}.{field}"


@pytest.mark.parametrize("seed", range(6))
def test_decode_plan_in_closed_form_equals_the_general_one(tiny_ckpt, seed):
    cfg = ModelConfig.from_json(tiny_ckpt)
    rng = random.Random(seed)
    ratios = sorted({r for r in cfg.compress_ratios if r})
    # positions at and around every window boundary of both ratios, the first ones, and past the ring
    candidates = [0, 1, 2, 3, 4, 5, 7, 8, 126, 127, 128, 129, 254, 255, 256, 300, 511, 512, 1023]
    for size in (1, 2, 5, 8):
        batch = decode_batch(rng, rng.sample(candidates, size))
        built = plan.build_plan(cfg, batch, PAGE)
        chunks = plan._Chunks.of(batch.chunks, PAGE)
        captures = plan._Captures.of(batch, {c.slot: i for i, c in enumerate(batch.chunks)}, chunks)
        for r in ratios:
            state_rows = plan._state_rows(cfg, r)
            assert_same(plan._decode_compress_plan(chunks, r, state_rows),
                        plan._compress_plan(chunks, r, state_rows, captures), f"compress[{r}]")
            assert_same(built.compress[r], plan._compress_plan(chunks, r, state_rows, captures), f"plan.compress[{r}]")
        assert_same(built.ring_write, plan._concat_writes(plan._ring_write(chunks, cfg.sliding_window),
                                                          captures.rows_before(cfg.sliding_window, ring=True)),
                    "ring_write")
        for r in ratios:  # (a window completes where a token ends one)
            assert len(built.compress[r].window_positions) == sum((c.start_pos + 1) % r == 0 for c in batch.chunks)
