import pytest

from dsv4.memory.allocator import (
    DoubleFree,
    GenerationalAllocator,
    Handle,
    OutOfResources,
    PageSlotAllocator,
    StaleGeneration,
)


def test_generation_bumps_on_every_allocation():
    pages = GenerationalAllocator("page", 1)
    first = pages.allocate("a")[0]
    pages.free(first)
    second = pages.allocate("b")[0]
    assert first.id == second.id and second.generation == first.generation + 1


def test_free_counts_and_all_or_nothing():
    pages = GenerationalAllocator("page", 3)
    held = pages.allocate("a", 2)
    assert pages.num_free == 1
    with pytest.raises(OutOfResources):
        pages.allocate("b", 2)
    assert pages.num_free == 1
    for h in held:
        pages.free(h)
    assert pages.num_free == 3


def test_double_free_and_stale_generation_raise():
    pages = GenerationalAllocator("page", 2)
    h = pages.allocate("a")[0]
    pages.free(h)
    with pytest.raises(DoubleFree):
        pages.free(h)
    pages.allocate("x")  # the other id: FIFO reuse keeps h.id free a little longer
    reused = pages.allocate("b")[0]
    assert reused.id == h.id
    with pytest.raises(StaleGeneration):
        pages.free(h)
    with pytest.raises(StaleGeneration):
        pages.check(Handle(h.id, reused.generation + 1))
    pages.check(reused)


def test_holders_lists_owners():
    alloc = PageSlotAllocator(num_pages=4, num_slots=2)
    alloc.pages.allocate("r1", 2)
    alloc.pages.allocate("r2", 1)
    alloc.slots.allocate("r2")
    assert alloc.pages.holders() == {"r1": [0, 1], "r2": [2]}
    assert alloc.slots.holders() == {"r2": [0]}
    assert alloc.snapshot() == {"free_pages": 1, "total_pages": 4, "free_slots": 1, "total_slots": 2}
