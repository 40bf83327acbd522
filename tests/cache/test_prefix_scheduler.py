"""The scheduler with a prefix cache (pure Python, no runner): what pages join the cache and when, what
a hit shares and restores, that shared pages are never written, and that everything is freed once."""

import random

from dsv4.cache.radix import RadixCache
from dsv4.engine.request import Request, RequestState
from dsv4.engine.scheduler import Scheduler
from dsv4.memory.allocator import PageSlotAllocator
from dsv4.protocol import SamplingParams

P = 128


def make(num_pages=16, num_slots=4, budget=512, window=None):
    alloc = PageSlotAllocator(num_pages, num_slots, num_snapshots=num_pages)
    cache = RadixCache(P, alloc.pages, alloc.snapshots)
    return Scheduler(alloc, page_size=P, token_budget=budget, max_context=100_000, prefix_cache=cache,
                     window=window)


def req(rid, prompt, max_new=4):
    return Request(rid=rid, prompt_ids=tuple(prompt), sampling=SamplingParams(max_new_tokens=max_new),
                   arrival=0.0, deadline=1e9)


def tick(s):
    plan = s.schedule()
    for c in plan.batch.chunks:
        r = s.get(c.rid)
        shared = len(r.cached)
        # A chunk never writes a cached page: it starts at or after the end of the pages it shares.
        assert c.start_pos >= shared * P, (c.rid, c.start_pos, shared)
        if c.sample:
            r.output_ids.append(9)
            if len(r.output_ids) == r.sampling.max_new_tokens:
                s.finish(r, "length")
    return plan


def run(s, *rids):
    while any(s.get(rid) is not None for rid in rids):
        tick(s)


def assert_nothing_leaks(s):
    """Once no request runs, every page and snapshot is the cache's and unreferenced, or free."""
    assert not s.running and not s.waiting
    cache = s.cache
    assert cache.num_unreferenced == cache.num_nodes
    cache.evict(cache.num_nodes)
    a = s.allocator
    assert (a.pages.num_free, a.slots.num_free, a.snapshots.num_free) == (
        a.pages.capacity, a.slots.capacity, a.snapshots.capacity)


def test_prefill_ends_chunks_at_page_boundaries_and_snapshots_each():
    s = make()
    prompt = list(range(300))
    s.add(req("a", prompt))
    plans = [tick(s) for _ in range(3)]
    assert [(c.start_pos, len(c.token_ids)) for p in plans for c in p.batch.chunks] == [(0, 128), (128, 128),
                                                                                      (256, 44)]
    assert [len(p.batch.snapshots) for p in plans] == [1, 1, 0]
    assert plans[0].batch.snapshots[0].src == s.get("a").slot.id
    assert s.cache.num_nodes == 2 and len(s.get("a").cached) == 2  # the second joined at this step
    run(s, "a")
    assert s.cache.num_nodes == 2 and s.cache.num_unreferenced == 2


def test_with_boundary_captures_a_prefill_runs_whole_and_every_page_joins_in_order():
    """With the model's window (<= the page size) the scheduler captures boundaries inside a chunk:
    a 300-token prompt is one chunk capturing 128 and 256; a 700-token one under a 512-token budget
    stops at the boundary 512 (slot copy) and its next chunk captures 640."""
    s = make(window=P)
    s.add(req("a", list(range(300))))
    plan = tick(s)
    ((start, length),) = [(c.start_pos, len(c.token_ids)) for c in plan.batch.chunks]
    assert (start, length) == (0, 300) and not plan.batch.snapshots
    slot, units = s.get("a").slot.id, [c.unit for c in plan.batch.captures]
    assert [(c.slot, c.position) for c in plan.batch.captures] == [(slot, 128), (slot, 256)]
    assert len(set(units)) == 2 and all(u >= s.allocator.slots.capacity for u in units)
    tick(s)
    assert [n.key[0] for n in s.get("a").cached] == [0, 128]  # joined at the next step, in page order
    run(s, "a")

    s.add(req("b", [7] * 700))
    plans = [tick(s), tick(s)]
    assert [(c.start_pos, len(c.token_ids)) for p in plans for c in p.batch.chunks] == [(0, 512), (512, 188)]
    assert [c.position for c in plans[0].batch.captures] == [128, 256, 384] and len(plans[0].batch.snapshots) == 1
    assert [c.position for c in plans[1].batch.captures] == [640]
    run(s, "b")
    assert s.cache.num_nodes == 2 + 5  # a's two pages, b's five (its own: the token values differ)
    assert_nothing_leaks(s)


