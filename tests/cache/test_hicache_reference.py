"""Host tier (HiCache) on, device pool forced tiny, so that cached pages are evicted to the host and
hits come back from it: greedy outputs equal the reference's (margin-aware) for fp8 and bf16 index
keys and fp8 main rows, on full hits, partial hits at every page boundary of a 3-page prompt and a
multi-turn chat; with both write policies, and with copies delayed and reordered by fault injection.
Every loaded page is checked against its write checksum (--verify-transfers: no failure), the
indexer's selections on hit paths agree with the reference (--verify-indexer: 0 mismatches), and
afterwards every page, snapshot and host unit is free or held by exactly one live cache node."""

import asyncio
import random

import pytest

from dsv4.cache.radix import CACHE_OWNER
from dsv4.config import ServerArgs
from dsv4.engine.engine import Engine
from dsv4.engine.launch import load_model
from dsv4.tiny import make_tiny
from tests.cache.test_prefix_cache_reference import generate, indexer_mismatches
from tests.engine.test_engine_reference import VARIANTS, assert_matches_reference

P = 128
DEVICE_PAGES = 8
DELAYS = "delay:hicache_load:0.5:40ms,delay:hicache_write:0.5:30ms"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"))


def hicache_args(checkpoint, variant, **overrides) -> ServerArgs:
    index_key_dtype, kv_cache_dtype, _ = VARIANTS[variant]
    return ServerArgs(**{"model": str(checkpoint), "dtype": "float32", "index_key_dtype": index_key_dtype,
                         "kv_cache_dtype": kv_cache_dtype, "chunked_prefill_size": 97, "max_running_requests": 4,
                         "max_total_tokens": P * DEVICE_PAGES, "enable_hierarchical_cache": True,
                         "hicache_ratio": 8.0, "verify_transfers": True, "verify_indexer": "count", **overrides})


def start_engine(args: ServerArgs) -> Engine:
    model = load_model(args)
    return Engine(args, model.config, model.tokenizer, model.runner, model_name=model.name)


def metric(engine, name, labels=None) -> float:
    return engine.metrics.registry.get_sample_value(name, labels) or 0.0


def assert_accounted(engine) -> None:
    """Nothing is held by a request any more, and every page, snapshot unit and host unit that is not
    free is held by the cache for exactly one live node (no leak, nothing held twice, no copy left)."""
    cache, alloc = engine.scheduler.cache, engine.allocator
    assert not engine.scheduler.requests()
    nodes = list(cache._nodes())
    for allocator, held in ((alloc.pages, [n.page for n in nodes if n.page is not None]),
                            (alloc.snapshots, [n.snapshot for n in nodes if n.snapshot is not None]),
                            (cache.host.units, [n.host for n in nodes if n.host is not None])):
        for handle in held:
            allocator.check(handle)  # the current tenancy of a held unit
        assert allocator.holders() == ({CACHE_OWNER: sorted(h.id for h in held)} if held else {})
        assert allocator.num_free + len(held) == allocator.capacity
    assert all(n.copy is None and n.refs == 0 and not n.broken for n in nodes)
    debug = engine.debug_requests()
    assert debug["loads_in_flight"] == debug["writes_in_flight"] == 0
    assert debug["free_pages"] == debug["total_pages"] and debug["free_slots"] == debug["total_slots"]
    assert debug["host_free_pages"] + debug["host_cached_pages"] == debug["host_total_pages"]


