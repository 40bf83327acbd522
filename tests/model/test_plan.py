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


def test_decode_planner_equals_the_decode_part_of_the_plan(tiny_ckpt):
    """DecodePlanner against DecodePlan.of(build_plan(...)) over runs of decode steps, whose parts it keeps
    and shares between steps (compressed rows seen, compressor plans, whose windows' positions and places
    it sets where windows complete): the same tensors at every step, through windows completing (from
    the start of a sequence on), pages added and batches changing. Batches that are
    not decode tokens alone, each sampled, are not its."""
    cfg = ModelConfig.from_json(tiny_ckpt)
    planner = plan.DecodePlanner(cfg, PAGE)
    rng = random.Random(7)
    shared = {"compressed": 0, "compress": 0}  # steps whose part is an earlier step's object
    earlier = {part: {} for part in shared}  # id -> part (held: ids stay unique)
    for run in range(7):  # (the first from near position 0: windows there pool rows before it)
        positions = rng.sample(range(12) if run == 0 else range(600), rng.choice((1, 3, 8)))
        slots = rng.sample(range(40), len(positions))
        pages = [list(rng.sample(range(200), p // PAGE + 1)) for p in positions]
        for _ in range(rng.randrange(10, 140)):
            chunks = []
            for slot, position, table in zip(slots, positions, pages, strict=True):
                if position // PAGE + 1 > len(table):
                    table.append(rng.randrange(200))  # (a new page as the request crosses into it)
                chunks.append(ForwardChunk(rid=f"r{slot}", slot=slot, slot_generation=1, start_pos=position,
                                           token_ids=(rng.randrange(100),), page_ids=tuple(table),
                                           page_generations=(1,) * len(table), sample=True))
            batch = ForwardBatch(tick=1, chunks=tuple(chunks))
            got, want = planner.plan(batch), plan.DecodePlan.of(plan.build_plan(cfg, batch, PAGE))
            for field in ("token_ids", "positions", "slots"):
                assert torch.equal(getattr(got, field), getattr(want, field)), field
            assert got.last_position == want.last_position == max(positions)
            for r in want.compress:
                assert_same(got.compressed[r], want.compressed[r], f"compressed[{r}]")
                assert_same(got.compress[r], want.compress[r], f"compress[{r}]")
                for part, objects in earlier.items():
                    value = getattr(got, part)[r]
                    shared[part] += id(value) in objects
                    objects[id(value)] = value
            positions = [p + 1 for p in positions]
    assert all(shared.values()), shared

    prefill = ForwardChunk(rid="p", slot=1, slot_generation=1, start_pos=0, token_ids=(1, 2), page_ids=(0,),
                           page_generations=(1,), sample=True)
    unsampled = ForwardChunk(rid="u", slot=2, slot_generation=1, start_pos=5, token_ids=(1,), page_ids=(0,),
                             page_generations=(1,), sample=False)
    for chunks in ((prefill,), (unsampled,), (unsampled, prefill)):
        assert planner.plan(ForwardBatch(tick=1, chunks=chunks)) is None
