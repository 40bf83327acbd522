"""StatePools: layouts and byte sizes, generations, pages and slots as byte units."""

from __future__ import annotations

import itertools

import pytest
import torch

from dsv4.config import ServerArgs
from dsv4.engine.runner import ModelRunner
from dsv4.memory.pools import StaleReference, StatePools
from dsv4.protocol import ForwardBatch, ForwardChunk
from dsv4.tiny import random_state_dict, tiny_config

CFG = tiny_config("tiny")  # layers: window, CSA, HCA, CSA; head_dim 512, index_head_dim 128, window 128
PAGE = 256


def pools(**kw) -> StatePools:
    args = {"num_pages": 4, "num_slots": 2, "page_size": PAGE, "dtype": torch.float32, "kv_cache_dtype": "auto",
            "index_key_dtype": "fp8"}
    return StatePools(CFG, **(args | kw))


@pytest.mark.parametrize("index_key_dtype, row_bytes", [("fp8", 132), ("bf16", 256), ("fp32", 512)])
def test_index_key_rows(index_key_dtype, row_bytes):
    p = pools(index_key_dtype=index_key_dtype)
    assert p.index_keys(1).shape == (4, PAGE // 4, row_bytes)
    assert p.index_keys(1).dtype == torch.uint8


@pytest.mark.parametrize("dtype, kv_cache_dtype, row_bytes",
                         [(torch.float32, "fp8_e4m3", 584), (torch.bfloat16, "fp8_e4m3", 584),
                          (torch.bfloat16, "auto", 1024), (torch.float32, "auto", 2048)])
def test_main_rows(dtype, kv_cache_dtype, row_bytes):
    p = pools(dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    assert p.compressed_rows(1).shape == (4, PAGE // 4, row_bytes)  # CSA
    assert p.compressed_rows(2).shape == (4, PAGE // 128, row_bytes)  # HCA
    assert p.window(0).shape == (2, CFG.sliding_window, row_bytes)


def test_layout_covers_every_layer_once():
    p = pools(kv_cache_dtype="fp8_e4m3")
    assert [r.name for r in p.page_layout()] == [
        "layers.1.compressed", "layers.1.index_keys", "layers.2.compressed", "layers.3.compressed",
        "layers.3.index_keys"]
    # Every row of a page: 2 CSA layers x (64 main + 64 index rows) + 1 HCA layer x 2 main rows.
    assert sum(r.nbytes for r in p.page_layout()) == 2 * 64 * (584 + 132) + 2 * 584
    assert p.page_bytes >= sum(r.nbytes for r in p.page_layout()) and p.page_bytes % 64 == 0
    regions = sorted(p.page_layout(), key=lambda r: r.offset)
    assert all(a.offset + a.nbytes <= b.offset for a, b in itertools.pairwise(regions))
    slot = {r.name: r for r in p.slot_layout()}
    assert slot["layers.1.compressor"].rows == 8 and slot["layers.2.compressor"].rows == 128
    assert p.compressor_state(1).shape == (2, 8, 4 * 512) and p.compressor_state(2).shape == (2, 128, 2 * 512)
    assert p.indexer_state(3).shape == (2, 8, 4 * 128) and p.indexer_state(3).dtype == torch.float32


def test_generations():
    p = pools()
    with pytest.raises(StaleReference, match="page 2: generation 1 was never handed out"):
        p.bind(2, 1)
    p.begin_tenancies([(2, 1)], [(1, 4)])
    p.bind(2, 1)
    p.bind(2, 1)  # the same tenancy, again
    with pytest.raises(StaleReference, match="page 2: generation 3 was never handed out"):
        p.bind(2, 3)  # a generation from the future is as wrong as one from the past
    p.begin_tenancies([(2, 3)], [])  # re-allocated
    with pytest.raises(StaleReference, match="page 2: generation 1 is stale"):
        p.bind(2, 1)
    with pytest.raises(StaleReference, match="not newer"):
        p.begin_tenancies([(2, 3)], [])
    p.begin_tenancies([(0, 1), (0, 2)], [])  # allocated, freed and allocated again between two plans
    p.bind(0, 2)
    with pytest.raises(StaleReference):
        p.bind_pages([2, 0], [3, 1])
    with pytest.raises(StaleReference, match="slot 1"):
        p.read_slot(1, 3)
    p.read_slot(1, 4)


def test_pages_and_slots_as_bytes():
    p = pools(kv_cache_dtype="fp8_e4m3")
    p.begin_tenancies([(3, 1)], [(0, 1), (1, 1)])
    data = torch.randint(0, 256, (p.page_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    p.write_page(3, 1, data.numpy().tobytes())
    assert p.read_page(3, 1) == data.numpy().tobytes()
    assert torch.equal(p.compressed_rows(1)[3].flatten(), data[: 64 * 584]), "the page unit aliases the layer views"
    before = p.page_checksum(3)
    p.index_keys(3)[3, 5, 0] ^= 1
    assert p.page_checksum(3) != before
    with pytest.raises(ValueError, match="bytes"):
        p.write_page(3, 1, b"short")
    p.write_slot(0, 1, torch.zeros(p.slot_bytes, dtype=torch.uint8))
    assert p.slot_checksum(0) == p.slot_checksum(1)


def test_runner_rejects_stale_references_before_writing():
    cfg, weights = CFG, random_state_dict(CFG)
    args = ServerArgs(dtype="float32", page_size=128, max_running_requests=2, max_total_tokens=512,
                      index_key_dtype="fp32")
    runner = ModelRunner(cfg, weights, args)
    assert (runner.num_pages, runner.num_slots) == (4, 2)

    def chunk(page_generation, slot_generation=1):
        return ForwardChunk(rid="r", slot=0, slot_generation=slot_generation, start_pos=0, token_ids=(5, 6, 7),
                            page_ids=(2,), page_generations=(page_generation,), sample=True)

    runner.begin_tenancies([(2, 1), (3, 1)], [(0, 1), (1, 1)])
    runner.begin_tenancies([(2, 2)], [])  # page 2 re-allocated
    runner.forward(ForwardBatch(tick=0, chunks=(chunk(2),)))
    slot, page = runner.pools.read_slot(0, 1), runner.pools.read_page(2, 2)
    with pytest.raises(StaleReference):
        runner.forward(ForwardBatch(tick=1, chunks=(chunk(1),)))
    with pytest.raises(StaleReference):
        runner.forward(ForwardBatch(tick=1, chunks=(chunk(3),)))
    runner.begin_tenancies([], [(0, 2)])  # the slot is re-allocated: its first tenant's chunks are now stale
    with pytest.raises(StaleReference):
        runner.forward(ForwardBatch(tick=2, chunks=(chunk(2, slot_generation=1),)))
    assert runner.pools.read_slot(0, 2) == slot and runner.pools.read_page(2, 2) == page, "nothing was written"

    with pytest.raises(ValueError, match="share a slot"):
        runner.forward(ForwardBatch(tick=3, chunks=(chunk(2, 2), chunk(2, 2))))
    with pytest.raises(ValueError, match="cannot hold"):
        runner.forward(ForwardBatch(tick=4, chunks=(ForwardChunk(
            rid="r", slot=1, slot_generation=1, start_pos=127, token_ids=(1, 2), page_ids=(3,), page_generations=(1,),
            sample=True),)))
