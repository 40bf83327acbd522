"""The radix tree alone (torch-free): matching whole pages, references, LRU eviction of unreferenced
leaves only, generations of evicted pages."""

import pytest

from dsv4.cache.radix import CACHE_OWNER, RadixCache
from dsv4.memory.allocator import AllocatorError, PageSlotAllocator, StaleGeneration

P = 4


def make(num_pages=8):
    alloc = PageSlotAllocator(num_pages, 2, num_snapshots=num_pages)
    return alloc, RadixCache(P, alloc.pages, alloc.snapshots)


def cache_chain(alloc, cache, tokens, owner="r"):
    """Inserts the whole pages of `tokens` as one request would, and returns its held chain."""
    chain = []
    for i in range(len(tokens) // P):
        (page,), (unit,) = alloc.pages.allocate(owner), alloc.snapshots.allocate(owner)
        node = cache.insert(chain[-1] if chain else None, tuple(tokens[i * P : (i + 1) * P]), page, unit)
        assert node is not None
        chain.append(node)
    return chain


def test_match_whole_pages_only_and_up_to_the_limit():
    alloc, cache = make()
    chain = cache_chain(alloc, cache, list(range(12)))
    assert cache.match(list(range(12)), 3) == chain
    assert cache.match(list(range(12)), 2) == chain[:2]
    assert cache.match(list(range(11)), 9) == chain[:2]  # the third page is not whole in the query
    assert cache.match([0, 1, 2, 3, 4, 5, 6, 99, 8], 9) == chain[:1]  # diverges inside page 2
    assert cache.match([7, 1, 2, 3], 9) == []
    assert alloc.pages.holders() == {CACHE_OWNER: [0, 1, 2]}


def test_references_block_eviction_and_release_exactly_once():
    alloc, cache = make()
    chain = cache_chain(alloc, cache, list(range(8)))
    assert cache.num_unreferenced == 0 and cache.evict(8) == 0
    cache.acquire(chain)  # a second request shares both pages
    cache.release(chain)  # the inserting request ends
    assert cache.num_unreferenced == 0 and cache.evict(8) == 0
    cache.release(chain)
    assert cache.num_unreferenced == 2
    with pytest.raises(AllocatorError):
        cache.release(chain)
    assert cache.evict(8) == 2 and alloc.pages.num_free == 8 and alloc.snapshots.num_free == 8
    with pytest.raises(AllocatorError):
        cache.acquire(chain)  # evicted nodes cannot be shared again


def test_eviction_is_lru_over_leaves_and_keeps_shared_ancestors():
    alloc, cache = make()
    a = cache_chain(alloc, cache, [1] * 4 + [2] * 4)  # root -> A1 -> A2
    (page,), (unit,) = alloc.pages.allocate("b"), alloc.snapshots.allocate("b")
    assert cache.insert(None, (1,) * 4, page, unit) is None  # A1 is cached already: b keeps its page
    cache.acquire(a[:1])  # b shares A1 and caches its second page under it
    b2 = cache.insert(a[0], (3,) * 4, page, unit)
    cache.release(a)
    cache.release(a[:1])
    cache.release([b2])
    cache.match([1] * 4 + [2] * 4, 2)  # A2 used after B2: B2 is the least recently used leaf
    assert cache.evict(1) == 1 and not b2.alive and a[1].alive
    assert cache.evict(1) == 1 and not a[1].alive and a[0].alive  # leaves before their parent
    assert cache.evict(5) == 1 and cache.num_nodes == 0 and alloc.pages.num_free == 8


def test_a_referenced_descendant_protects_its_path():
    alloc, cache = make()
    chain = cache_chain(alloc, cache, list(range(12)))
    cache.release(chain[:2])  # a chain is released whole; here only the leaf stays held
    assert cache.num_unreferenced == 2
    assert cache.evict(8) == 0  # the only leaf is held, so nothing above it is a leaf


def test_evicted_page_handles_are_stale():
    alloc, cache = make(num_pages=1)
    (node,) = cache_chain(alloc, cache, [5] * 4)
    page = node.page
    cache.release([node])
    cache.evict(1)
    assert node.page is None and not node.alive
    (again,) = alloc.pages.allocate("next")
    assert again.id == page.id and again.generation == page.generation + 1
    with pytest.raises(StaleGeneration):
        alloc.pages.check(page)


def test_insert_needs_whole_page_and_a_held_parent():
    alloc, cache = make()
    (node,) = cache_chain(alloc, cache, [1] * 4)
    (page,), (unit,) = alloc.pages.allocate("r"), alloc.snapshots.allocate("r")
    with pytest.raises(ValueError):
        cache.insert(node, (1, 2), page, unit)
    cache.release([node])
    with pytest.raises(AllocatorError):
        cache.insert(node, (2,) * 4, page, unit)