def test_a_hit_shares_pages_restores_the_last_snapshot_and_starts_at_its_boundary():
    s = make()
    prompt = [random.Random(0).randrange(1000) for _ in range(300)]
    s.add(req("a", prompt))
    run(s, "a")
    nodes = s.cache.match(prompt, 9)
    s.add(req("b", prompt[:256] + [1, 2, 3]))
    plan = tick(s)
    (c,) = plan.batch.chunks
    (restore,) = plan.batch.restores
    assert c.start_pos == 256 and c.token_ids == (1, 2, 3) and c.sample
    assert c.page_ids[:2] == tuple(n.page.id for n in nodes)
    assert (restore.src, restore.dst) == (s.allocator.slots.capacity + nodes[1].snapshot.id, c.slot)
    assert s.get("b").cached_tokens == 256 and s.cache.hit_pages == 2
    s.add(req("c", prompt[:128] + [5] * 200))  # partial hit: one page
    plan = tick(s)
    (c,) = [c for c in plan.batch.chunks if c.rid == "c"]
    assert c.start_pos == 128 and c.page_ids[0] == nodes[0].page.id
    run(s, "b", "c")
    assert_nothing_leaks(s)


def test_a_hit_leaves_the_last_token_to_compute():
    s = make()
    prompt = list(range(256))
    s.add(req("a", prompt))
    run(s, "a")
    s.add(req("b", prompt))  # two whole cached pages, but the last token's logits are needed
    (c,) = tick(s).batch.chunks
    assert c.start_pos == 128 and len(c.token_ids) == 128 and c.sample
    run(s, "b")
    assert_nothing_leaks(s)


def test_decodes_cache_the_page_they_complete_and_multi_turn_extends_it():
    s = make()
    prompt = list(range(126))
    s.add(req("turn1", prompt, max_new=5))
    run(s, "turn1")
    assert s.cache.num_nodes == 1  # position 127 was fed by a decode, which completed page 0
    history = prompt + [9] * 5
    s.add(req("turn2", history + list(range(400, 500))))
    (c,) = tick(s).batch.chunks
    assert c.start_pos == 128 and s.get("turn2").cached_tokens == 128
    run(s, "turn2")
    assert_nothing_leaks(s)


def test_the_same_prefix_computed_twice_at_once_is_cached_once():
    s = make()
    prompt = list(range(200))
    s.add(req("a", prompt))
    s.add(req("b", prompt))
    run(s, "a", "b")
    assert s.cache.num_nodes == 1
    assert_nothing_leaks(s)


def test_eviction_frees_only_unreferenced_pages_under_pressure():
    s = make(num_pages=4, num_slots=2)
    s.add(req("a", list(range(300)), max_new=1))
    run(s, "a")
    assert s.cache.num_nodes == 2 and s.allocator.pages.num_free == 2
    s.add(req("b", [7] * 300, max_new=2))  # needs 3 pages: one cached page is evicted (LRU: the leaf)
    tick(s)
    assert s.cache.num_nodes == 1 and s.cache.evicted_pages == 1
    assert s.capacity()["free_pages"] == 1
    run(s, "b")
    assert_nothing_leaks(s)


def test_abort_and_retraction_release_each_reference_exactly_once():
    rng = random.Random(3)
    s = make(num_pages=10, num_slots=3, budget=300)
    system = [rng.randrange(50) for _ in range(256)]
    live = set()
    for step in range(400):
        if rng.random() < 0.3 and len(live) < 12:
            rid = f"r{step}"
            s.add(req(rid, system[: rng.choice([0, 128, 256])] + [rng.randrange(50) for _ in range(rng.randint(1, 200))],
                      max_new=rng.randint(1, 150)))
            live.add(rid)
        if live and rng.random() < 0.1:
            rid = rng.choice(sorted(live))
            s.abort(rid, "test")
        tick(s)
        live = {rid for rid in live if s.get(rid) is not None}
        for r in s.running:
            assert len(r.pages) >= len(r.cached) and r.pages[: len(r.cached)] == [n.page for n in r.cached]
        assert all(r.state is RequestState.RUNNING for r in s.running)
    for rid in list(live):
        s.abort(rid, "end")
    s.schedule()
    assert s.cache.hit_pages > 0
    assert_nothing_leaks(s)
