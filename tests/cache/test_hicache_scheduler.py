"""The scheduler and radix cache with a real host tier (state pools on the CPU, the copy thread, no
model): no chunk reads a page whose load has not completed, a request waiting for loads does not
block the queue, aborts during loads and write-backs free everything exactly once (both tiers back to
their initial free counts), a load that fails its checksum fails its request alone and drops the node,
and injected delays reorder copies."""

import random
import time

import pytest
import torch

from dsv4.cache.hicache import HostTier
from dsv4.cache.radix import RadixCache
from dsv4.config import ModelConfig
from dsv4.config.faults import CopyDelay
from dsv4.engine.request import Request, RequestState
from dsv4.engine.scheduler import Scheduler
from dsv4.memory.allocator import PageSlotAllocator
from dsv4.memory.copier import CopyEngine
from dsv4.memory.pools import StaleReference, StatePools
from dsv4.protocol import SamplingParams
from dsv4.tiny import make_tiny

P = 128
SLOTS = 3


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return ModelConfig.from_json(make_tiny(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def make(config):
    tiers = []

    def make(num_pages=6, host_units=12, policy="write_through", delays=(), verify=True):
        pools = StatePools(config, num_pages=num_pages, num_slots=SLOTS + num_pages, page_size=P,
                           dtype=torch.float32, index_key_dtype="bf16")
        alloc = PageSlotAllocator(num_pages, SLOTS, num_snapshots=num_pages)
        tier = HostTier(pools, host_units, snapshot_unit=alloc.snapshot_unit, write_policy=policy, verify=verify,
                        delays=delays)
        tiers.append(tier)
        cache = RadixCache(P, alloc.pages, alloc.snapshots, host=tier)
        return Scheduler(alloc, page_size=P, token_budget=512, max_context=100_000, prefix_cache=cache), pools

    yield make
    for tier in tiers:
        tier.close()


def req(rid, prompt, max_new=4):
    return Request(rid=rid, prompt_ids=tuple(prompt), sampling=SamplingParams(max_new_tokens=max_new),
                   arrival=0.0, deadline=1e9)


def apply(s, pools, plan):
    """What the tick does with a plan before and after its forward: the pools learn its handouts,
    then the host-tier loads it recorded start (they name units handed out by it)."""
    pools.begin_tenancies(plan.page_handouts, plan.slot_handouts)
    s.cache.start_pending()


def tick(s, pools):
    plan = s.schedule()
    apply(s, pools, plan)
    for c in plan.batch.chunks:
        r = s.get(c.rid)
        # Never a forward over a page still loading, nor one a chunk would write while it is shared.
        assert all(node.on_device for node in r.cached), (c.rid, r.cached)
        assert c.start_pos >= len(r.cached) * P
        if c.sample:
            r.output_ids.append(9)
            if len(r.output_ids) == r.sampling.max_new_tokens:
                s.finish(r, "length")
    return plan


def run(s, pools, *rids, timeout=20.0):
    end = time.monotonic() + timeout
    while any(s.get(rid) is not None for rid in rids):
        assert time.monotonic() < end, "requests did not finish"
        tick(s, pools)
        time.sleep(0.001)


def assert_both_tiers_empty(s):
    """Nothing runs; dropping every cached copy returns both tiers to their initial free counts."""
    assert not s.requests()
    cache = s.cache
    assert all(n.refs == 0 for n in cache._nodes())
    cache.evict(cache.num_nodes)
    cache.evict_host(cache.host.units.capacity)
    a = s.allocator
    assert not list(cache._nodes())
    assert (a.pages.num_free, a.slots.num_free, a.snapshots.num_free, cache.host.units.num_free) == (
        a.pages.capacity, a.slots.capacity, a.snapshots.capacity, cache.host.units.capacity)
    assert cache.num_nodes == cache.num_unreferenced == cache.num_host == 0


def push_out(s, pools, tag):
    """A prompt as large as the device pool: every unreferenced cached page leaves the device."""
    s.add(req(tag, [7] * (s.allocator.pages.capacity * P - 8), max_new=2))
    run(s, pools, tag)


def test_a_host_hit_loads_before_its_forward_and_does_not_block_the_queue(make):
    s, pools = make(delays=(CopyDelay("hicache_load", 1.0, 0.2),))
    prompt = list(range(2 * P + 10))
    s.add(req("a", prompt))
    run(s, pools, "a")
    push_out(s, pools, "filler")
    assert all(n.page is None and n.host is not None for n in s.cache.match(prompt, 2))
    s.add(req("hit", prompt))
    s.add(req("other", [3] * 20))
    plan = tick(s, pools)
    hit = s.get("hit")
    assert hit.state is RequestState.LOADING and hit.cached_tokens == hit.cached_host_tokens == 2 * P
    assert [c.rid for c in plan.batch.chunks] == ["other"]  # admitted past the loading request
    assert hit.describe(0.0)["pending_loads"] == 2
    started = time.monotonic()
    while not any(c.rid == "hit" for c in tick(s, pools).batch.chunks):  # (tick: only once its pages are loaded)
        assert s.get("hit").state is RequestState.LOADING
        assert time.monotonic() - started < 10
        time.sleep(0.01)
    assert time.monotonic() - started >= 0.15  # it waited for the delayed loads
    run(s, pools, "hit", "other")
    assert s.cache.hit_pages_host == 2 and s.cache.loaded_pages == 2
    assert_both_tiers_empty(s)


def test_a_load_starts_once_its_plan_is_applied_and_one_never_started_just_gives_its_units_back(make):
    s, pools = make()
    prompt = list(range(2 * P + 10))
    s.add(req("a", prompt))
    run(s, pools, "a")
    push_out(s, pools, "filler")
    s.add(req("hit", prompt))
    plan = s.schedule()
    loading = [n for n in s.cache._nodes() if n.loading]
    assert len(loading) == 2 and all(n.copy.fence is None for n in loading)  # recorded, not started
    assert {n.page for n in loading} <= set(plan.page_handouts)
    with pytest.raises(StaleReference):  # why: the pools learn those pages from this plan only
        pools.page_view(*loading[0].page)
    s.abort("hit", "test")
    s.cache.evict(s.cache.num_nodes)  # its loads never started: the device units go back, the host copies stay
    assert all(n.page is None and n.host is not None and n.copy is None for n in loading)
    apply(s, pools, plan)  # nothing left to start
    assert s.cache.loaded_pages == 0 and s.cache.stale_completions == 0
    s.add(req("again", prompt))
    run(s, pools, "again")
    assert s.cache.loaded_pages == 2 and s.cache.hit_pages_host == 4
    assert_both_tiers_empty(s)


def test_a_request_for_prompt_logprobs_takes_host_pages_only_before_the_first_position_it_needs(make):
    s, pools = make()
    prompt = list(range(2 * P + 10))
    s.add(req("a", prompt))
    run(s, pools, "a")
    push_out(s, pools, "filler")
    for start, pages in ((P + 5, 1), (1, 0)):  # logits from P + 4 (inside page 1), from 0
        s.add(Request(rid=f"from{start}", prompt_ids=tuple(prompt), arrival=0.0, deadline=1e9,
                      sampling=SamplingParams(max_new_tokens=4, prompt_logprobs=0, prompt_logprobs_start=start)))
        tick(s, pools)
        r = s.get(f"from{start}")
        assert len(r.cached) == pages and r.cached_tokens == r.cached_host_tokens == pages * P
        run(s, pools, r.rid)
    assert_both_tiers_empty(s)


def test_an_abort_during_a_load_frees_everything_exactly_once(make):
    s, pools = make(delays=(CopyDelay("hicache_load", 1.0, 0.3),))
    prompt = list(range(2 * P + 10))
    s.add(req("a", prompt))
    run(s, pools, "a")
    push_out(s, pools, "filler")
    s.add(req("hit", prompt))
    tick(s, pools)
    assert s.get("hit").state is RequestState.LOADING
    s.abort("hit", "test")
    assert s.get("hit") is None
    loading = [n for n in s.cache._nodes() if n.loading]
    assert len(loading) == 2 and all(n.refs == 0 for n in loading)
    tick(s, pools)
    assert_both_tiers_empty(s)  # eviction waits for the loads in flight, then frees their pages once


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_an_abort_during_a_write_frees_everything_exactly_once(make, policy):
    s, pools = make(policy=policy, delays=(CopyDelay("hicache_write", 1.0, 0.2),))
    s.add(req("a", list(range(3 * P + 10)), max_new=50))
    for _ in range(4):
        tick(s, pools)
    writes = [n for n in s.cache._nodes() if n.copy is not None]
    assert len(writes) == (3 if policy == "write_through" else 0)  # write-through: at insertion
    s.abort("a", "test")
    push_out(s, pools, "filler")  # eviction waits for each write in flight (write-back: starts them)
    assert s.cache.written_pages >= 3 and s.cache.num_host >= 3
    assert_both_tiers_empty(s)


def test_a_load_that_fails_its_checksum_fails_its_requests_alone_and_drops_the_node(make):
    s, pools = make()
    prompt = list(range(2 * P + 10))
    s.add(req("a", prompt))
    run(s, pools, "a")
    push_out(s, pools, "filler")
    first, second = s.cache.match(prompt, 2)
    s.cache.host.pool.data[second.host.id, 5] ^= 0x20  # one flipped bit in the host copy
    s.add(req("victim", prompt))
    s.add(req("sibling", prompt[:P] + [5] * 40))  # shares only the first page: unaffected
    deadline = time.monotonic() + 10
    failed = []
    while s.get("victim") is not None or s.get("sibling") is not None:
        assert time.monotonic() < deadline
        tick(s, pools)
        failed += s.take_failed()
        time.sleep(0.005)
    assert [r.rid for r in failed] == ["victim"] and "host tier" in failed[0].error
    assert failed[0].finish_reason == "error"
    assert s.cache.load_failures == 1 and not second.alive
    assert s.cache.match(prompt, 2) == [first]  # the broken page is never matched again
    assert_both_tiers_empty(s)


def test_eviction_under_pressure_with_delayed_copies_never_touches_a_running_request(make):
    rng = random.Random(5)
    s, pools = make(num_pages=8, host_units=10, delays=(CopyDelay("hicache_load", 0.5, 0.02),
                                                    CopyDelay("hicache_write", 0.5, 0.02)))
    system = [rng.randrange(50) for _ in range(256)]
    live = set()
    for step in range(300):
        if rng.random() < 0.3 and len(live) < 8:
            rid = f"r{step}"
            s.add(req(rid, system[: rng.choice([0, 128, 256])] + [rng.randrange(50) for _ in range(rng.randint(1, 200))],
                      max_new=rng.randint(1, 120)))
            live.add(rid)
        if live and rng.random() < 0.1:
            s.abort(rng.choice(sorted(live)), "test")
        tick(s, pools)
        live = {rid for rid in live if s.get(rid) is not None}
        for r in s.running:
            assert r.pages[: len(r.cached)] == [n.page for n in r.cached]
            assert all(n.on_device and n.refs > 0 for n in r.cached)
        time.sleep(0.002)
    for rid in list(live):
        s.abort(rid, "end")
    tick(s, pools)
    assert s.cache.hit_pages_host > 0 and s.cache.evicted_pages > 0
    assert_both_tiers_empty(s)


def test_a_delayed_copy_is_overtaken_by_later_ones():
    engine = CopyEngine(torch.device("cpu"), [CopyDelay("hicache_load", 1.0, 0.2)])
    try:
        dst, src = torch.zeros(4, dtype=torch.uint8), torch.arange(4, dtype=torch.uint8)
        slow = engine.submit("hicache_load", [(dst[:2], src[:2])])
        fast = engine.submit("hicache_write", [(dst[2:], src[2:])], checksum=True)
        assert fast.wait(5) and not slow.done()
        assert slow.wait(5) and slow.seconds >= 0.2 > fast.seconds
        assert dst.tolist() == [0, 1, 2, 3] and fast.checksum is not None and slow.error is None
    finally:
        engine.close()