async def serve_with_host_hits(engine, vocab):
    """Runs the hit scenario; returns (prompts, outputs, host-tier cached tokens expected at least)."""
    rng = random.Random(7)

    def fresh(n):
        return [rng.randrange(vocab) for _ in range(n)]

    async def push_to_host():  # a prompt as large as the device pool: every cached page leaves the device
        await generate(engine, f"filler-{rng.randrange(1 << 30)}", fresh(DEVICE_PAGES * P - 20))

    base = fresh(3 * P + 40)
    prompts, outputs = [base], [(await generate(engine, "cold", base))[0]]
    await push_to_host()
    hits = {"full": (base, 3 * P), **{f"boundary-{k}": (base[: k * P] + fresh(50), k * P) for k in (1, 2, 3)}}
    served = await asyncio.gather(*(generate(engine, name, p) for name, (p, _) in hits.items()))
    for (name, (prompt, cached)), (tokens, got) in zip(hits.items(), served, strict=True):
        assert got == cached, f"{name}: {got} cached tokens, expected {cached}"
        prompts.append(prompt)
        outputs.append(tokens)
    # Multi-turn: the first turn decodes across a page boundary, the second extends it, from the host.
    turn1 = fresh(P - 3)
    turn1_out, _ = await generate(engine, "turn1", turn1)
    await push_to_host()
    turn2 = turn1 + turn1_out + fresh(60)
    turn2_out, turn2_cached = await generate(engine, "turn2", turn2)
    assert turn2_cached == P
    return prompts + [turn1, turn2], outputs + [turn1_out, turn2_out]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("variant", "policy", "faults"), [
    ("index-fp8", "write_through", None),
    ("index-bf16", "write_through", None),
    ("kv-fp8", "write_back", None),
    ("index-bf16", "write_back", DELAYS),
    ("index-fp8", "write_through", DELAYS),
])
async def test_greedy_outputs_with_host_tier_hits_equal_the_reference(checkpoint, variant, policy, faults):
    engine = start_engine(hicache_args(checkpoint, variant, hicache_write_policy=policy, fault_inject=faults))
    await engine.start()
    try:
        async with asyncio.timeout(300):
            prompts, outputs = await serve_with_host_hits(engine, engine.model_config.vocab_size)
        assert_matches_reference(checkpoint, variant, prompts, outputs)
        verified, mismatches = indexer_mismatches(engine)
        assert verified > 0 and mismatches == 0
        assert metric(engine, "dsv4_hicache_load_failures_total") == 0
        assert metric(engine, "dsv4_hicache_stale_completions_total") == 0
        # Every hit after a filler came from the host: 3 pages of the 3-page prompt (the boundary hits
        # share them, loaded once or waited for), and turn 1's page.
        assert metric(engine, "dsv4_prefix_cache_hit_tokens_total", {"tier": "host"}) >= 4 * P
        assert metric(engine, "dsv4_prefix_cache_evicted_pages_total", {"tier": "device"}) > 0
        assert metric(engine, "dsv4_hicache_copy_bytes_total", {"direction": "load"}) > 0
        assert metric(engine, "dsv4_hicache_copy_bytes_total", {"direction": "write"}) > 0
        assert metric(engine, "dsv4_hicache_copy_seconds_count", {"direction": "load"}) > 0
        assert_accounted(engine)
    finally:
        await engine.stop()


@pytest.mark.timeout(200)
async def test_copies_in_flight_do_not_spin_the_tick_loop(checkpoint):
    """While the only request waits for host-tier loads (each held 300 ms by fault injection), the tick loop
    waits for the copies to land rather than ticking again at once: a few dozen ticks, where a spinning loop
    ran thousands (and kept the event loop, /health included, from answering until the loads were done).
    And write-through copies landing once the engine is idle wake it without leaving it awake: the event loop
    goes on answering (a spinning idle loop would never return from the sleep below)."""
    engine = start_engine(hicache_args(checkpoint, "index-bf16", verify_indexer="off",
                                       fault_inject="delay:hicache_load:1.0:300ms,delay:hicache_write:1.0:300ms"))
    await engine.start()
    try:
        async with asyncio.timeout(150):
            rng = random.Random(3)
            vocab = engine.model_config.vocab_size
            base = [rng.randrange(vocab) for _ in range(3 * P + 40)]
            await generate(engine, "cold", base)
            await generate(engine, "filler", [rng.randrange(vocab) for _ in range(DEVICE_PAGES * P - 20)])
            ticks = metric(engine, "dsv4_ticks_total")
            started = asyncio.get_running_loop().time()
            _, cached = await generate(engine, "hit", base)
            waited = asyncio.get_running_loop().time() - started
            hit_ticks = metric(engine, "dsv4_ticks_total") - ticks
            await generate(engine, "last", [rng.randrange(vocab) for _ in range(2 * P + 10)])
            await asyncio.sleep(0.6)  # (its pages' write-through copies land meanwhile, the engine idle)
        assert cached == 3 * P and metric(engine, "dsv4_prefix_cache_hit_tokens_total", {"tier": "host"}) >= 3 * P
        assert waited >= 0.3  # (the loads were held)
        assert hit_ticks < 60
    finally:
        await engine.stop()
